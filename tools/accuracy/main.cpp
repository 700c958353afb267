// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `accuracy`: does the lookahead predict the blocks the next step attends to, well
//! enough that the output stays that of full attention? Runs a real model over real text,
//! scores every predictor configuration against the oracle at every evaluated step and layer,
//! and runs teacher-forced decodes with sparse attention in the loop. See docs/accuracy.md.
#include <cblas.h>
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <span>
#include <sstream>

#include <mini_decoder/decode/decoder.hpp>
#include <mini_decoder/io/error.hpp>

#include "evaluator.hpp"
#include "kl.hpp"
#include "runner.hpp"
#include "tasks.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// The model's own text: stories sampled at temperature 1 from BOS, concatenated (a llama2.c
// model ends a story at BOS, so one generation is short). Each story stops at `story_max`
// tokens whatever `want` is, so asking for more windows extends the text without changing it.
std::vector<int> sampled_text(const mini_decoder::model& m, std::size_t want,
                              std::uint32_t story_max, float rope_scale, std::uint64_t seed) {
  std::vector<int> out;
  const std::vector<int> start = m.tok->encode("Once upon a time", true);
  for (std::uint64_t s = seed; out.size() < want; ++s) {
    mini_decoder::decoder_options o;
    o.temperature = 1.0f;
    o.seed = s;
    o.rope_scale = rope_scale;
    o.max_tokens = story_max;
    o.context = 1024;
    mini_decoder::decoder d(m, o);
    out.insert(out.end(), start.begin(), start.end());
    const std::vector<int> g = d.generate(start);
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

using rows_type = std::map<std::string, std::map<std::string, double>>;

// JSON has no NaN or infinity: a figure that is not finite (a KL over a NaN logit, say) is
// written as null, so that the file stays readable and the figure cannot pass for a number.
void write_rows(std::ostream& js, const rows_type& rows, const char* indent) {
  bool first = true;
  for (const auto& [name, row] : rows) {
    js << (first ? "" : ",\n") << indent << "\"" << name << "\": {";
    bool f2 = true;
    for (const auto& [k, v] : row) {
      js << (f2 ? "" : ", ") << "\"" << k
         << "\": " << (std::isfinite(v) ? fmt::format("{:.6g}", v) : std::string("null"));
      f2 = false;
    }
    js << "}";
    first = false;
  }
}

// The KL figures of one text (greedy continuation: no suffix; held-out: "_held_out").
void put_kl(std::map<std::string, double>& row, const accuracy::kl_summary& k,
            const std::string& suffix) {
  row["kl_mean" + suffix] = k.mean;
  row["kl_p90" + suffix] = k.p90;
  row["kl_max" + suffix] = k.max;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"accuracy: lookahead block prediction against the oracle on a real model"};
  std::string model_path, json_path, source = "text";
  std::vector<std::string> text_files, e2e_specs, expects;
  std::uint32_t context = 4096, tokens = 512, draft_len = 4, eval_every = 4, draft_layers = 6;
  std::uint32_t windows = 1;
  std::string drafter = "ngram";
  std::vector<std::uint32_t> budgets{256, 512, 1024, 2048}, blocks{16, 32};
  float rope_scale = 1.0f;
  float contender_factor = oasiskv::cascade_params{}.contender_factor;
  std::uint64_t seed = 1;
  app.add_option("--model", model_path, "GGUF or llama2.c model")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--text", text_files, "files whose concatenation is the text (source=text)")
      ->check(CLI::ExistingFile);
  app.add_option("--source", source, "text (the files) or sampled (the model's own stories)")
      ->check(CLI::IsMember({"text", "sampled"}));
  app.add_option("--context", context, "prompt + continuation tokens")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--tokens", tokens, "continuation tokens decoded (greedy and held-out)")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--windows", windows,
                 "end to end over N consecutive, non-overlapping windows of the text, each "
                 "--context (+1) tokens with its own dense prefill (window 0: the text's start; "
                 "a later one behind a BOS where the model adds one); the e2e rows are means "
                 "over the windows, the sweep runs on window 0")
      ->check(CLI::Range(1u, 1u << 16));
  app.add_option("--rope-scale", rope_scale, "RoPE theta multiplier")
      ->check(CLI::Range(0.01f, 1000.0f));
  app.add_option("--draft-len", draft_len, "drafts per step (lookahead tokens)")
      ->check(CLI::Range(1u, 15u));
  app.add_option("--drafter", drafter,
                 "ngram (prompt lookup, the default) or self (the model's first --draft-layers "
                 "layers and its head: self-speculation)")
      ->check(CLI::IsMember({"ngram", "self"}));
  app.add_option("--draft-layers", draft_layers, "layers of the self-speculative draft")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--eval-every", eval_every, "evaluate predictors every N-th step")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--budgets", budgets, "budgets in tokens")->check(CLI::Range(1u, 1u << 24));
  app.add_option("--blocks", blocks, "block sizes in tokens")->check(CLI::Range(1u, 1u << 24));
  app.add_option("--e2e", e2e_specs,
                 "sparse-in-the-loop runs, pred:agg:budget[:scoring[:factor][:tMASS]] (pred la1 "
                 "la2 la4 prev cur recency; scoring summary (min/max f16, the default), qminmax "
                 "(min/max in int8), int8 or int4 (key copies), cascade4 or cascade8 (qminmax "
                 "picks factor x budget contenders, int4 / int8 keys score them), cascade2 "
                 "(qminmax_int2_summary: 2-bit codes between the bounds score them; factor: "
                 "--contender-factor unless given); tMASS, e.g. t0.9: an adaptive budget, the "
                 "fewest blocks covering MASS of the predicted mass, budget on average)");
  app.add_option(
         "--contender-factor", contender_factor,
         "cascade4 / cascade8 / cascade2: contenders = ceil(factor x budget blocks) per KV head")
      ->check(CLI::Range(1.0f, 1.0e6f));
  app.add_option("--json", json_path, "write every figure here");
  app.add_option("--expect", expects, "<config>:<metric>>=<value> (or <=); exit 1 when one fails");
  app.add_option("--seed", seed, "random predictor and sampled text");
  accuracy::task_options task;
  accuracy::add_task_options(app, task);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      return app.exit(e);
    }
    fmt::print(stderr, "accuracy: error: {} (see --help)\n", e.what());
    return 2;
  }
  // Shared machines: spinning workers that get descheduled cost more than they give.
  omp_set_num_threads(1);
  openblas_set_num_threads(1);
  try {
    const auto t0 = clock_type::now();
    auto m = mini_decoder::load_model(model_path);
    const mini_decoder::model_config& c = m->config;
    if (!task.task.empty()) {  // needle / agree: free-running tasks (tasks.hpp)
      return accuracy::run_task(
          task, {m.get(), rope_scale, context, draft_len, blocks.front(), seed, text_files,
                 e2e_specs, expects, json_path, contender_factor});
    }
    if (tokens + 2 > context) {
      mini_decoder::fail("--tokens ", tokens, " leaves no prompt in --context ", context);
    }
    std::vector<int> text;
    if (source == "sampled") {
      text = sampled_text(*m, std::size_t{windows} * (context + 1),
                          std::min<std::uint32_t>(context + 1, 1000), rope_scale, seed);
    } else {
      std::string all;
      for (const std::string& f : text_files) {
        std::ifstream in(f, std::ios::binary);
        if (!in) {
          mini_decoder::fail("cannot read --text ", f);
        }
        std::stringstream ss;
        ss << in.rdbuf();
        all += ss.str() + "\n\n";
      }
      text = m->tok->encode(all, m->tok->adds_bos());
    }
    // Window 0 is the text's first context + 1 tokens (BOS included where the model adds one),
    // as with one window. Each later one takes the tokens that follow, behind a BOS of its own
    // where the model adds one, so that every window opens as the first does.
    std::vector<int> bos;
    if (m->tok->adds_bos()) {
      bos = m->tok->encode("", true);
    }
    std::vector<std::size_t> starts;  // where each window's own tokens begin in the text
    std::size_t text_end = 0;
    for (std::uint32_t w = 0; w < windows; ++w) {
      starts.push_back(text_end);
      text_end += context + 1 - (w > 0 ? bos.size() : 0);
    }
    if (text.size() < text_end) {
      if (windows == 1) {
        mini_decoder::fail("the text is ", text.size(), " tokens; --context ", context, " needs ",
                           context + 1);
      }
      mini_decoder::fail("the text is ", text.size(), " tokens; --windows ", windows,
                         " of --context ", context, " need ", text_end);
    }
    const std::uint32_t P = context - tokens;
    fmt::print(stderr,
               "model {} ({} layers, {} q / {} kv heads, d {}); prompt {} tokens, {} "
               "continuation tokens, context {}\n",
               c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, P, tokens,
               context);

    if (drafter != "ngram" && drafter != "self") {
      mini_decoder::fail("--drafter '", drafter, "' is not ngram or self");
    }
    if (drafter == "self" && (draft_layers == 0 || draft_layers >= c.num_layers)) {
      mini_decoder::fail("--draft-layers = ", draft_layers, " must be in [1, ", c.num_layers - 1,
                         "]");
    }
    std::vector<accuracy::sparse_config> configs;
    for (const std::string& spec : e2e_specs) {
      configs.push_back(accuracy::parse_sparse_config(spec, contender_factor));
      configs.back().block = blocks.front();
    }
    accuracy::runner r(*m, rope_scale, context, draft_len, drafter == "self" ? draft_layers : 0);
    accuracy::evaluator ev({c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, context}, blocks,
                           budgets, seed);
    const std::size_t V = c.vocab_size;
    // The dense logits of the window being run, one copy per text, that every sparse
    // configuration's KL compares with: the greedy run's at the positions agreement scores (it
    // is the dense run teacher-forced on its own continuation: the same steps) and the held-out
    // run's; [position][vocab], 100 MB at 512 positions of SmolLM2's 49,152 tokens. Logits, not
    // log-probabilities: both sides then go through the same log-sum-exp, and identical logits
    // give a KL of exactly 0. Reserved whole, so that growing never holds two copies.
    std::vector<float> dense_greedy_logits, dense_ho_logits;
    const auto keep = [V](std::vector<float>& dst, std::size_t positions) {
      dst.clear();
      dst.reserve(positions * V);
      return [&dst, positions, V](std::uint32_t i, const float* lg) {
        if (i < positions) {
          dst.resize(std::max(dst.size(), (std::size_t{i} + 1) * V));
          std::copy(lg, lg + V, dst.begin() + static_cast<std::ptrdiff_t>(i * V));
        }
      };
    };
    // KL(dense || sparse) at step i against `dense` (positions it holds; the others unscored).
    const auto kl_into = [V](const std::vector<float>& dense, std::vector<double>& out) {
      return [&dense, &out, V](std::uint32_t i, const float* lg) {
        if ((std::size_t{i} + 1) * V <= dense.size()) {
          out.push_back(
              accuracy::kl_divergence(std::span<const float>(dense.data() + std::size_t{i} * V, V),
                                      std::span<const float>(lg, V)));
        }
      };
    };
    rows_type results;
    std::vector<rows_type> window_rows(windows);  // each window's e2e rows
    // Per configuration, every window's per-position KL: the pooled figures.
    std::map<std::string, std::vector<double>> kl_greedy_all, kl_ho_all;
    for (std::uint32_t w = 0; w < windows; ++w) {
      std::vector<int> win = w > 0 ? bos : std::vector<int>{};
      const std::size_t take = context + 1 - win.size();
      win.insert(win.end(), text.begin() + static_cast<std::ptrdiff_t>(starts[w]),
                 text.begin() + static_cast<std::ptrdiff_t>(starts[w] + take));
      const std::vector<int> prompt(win.begin(), win.begin() + P);
      const std::vector<int> held_out(win.begin() + P, win.end());
      if (windows > 1) {
        fmt::print(stderr, "window {} of {}: text tokens {}..{}{}\n", w, windows, starts[w],
                   starts[w] + take, win.size() > take ? ", behind a BOS" : "");
      }
      const auto tw = clock_type::now();
      r.prefill(prompt);
      fmt::print(stderr, "prefill {:.1f} s\n", since(w == 0 ? t0 : tw));
      auto t1 = clock_type::now();
      // The sweep runs on the first window only: its figures do not depend on --windows.
      accuracy::evaluator* const evw = w == 0 ? &ev : nullptr;
      const accuracy::run_result greedy =
          r.dense_greedy(tokens, evw, eval_every, keep(dense_greedy_logits, tokens - 1));
      if (evw != nullptr) {
        fmt::print(stderr, "dense greedy + evaluation ({} samples) {:.1f} s\n", ev.samples(),
                   since(t1));
      } else {
        fmt::print(stderr, "dense greedy {:.1f} s\n", since(t1));
      }
      const double acceptance = greedy.drafted ? double(greedy.accepted) / greedy.drafted : 0.0;

      if (w == 0) {
        for (const accuracy::eval_config& e : ev.configs()) {
          const auto& s = e.sums;
          if (s.n == 0) {  // not evaluated (e.g. --eval-every past the run): missing, not zero
            continue;
          }
          auto& row = results[e.name];
          row["agree_all"] = s.n ? s.agree_all / s.n : 0;
          row["agree_free"] = s.n_free ? s.agree_free / s.n_free : 0;
          row["agree_next"] = s.n ? s.agree_next / s.n : 0;
          row["recall"] = s.n ? s.recall / s.n : 0;
          row["rel_recall"] = s.n ? s.rel_recall / s.n : 0;
          row["l2"] = s.n ? s.l2 / s.n : 0;
          row["samples"] = static_cast<double>(s.n);
        }
      }
      // End to end: teacher-forced on the dense greedy continuation (agreement) and on the
      // held-out text (perplexity); KL against the dense run's distributions on both.
      rows_type& wr = window_rows[w];
      t1 = clock_type::now();
      const accuracy::run_result dense_ho =
          r.forced(held_out, nullptr, keep(dense_ho_logits, held_out.size() - 1));
      const double ppl_dense = std::exp(dense_ho.nll / std::max(dense_ho.scored, 1u));
      wr["e2e/dense"] = {{"ppl", ppl_dense},
                         {"acceptance_greedy", acceptance},
                         {"acceptance_held_out",
                          dense_ho.drafted ? double(dense_ho.accepted) / dense_ho.drafted : 0}};
      fmt::print(stderr, "dense held-out {:.1f} s\n", since(t1));
      for (const accuracy::sparse_config& sc : configs) {
        t1 = clock_type::now();
        std::vector<double> klg, klh;
        const accuracy::run_result sg =
            r.forced(greedy.tokens, &sc, kl_into(dense_greedy_logits, klg));
        const accuracy::run_result sh = r.forced(held_out, &sc, kl_into(dense_ho_logits, klh));
        std::uint32_t agree = 0, agree_ho = 0;
        for (std::size_t i = 0; i + 1 < greedy.tokens.size(); ++i) {
          agree += sg.argmax[i] == greedy.tokens[i + 1] ? 1u : 0u;
        }
        for (std::size_t i = 0; i < sh.argmax.size() && i < dense_ho.argmax.size(); ++i) {
          agree_ho += sh.argmax[i] == dense_ho.argmax[i] ? 1u : 0u;
        }
        const double ppl = std::exp(sh.nll / std::max(sh.scored, 1u));
        auto& row = wr["e2e/" + sc.name()];
        row["agreement"] = double(agree) / std::max<std::size_t>(greedy.tokens.size() - 1, 1);
        row["agreement_held_out"] = double(agree_ho) / std::max<std::size_t>(sh.argmax.size(), 1);
        row["ppl"] = ppl;
        row["ppl_ratio"] = ppl / ppl_dense;
        // On the greedy continuation: the share of each step's blocks new since that layer's
        // previous step (what a prefetcher fetches per step; a cache holding only the last
        // selection would miss this share on demand).
        row["churn"] = sg.churn_all ? double(sg.churn_new) / double(sg.churn_all) : 0.0;
        // Blocks attended per predicted (step, layer) on the greedy continuation and on the
        // held-out text: fixed and adaptive budgets compare at equal means.
        row["mean_blocks"] = sg.selections ? double(sg.selected_blocks) / sg.selections : 0.0;
        row["mean_blocks_held_out"] =
            sh.selections ? double(sh.selected_blocks) / sh.selections : 0.0;
        row["target_mass"] = sc.target_mass;
        // KL(dense || sparse) of the next-token distributions at the positions agreement
        // scores: it sees every change of the distribution, not only those that flip an argmax.
        const accuracy::kl_summary kg = accuracy::summarize_kl(klg);
        const accuracy::kl_summary kh = accuracy::summarize_kl(klh);
        put_kl(row, kg, "");
        put_kl(row, kh, "_held_out");
        auto& pg = kl_greedy_all[sc.name()];
        pg.insert(pg.end(), klg.begin(), klg.end());
        auto& ph = kl_ho_all[sc.name()];
        ph.insert(ph.end(), klh.begin(), klh.end());
        fmt::print(stderr,
                   "e2e {}: agreement {:.4f} (held-out {:.4f}), ppl {:.3f} vs dense {:.3f}, "
                   "churn {:.4f}, mean blocks {:.2f} (held-out {:.2f}), KL mean {:.4g} p90 {:.4g} "
                   "max {:.4g} (held-out {:.4g} {:.4g} {:.4g}) ({:.1f} s)\n",
                   sc.name(), row["agreement"], row["agreement_held_out"], ppl, ppl_dense,
                   row["churn"], row["mean_blocks"], row["mean_blocks_held_out"], kg.mean, kg.p90,
                   kg.max, kh.mean, kh.p90, kh.max, since(t1));
      }
    }
    // Over the windows: each figure's mean (a window's positions count alike in each), but the
    // KL figures, which are over every window's positions together (the mean is the same).
    for (const auto& [name, row0] : window_rows[0]) {
      auto& row = results[name];
      for (const auto& [k, v0] : row0) {
        double sum = 0;
        for (const rows_type& wr : window_rows) {
          sum += wr.at(name).at(k);
        }
        row[k] = windows == 1 ? v0 : sum / windows;
      }
      if (windows > 1 && kl_greedy_all.contains(name.substr(4))) {
        const std::string cfg = name.substr(4);
        put_kl(row, accuracy::summarize_kl(kl_greedy_all[cfg]), "");
        put_kl(row, accuracy::summarize_kl(kl_ho_all[cfg]), "_held_out");
        fmt::print(stderr,
                   "e2e {} over {} windows: agreement {:.4f} (held-out {:.4f}), ppl / dense "
                   "{:.4f}, KL mean {:.4g} p90 {:.4g} max {:.4g} (held-out {:.4g} {:.4g} {:.4g})\n",
                   cfg, windows, row["agreement"], row["agreement_held_out"], row["ppl_ratio"],
                   row["kl_mean"], row["kl_p90"], row["kl_max"], row["kl_mean_held_out"],
                   row["kl_p90_held_out"], row["kl_max_held_out"]);
      }
    }

    fmt::print("{:<44} {:>9} {:>10} {:>10} {:>7} {:>10} {:>8}\n", "config", "agree_all",
               "agree_free", "agree_next", "recall", "rel_recall", "l2");
    for (const auto& [name, row] : results) {
      if (name.rfind("e2e/", 0) == 0) {
        continue;
      }
      fmt::print("{:<44} {:>9.4f} {:>10.4f} {:>10.4f} {:>7.4f} {:>10.4f} {:>8.4f}\n", name,
                 row.at("agree_all"), row.at("agree_free"), row.at("agree_next"), row.at("recall"),
                 row.at("rel_recall"), row.at("l2"));
    }
    for (const auto& [name, row] : results) {
      if (name.rfind("e2e/", 0) == 0) {
        std::string line = name;
        for (const auto& [k, v] : row) {
          line += fmt::format(" {}={:.4f}", k, v);
        }
        fmt::print("{}\n", line);
      }
    }
    if (!json_path.empty()) {
      std::ofstream js(json_path);
      js << "{\n  \"model\": \"" << c.architecture << "\", \"context\": " << context
         << ", \"tokens\": " << tokens << ", \"prompt\": " << P << ", \"drafter\": \"" << drafter
         << "\", \"draft_layers\": " << (drafter == "self" ? draft_layers : 0)
         << ", \"draft_len\": " << draft_len << ", \"eval_every\": " << eval_every
         << ", \"windows\": " << windows << ",\n  \"results\": {\n";
      write_rows(js, results, "    ");
      js << "\n  }";
      if (windows > 1) {  // each window's e2e rows; `offset`: where its own tokens begin
        js << ",\n  \"per_window\": [\n";
        for (std::uint32_t w = 0; w < windows; ++w) {
          js << (w ? ",\n" : "") << "    {\"window\": " << w << ", \"offset\": " << starts[w]
             << ", \"results\": {\n";
          write_rows(js, window_rows[w], "      ");
          js << "\n    }}";
        }
        js << "\n  ]";
      }
      js << "\n}\n";
    }
    int failed = 0;
    for (const std::string& s : expects) {
      const accuracy::expectation e = accuracy::parse_expect(s);
      const auto it = results.find(e.key);
      if (it == results.end() || !it->second.contains(e.metric)) {
        fmt::print(stderr, "FAIL {}: no such figure\n", s);
        ++failed;
        continue;
      }
      const double v = it->second.at(e.metric);
      const bool ok = e.at_most ? v <= e.value : v >= e.value;
      fmt::print(stderr, "{} {}: measured {:.4f}\n", ok ? "ok  " : "FAIL", s, v);
      failed += ok ? 0 : 1;
    }
    fmt::print(stderr, "total {:.1f} s\n", since(t0));
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "accuracy: {}\n", e.what());
    return 2;
  }
}
