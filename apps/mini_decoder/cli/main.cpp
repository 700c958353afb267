// SPDX-License-Identifier: Apache-2.0
// mini_decoder: a small Llama-family engine whose attention runs through OasisKV.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include <mini_decoder/decode/decoder.hpp>
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/blas.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/ops/threads.hpp>
#include <throughput/throughput.hpp>

#include "oasiskv/core/error.hpp"

using namespace mini_decoder;

namespace {

struct cli_options {
  std::string model, prompt, prompt_file, tokenizer, mode = "dense", draft = "none", compare;
  std::string expect_answer;  // text each answer is checked for (case-insensitive)
  std::string matmul = "int8";
  std::string summary = to_string(default_summary);
  // --throughput: the equal-memory throughput run instead of one generation.
  std::uint32_t throughput_requests = 0, throughput_prompt_tokens = 8064, dense_sequences = 4;
  std::uint32_t step_tokens = 0;  // the batched engine's step budget (0: whole prefills)
  bool stall_probe = false;       // --stall-probe instead of --throughput
  double fast_tier_mib = 0;
  std::uint32_t time_tokens = 0;  // decode at least this many tokens for the speed figures
  decoder_options dec;
  bool chat = false, quiet = false;
  int threads = 1;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    fail("cannot open --prompt-file '", path, "'");
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string mib(std::uint64_t b) {
  return fmt::format("{:.2f} MiB", b / 1048576.0);
}

std::string lower(std::string s) {
  for (char& ch : s) {
    if (ch >= 'A' && ch <= 'Z') {
      ch = static_cast<char>(ch - 'A' + 'a');
    }
  }
  return s;
}

std::string text_of(const model& m, int prev, const std::vector<int>& tokens) {
  std::string out;
  for (int t : tokens) {
    out += m.tok->decode(prev, t);
    prev = t;
  }
  return out;
}

// One line under an answer: whether it contains the expected text.
bool report_expected(const std::string& answer, const std::string& expected) {
  const bool found = lower(answer).find(lower(expected)) != std::string::npos;
  std::printf("   contains \"%s\": %s\n", expected.c_str(), found ? "yes" : "no");
  return found;
}

// The tokens two runs share: the common prefix and the equal positions.
struct agreement {
  std::size_t prefix = 0, same = 0, length = 0;
};

agreement agreement_of(const std::vector<int>& a, const std::vector<int>& b) {
  agreement g;
  const std::size_t n = std::min(a.size(), b.size());
  while (g.prefix < n && a[g.prefix] == b[g.prefix]) {
    ++g.prefix;
  }
  for (std::size_t i = 0; i < n; ++i) {
    g.same += a[i] == b[i];
  }
  g.length = std::max(a.size(), b.size());
  return g;
}

void print_table(const cli_options& cli, const generation_report& r, const generation_report* dense,
                 const std::vector<int>& tokens, const std::vector<int>* dense_tokens) {
  auto row = [&](const std::string& name, const std::string& a, const std::string& b) {
    fmt::print(stderr, "  {:<34} {:>18} {:>18}\n", name, a, dense != nullptr ? b : "");
  };
  fmt::print(stderr, "\n");
  row("", cli.mode, "dense");
  auto both = [&](const std::string& name, auto f) {
    row(name, f(r), dense ? f(*dense) : "");
  };
  both("prompt tokens",
       [](const generation_report& x) { return fmt::format("{}", x.prompt_tokens); });
  both("generated tokens",
       [](const generation_report& x) { return fmt::format("{}", x.generated); });
  both("prefill tokens/s", [](const generation_report& x) {
    return fmt::format("{:.1f}", x.prompt_tokens / std::max(1e-9, x.prefill_seconds));
  });
  both("decode tokens/s", [](const generation_report& x) {
    return fmt::format("{:.2f}", x.decode_tokens_per_second());
  });
  both("rounds / drafted / accepted", [](const generation_report& x) {
    return fmt::format("{}/{}/{}", x.rounds, x.drafted, x.accepted);
  });
  both("acceptance rate", [](const generation_report& x) {
    return fmt::format("{:.1f}%", 100.0 * x.acceptance_rate());
  });
  both("tokens per target pass", [](const generation_report& x) {
    return fmt::format("{:.2f}", x.rounds ? double(x.accepted + x.rounds) / x.rounds : 0.0);
  });
  both("attention steps (seq x layer)",
       [](const generation_report& x) { return fmt::format("{}", x.cache.sequence_steps); });
  both("lookaheads / unpredicted", [](const generation_report& x) {
    return fmt::format("{}/{}", x.cache.lookaheads, x.cache.unpredicted);
  });
  both("prefetch hits / misses", [](const generation_report& x) {
    return fmt::format("{}/{}", x.cache.step.hits, x.cache.step.misses);
  });
  both("hit rate", [](const generation_report& x) {
    return fmt::format("{:.2f}%", 100.0 * x.cache.hit_rate());
  });
  both("bytes prefetched",
       [](const generation_report& x) { return mib(x.cache.bytes_prefetched); });
  both("blocks attended per step", [](const generation_report& x) {
    return fmt::format("{:.1f}", x.cache.sequence_steps
                                     ? double(x.cache.selected_blocks) / x.cache.sequence_steps
                                     : 0.0);
  });
  both("fast-tier bytes held", [](const generation_report& x) { return mib(x.fast_tier_bytes); });
  both("block summary bytes", [](const generation_report& x) { return mib(x.summary_bytes); });
  both("dense KV bytes (final length)",
       [](const generation_report& x) { return mib(x.dense_kv_bytes); });
  both("(fast tier + summaries) / dense", [](const generation_report& x) {
    return fmt::format(
        "{:.3f}",
        x.dense_kv_bytes ? double(x.fast_tier_bytes + x.summary_bytes) / x.dense_kv_bytes : 0.0);
  });
  if (dense_tokens != nullptr) {
    const agreement g = agreement_of(tokens, *dense_tokens);
    row("agreement with dense (prefix)", fmt::format("{}/{}", g.prefix, dense_tokens->size()), "");
    row("agreement with dense (positions)",
        fmt::format("{:.1f}%", g.length ? 100.0 * g.same / g.length : 100.0), "");
  }
}

// The equal-memory throughput run: `--throughput N` requests of `--throughput-prompt-tokens`
// tokens cut from the prompt text, `--max-tokens` answer tokens each, one fast-tier budget
// (`--fast-tier-mib`, or room for `--dense-sequences` dense ones), drafts as `--draft`; the JSON
// on stdout. `--stall-probe`: a stream decodes while a prompt of `--throughput-prompt-tokens`
// tokens is admitted (with `--step-tokens`).
int run_throughput_mode(const cli_options& cli, const model& m, const std::string& text) {
  throughput_options o;
  o.mode = cli.dec.mode;
  o.summary = cli.dec.summary;
  o.requests = cli.throughput_requests;
  o.prompt_tokens = cli.throughput_prompt_tokens;
  o.answer_tokens = cli.dec.max_tokens;
  o.fast_tier_bytes = static_cast<std::uint64_t>(cli.fast_tier_mib * 1048576.0);
  o.dense_sequences = cli.dense_sequences;
  o.budget_tokens = cli.dec.budget_tokens;
  o.attention_threads = cli.dec.attention_threads;
  o.draft = cli.dec.draft;
  o.draft_len = cli.dec.draft_len;
  o.draft_layers = cli.dec.draft_layers;
  o.step_tokens = cli.step_tokens;
  o.context = cli.dec.context;
  o.rope_scale = cli.dec.rope_scale;
  if (cli.stall_probe) {
    const auto stream = throughput_prompts(m, text, 1, 32).front();
    const auto long_prompt = throughput_prompts(m, text, 1, o.prompt_tokens).front();
    fmt::print(stderr,
               "stall probe: a stream decodes while a {}-token prompt is admitted, {} mode, "
               "step budget {} tokens, drafts {}, matmul path {}, OpenBLAS {}\n",
               o.prompt_tokens, to_string(o.mode), o.step_tokens, to_string(o.draft), matmul_isa(),
               blas_kernels());
    const stall_result r = run_stall_probe(m, stream, long_prompt, o);
    fmt::print(stderr,
               "stall probe: the stream's worst gap {:.3f} s against its median {:.3f} s; the "
               "prompt's first token after {:.1f} s ({} chunks)\n",
               r.worst_gap, r.median_gap, r.long_first_token, r.prefill_chunks);
    fmt::print("{}\n", to_json(r));
    return 0;
  }
  const auto prompts = throughput_prompts(m, text, o.requests, o.prompt_tokens);
  fmt::print(stderr,
             "throughput: {} requests of {} + {} tokens, {} mode, drafts {} (up to {}), matmul "
             "path {}, OpenBLAS {}\n",
             o.requests, o.prompt_tokens, o.answer_tokens, to_string(o.mode), to_string(o.draft),
             o.draft_len, matmul_isa(), blas_kernels());
  const throughput_result r = run_throughput(m, prompts, o);
  fmt::print(stderr,
             "throughput: {:.2f} decode tokens/s, {} requests held at most, fast tier {:.1f} MiB "
             "({:.1f} MiB a request), {:.2f} tokens a sequence-round\n",
             r.decode_tokens_per_second, r.peak_active, r.fast_tier_bytes / 1048576.0,
             r.sequence_fast_bytes / 1048576.0,
             r.rounds ? static_cast<double>(r.decode_tokens) / static_cast<double>(r.rounds) : 0.0);
  fmt::print("{}\n", to_json(r));
  return 0;
}

// The answer a user reads: with --time-tokens, generation went on past the answer for timing;
// the answer ends at the first end token and has at most --max-tokens tokens.
std::vector<int> answer_part(const cli_options& cli, const model& m, const std::vector<int>& tokens,
                             std::uint32_t max) {
  if (cli.time_tokens == 0) {
    return tokens;
  }
  std::vector<int> a;
  for (int t : tokens) {
    if (m.tok->is_end(t) || a.size() >= max) {
      break;
    }
    a.push_back(t);
  }
  return a;
}

int run(cli_options& cli) {
  set_num_threads(cli.threads);
  set_matmul_activations(matmul_activations_from_string(cli.matmul));
  cli.dec.mode = parse_mode(cli.mode);
  cli.dec.summary = parse_summary(cli.summary);
  cli.dec.draft = parse_draft(cli.draft);
  if (!cli.compare.empty() && cli.compare != "dense") {
    fail("--compare accepts only 'dense'");
  }
  if (cli.prompt.empty() == cli.prompt_file.empty()) {
    fail("give exactly one of --prompt and --prompt-file");
  }
  const std::string text = cli.prompt_file.empty() ? cli.prompt : read_file(cli.prompt_file);
  const auto m = load_model(cli.model, cli.tokenizer);
  if (cli.throughput_requests > 0 || cli.stall_probe) {
    return run_throughput_mode(cli, *m, text);
  }
  const model_config& c = m->config;
  fmt::print(stderr,
             "model: {} ({} layers, {} q / {} kv heads, head_dim {}, vocab {}, context {}, "
             "rope theta {}), matmul path {}, OpenBLAS {} kernels, {} threads\n",
             c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
             c.context_length, c.rope_theta * cli.dec.rope_scale, matmul_isa(), blas_kernels(),
             cli.threads);
  const std::vector<int> prompt = m->tok->encode(cli.chat ? m->tok->chat_prompt(text) : text, true);
  if (!cli.quiet && !cli.chat) {
    for (std::size_t i = 0; i < prompt.size(); ++i) {
      if (i == 0 && m->tok->adds_bos())
        continue;
      std::fputs(m->tok->decode(i ? prompt[i - 1] : -1, prompt[i]).c_str(), stdout);
    }
  }
  auto progress = [](const char* phase, std::uint32_t done, std::uint32_t total, double s) {
    if (std::string(phase) == "prefill") {
      fmt::print(stderr, "\rprefill: layer {}/{} ({:.1f} s)   ", done, total, s);
    } else if (std::string(phase) == "decode") {
      fmt::print(stderr, "\rdecode: {}/{} tokens, {:.2f} tokens/s   ", done, total,
                 s > 0 ? done / s : 0.0);
    } else {
      fmt::print(stderr, "\rdone: {} tokens in {:.2f} s               \n", done, s);
    }
  };
  cli.dec.progress = progress;
  // --time-tokens: generation goes on past the end token until that many tokens are timed; the
  // answer shown and checked stops at the end token.
  const std::uint32_t answer_max = cli.dec.max_tokens;
  if (cli.time_tokens > 0) {
    cli.dec.ignore_eos = true;
    cli.dec.max_tokens = std::max(answer_max, cli.time_tokens);
  }
  decoder dec(*m, cli.dec);
  const bool compare = cli.compare == "dense";
  const std::string name =
      cli.mode == "dense"   ? std::string("dense")
      : cli.mode == "oasis" ? fmt::format("OasisKV, budget {} tokens", cli.dec.budget_tokens)
                            : fmt::format("{}, budget {} tokens", cli.mode, cli.dec.budget_tokens);
  // A single run streams its tokens; a pair prints each answer whole once it is done, so the
  // progress lines on stderr never overwrite an answer on the same terminal line.
  const bool labelled = compare || !cli.expect_answer.empty();
  int prev = prompt.back();
  bool ended = false;  // --time-tokens: the answer's end token came
  std::size_t count = 0;
  const auto on_token = [&](int t) {
    ++count;
    ended = ended || m->tok->is_end(t) || count > answer_max;
    if (!cli.quiet && !labelled && !ended) {
      std::fputs(m->tok->decode(prev, t).c_str(), stdout);
      std::fflush(stdout);
    }
    prev = t;
    return cli.time_tokens == 0 || !ended || count < cli.time_tokens;
  };
  // A pair prefills once: the prefill is the same dense pass in every mode.
  prefilled_prompt prefilled;
  if (compare) {
    prefilled = dec.prefill(prompt);
  }
  const std::vector<int> tokens =
      compare ? dec.generate(prefilled, on_token) : dec.generate(prompt, on_token);
  const std::string answer = text_of(*m, prompt.back(), answer_part(cli, *m, tokens, answer_max));
  auto print_answer = [&](const std::string& label, const std::string& said) {
    if (!cli.quiet) {
      std::printf("\n== answer (%s):\n%s\n", label.c_str(), said.c_str());
    }
    const bool has = cli.expect_answer.empty() || report_expected(said, cli.expect_answer);
    std::fflush(stdout);
    return has;
  };
  bool found = true, dense_found = true;
  if (labelled) {
    found = print_answer(name, answer);
  } else if (!cli.quiet) {
    std::fputs("\n", stdout);
    std::fflush(stdout);
  }
  generation_report dense_report;
  std::vector<int> dense_tokens;
  if (compare) {
    decoder_options d = cli.dec;
    d.mode = attention_mode::dense;
    decoder dense(*m, d);
    prev = prompt.back();
    ended = false;
    count = 0;
    dense_tokens = dense.generate(prefilled, on_token);
    dense_report = dense.report();
    dense_found =
        print_answer("dense, the whole KV in fast memory",
                     text_of(*m, prompt.back(), answer_part(cli, *m, dense_tokens, answer_max)));
  }
  const generation_report r = dec.report();
  print_table(cli, r, compare ? &dense_report : nullptr, tokens, compare ? &dense_tokens : nullptr);
  if (compare) {
    // Memory against what dense attention needs at the final length (not the pool dense mode
    // allocates for the whole context), so the ratio never flatters OasisKV.
    const agreement g = agreement_of(answer_part(cli, *m, tokens, answer_max),
                                     answer_part(cli, *m, dense_tokens, answer_max));
    const double speed =
        r.decode_tokens_per_second() / std::max(1e-9, dense_report.decode_tokens_per_second());
    const std::uint64_t held_bytes = r.fast_tier_bytes + r.summary_bytes;
    const double memory = double(r.dense_kv_bytes) / double(std::max<std::uint64_t>(1, held_bytes));
    std::string facts;
    if (!cli.expect_answer.empty()) {
      facts =
          found && dense_found ? fmt::format("; both answers contain \"{}\"", cli.expect_answer)
          : found ? fmt::format("; only the {} answer contains \"{}\"", cli.mode, cli.expect_answer)
          : dense_found ? fmt::format("; only the dense answer contains \"{}\"", cli.expect_answer)
                        : fmt::format("; neither answer contains \"{}\"", cli.expect_answer);
    }
    std::fflush(stderr);
    // A short answer decodes in a fraction of a second, where a ratio of times says little: the
    // verdict says so rather than let a noisy ratio stand for the speed. Timed over 64 tokens or
    // more (--time-tokens), it states both speeds.
    const double timed = std::min(r.decode_seconds, dense_report.decode_seconds);
    const std::uint32_t timed_tokens = std::min(r.generated, dense_report.generated);
    const std::string timing =
        timed_tokens >= 64
            ? fmt::format(" ({:.1f} against {:.1f} tokens/s, each timed over {} tokens)",
                          r.decode_tokens_per_second(), dense_report.decode_tokens_per_second(),
                          timed_tokens)
        : timed < 1.0 ? fmt::format(
                            " ({:.2f} s against {:.2f} s of decoding: too short to time; "
                            "scripts/decoder-speed.sh measures speed)",
                            r.decode_seconds, dense_report.decode_seconds)
                      : std::string();
    const std::string held = memory >= 1.0
                                 ? fmt::format("{:.2f}x less", memory)
                                 : std::string("more: the budget covers the whole context");
    std::printf(
        "\nverdict: %s (budget %u tokens) decoded at %.2fx dense's speed%s, holding %s of KV and "
        "block summaries in fast memory where dense needs %s (%s); %zu of %zu tokens equal "
        "dense's%s\n",
        cli.mode == "oasis" ? "OasisKV" : cli.mode.c_str(), cli.dec.budget_tokens, speed,
        timing.c_str(), mib(held_bytes).c_str(), mib(r.dense_kv_bytes).c_str(), held.c_str(),
        g.same, g.length, facts.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

namespace mini_decoder {
int serve_main(int argc, char** argv);  // serve_main.cpp: `mini_decoder serve ...`
}

int main(int argc, char** argv) {
  choose_blas_kernels(argv);  // may start the program again, with OpenBLAS's Haswell kernels
  if (argc > 1 && std::string(argv[1]) == "serve") {
    return serve_main(argc - 1, argv + 1);
  }
  CLI::App app{"mini_decoder: a Llama-family decoder whose attention runs through OasisKV"};
  app.footer("mini_decoder serve --help: the OpenAI-compatible HTTP server");
  cli_options cli;
  decoder_options& d = cli.dec;
  app.add_option("--model", cli.model, "GGUF or llama2.c model file")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--tokenizer", cli.tokenizer, "llama2.c tokenizer (default: beside the model)");
  app.add_option("--prompt", cli.prompt, "prompt text");
  app.add_option("--prompt-file", cli.prompt_file, "file holding the prompt");
  app.add_flag("--chat", cli.chat, "wrap the prompt in the model's ChatML template");
  app.add_option("--max-tokens", d.max_tokens, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_flag("--ignore-eos", d.ignore_eos,
               "keep generating past the end token (equal-length runs for speed comparisons)");
  app.add_option("--mode", cli.mode, "dense|oasis|quest|recency|on-demand")
      ->capture_default_str()
      ->check(CLI::IsMember({"dense", "oasis", "quest", "recency", "on-demand"}));
  app.add_option("--summary", cli.summary,
                 std::string("oasis, on-demand: the block summary the predictor scores with (") +
                     summary_names() + ")")
      ->capture_default_str();
  app.add_option("--budget", d.budget_tokens, "tokens attended per layer and step")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--block", d.block_tokens, "tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--draft", cli.draft, "self|ngram|none")
      ->capture_default_str()
      ->check(CLI::IsMember({"self", "ngram", "none"}));
  app.add_option("--draft-len", d.draft_len,
                 "tokens drafted per round (1-15); --throughput: the most (lengths adapt)")
      ->capture_default_str();
  app.add_option("--draft-layers", d.draft_layers, "layers of the self-speculative draft")
      ->capture_default_str();
  app.add_option("--temperature", d.temperature, "0: greedy")->capture_default_str();
  app.add_option("--top-p", d.top_p, "nucleus sampling mass")->capture_default_str();
  app.add_option("--seed", d.seed, "sampling seed")->capture_default_str();
  app.add_option("--context", d.context, "context length (0: the model's)")->capture_default_str();
  app.add_option("--rope-scale", d.rope_scale, "multiplies RoPE theta")->capture_default_str();
  app.add_option("--threads", cli.threads, "threads for matrix products")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--matmul", cli.matmul,
                 "activations of the quantized products: int8 (integer dot products) or f32 "
                 "(weights expanded to f32: exact, slower)")
      ->capture_default_str()
      ->check(CLI::IsMember({"int8", "f32"}));
  app.add_option("--attention-threads", d.attention_threads, "threads of the attention kernel")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--compare", cli.compare, "also run 'dense' and report agreement")
      ->check(CLI::IsMember({"dense"}));
  app.add_option("--expect-answer", cli.expect_answer,
                 "text an answer should contain: say under each answer whether it does");
  app.add_flag("--quiet", cli.quiet, "print only the table");
  app.add_option("--throughput", cli.throughput_requests,
                 "equal-memory throughput run: N requests cut from the prompt text, all "
                 "submitted at once to the batched engine (--mode dense|oasis); prints JSON")
      ->check(CLI::Range(1u, 100000u));
  app.add_option("--throughput-prompt-tokens", cli.throughput_prompt_tokens,
                 "tokens of each throughput request's prompt")
      ->capture_default_str()
      ->check(CLI::Range(2u, 1u << 24));
  app.add_option("--fast-tier-mib", cli.fast_tier_mib,
                 "throughput: the fast tier's budget (0: room for --dense-sequences dense ones)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--dense-sequences", cli.dense_sequences,
                 "throughput: dense sequences the default fast tier holds")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100000u));
  app.add_option("--step-tokens", cli.step_tokens,
                 "throughput, stall probe: tokens an engine step computes, decode rows and "
                 "prefill chunks together (0: each prompt prefilled whole when admitted)")
      ->capture_default_str()
      ->check(CLI::Range(0u, 1u << 24));
  app.add_flag("--stall-probe", cli.stall_probe,
               "a stream decodes on the batched engine while a prompt of "
               "--throughput-prompt-tokens tokens is admitted; prints its worst and median gaps "
               "as JSON");
  app.add_option("--time-tokens", cli.time_tokens,
                 "decode at least this many tokens for the speed figures, past the end token "
                 "(the answer shown still ends there)")
      ->capture_default_str()
      ->check(CLI::Range(0u, 1u << 24));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      return app.exit(e);
    }
    fmt::print(stderr, "mini_decoder: error: {} (see --help)\n", e.what());
    return 2;
  }
  try {
    return run(cli);
  } catch (const std::exception& e) {  // decoder_error, oasiskv::error, bad_alloc: one line
    std::fflush(stdout);
    fmt::print(stderr, "\nmini_decoder: error: {}\n", e.what());
    return 1;
  }
}
