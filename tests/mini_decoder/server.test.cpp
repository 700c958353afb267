// SPDX-License-Identifier: Apache-2.0
// mini_decoder serve in-process on 127.0.0.1 (a free port), stories260K: greedy answers equal the
// single-sequence decoder's, streamed chunks add up to the whole answer, concurrent clients get
// their own answers, admission makes requests wait for memory, and bad requests get OpenAI-style
// errors without disturbing what runs.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/decode/decoder.hpp>
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/server.hpp>

#include "models.hpp"

using namespace mini_decoder;
using json = nlohmann::json;

namespace {

const model& stories() {
  static const auto m = load_model(std::string(MINI_DECODER_STORIES_DIR) + "/stories260K.bin");
  return *m;
}

std::vector<int> prompt_of(const std::string& text) {
  return stories().tok->encode(text, true);
}

// The single-sequence decoder's greedy answer (dense), as text. Never while a server runs: the
// decoder and the engine thread would share the engine's thread pool.
std::string reference(const std::string& prompt, std::uint32_t max_tokens) {
  decoder_options o;
  o.max_tokens = max_tokens;
  decoder d(stories(), o);
  const std::vector<int> p = prompt_of(prompt);
  int prev = p.back();
  std::string s;
  for (int t : d.generate(p)) {
    s += stories().tok->decode(prev, t);
    prev = t;
  }
  return s;
}

server_options options(std::uint64_t fast_bytes = std::uint64_t{64} << 20) {
  server_options o;
  o.engine.fast_tier_bytes = fast_bytes;
  return o;
}

// A client with generous timeouts (the engine may make a request wait for memory).
struct client {
  explicit client(int port) : c("127.0.0.1", port) {
    c.set_connection_timeout(10);
    c.set_read_timeout(120);
    c.set_write_timeout(30);
  }
  httplib::Result post(const std::string& path, const json& body) {
    return c.Post(path.c_str(), body.dump(), "application/json");
  }
  httplib::Result post_raw(const std::string& path, const std::string& body) {
    return c.Post(path.c_str(), body, "application/json");
  }
  httplib::Client c;
};

json completion(const std::string& prompt, std::uint32_t max_tokens, bool stream = false) {
  return {{"model", "stories260K"},
          {"prompt", prompt},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"stream", stream}};
}

json chat(const std::string& content, std::uint32_t max_tokens, bool stream = false) {
  return {{"model", "stories260K"},
          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"stream", stream}};
}

// The events of a Server-Sent Events body: every `data: ...` payload, in order.
std::vector<std::string> events_of(const std::string& body) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    const std::string e = body.substr(at, end - at);
    REQUIRE(e.rfind("data: ", 0) == 0);
    out.push_back(e.substr(6));
    at = end + 2;
  }
  return out;
}

struct streamed {
  std::string text, finish_reason, role;
  std::size_t chunks = 0;
};

// Concatenates a stream's pieces; checks that it ends with [DONE] and that each chunk has the
// OpenAI shape.
streamed read_stream(const std::string& body, bool is_chat) {
  const std::vector<std::string> ev = events_of(body);
  REQUIRE(ev.size() >= 2);
  CHECK(ev.back() == "[DONE]");
  streamed s;
  for (std::size_t i = 0; i + 1 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    CHECK(c["object"] == (is_chat ? "chat.completion.chunk" : "text_completion"));
    CHECK(c["model"] == "stories260K");
    REQUIRE(c["choices"].size() == 1);
    const json& ch = c["choices"][0];
    if (is_chat) {
      if (ch["delta"].contains("role")) {
        s.role = ch["delta"]["role"];
      }
      s.text += ch["delta"].value("content", "");
    } else {
      s.text += ch["text"].get<std::string>();
    }
    if (!ch["finish_reason"].is_null()) {
      s.finish_reason = ch["finish_reason"];
      CHECK(i + 2 == ev.size());  // the finish comes last, before [DONE]
    }
    ++s.chunks;
  }
  return s;
}

std::string text_of(const json& r, bool is_chat) {
  const json& ch = r["choices"][0];
  return is_chat ? ch["message"]["content"].get<std::string>() : ch["text"].get<std::string>();
}

void check_error(const httplib::Result& r, int status, const char* param,
                 const char* code = nullptr) {
  REQUIRE(r);
  CHECK(r->status == status);
  const json e = json::parse(r->body);
  REQUIRE(e.contains("error"));
  CHECK(e["error"]["type"] == "invalid_request_error");
  CHECK(e["error"]["message"].is_string());
  CHECK(!e["error"]["message"].get<std::string>().empty());
  if (code == nullptr) {
    CHECK(e["error"]["code"].is_null());
  } else {
    CHECK(e["error"]["code"] == code);
  }
  if (param == nullptr) {
    CHECK(e["error"]["param"].is_null());
  } else {
    CHECK(e["error"]["param"] == param);
  }
}

const std::vector<std::string> prompts = {"Once upon a time",   "Lily and Tom",   "The cat",
                                          "One day, a big dog", "Sam saw a bird", "The sun"};

}  // namespace

TEST_CASE("server: a greedy completion equals the single-sequence decoder's answer") {
  const std::string want = reference(prompts[0], 40);
  REQUIRE(!want.empty());
  server s(stories(), options());
  const int port = s.start();
  REQUIRE(port > 0);
  client c(port);

  const auto r = c.post("/v1/completions", completion(prompts[0], 40));
  REQUIRE(r);
  REQUIRE(r->status == 200);
  const json j = json::parse(r->body);
  CHECK(j["object"] == "text_completion");
  CHECK(j["model"] == "stories260K");
  CHECK(j["id"].get<std::string>().rfind("cmpl-", 0) == 0);
  CHECK(j["created"].is_number_integer());
  CHECK(text_of(j, false) == want);
  const auto P = prompt_of(prompts[0]).size();
  CHECK(j["usage"]["prompt_tokens"] == P);
  const std::uint32_t generated = j["usage"]["completion_tokens"];
  CHECK(j["usage"]["total_tokens"] == P + generated);
  CHECK(j["choices"][0]["finish_reason"] == (generated == 40 ? "length" : "stop"));

  // A chat of one user message: llama2.c has no template, so the prompt is the message itself.
  const auto rc = c.post("/v1/chat/completions", chat(prompts[0], 40));
  REQUIRE(rc);
  REQUIRE(rc->status == 200);
  const json jc = json::parse(rc->body);
  CHECK(jc["object"] == "chat.completion");
  CHECK(jc["choices"][0]["message"]["role"] == "assistant");
  CHECK(text_of(jc, true) == want);

  const auto m = c.c.Get("/v1/models");
  REQUIRE(m);
  CHECK(m->status == 200);
  const json jm = json::parse(m->body);
  CHECK(jm["object"] == "list");
  CHECK(jm["data"][0]["id"] == "stories260K");
  const auto one = c.c.Get("/v1/models/stories260K");
  REQUIRE(one);
  CHECK(one->status == 200);
  CHECK(json::parse(one->body)["id"] == "stories260K");
  check_error(c.c.Get("/v1/models/gpt-5"), 404, "model", "model_not_found");
  const auto h = c.c.Get("/health");
  REQUIRE(h);
  CHECK(h->status == 200);
  CHECK(json::parse(h->body)["status"] == "ok");
  s.stop();
}

TEST_CASE("server: streamed chunks add up to the whole answer and end with [DONE]") {
  server s(stories(), options());
  client c(s.start());
  for (const bool is_chat : {false, true}) {
    CAPTURE(is_chat);
    const char* path = is_chat ? "/v1/chat/completions" : "/v1/completions";
    const auto whole = c.post(path, is_chat ? chat(prompts[1], 60) : completion(prompts[1], 60));
    const auto parts =
        c.post(path, is_chat ? chat(prompts[1], 60, true) : completion(prompts[1], 60, true));
    REQUIRE(whole);
    REQUIRE(parts);
    REQUIRE(whole->status == 200);
    REQUIRE(parts->status == 200);
    CHECK(parts->get_header_value("Content-Type").find("text/event-stream") == 0);
    const json w = json::parse(whole->body);
    const streamed st = read_stream(parts->body, is_chat);
    CHECK(st.text == text_of(w, is_chat));
    CHECK(st.finish_reason == w["choices"][0]["finish_reason"]);
    if (is_chat) {
      CHECK(st.role == "assistant");
    }
  }
  // Stop strings: the answer is cut before the first one, streamed or not.
  const std::string full =
      text_of(json::parse(c.post("/v1/completions", completion(prompts[0], 60))->body), false);
  const std::size_t cut = full.find(" was");
  REQUIRE(cut != std::string::npos);
  json body = completion(prompts[0], 60);
  body["stop"] = json::array({" was", "zzz"});
  const auto r = c.post("/v1/completions", body);
  REQUIRE(r);
  const json j = json::parse(r->body);
  CHECK(text_of(j, false) == full.substr(0, cut));
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  body["stream"] = true;
  const auto rs = c.post("/v1/completions", body);
  REQUIRE(rs);
  const streamed st = read_stream(rs->body, false);
  CHECK(st.text == full.substr(0, cut));
  CHECK(st.finish_reason == "stop");
  s.stop();
}

TEST_CASE("server: concurrent clients each get their own answer") {
  std::vector<std::string> want;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    want.push_back(reference(prompts[i], static_cast<std::uint32_t>(20 + 10 * i)));
  }
  server s(stories(), options());
  const int port = s.start();
  std::vector<std::string> got(prompts.size());
  std::vector<int> status(prompts.size(), 0);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      client c(port);
      const bool stream = i % 2 == 1, is_chat = i % 3 == 2;
      const auto n = static_cast<std::uint32_t>(20 + 10 * i);
      const auto r =
          c.post(is_chat ? "/v1/chat/completions" : "/v1/completions",
                 is_chat ? chat(prompts[i], n, stream) : completion(prompts[i], n, stream));
      if (!r) {
        return;
      }
      status[i] = r->status;
      if (r->status == 200) {
        got[i] =
            stream ? read_stream(r->body, is_chat).text : text_of(json::parse(r->body), is_chat);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  s.stop();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(status[i] == 200);
    CHECK(got[i] == want[i]);
  }
}

TEST_CASE("server: a budget for one sequence serves three concurrent requests in turn") {
  const std::uint32_t n = 48;
  std::vector<std::string> want;
  std::uint64_t one = 0;
  {
    batch_options probe = options().engine;
    batch_engine e(stories(), probe);
    for (std::size_t i = 0; i < 3; ++i) {
      want.push_back(reference(prompts[i], n));
      one = std::max(
          one, e.need(static_cast<std::uint32_t>(prompt_of(prompts[i]).size()), n).fast_bytes);
    }
  }
  server s(stories(), options(one));  // room for one sequence, never two
  const int port = s.start();
  std::vector<std::string> got(3);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      client c(port);
      const auto r = c.post("/v1/completions", completion(prompts[i], n, i == 1));
      if (r && r->status == 200) {
        got[i] = i == 1 ? read_stream(r->body, false).text : text_of(json::parse(r->body), false);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  // A request that could never fit: the engine refuses it with the numbers, HTTP 400 naming
  // max_tokens (with the prompt, what makes it too large).
  client c(port);
  const auto big = c.post("/v1/completions", completion(prompts[0], 400));
  check_error(big, 400, "max_tokens");
  CHECK(json::parse(big->body)["error"]["message"].get<std::string>().find(
            "could never be admitted") != std::string::npos);
  s.stop();
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(got[i] == want[i]);
  }
}

TEST_CASE("server: bad requests get 400 or 404 with an OpenAI error body, others go on") {
  const std::string want = reference(prompts[3], 300);
  server s(stories(), options());
  const int port = s.start();
  // A long streamed request runs while the bad ones arrive.
  std::string got;
  std::thread long_one([&] {
    client c(port);
    const auto r = c.post("/v1/completions", completion(prompts[3], 300, true));
    if (r && r->status == 200) {
      got = read_stream(r->body, false).text;
    }
  });
  client c(port);
  check_error(c.post_raw("/v1/completions", "{\"prompt\": "), 400, nullptr);
  check_error(c.post_raw("/v1/completions", "[1, 2]"), 400, nullptr);
  check_error(c.post("/v1/completions", json{{"max_tokens", 4}}), 400, "prompt");
  check_error(c.post("/v1/completions", json{{"prompt", 7}}), 400, "prompt");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 0}}), 400,
              "max_tokens");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", "ten"}}), 400,
              "max_tokens");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"temperature", -0.5}}), 400,
              "temperature");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"top_p", 0}}), 400, "top_p");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"stream", "yes"}}), 400, "stream");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"stop", 3}}), 400, "stop");
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"n", 9}}), 400, "n");
  // Too long for the context (512 tokens): with max_tokens, and the prompt alone.
  check_error(c.post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 600}}), 400,
              "max_tokens");
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) {
    long_prompt += "Once upon a time ";
  }
  check_error(c.post("/v1/completions", json{{"prompt", long_prompt}}), 400, "prompt");
  check_error(c.post("/v1/chat/completions", json{{"messages", "hi"}}), 400, "messages");
  check_error(c.post("/v1/chat/completions", json{{"messages", json::array()}}), 400, "messages");
  check_error(c.post("/v1/chat/completions",
                     json{{"messages", json::array({{{"role", "wizard"}, {"content", "hi"}}})}}),
              400, "messages[0].role");
  check_error(c.post("/v1/chat/completions",
                     json{{"messages", json::array({{{"role", "user"}, {"content", 5}}})}}),
              400, "messages[0].content");
  const auto nf = c.c.Get("/v1/nothing");
  REQUIRE(nf);
  CHECK(nf->status == 404);
  CHECK(json::parse(nf->body)["error"]["message"].get<std::string>().find("/v1/nothing") !=
        std::string::npos);
  check_error(c.post("/v2/completions", completion("x", 2)), 404, nullptr);
  long_one.join();
  s.stop();
  CHECK(got == want);
}

namespace {

const model& smollm2() {
  return test::smollm2();
}

// The decoder's greedy answer to `text` on `m`, and the prompt's length in tokens.
std::pair<std::string, std::size_t> greedy(const model& m, const std::string& text,
                                           std::uint32_t n) {
  decoder_options o;
  o.max_tokens = n;
  decoder d(m, o);
  const std::vector<int> p = m.tok->encode(text, true);
  int prev = p.back();
  std::string s;
  for (int t : d.generate(p)) {
    s += m.tok->decode(prev, t);
    prev = t;
  }
  return {s, p.size()};
}

}  // namespace

// SmolLM2, slow enough that a 1000-token stream is still running when its client leaves.
TEST_CASE("server: a client gone mid-stream ends its request, others are served") {
  const model& m = smollm2();
  const std::string question = "What is 2 + 2?";
  const auto want = greedy(m, m.tok->chat_prompt(question), 10).first;
  server s(m, options());
  const int port = s.start();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  json body = {{"prompt", "Once upon a time"},
               {"max_tokens", 1000},
               {"temperature", 0},
               {"stream", true},
               {"ignore_eos", true}};
  const std::string b = body.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(b.size()) + "\r\n\r\n" + b;
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  std::string got;
  for (int i = 0; i < 100 && got.find("\"text\"") == std::string::npos; ++i) {
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      break;
    }
    got.append(buf, static_cast<std::size_t>(n));
  }
  CHECK(got.find("\"text\"") != std::string::npos);  // the stream began
  // Another client meanwhile gets its own answer.
  client c(port);
  const auto r = c.post("/v1/chat/completions",
                        {{"messages", json::array({{{"role", "user"}, {"content", question}}})},
                         {"max_tokens", 10},
                         {"temperature", 0}});
  ::close(fd);  // gone mid-stream
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(text_of(json::parse(r->body), true) == want);
  // The engine ends the abandoned request at its next token: soon idle (bounded wait), and
  // counted as cancelled.
  json h;
  for (int i = 0; i < 600; ++i) {
    h = json::parse(c.c.Get("/health")->body);
    if (h["active"] == 0 && h["waiting"] == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(h["active"] == 0);
  CHECK(h["waiting"] == 0);
  CHECK(h["cancelled"] == 1);
  s.stop();
}

namespace {

// A tokenizer with SmolLM2's ChatML template, for the prompt text alone.
struct chatml_tokenizer : tokenizer {
  std::vector<int> encode(const std::string&, bool) const override { return {}; }
  std::string decode(int, int) const override { return {}; }
  bool is_end(int) const override { return false; }
  std::string chat_prompt(const std::string& user) const override {
    return "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
           "Face<|im_end|>\n<|im_start|>user\n" +
           user + "<|im_end|>\n<|im_start|>assistant\n";
  }
  bool adds_bos() const override { return false; }
  std::uint32_t vocab_size() const override { return 0; }
};

}  // namespace

TEST_CASE("server: chat prompts in the model's ChatML template, or the contents joined") {
  const chatml_tokenizer t;
  CHECK(chat_text(t, {{"user", "Hi there"}}) == t.chat_prompt("Hi there"));
  CHECK(
      chat_text(
          t, {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}}) ==
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
      "<|im_start|>assistant\n");
  CHECK(chat_text(t, {{"user", "Hi"}, {"assistant", "Yo"}, {"user", "Q"}}) ==
        t.chat_prompt("Hi").substr(0, t.chat_prompt("Hi").rfind("<|im_start|>assistant\n")) +
            "<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n");
  CHECK_THROWS_AS(chat_text(t, {{"wizard", "x"}}), decoder_error);
  // llama2.c: no template.
  CHECK(chat_text(*stories().tok, {{"user", "Once upon"}, {"user", "a time"}}) ==
        "Once upon\na time");
}

TEST_CASE("server: SmolLM2 chat completions in its ChatML template equal the decoder's answer") {
  const model& m = smollm2();
  const std::string question = "What is the capital of France?";
  const std::vector<chat_message> messages = {{"system", "You answer in one word."},
                                              {"user", question}};
  // References first (no server running): one user message, and a chat with a system message.
  const auto [want_one, p_one] = greedy(m, m.tok->chat_prompt(question), 12);
  const auto [want_sys, p_sys] = greedy(m, chat_text(*m.tok, messages), 12);
  server s(m, options());
  client c(s.start());
  CHECK(s.model_id() == "SmolLM2-135M-Instruct.Q4_1");
  json body = {{"messages", json::array({{{"role", "user"}, {"content", question}}})},
               {"max_tokens", 12},
               {"temperature", 0}};
  auto r = c.post("/v1/chat/completions", body);
  REQUIRE(r);
  REQUIRE(r->status == 200);
  json j = json::parse(r->body);
  CHECK(text_of(j, true) == want_one);
  CHECK(j["usage"]["prompt_tokens"] == p_one);
  body["messages"] = json::array({{{"role", "system"}, {"content", messages[0].content}},
                                  {{"role", "user"}, {"content", question}}});
  r = c.post("/v1/chat/completions", body);
  REQUIRE(r);
  REQUIRE(r->status == 200);
  j = json::parse(r->body);
  CHECK(text_of(j, true) == want_sys);
  CHECK(j["usage"]["prompt_tokens"] == p_sys);
  s.stop();
}

// As `mini_decoder serve` runs it: speculative rounds (prompt lookup) and a step budget.
TEST_CASE("server: the speculative engine answers as the decoder, with per-request timings") {
  std::vector<std::string> want;
  for (std::size_t i = 0; i < 3; ++i) {
    want.push_back(reference(prompts[i], 60));
  }
  server_options o = options();
  o.engine.draft = draft_kind::ngram;
  o.engine.step_tokens = 64;
  server s(stories(), o);
  const int port = s.start();
  std::vector<std::string> got(3);
  std::vector<json> timings(3);
  std::vector<std::thread> clients;
  for (std::size_t i = 0; i < 3; ++i) {
    clients.emplace_back([&, i] {
      client c(port);
      const auto r = c.post("/v1/completions", completion(prompts[i], 60));
      if (r && r->status == 200) {
        const json j = json::parse(r->body);
        got[i] = text_of(j, false);
        timings[i] = j["timings"];
      }
    });
  }
  for (auto& t : clients) {
    t.join();
  }
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(got[i] == want[i]);
    const json& t = timings[i];
    REQUIRE(t.is_object());
    CHECK(t["first_token_seconds"].get<double>() > 0.0);
    CHECK(t["first_token_seconds"].get<double>() >= t["queue_seconds"].get<double>());
    CHECK(t["inter_token_seconds"]["p50"].get<double>() <=
          t["inter_token_seconds"]["max"].get<double>());
    CHECK(t["accepted"].get<std::uint32_t>() <= t["drafted"].get<std::uint32_t>());
  }
  // Streamed with usage: the timings come with it.
  client c(port);
  json body = completion(prompts[0], 60, true);
  body["stream_options"] = {{"include_usage", true}};
  const auto r = c.post("/v1/completions", body);
  REQUIRE(r);
  REQUIRE(r->status == 200);
  const std::vector<std::string> ev = events_of(r->body);
  REQUIRE(ev.size() >= 3);
  const json u = json::parse(ev[ev.size() - 2]);
  CHECK(u["usage"]["completion_tokens"].get<std::uint32_t>() > 0);
  CHECK(u["timings"]["first_token_seconds"].get<double>() > 0.0);
  s.stop();
}
