// SPDX-License-Identifier: Apache-2.0
// `mini_decoder serve`: the command line of the OpenAI-compatible HTTP server (server/server.hpp).
#include <fmt/core.h>
#include <pthread.h>
#include <CLI/CLI.hpp>

#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/kv_backend.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/ops/threads.hpp>
#include <mini_decoder/server/access.hpp>
#include <mini_decoder/server/server.hpp>

namespace mini_decoder {

//! `mini_decoder serve ...` (argv[0] is "serve"): serves until SIGINT or SIGTERM. Returns the
//! exit code: 0 after a signal, 1 on an error, 2 on a bad flag.
int serve_main(int argc, char** argv);

namespace {

bool is_loopback_listen(const std::string& host) {
  return serving::is_loopback_address(host);
}

}  // namespace

int serve_main(int argc, char** argv) {
  CLI::App app{
      "mini_decoder serve: an OpenAI-compatible HTTP server (/v1/completions, "
      "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics) on the "
      "batched engine",
      "mini_decoder serve"};
  server_options o;
  std::string model_path, tokenizer_path, mode = "dense", matmul = "int8", draft = "ngram";
  std::string summary = to_string(default_summary);
  double fast_tier_mib = 256;
  int threads = 1;
  app.add_option("--model", model_path, "GGUF or llama2.c model file")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--tokenizer", tokenizer_path, "llama2.c tokenizer (default: beside the model)");
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "port (0: a free one; the line on stderr names it)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--model-id", o.model_id,
                 "the model name the API reports (default: the file name without extension)");
  app.add_option("--mode", mode, "dense|oasis")
      ->capture_default_str()
      ->check(CLI::IsMember({"dense", "oasis"}));
  app.add_option("--summary", summary,
                 std::string("oasis: the block summary the predictor scores with (") +
                     summary_names() + ")")
      ->capture_default_str();
  app.add_option("--budget", o.engine.budget_tokens, "oasis: tokens attended per layer and step")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--block", o.engine.block_tokens, "tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--fast-tier-mib", fast_tier_mib,
                 "the fast tier's size, the admission budget: requests wait while it is full")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 1048576.0));
  app.add_option("--max-batch", o.engine.max_batch, "most sequences decoding at once")
      ->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  app.add_option("--context", o.engine.context, "context length (0: the model's)")
      ->capture_default_str();
  app.add_option("--draft", draft,
                 "each sequence's drafts: ngram (prompt lookup), self (the first --draft-layers "
                 "layers) or none")
      ->capture_default_str()
      ->check(CLI::IsMember({"ngram", "self", "none"}));
  app.add_option("--draft-len", o.engine.draft_len,
                 "the most tokens a sequence drafts a round (its length adapts to its acceptance)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 15u));
  app.add_option("--draft-layers", o.engine.draft_layers, "self drafts: the draft model's layers")
      ->capture_default_str();
  app.add_option("--step-tokens", o.engine.step_tokens,
                 "tokens an engine step computes, decode rows and prefill chunks together (0: "
                 "each prompt prefilled whole when admitted, holding the running streams)")
      ->capture_default_str()
      ->check(CLI::Range(0u, 1u << 24));
  app.add_option("--threads", threads, "threads for matrix products")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--matmul", matmul, "activations of the quantized products: int8 or f32")
      ->capture_default_str()
      ->check(CLI::IsMember({"int8", "f32"}));
  app.add_option("--http-threads", o.http.worker_threads,
                 "threads that parse and tokenize requests (connections and streams hold none)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 256u));
  app.add_option("--max-connections", o.http.max_connections, "connections open at once, in all")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  app.add_option("--max-connections-per-client", o.http.max_connections_per_client,
                 "connections open at once from one address")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  double max_body_mib = static_cast<double>(o.http.max_body_bytes) / 1048576.0;
  app.add_option("--max-body-mib", max_body_mib, "the largest request body")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 1024.0));
  app.add_option("--header-timeout", o.http.header_timeout,
                 "seconds from a request's first byte to the end of its head")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--request-timeout", o.http.request_timeout,
                 "seconds from a request's first byte to the end of its body")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--keep-alive-timeout", o.http.keep_alive_timeout,
                 "seconds an open connection may wait with no request")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--write-timeout", o.http.write_timeout,
                 "seconds an answer may wait for a client that reads none of it")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--shutdown-grace", o.shutdown_grace,
                 "on SIGTERM: seconds running requests may go on before their streams are ended")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--max-n", o.max_n, "the most choices ('n') one request may ask for")
      ->capture_default_str()
      ->check(CLI::Range(1u, 128u));
  std::string api_key_file;
  app.add_option("--api-key", o.api_key,
                 "clients must send 'Authorization: Bearer KEY' (all but /health and /metrics); "
                 "visible to other users in the process list: prefer --api-key-file");
  app.add_option("--api-key-file", api_key_file, "the API key, from the first line of a file")
      ->check(CLI::ExistingFile);
  app.add_option("--allowed-host", o.allowed_hosts,
                 "a Host name to answer besides localhost and 127.0.0.1 (repeatable)");
  app.add_option("--allowed-origin", o.allowed_origins,
                 "a browser Origin to accept, e.g. http://localhost:3000 (repeatable; by default "
                 "requests from web pages are refused)");
  app.add_option("--default-max-tokens", o.default_max_tokens,
                 "max_tokens of a chat completion that gives none (capped by the context)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_flag("--log", o.log_requests, "one line per request on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      return app.exit(e);
    }
    fmt::print(stderr, "mini_decoder serve: error: {} (see --help)\n", e.what());
    return 2;
  }
  try {
    set_num_threads(threads);
    set_matmul_activations(matmul_activations_from_string(matmul));
    o.engine.mode = parse_mode(mode);
    o.engine.summary = parse_summary(summary);
    o.engine.draft = parse_draft(draft);
    o.engine.fast_tier_bytes = static_cast<std::uint64_t>(fast_tier_mib * 1048576.0);
    o.http.max_body_bytes = static_cast<std::size_t>(max_body_mib * 1048576.0);
    if (!api_key_file.empty()) {
      std::ifstream in(api_key_file);
      std::getline(in, o.api_key);
      while (!o.api_key.empty() && (o.api_key.back() == '\r' || o.api_key.back() == ' ')) {
        o.api_key.pop_back();
      }
      if (o.api_key.empty()) {
        fail("--api-key-file ", api_key_file, ": its first line is empty");
      }
    }
    // Descriptors: one per connection and a few dozen besides. Raise the soft limit to the hard
    // one, and hold the connection limit under what that allows.
    rlimit nofile{};
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
      nofile.rlim_cur = nofile.rlim_max;
      setrlimit(RLIMIT_NOFILE, &nofile);
      getrlimit(RLIMIT_NOFILE, &nofile);
      if (nofile.rlim_cur != RLIM_INFINITY && nofile.rlim_cur < o.http.max_connections + 64) {
        const auto fit =
            static_cast<std::size_t>(nofile.rlim_cur > 128 ? nofile.rlim_cur - 64 : 64);
        fmt::print(stderr,
                   "mini_decoder serve: warning: {} descriptors allowed; --max-connections "
                   "lowered from {} to {}\n",
                   nofile.rlim_cur, o.http.max_connections, fit);
        o.http.max_connections = fit;
      }
    }
    if (!is_loopback_listen(o.host) && o.api_key.empty()) {
      fmt::print(stderr,
                 "mini_decoder serve: warning: listening on {} with no --api-key: anyone who "
                 "can reach this address can use the server\n",
                 o.host);
    }
    const auto m = load_model(model_path, tokenizer_path);
    // SIGINT and SIGTERM wait for sigwait below: blocked here, before any thread starts, so
    // every thread inherits the mask. A client gone mid-write must not kill the server.
    std::signal(SIGPIPE, SIG_IGN);
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    server s(*m, o);
    const int port = s.start();
    fmt::print(stderr,
               "mini_decoder serve: listening on http://{}:{} (model {}, {} mode, fast tier "
               "{:.1f} MiB, max batch {}, drafts {}, step budget {} tokens)\n",
               o.host, port, s.model_id(), mode, fast_tier_mib, o.engine.max_batch, draft,
               o.engine.step_tokens);
    std::fflush(stderr);
    int sig = 0;
    sigwait(&stop_signals, &sig);
    fmt::print(stderr,
               "mini_decoder serve: signal {}, stopping (running requests have {} s to finish)\n",
               sig, o.shutdown_grace);
    s.stop();
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mini_decoder serve: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace mini_decoder
