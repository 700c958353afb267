// SPDX-License-Identifier: Apache-2.0
#include "runner.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <span>
#include <sstream>

#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/predictor/current_query_predictor.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"

namespace accuracy {

std::string sparse_config::name() const {
  // One stream: gcc 12 at -O3 warns (-Wrestrict, a false positive) on `"x" + str` here.
  std::ostringstream n;
  n << pred << '/' << scoring;
  if (scoring.rfind("cascade", 0) == 0) {
    n << 'x' << contender_factor;
  }
  n << '/' << agg << "/shared/b" << block << '/' << budget;
  if (target_mass != 0) {
    n << "/t" << target_mass;
  }
  return n.str();
}

sparse_config parse_sparse_config(const std::string& spec, float default_factor) {
  sparse_config sc;
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const auto next = spec.find(':', at);
    parts.push_back(spec.substr(at, next == std::string::npos ? next : next - at));
    if (next == std::string::npos) {
      break;
    }
    at = next + 1;
  }
  if (parts.size() < 3 || parts.size() > 6) {
    mini_decoder::fail("--e2e '", spec, "' is not pred:agg:budget[:scoring[:factor][:tMASS]]");
  }
  sc.pred = parts[0];
  sc.agg = parts[1];
  char* end = nullptr;
  const unsigned long budget = std::strtoul(parts[2].c_str(), &end, 10);
  if (parts[2].empty() || *end != '\0' || budget == 0 || budget > (1ul << 24)) {
    mini_decoder::fail("--e2e '", spec, "': budget '", parts[2], "' is not a token count");
  }
  sc.budget = static_cast<std::uint32_t>(budget);
  if (parts.size() >= 4) {
    sc.scoring = parts[3];
  }
  sc.contender_factor = default_factor;
  const bool cascade = sc.scoring.rfind("cascade", 0) == 0;
  for (std::size_t i = 4; i < parts.size(); ++i) {
    const std::string& o = parts[i];
    if (!o.empty() && o[0] == 't') {  // tMASS: an adaptive budget covering MASS of the mass
      end = nullptr;
      const float t =
          o.size() > 1 ? std::strtof(o.c_str() + 1, &end) : std::numeric_limits<float>::quiet_NaN();
      if (end == nullptr || *end != '\0' || !(t > 0.0f && t <= 1.0f)) {
        mini_decoder::fail("--e2e '", spec, "': '", o,
                           "' is not tMASS with MASS in (0, 1], e.g. t0.9");
      }
      if (sc.pred == "recency") {
        mini_decoder::fail("--e2e '", spec, "': recency has no mass to cover");
      }
      sc.target_mass = t;
    } else {
      if (!cascade) {
        mini_decoder::fail("--e2e '", spec,
                           "': only cascade4 / cascade8 / cascade2 take a factor ('", o, "')");
      }
      end = nullptr;
      const float f = std::strtof(o.c_str(), &end);
      if (o.empty() || *end != '\0') {
        mini_decoder::fail("--e2e '", spec, "': factor '", o, "' is not a number");
      }
      sc.contender_factor = f;  // checked by cascade_params
    }
  }
  return sc;
}

expectation parse_expect(const std::string& s) {
  const auto colon = s.rfind(':');
  auto op = s.find(">=");
  const bool at_most = op == std::string::npos;
  if (at_most) {
    op = s.find("<=");
  }
  if (colon == std::string::npos || op == std::string::npos || op < colon) {
    mini_decoder::fail("--expect '", s, "' is not <config>:<metric>>=<value> (or <=)");
  }
  return {s.substr(0, colon), s.substr(colon + 1, op - colon - 1), at_most,
          std::stod(s.substr(op + 2))};
}

// The library predictors of one summary type, and its per-layer entries.
template <class S>
struct predictors {
  std::vector<S> summaries;  // [layer]
  oasiskv::lookahead_predictor<S, oasiskv::max_aggregation> la_max;
  oasiskv::lookahead_predictor<S, oasiskv::softmax_mass_aggregation> la_mass;
  oasiskv::lookahead_predictor<S, oasiskv::confidence_weighted_aggregation> la_conf;
  oasiskv::current_query_predictor<S> quest;

  // Selects for layer l: Quest from `current` when `cur`, else the lookahead with `agg`.
  void select(const sparse_config& sc, std::uint32_t l, const oasiskv::kv_layout& layout,
              std::uint32_t len, std::span<const std::uint32_t> ids, oasiskv::query_view prev,
              oasiskv::query_view current, const oasiskv::selection_params& sp,
              oasiskv::selection& sel) {
    oasiskv::prediction_input<S> in{layout, len, &summaries[l], ids, prev, {}, {}};
    if (sc.pred == "cur") {
      in.queries = current;
      quest.select(in, sp, sel);
    } else if (sc.agg == "mass") {
      la_mass.select(in, sp, sel);
    } else if (sc.agg == "conf") {
      la_conf.select(in, sp, sel);
    } else {
      la_max.select(in, sp, sel);
    }
  }
};

// One sparse run's summaries (its own keys: in the loop they drift from the dense run's) and
// the library predictors it selects with.
struct runner::sparse_state {
  oasiskv::kv_layout layout;
  // Which summary the run scores with: 0 min/max, 1 int8 min/max, 8 / 4 keys, 14 / 18 the
  // int8 min/max -> int4 / int8 keys cascade; 12 the int8 min/max -> 2-bit codes summary.
  int kind = 0;
  predictors<oasiskv::minmax_summary<>> minmax;
  predictors<oasiskv::quantized_minmax_summary> qminmax;
  predictors<oasiskv::int8_key_summary> keys8;
  predictors<oasiskv::int4_key_summary> keys4;
  predictors<oasiskv::qminmax_int4_cascade> cascade4;
  predictors<oasiskv::qminmax_int8_cascade> cascade8;
  predictors<oasiskv::qminmax_int2_summary> cascade2;
  std::vector<std::byte> slot;
  std::vector<std::uint32_t> ids;
  oasiskv::block_selector selector;
  oasiskv::selection sel;
  std::vector<float> recency;

  // Folds tokens [first, first + count) of a block, rows `k` ([count][kv_dim]), into layer l.
  void update(std::uint32_t l, std::uint32_t b, std::uint32_t first, const float* k,
              std::uint32_t count) {
    const std::uint32_t d = layout.head_dim;
    for (std::uint32_t t = 0; t < count; ++t) {
      for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        auto* dst = reinterpret_cast<std::uint16_t*>(slot.data() + layout.key_offset(h)) +
                    std::size_t{first + t} * d;
        for (std::uint32_t x = 0; x < d; ++x) {
          dst[x] =
              oasiskv::f16::from_float(k[(std::size_t{t} * layout.num_kv_heads + h) * d + x]).bits;
        }
      }
    }
    if (kind == 1) {
      qminmax.summaries[l].update(b, slot.data(), first, count);
    } else if (kind == 8) {
      keys8.summaries[l].update(b, slot.data(), first, count);
    } else if (kind == 4) {
      keys4.summaries[l].update(b, slot.data(), first, count);
    } else if (kind == 14) {
      cascade4.summaries[l].update(b, slot.data(), first, count);
    } else if (kind == 18) {
      cascade8.summaries[l].update(b, slot.data(), first, count);
    } else if (kind == 12) {
      cascade2.summaries[l].update(b, slot.data(), first, count);
    } else {
      minmax.summaries[l].update(b, slot.data(), first, count);
    }
  }
};

runner::runner(const mini_decoder::model& m, float rope_scale, std::uint32_t context,
               std::uint32_t draft_len, std::uint32_t draft_layers)
    : m_(m),
      tf_(m, rope_scale),
      context_(context),
      draft_len_(draft_len),
      draft_layers_(draft_layers) {
  kv_dim_ = m.config.num_kv_heads * m.config.head_dim;
  if (draft_layers_ >= m.config.num_layers) {
    mini_decoder::fail("--draft-layers = ", draft_layers_, " must be below the model's ",
                       m.config.num_layers, " layers");
  }
}

// Self-speculation: g tokens, greedy, each through the first draft_layers_ layers and the head.
// Token j (x, then the drafts) sits at position pos + j; its key and value go into K / V at that
// position, where the target step will write position pos's own (the same layers' values of
// the same token) and reads nothing beyond it. Attention is dense over the committed tokens
// and the draft's.
std::vector<int> runner::self_draft(std::vector<std::vector<float>>& K,
                                    std::vector<std::vector<float>>& V, int x, std::uint32_t pos,
                                    std::uint32_t g) {
  const mini_decoder::model_config& c = m_.config;
  const std::uint32_t H = c.num_heads, D = c.head_dim, G = H / c.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::uint32_t at = pos;
  const mini_decoder::attention_fn attend = [&](std::uint32_t l, std::uint32_t, const float* q,
                                                const float* k, const float* v, float* out) {
    std::copy(k, k + kv_dim_, K[l].data() + std::size_t{at} * kv_dim_);
    std::copy(v, v + kv_dim_, V[l].data() + std::size_t{at} * kv_dim_);
    const std::uint32_t len = at + 1;
    draft_scores_.resize(std::size_t{G} * len);
    for (std::uint32_t hk = 0; hk < c.num_kv_heads; ++hk) {
      const std::size_t off = std::size_t{hk} * D;
      float* s = draft_scores_.data();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(G),
                  static_cast<int>(len), static_cast<int>(D), scale, q + off * G,
                  static_cast<int>(D), K[l].data() + off, static_cast<int>(kv_dim_), 0.0f, s,
                  static_cast<int>(len));
      for (std::uint32_t g2 = 0; g2 < G; ++g2) {
        float* row = s + std::size_t{g2} * len;
        const float mx = *std::max_element(row, row + len);
        double sum = 0;
        for (std::uint32_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - mx);
          sum += row[t];
        }
        const auto inv = static_cast<float>(1.0 / sum);
        for (std::uint32_t t = 0; t < len; ++t) {
          row[t] *= inv;
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(G),
                  static_cast<int>(D), static_cast<int>(len), 1.0f, s, static_cast<int>(len),
                  V[l].data() + off, static_cast<int>(kv_dim_), 0.0f, out + off * G,
                  static_cast<int>(D));
    }
  };
  draft_logits_.resize(c.vocab_size);
  std::vector<int> drafts;
  int tok = x;
  for (std::uint32_t j = 0; j < g; ++j) {
    at = pos + j;
    tf_.step(&tok, 1, at, draft_layers_, attend, draft_logits_.data());
    tok = mini_decoder::argmax(draft_logits_.data(), c.vocab_size);
    drafts.push_back(tok);
  }
  return drafts;
}

void runner::prefill(const std::vector<int>& prompt) {
  prompt_ = prompt;
  const std::uint32_t L = m_.config.num_layers;
  prefill_k_.assign(L, {});
  prefill_v_.assign(L, {});
  first_logits_.resize(m_.config.vocab_size);
  tf_.prefill(
      prompt.data(), static_cast<std::uint32_t>(prompt.size()),
      [&](std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
        prefill_k_[l].assign(k, k + std::size_t{n} * kv_dim_);
        prefill_v_[l].assign(v, v + std::size_t{n} * kv_dim_);
      },
      first_logits_.data());
}

run_result runner::dense_greedy(std::uint32_t n, evaluator* ev, std::uint32_t eval_every,
                                const logits_fn& on_logits) {
  return loop(nullptr, n, nullptr, ev, std::max(eval_every, 1u), on_logits);
}

run_result runner::forced(const std::vector<int>& teacher, const sparse_config* sparse,
                          const logits_fn& on_logits) {
  return loop(&teacher, static_cast<std::uint32_t>(teacher.size()), sparse, nullptr, 1, on_logits);
}

run_result runner::greedy(std::uint32_t n, const sparse_config* sparse, bool reversed) {
  reversed_ = reversed && sparse == nullptr;
  run_result r = loop(nullptr, n, sparse, nullptr, 1);
  reversed_ = false;
  return r;
}

run_result runner::loop(const std::vector<int>* teacher, std::uint32_t n,
                        const sparse_config* sparse, evaluator* ev, std::uint32_t eval_every,
                        const logits_fn& on_logits) {
  const mini_decoder::model_config& c = m_.config;
  const std::uint32_t L = c.num_layers, H = c.num_heads, D = c.head_dim;
  const std::uint32_t G = H / c.num_kv_heads, qd = H * D, V = c.vocab_size;
  const auto P = static_cast<std::uint32_t>(prompt_.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  n = std::min(n, context_ - P);
  std::vector<std::vector<float>> K(L), Vv(L);
  for (std::uint32_t l = 0; l < L; ++l) {
    K[l] = prefill_k_[l];
    Vv[l] = prefill_v_[l];
    K[l].resize(std::size_t{context_} * kv_dim_);
    Vv[l].resize(std::size_t{context_} * kv_dim_);
  }
  std::unique_ptr<sparse_state> ss;
  if (sparse != nullptr) {
    ss = std::make_unique<sparse_state>();
    ss->layout = oasiskv::kv_layout{1, H, c.num_kv_heads, D, sparse->block, oasiskv::dtype::f16};
    ss->layout.validate();
    ss->slot.resize(ss->layout.block_bytes());
    const std::uint32_t cap = ss->layout.blocks_for(context_);
    ss->ids.resize(cap);
    for (std::uint32_t i = 0; i < cap; ++i) {
      ss->ids[i] = i;
    }
    if (sparse->scoring != "summary" && sparse->scoring != "qminmax" && sparse->scoring != "int8" &&
        sparse->scoring != "int4" && sparse->scoring != "cascade4" &&
        sparse->scoring != "cascade8" && sparse->scoring != "cascade2") {
      mini_decoder::fail("--e2e scoring '", sparse->scoring,
                         "' is not summary, qminmax, int8, int4, cascade4, cascade8 or cascade2");
    }
    ss->kind = sparse->scoring == "int8"       ? 8
               : sparse->scoring == "int4"     ? 4
               : sparse->scoring == "qminmax"  ? 1
               : sparse->scoring == "cascade4" ? 14
               : sparse->scoring == "cascade8" ? 18
               : sparse->scoring == "cascade2" ? 12
                                               : 0;
    const oasiskv::cascade_params cp{sparse->contender_factor};
    for (std::uint32_t l = 0; l < L; ++l) {
      if (ss->kind == 1) {
        ss->qminmax.summaries.emplace_back(ss->layout, cap);
      } else if (ss->kind == 8) {
        ss->keys8.summaries.emplace_back(ss->layout, cap);
      } else if (ss->kind == 4) {
        ss->keys4.summaries.emplace_back(ss->layout, cap);
      } else if (ss->kind == 14) {
        ss->cascade4.summaries.emplace_back(ss->layout, cap, cp);
      } else if (ss->kind == 18) {
        ss->cascade8.summaries.emplace_back(ss->layout, cap, cp);
      } else if (ss->kind == 12) {
        ss->cascade2.summaries.emplace_back(ss->layout, cap, cp);
      } else {
        ss->minmax.summaries.emplace_back(ss->layout, cap);
      }
      for (std::uint32_t t0 = 0; t0 < P; t0 += sparse->block) {
        ss->update(l, t0 / sparse->block, 0, K[l].data() + std::size_t{t0} * kv_dim_,
                   std::min(sparse->block, P - t0));
      }
    }
  }
  if (ev != nullptr) {
    for (std::uint32_t l = 0; l < L; ++l) {
      for (std::uint32_t t = 0; t < P; ++t) {
        ev->append(l, t, K[l].data() + std::size_t{t} * kv_dim_);
      }
    }
  }
  std::vector<std::vector<float>> prevq(L, std::vector<float>(16 * qd)), prevw(L);
  std::vector<std::uint32_t> prevn(L, 0);
  std::vector<float> logits(std::size_t{16} * V), sc, weights, kgat, vgat, side;
  std::vector<double> dens;
  std::vector<std::uint32_t> blocks;
  std::vector<std::vector<std::uint32_t>> last_blocks(L);  // [layer]: the previous step's
  std::vector<std::vector<int>> step_drafts;
  std::vector<int> history = prompt_, drafts, batch;
  run_result res;
  int x = teacher != nullptr ? (*teacher)[0] : mini_decoder::argmax(first_logits_.data(), V);
  std::uint64_t first_drafted = 0, first_ok = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint32_t pos = P + i;
    if (!drafts.empty()) {  // the previous step's first draft is now known right or wrong
      ++first_drafted;
      first_ok += drafts[0] == x ? 1u : 0u;
    }
    history.push_back(x);
    drafts.clear();
    const std::uint32_t g = std::min(draft_len_, context_ - 1 - pos);
    if (g > 0) {
      drafts =
          draft_layers_ > 0 ? self_draft(K, Vv, x, pos, g) : mini_decoder::ngram_draft(history, g);
    }
    step_drafts.push_back(drafts);
    batch.assign(1, x);
    batch.insert(batch.end(), drafts.begin(), drafts.end());
    // Draft confidence: the chance that drafts 1..j are all right, from the running
    // acceptance of first drafts (Laplace-smoothed); the pending token is certain.
    const double rate = (first_ok + 1.0) / (first_drafted + 2.0);
    weights.resize(batch.size());
    for (std::size_t j = 0; j < batch.size(); ++j) {
      weights[j] = static_cast<float>(std::pow(rate, double(j)));
    }
    const bool eval_now = ev != nullptr && i > 0 && i % eval_every == 0;
    const mini_decoder::attention_fn attend = [&](std::uint32_t l, std::uint32_t rows,
                                                  const float* q, const float* k, const float* v,
                                                  float* out) {
      float* Kl = K[l].data();
      float* Vl = Vv[l].data();
      std::copy(k, k + kv_dim_, Kl + std::size_t{pos} * kv_dim_);
      std::copy(v, v + kv_dim_, Vl + std::size_t{pos} * kv_dim_);
      const std::uint32_t len = pos + 1;
      if (ev != nullptr) {
        ev->append(l, pos, k);
        if (eval_now && prevn[l] > 0) {
          ev->evaluate(l, len, Kl, Vl, q, prevq[l].data(), prevn[l], prevw[l].data());
        }
      }
      // The blocks this step attends: all (dense), or the selection predicted a step early.
      std::uint32_t bt = 16;
      blocks.clear();
      if (ss != nullptr) {
        bt = sparse->block;
        ss->update(l, pos / bt, pos % bt, k, 1);
      }
      const std::uint32_t nb = (len + bt - 1) / bt;
      if (ss == nullptr || (prevn[l] == 0 && sparse->pred != "cur")) {
        for (std::uint32_t b = 0; b < nb; ++b) {
          blocks.push_back(b);
        }
        if (reversed_) {
          std::reverse(blocks.begin(), blocks.end());
        }
      } else {
        const oasiskv::selection_params sp{std::max(sparse->budget / bt, 2u), 1, 1,
                                           sparse->target_mass};
        if (sparse->pred == "recency") {
          ss->recency.resize(nb);
          for (std::uint32_t b = 0; b < nb; ++b) {
            ss->recency[b] = static_cast<float>(b);
          }
          ss->selector.append_table(ss->recency.data(), nb, sp, blocks);
        } else {
          std::uint32_t tok = prevn[l];
          if (sparse->pred == "prev") {
            tok = 1;
          } else if (sparse->pred.rfind("la", 0) == 0) {
            tok = std::min<std::uint32_t>(std::stoi(sparse->pred.substr(2)) + 1, prevn[l]);
          }
          const std::span<const std::uint32_t> ids(ss->ids.data(), nb);
          const oasiskv::query_view prev{prevq[l].data(), prevw[l].data(), tok};
          const oasiskv::query_view current{q, nullptr, rows};
          if (ss->kind == 1) {
            ss->qminmax.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else if (ss->kind == 8) {
            ss->keys8.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else if (ss->kind == 4) {
            ss->keys4.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else if (ss->kind == 14) {
            ss->cascade4.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else if (ss->kind == 18) {
            ss->cascade8.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else if (ss->kind == 12) {
            ss->cascade2.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          } else {
            ss->minmax.select(*sparse, l, ss->layout, len, ids, prev, current, sp, ss->sel);
          }
          blocks.assign(ss->sel.blocks.begin(), ss->sel.blocks.end());
        }
        res.selected_blocks += blocks.size();
        ++res.selections;
      }
      if (ss != nullptr) {  // blocks (ascending) new since this layer's previous step
        std::vector<std::uint32_t>& last = last_blocks[l];
        if (!last.empty()) {
          std::size_t a = 0;
          for (const std::uint32_t b : blocks) {
            while (a < last.size() && last[a] < b) {
              ++a;
            }
            res.churn_new += a < last.size() && last[a] == b ? 0u : 1u;
          }
          res.churn_all += blocks.size();
        }
        last.assign(blocks.begin(), blocks.end());
      }
      // Row j attends the selected committed positions and, exactly, drafts 1..j (the side
      // buffer of the mini-decoder's verification). The committed keys of one KV head are
      // gathered once and multiplied through BLAS for the group's q heads.
      std::uint32_t m = 0;
      for (std::uint32_t b : blocks) {
        m += std::min(len, (b + 1) * bt) - b * bt;
      }
      sc.resize(std::size_t{G} * m);
      for (std::uint32_t hk = 0; hk < c.num_kv_heads; ++hk) {
        const std::size_t off = std::size_t{hk} * D;
        const float* kg = Kl + off;
        const float* vg = Vl + off;
        int ld = static_cast<int>(kv_dim_);
        if (m != len || reversed_) {  // sparse (or reversed): gather the selected positions
          kgat.resize(std::size_t{m} * D);
          vgat.resize(kgat.size());
          std::size_t at = 0;
          for (std::uint32_t b : blocks) {
            for (std::uint32_t t = b * bt; t < std::min(len, (b + 1) * bt); ++t, ++at) {
              std::copy(Kl + std::size_t{t} * kv_dim_ + off,
                        Kl + std::size_t{t} * kv_dim_ + off + D, kgat.data() + at * D);
              std::copy(Vl + std::size_t{t} * kv_dim_ + off,
                        Vl + std::size_t{t} * kv_dim_ + off + D, vgat.data() + at * D);
            }
          }
          kg = kgat.data();
          vg = vgat.data();
          ld = static_cast<int>(D);
        }
        for (std::uint32_t j = 0; j < rows; ++j) {
          const float* qg = q + (std::size_t{j} * H + hk * G) * D;
          float* og = out + (std::size_t{j} * H + hk * G) * D;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(G),
                      static_cast<int>(m), static_cast<int>(D), scale, qg, static_cast<int>(D), kg,
                      ld, 0.0f, sc.data(), static_cast<int>(m));
          // Per q head: softmax weights (unnormalized, shared max) of the committed keys in
          // place and of the side keys in `side`, then P.V through BLAS plus the side's share.
          side.resize(std::size_t{G} * 16);
          dens.resize(G);
          for (std::uint32_t g2 = 0; g2 < G; ++g2) {
            float* s = sc.data() + std::size_t{g2} * m;
            float* sd = side.data() + std::size_t{g2} * 16;
            const float* qv = qg + std::size_t{g2} * D;
            float mx = -std::numeric_limits<float>::infinity();
            for (std::uint32_t t = 0; t < m; ++t) {
              mx = std::max(mx, s[t]);
            }
            for (std::uint32_t d2 = 1; d2 <= j; ++d2) {
              const float* kv = k + std::size_t{d2} * kv_dim_ + off;
              float dot = 0.0f;
              for (std::uint32_t x2 = 0; x2 < D; ++x2) {
                dot += qv[x2] * kv[x2];
              }
              sd[d2] = scale * dot;
              mx = std::max(mx, sd[d2]);
            }
            double den = 0;
            for (std::uint32_t t = 0; t < m; ++t) {
              s[t] = std::exp(s[t] - mx);
              den += s[t];
            }
            for (std::uint32_t d2 = 1; d2 <= j; ++d2) {
              sd[d2] = std::exp(sd[d2] - mx);
              den += sd[d2];
            }
            dens[g2] = den;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(G),
                      static_cast<int>(D), static_cast<int>(m), 1.0f, sc.data(),
                      static_cast<int>(m), vg, ld, 0.0f, og, static_cast<int>(D));
          for (std::uint32_t g2 = 0; g2 < G; ++g2) {
            float* o = og + std::size_t{g2} * D;
            const float* sd = side.data() + std::size_t{g2} * 16;
            for (std::uint32_t d2 = 1; d2 <= j; ++d2) {
              const float* vv = v + std::size_t{d2} * kv_dim_ + off;
              for (std::uint32_t x2 = 0; x2 < D; ++x2) {
                o[x2] += sd[d2] * vv[x2];
              }
            }
            for (std::uint32_t x2 = 0; x2 < D; ++x2) {
              o[x2] = static_cast<float>(o[x2] / dens[g2]);
            }
          }
        }
      }
      std::copy(q, q + std::size_t{rows} * qd, prevq[l].begin());
      prevn[l] = rows;
      prevw[l] = weights;
    };
    tf_.step(batch.data(), static_cast<std::uint32_t>(batch.size()), pos, L, attend, logits.data());
    const int a = mini_decoder::argmax(logits.data(), V);
    if (on_logits) {
      on_logits(i, logits.data());
    }
    if ((i + 1) % 64 == 0) {  // a long run on a loaded machine should show it is alive
      std::fprintf(stderr, "  step %u/%u\n", i + 1, n);
    }
    res.tokens.push_back(x);
    res.argmax.push_back(a);
    if (teacher != nullptr) {
      if (i + 1 >= teacher->size()) {
        break;
      }
      const int y = (*teacher)[i + 1];
      const float mx = *std::max_element(logits.begin(), logits.begin() + V);
      double sum = 0;
      for (std::uint32_t t = 0; t < V; ++t) {
        sum += std::exp(double(logits[t]) - mx);
      }
      res.nll += std::log(sum) + mx - logits[static_cast<std::size_t>(y)];
      ++res.scored;
      x = y;
    } else {
      x = a;
    }
  }
  // Acceptance as a speculative decoder would count it, per step: the drafts' longest prefix
  // that the committed continuation confirms.
  for (std::size_t i = 0; i < step_drafts.size(); ++i) {
    const std::vector<int>& d = step_drafts[i];
    res.drafted += static_cast<std::uint32_t>(d.size());
    for (std::size_t j = 0; j < d.size() && i + 1 + j < res.tokens.size(); ++j) {
      if (d[j] != res.tokens[i + 1 + j]) {
        break;
      }
      ++res.accepted;
    }
  }
  return res;
}

}  // namespace accuracy
