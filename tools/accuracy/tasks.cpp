// SPDX-License-Identifier: Apache-2.0
#include "tasks.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>
#include <sstream>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

#include "runner.hpp"

namespace accuracy {

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

using results_map = std::map<std::string, std::map<std::string, double>>;

// An --e2e spec, parsed as the end-to-end runs parse it, at the task's block size.
sparse_config parse_spec(const std::string& spec, const task_inputs& in) {
  sparse_config sc = parse_sparse_config(spec, in.contender_factor);
  sc.block = in.block;
  return sc;
}

std::string read_file(const std::string& f) {
  std::ifstream in(f, std::ios::binary);
  if (!in) {
    mini_decoder::fail("cannot read ", f);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20) {
      out += fmt::format("\\u{:04x}", u);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// The text of greedy tokens, up to the first end-of-generation token.
std::string answer_text(const mini_decoder::tokenizer& tok, const std::vector<int>& tokens) {
  std::string s;
  int prev = -1;
  for (const int t : tokens) {
    if (tok.is_end(t)) {
      break;
    }
    s += tok.decode(prev, t);
    prev = t;
  }
  return s;
}

// The first token from the dense prefill, then the run's: what the model answers.
std::vector<int> answer_tokens(const run_result& r) {
  std::vector<int> a;
  if (!r.tokens.empty()) {
    a.push_back(r.tokens[0]);
  }
  a.insert(a.end(), r.argmax.begin(), r.argmax.end());
  return a;
}

void write_results(std::ofstream& js, const results_map& results) {
  js << "  \"results\": {\n";
  bool first = true;
  for (const auto& [name, row] : results) {
    js << (first ? "" : ",\n") << "    " << json_string(name) << ": {";
    bool f2 = true;
    for (const auto& [k, v] : row) {
      js << (f2 ? "" : ", ") << json_string(k) << ": " << fmt::format("{:.6g}", v);
      f2 = false;
    }
    js << "}";
    first = false;
  }
  js << "\n  }";
}

// "<config>:<metric>>=<value>" (or "<="), as the harness's --expect.
int check_expects(const results_map& results, const std::vector<std::string>& expects) {
  int failed = 0;
  for (const std::string& s : expects) {
    const expectation e = parse_expect(s);
    const std::string &key = e.key, &metric = e.metric;
    const bool at_most = e.at_most;
    const double want = e.value;
    const auto it = results.find(key);
    if (it == results.end() || !it->second.contains(metric)) {
      fmt::print(stderr, "FAIL {}: no such figure\n", s);
      ++failed;
      continue;
    }
    const double v = it->second.at(metric);
    const bool ok = at_most ? v <= want : v >= want;
    fmt::print(stderr, "{} {}: measured {:.4f}\n", ok ? "ok  " : "FAIL", s, v);
    failed += ok ? 0 : 1;
  }
  return failed;
}

// --- needle in a haystack ----------------------------------------------------------------------

constexpr const char* filler_unit =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
constexpr const char* needle_intro =
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will "
    "quiz you about the pass key later on.\n\n";
constexpr const char* needle_question = "\n\nWhat is the pass key? Answer with the pass key only.";

struct haystack {
  bool filler = true;
  std::string text;  // real text (filler: unused)
  // The haystack of size `s` (filler units, or characters of the text) with `needle` at
  // `depth` (at a unit boundary, or after the next line or sentence end of the text).
  std::string with_needle(std::size_t s, double depth, const std::string& needle) const {
    if (filler) {
      const auto at = static_cast<std::size_t>(depth * double(s) + 0.5);
      std::string h;
      for (std::size_t u = 0; u < s; ++u) {
        if (u == at) {
          h += needle;
        }
        h += filler_unit;
      }
      return at >= s ? h + needle : h;
    }
    std::string h = text.substr(0, s);
    std::size_t at = static_cast<std::size_t>(depth * double(s));
    const std::size_t nl = h.find('\n', at), dot = h.find(". ", at);
    at = std::min(nl == std::string::npos ? s : nl + 1, dot == std::string::npos ? s : dot + 2);
    return h.substr(0, at) + needle + h.substr(at);
  }
  std::size_t max_size() const { return filler ? std::size_t{1} << 20 : text.size(); }
};

// The prompt: the user turn through the chat template when the model has one (else the plain
// text), then the answer's start.
std::string needle_prompt(const mini_decoder::tokenizer& tok, const std::string& hay) {
  const std::string user = needle_intro + hay + needle_question;
  try {
    return tok.chat_prompt(user) + "The pass key is";
  } catch (const std::exception&) {
    return user + "\nThe pass key is";
  }
}

std::string needle_of(const std::string& key) {
  return "The pass key is " + key + ". Remember it. " + key + " is the pass key. ";
}

int run_needle(const task_options& o, const task_inputs& in) {
  const mini_decoder::model& m = *in.model;
  const mini_decoder::tokenizer& tok = *m.tok;
  haystack hs;
  if (o.haystack == "text") {
    if (in.text_files.empty()) {
      mini_decoder::fail("--haystack text needs --text files");
    }
    hs.filler = false;
    for (const std::string& f : in.text_files) {
      hs.text += read_file(f) + "\n\n";
    }
  }
  std::vector<sparse_config> configs;
  for (const std::string& s : in.e2e_specs) {
    configs.push_back(parse_spec(s, in));
  }
  std::vector<double> depths;
  for (std::uint32_t d = 0; d < o.depths; ++d) {
    depths.push_back(o.depths == 1 ? 0.5 : 0.1 + 0.8 * double(d) / double(o.depths - 1));
  }
  std::mt19937_64 rng(in.seed);
  results_map results;
  std::ostringstream cases_js;
  bool first_case = true;
  double prefill_s = 0, decode_s = 0;
  std::uint64_t prefill_tokens = 0;
  const auto t0 = clock_type::now();
  for (const std::uint32_t C : o.contexts) {
    if (C <= o.answer_tokens + 64) {
      mini_decoder::fail("--contexts ", C, " leaves no room for a haystack");
    }
    const std::uint32_t T = C - o.answer_tokens;  // prompt tokens at most
    auto tokens_of = [&](std::size_t s, double depth, const std::string& key) {
      return tok.encode(needle_prompt(tok, hs.with_needle(s, depth, needle_of(key))), true);
    };
    // The largest haystack whose prompt (a 6-digit key, mid-depth) fits T - 4 tokens: searched
    // up to twice the size a sample's tokens per unit (or character) predict.
    const std::size_t sample = hs.filler ? 8 : std::min<std::size_t>(hs.text.size(), 8000);
    const std::size_t base = tokens_of(0, 0.5, "999999").size();
    const std::size_t per =
        std::max<std::size_t>(tokens_of(sample, 0.5, "999999").size() - base, 1);
    std::size_t lo = 0, hi = std::min(hs.max_size(), 2 * sample * T / per + 2);
    while (lo < hi) {
      const std::size_t mid = (lo + hi + 1) / 2;
      if (tokens_of(mid, 0.5, "999999").size() + 4 <= T) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (lo == 0) {
      mini_decoder::fail("context ", C, ": no haystack fits");
    }
    runner r(m, in.rope_scale, C, in.draft_len);
    auto& dense_row = results[fmt::format("needle/{}/dense", C)];
    std::vector<std::uint32_t> ok(configs.size(), 0), lost(configs.size(), 0),
        gained(configs.size(), 0), same(configs.size(), 0);
    std::uint32_t dense_ok = 0, cases = 0;
    fmt::print(stderr, "context {}: haystack {} {}\n", C, lo, hs.filler ? "units" : "characters");
    for (const double depth : depths) {
      for (std::uint32_t k = 0; k < o.keys; ++k) {
        const std::string key = std::to_string(10000 + rng() % 990000);  // 5 or 6 digits
        std::size_t s = lo;
        std::vector<int> prompt = tokens_of(s, depth, key);
        while (prompt.size() > T && s > 1) {  // tokenization at the needle can differ by one
          s -= std::max<std::size_t>(1, s / 100);
          prompt = tokens_of(s, depth, key);
        }
        auto t1 = clock_type::now();
        r.prefill(prompt);
        prefill_s += since(t1);
        prefill_tokens += prompt.size();
        t1 = clock_type::now();
        const run_result dense = r.greedy(o.answer_tokens, nullptr);
        const std::vector<int> da = answer_tokens(dense);
        const std::string dtext = answer_text(tok, da);
        const bool dok = dtext.find(key) != std::string::npos;
        dense_ok += dok ? 1u : 0u;
        std::string line = fmt::format("{:>5} {:.2f} {:>6} dense {} {:?}", C, depth, key,
                                       dok ? "ok  " : "FAIL", dtext);
        cases_js << (first_case ? "" : ",\n") << "    {\"context\": " << C
                 << ", \"prompt_tokens\": " << prompt.size()
                 << ", \"depth\": " << fmt::format("{:.4g}", depth)
                 << ", \"key\": " << json_string(key)
                 << ", \"answers\": {\"dense\": {\"text\": " << json_string(dtext)
                 << ", \"success\": " << (dok ? "true" : "false") << "}";
        first_case = false;
        for (std::size_t ci = 0; ci < configs.size(); ++ci) {
          const run_result sr = r.greedy(o.answer_tokens, &configs[ci]);
          const std::vector<int> sa = answer_tokens(sr);
          const std::string stext = answer_text(tok, sa);
          const bool sok = stext.find(key) != std::string::npos;
          ok[ci] += sok ? 1u : 0u;
          lost[ci] += dok && !sok ? 1u : 0u;
          gained[ci] += !dok && sok ? 1u : 0u;
          same[ci] += sa == da ? 1u : 0u;
          cases_js << ", " << json_string("e2e/" + configs[ci].name())
                   << ": {\"text\": " << json_string(stext)
                   << ", \"success\": " << (sok ? "true" : "false") << "}";
          if (dok && !sok) {
            line += fmt::format("\n      lost by {}: {:?}", configs[ci].name(), stext);
          }
        }
        cases_js << "}}";
        decode_s += since(t1);
        ++cases;
        fmt::print(stderr, "{}\n", line);
      }
    }
    dense_row["success"] = double(dense_ok) / cases;
    dense_row["ok"] = dense_ok;
    dense_row["cases"] = cases;
    for (std::size_t ci = 0; ci < configs.size(); ++ci) {
      auto& row = results[fmt::format("needle/{}/e2e/{}", C, configs[ci].name())];
      row["success"] = double(ok[ci]) / cases;
      row["ok"] = ok[ci];
      row["lost"] = lost[ci];                         // fails where dense succeeds
      row["gained"] = gained[ci];                     // succeeds where dense fails
      row["match_dense"] = double(same[ci]) / cases;  // the same answer tokens as dense
      row["cases"] = cases;
    }
  }
  fmt::print("{:<8} {:<40} {:>8} {:>5} {:>6} {:>11}\n", "context", "config", "success", "lost",
             "gained", "match_dense");
  for (const auto& [name, row] : results) {
    const auto a = name.find('/', 7);
    fmt::print("{:<8} {:<40} {:>8.3f} {:>5.0f} {:>6.0f} {:>11.3f}\n", name.substr(7, a - 7),
               name.substr(a + 1), row.at("success"), row.contains("lost") ? row.at("lost") : 0.0,
               row.contains("gained") ? row.at("gained") : 0.0,
               row.contains("match_dense") ? row.at("match_dense") : 1.0);
  }
  const double total = since(t0);
  fmt::print(stderr,
             "prefill {:.1f} s ({} tokens, {:.0f} tokens/s), decode {:.1f} s, total {:.1f} s\n",
             prefill_s, prefill_tokens, double(prefill_tokens) / std::max(prefill_s, 1e-9),
             decode_s, total);
  if (!in.json_path.empty()) {
    std::ofstream js(in.json_path);
    js << "{\n  \"task\": \"needle\", \"model\": " << json_string(m.config.architecture)
       << ", \"haystack\": " << json_string(o.haystack) << ", \"depths\": " << o.depths
       << ", \"keys\": " << o.keys << ", \"answer_tokens\": " << o.answer_tokens
       << ", \"block\": " << in.block << ", \"draft_len\": " << in.draft_len
       << ",\n  \"seconds\": {\"prefill\": " << fmt::format("{:.2f}", prefill_s)
       << ", \"prefill_tokens\": " << prefill_tokens
       << ", \"decode\": " << fmt::format("{:.2f}", decode_s)
       << ", \"total\": " << fmt::format("{:.2f}", total) << "},\n";
    write_results(js, results);
    js << ",\n  \"cases\": [\n" << cases_js.str() << "\n  ]\n}\n";
  }
  return check_expects(results, in.expects) == 0 ? 0 : 1;
}

// --- free-running agreement --------------------------------------------------------------------

// Tokens of agreement before the first divergence from `ref` (all of them: ref.size()).
std::uint32_t prefix(const std::vector<int>& a, const std::vector<int>& ref) {
  std::uint32_t i = 0;
  while (i < ref.size() && i < a.size() && a[i] == ref[i]) {
    ++i;
  }
  return i;
}

int run_agree(const task_options& o, const task_inputs& in) {
  const mini_decoder::model& m = *in.model;
  std::vector<std::vector<std::string>> sources;
  for (const std::string& c : o.corpora) {
    std::vector<std::string> files;
    std::stringstream ss(c);
    for (std::string f; std::getline(ss, f, ',');) {
      if (!f.empty()) {
        files.push_back(f);
      }
    }
    sources.push_back(files);
  }
  for (const std::string& f : in.text_files) {
    sources.push_back({f});
  }
  if (sources.empty()) {
    mini_decoder::fail("--task agree needs text: --corpus (once per source) or --text");
  }
  if (o.decode + 64 > in.context) {
    mini_decoder::fail("--decode ", o.decode, " leaves no prompt in --context ", in.context);
  }
  const std::uint32_t W = in.context - o.decode;  // prompt tokens
  std::vector<std::vector<int>> texts;
  for (const auto& files : sources) {
    std::string all;
    for (const std::string& f : files) {
      all += read_file(f) + "\n\n";
    }
    texts.push_back(m.tok->encode(all, false));
    if (texts.back().size() < W) {
      mini_decoder::fail("a source (", files.front(), " ...) is ", texts.back().size(),
                         " tokens; a prompt of --context ", in.context, " - --decode ", o.decode,
                         " needs ", W);
    }
  }
  std::vector<sparse_config> configs;
  for (const std::string& s : in.e2e_specs) {
    configs.push_back(parse_spec(s, in));
  }
  for (const std::string& n : o.noise) {
    if (n != "order" && n != "f32act") {
      mini_decoder::fail("--noise '", n, "' is not order or f32act");
    }
  }
  // Rows: the noise baselines, then the sparse configurations; per prompt, the prefix.
  std::vector<std::string> names;
  for (const std::string& n : o.noise) {
    names.push_back("noise/" + n);
  }
  for (const sparse_config& sc : configs) {
    names.push_back("e2e/" + sc.name());
  }
  std::vector<std::vector<std::uint32_t>> prefixes(names.size());
  runner r(m, in.rope_scale, in.context, in.draft_len);
  const auto S = static_cast<std::uint32_t>(texts.size());
  double prefill_s = 0, decode_s = 0;
  std::ostringstream prompts_js;
  const auto t0 = clock_type::now();
  for (std::uint32_t p = 0; p < o.prompts; ++p) {
    const std::uint32_t s = p % S, k = p / S, count = (o.prompts - s + S - 1) / S;
    const std::size_t span = texts[s].size() - W;
    const auto off = static_cast<std::size_t>(double(span) * (k + 0.5) / count);
    std::vector<int> prompt;
    if (m.tok->adds_bos()) {
      prompt = m.tok->encode("", true);
    }
    prompt.insert(prompt.end(), texts[s].begin() + off, texts[s].begin() + off + W);
    prompt.resize(W);
    auto t1 = clock_type::now();
    r.prefill(prompt);
    prefill_s += since(t1);
    t1 = clock_type::now();
    const std::vector<int> dense = r.greedy(o.decode, nullptr).argmax;
    std::string line = fmt::format("prompt {:>2} (source {}, token {:>6}):", p, s, off);
    prompts_js << (p ? ",\n" : "") << "    {\"source\": " << s << ", \"offset\": " << off
               << ", \"prefix\": {";
    for (std::size_t ni = 0; ni < names.size(); ++ni) {
      std::vector<int> out;
      if (ni < o.noise.size()) {
        if (o.noise[ni] == "f32act") {
          mini_decoder::set_matmul_activations(mini_decoder::matmul_activations::f32);
          out = r.greedy(o.decode, nullptr).argmax;
          mini_decoder::set_matmul_activations(mini_decoder::matmul_activations::int8);
        } else {
          out = r.greedy(o.decode, nullptr, true).argmax;
        }
      } else {
        out = r.greedy(o.decode, &configs[ni - o.noise.size()]).argmax;
      }
      const std::uint32_t pre = prefix(out, dense);
      prefixes[ni].push_back(pre);
      line += fmt::format(" {}", pre);
      prompts_js << (ni ? ", " : "") << json_string(names[ni]) << ": " << pre;
    }
    prompts_js << "}}";
    decode_s += since(t1);
    fmt::print(stderr, "{} ({:.1f} s)\n", line, since(t1));
  }
  results_map results;
  fmt::print("{:<44} {:>11} {:>9} {:>10}\n", "config", "mean_prefix", "identical", "min_prefix");
  for (std::size_t ni = 0; ni < names.size(); ++ni) {
    const std::vector<std::uint32_t>& v = prefixes[ni];
    double sum = 0, same = 0;
    for (const std::uint32_t x : v) {
      sum += x;
      same += x == o.decode ? 1 : 0;
    }
    auto& row = results["agree/" + names[ni]];
    row["mean_prefix"] = sum / double(v.size());
    row["identical"] = same / double(v.size());
    row["identical_prompts"] = same;
    row["min_prefix"] = *std::min_element(v.begin(), v.end());
    row["prompts"] = double(v.size());
    fmt::print("{:<44} {:>11.2f} {:>9.3f} {:>10.0f}\n", names[ni], row["mean_prefix"],
               row["identical"], row["min_prefix"]);
  }
  const double total = since(t0);
  fmt::print(stderr, "prefill {:.1f} s, decode {:.1f} s, total {:.1f} s\n", prefill_s, decode_s,
             total);
  if (!in.json_path.empty()) {
    std::ofstream js(in.json_path);
    js << "{\n  \"task\": \"agree\", \"model\": " << json_string(m.config.architecture)
       << ", \"context\": " << in.context << ", \"prompt\": " << W << ", \"decode\": " << o.decode
       << ", \"prompts\": " << o.prompts << ", \"sources\": [";
    for (std::size_t s = 0; s < sources.size(); ++s) {
      js << (s ? ", " : "") << "[";
      for (std::size_t f = 0; f < sources[s].size(); ++f) {
        js << (f ? ", " : "") << json_string(sources[s][f]);
      }
      js << "]";
    }
    js << "], \"block\": " << in.block << ", \"draft_len\": " << in.draft_len
       << ",\n  \"seconds\": {\"prefill\": " << fmt::format("{:.2f}", prefill_s)
       << ", \"decode\": " << fmt::format("{:.2f}", decode_s)
       << ", \"total\": " << fmt::format("{:.2f}", total) << "},\n";
    write_results(js, results);
    js << ",\n  \"per_prompt\": [\n" << prompts_js.str() << "\n  ]\n}\n";
  }
  return check_expects(results, in.expects) == 0 ? 0 : 1;
}

}  // namespace

void add_task_options(CLI::App& app, task_options& o) {
  app.add_option("--task", o.task,
                 "needle (pass-key retrieval) or agree (free-running agreement with dense); "
                 "without it, the predictor run")
      ->check(CLI::IsMember({"needle", "agree"}));
  app.add_option("--contexts", o.contexts, "needle: contexts in tokens (prompt + answer)")
      ->check(CLI::Range(128u, 1u << 24));
  app.add_option("--depths", o.depths, "needle: depths, evenly from 10% to 90%")
      ->check(CLI::Range(1u, 1000u));
  app.add_option("--keys", o.keys, "needle: pass keys per depth")->check(CLI::Range(1u, 1000u));
  app.add_option("--answer-tokens", o.answer_tokens, "needle: greedy tokens of the answer")
      ->check(CLI::Range(1u, 1000u));
  app.add_option("--haystack", o.haystack, "needle: filler (repeated sentences) or text (--text)")
      ->check(CLI::IsMember({"filler", "text"}));
  app.add_option("--prompts", o.prompts, "agree: prompts, round-robin over the sources")
      ->check(CLI::Range(1u, 100000u));
  app.add_option("--decode", o.decode, "agree: greedy tokens per prompt")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--corpus", o.corpora,
                 "agree: one text source, files joined by commas (give it once per source; each "
                 "--text file is a source too)");
  app.add_option("--noise", o.noise,
                 "agree: dense noise baselines: order (blocks attended last to first), f32act "
                 "(f32 activations in the decode matmuls, not int8)")
      ->check(CLI::IsMember({"order", "f32act"}));
}

int run_task(const task_options& o, const task_inputs& in) {
  return o.task == "needle" ? run_needle(o, in) : run_agree(o, in);
}

}  // namespace accuracy
