// SPDX-License-Identifier: Apache-2.0
// `mini_decoder serve`: the command line of the OpenAI-compatible HTTP server (server/server.hpp).
#include <fmt/core.h>
#include <pthread.h>
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>

#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/kv_backend.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/ops/threads.hpp>
#include <mini_decoder/server/server.hpp>

namespace mini_decoder {

//! `mini_decoder serve ...` (argv[0] is "serve"): serves until SIGINT or SIGTERM. Returns the
//! exit code: 0 after a signal, 1 on an error, 2 on a bad flag.
int serve_main(int argc, char** argv);

int serve_main(int argc, char** argv) {
  CLI::App app{
      "mini_decoder serve: an OpenAI-compatible HTTP server (/v1/completions, "
      "/v1/chat/completions, /v1/models, /health) on the batched engine",
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
  app.add_option("--http-threads", o.http_threads,
                 "threads serving HTTP requests (each open stream holds one)")
      ->capture_default_str()
      ->check(CLI::Range(2u, 1024u));
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
    fmt::print(stderr, "mini_decoder serve: signal {}, stopping\n", sig);
    s.stop();
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mini_decoder serve: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace mini_decoder
