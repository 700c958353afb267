// SPDX-License-Identifier: Apache-2.0
#include "evaluator.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/kept_window.hpp"

namespace accuracy {
namespace {

constexpr std::uint32_t sink_blocks = 1, recent_blocks = 1;  // the cache's defaults

// Predictors that score blocks: which of this sample's query tokens they read. Tokens
// [0, n_prev) are the previous step's pending token and its drafts; token n_prev is the true
// query (only `cur`, Quest, may read it: it selects at attention time).
struct scored_predictor {
  const char* name;
  std::uint32_t drafts;  // lookahead tokens beyond the pending one; ~0u: the current query
};
constexpr scored_predictor scored[] = {
    {"cur", ~0u}, {"prev", 0}, {"la1", 1}, {"la2", 2}, {"la4", 4}};  // cur first: see agree_next
constexpr const char* scorings[] = {"exact", "summary", "int8", "int4", "qminmax"};
constexpr const char* grans[] = {"shared", "per_head"};

std::uint32_t intersect(const std::vector<std::uint32_t>& a, const std::vector<std::uint32_t>& b,
                        std::uint32_t skip_lo, std::uint32_t skip_hi) {
  std::uint32_t n = 0;
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      n += (a[i] >= skip_lo && a[i] < skip_hi) ? 1u : 0u;
      ++i;
      ++j;
    }
  }
  return n;
}

std::uint32_t count_in(const std::vector<std::uint32_t>& a, std::uint32_t lo, std::uint32_t hi) {
  return static_cast<std::uint32_t>(
      std::count_if(a.begin(), a.end(), [&](std::uint32_t b) { return b >= lo && b < hi; }));
}

}  // namespace

struct evaluator::per_block_size {
  std::uint32_t tokens = 16, index = 0;
};

evaluator::evaluator(const eval_shape& s, std::vector<std::uint32_t> block_sizes,
                     std::vector<std::uint32_t> budgets, std::uint64_t seed)
    : s_(s), block_sizes_(std::move(block_sizes)), budgets_(std::move(budgets)), rng_(seed) {
  std::size_t slot_bytes = 0;
  std::uint32_t max_blocks = 0;
  for (std::uint32_t t : block_sizes_) {
    const oasiskv::kv_layout l{1, s.num_q_heads,      s.num_kv_heads, s.head_dim,
                               t, oasiskv::dtype::f16};
    l.validate();
    summaries_.emplace_back();
    qmm_.emplace_back();
    int8_.emplace_back();
    int4_.emplace_back();
    for (std::uint32_t layer = 0; layer < s.num_layers; ++layer) {
      summaries_.back().emplace_back(l, l.blocks_for(s.capacity_tokens));
      qmm_.back().emplace_back(l, l.blocks_for(s.capacity_tokens));
      int8_.back().emplace_back(l, l.blocks_for(s.capacity_tokens));
      int4_.back().emplace_back(l, l.blocks_for(s.capacity_tokens));
    }
    slot_bytes = std::max(slot_bytes, l.block_bytes());
    max_blocks = std::max(max_blocks, l.blocks_for(s.capacity_tokens));
    // The same order as score_and_record walks them.
    for (const char* gran : grans) {
      auto add = [&](const std::string& pred, const std::string& scoring, const std::string& agg) {
        for (std::uint32_t b : budgets_) {
          eval_config c;
          c.pred = pred;
          c.scoring = scoring;
          c.agg = agg;
          c.gran = gran;
          c.block = t;
          c.budget = b;
          c.name = pred + "/" + scoring + "/" + agg + "/" + gran + "/b" + std::to_string(t) + "/" +
                   std::to_string(b);
          configs_.push_back(c);
        }
      };
      for (const scored_predictor& p : scored) {
        for (const char* scoring : scorings) {
          add(p.name, scoring, "max");
          add(p.name, scoring, "mass");
          if (p.drafts != 0 && p.drafts != ~0u) {
            add(p.name, scoring, "conf");  // one query token: conf == mass
          }
        }
      }
      add("recency", "-", "-");
      add("random", "-", "-");
    }
  }
  slot_.resize(slot_bytes);
  ids_.resize(max_blocks);
  for (std::uint32_t i = 0; i < max_blocks; ++i) {
    ids_[i] = i;
  }
}

void evaluator::append(std::uint32_t layer, std::uint32_t pos, const float* k) {
  const std::uint32_t d = s_.head_dim;
  for (std::size_t i = 0; i < block_sizes_.size(); ++i) {
    const std::uint32_t t = block_sizes_[i];
    const oasiskv::kv_layout l{1, s_.num_q_heads, s_.num_kv_heads, d, t, oasiskv::dtype::f16};
    const std::uint32_t first = pos % t;
    for (std::uint32_t h = 0; h < s_.num_kv_heads; ++h) {
      auto* dst =
          reinterpret_cast<std::uint16_t*>(slot_.data() + l.key_offset(h)) + std::size_t{first} * d;
      for (std::uint32_t x = 0; x < d; ++x) {
        dst[x] = oasiskv::f16::from_float(k[std::size_t{h} * d + x]).bits;
      }
    }
    summaries_[i][layer].update(pos / t, slot_.data(), first, 1);
    qmm_[i][layer].update(pos / t, slot_.data(), first, 1);
    int8_[i][layer].update(pos / t, slot_.data(), first, 1);
    int4_[i][layer].update(pos / t, slot_.data(), first, 1);
  }
}

void evaluator::evaluate(std::uint32_t layer, std::uint32_t len, const float* keys,
                         const float* values, const float* q_true, const float* q_prev,
                         std::uint32_t n_prev, const float* w_prev) {
  const std::uint32_t H = s_.num_q_heads, KH = s_.num_kv_heads, D = s_.head_dim, G = H / KH;
  const std::uint32_t kvd = KH * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  ntok_ = n_prev + 1;
  len_ = len;
  values_ = values;
  const std::uint32_t rows = ntok_ * G;
  // Query rows per KV head, [kv][token][group][dim]: what a summary's score() takes.
  qrows_.resize(std::size_t{KH} * rows * D);
  for (std::uint32_t hk = 0; hk < KH; ++hk) {
    for (std::uint32_t t = 0; t < ntok_; ++t) {
      const float* src = (t < n_prev ? q_prev + std::size_t{t} * H * D : q_true) + hk * G * D;
      std::copy(src, src + G * D, qrows_.data() + (std::size_t{hk} * rows + t * G) * D);
    }
  }
  // Exact logits q.k of every row against every key: [kv][row][len].
  logits_.resize(std::size_t{KH} * rows * len);
  for (std::uint32_t hk = 0; hk < KH; ++hk) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(len), static_cast<int>(D), 1.0f,
                qrows_.data() + std::size_t{hk} * rows * D, static_cast<int>(D), keys + hk * D,
                static_cast<int>(kvd), 0.0f, logits_.data() + std::size_t{hk} * rows * len,
                static_cast<int>(len));
  }
  // The true query's attention probabilities [q head][len] and the dense output [q head][dim].
  probs_.resize(std::size_t{H} * len);
  dense_out_.assign(std::size_t{H} * D, 0.0f);
  for (std::uint32_t h = 0; h < H; ++h) {
    const float* s = logits_.data() + (std::size_t{h / G} * rows + n_prev * G + h % G) * len;
    float* p = probs_.data() + std::size_t{h} * len;
    const float mx = *std::max_element(s, s + len);
    double sum = 0;
    for (std::uint32_t t = 0; t < len; ++t) {
      p[t] = std::exp(scale * (s[t] - mx));
      sum += p[t];
    }
    const auto inv = static_cast<float>(1.0 / sum);
    float* o = dense_out_.data() + std::size_t{h} * D;
    const std::size_t voff = std::size_t{h / G} * D;
    for (std::uint32_t t = 0; t < len; ++t) {
      p[t] *= inv;
      const float* v = values + std::size_t{t} * kvd + voff;
      for (std::uint32_t x = 0; x < D; ++x) {
        o[x] += p[t] * v[x];
      }
    }
  }
  for (std::size_t i = 0; i < block_sizes_.size(); ++i) {
    per_block_size bs{block_sizes_[i], static_cast<std::uint32_t>(i)};
    const std::uint32_t nb = (len + bs.tokens - 1) / bs.tokens;
    (void)layer;
    // Per block and q head: the true query's mass and its share of the output's numerator.
    mass_.assign(std::size_t{H} * nb, 0.0f);
    numer_.assign(std::size_t{H} * nb * D, 0.0f);
    for (std::uint32_t h = 0; h < H; ++h) {
      const float* p = probs_.data() + std::size_t{h} * len;
      const std::size_t voff = std::size_t{h / G} * D;
      for (std::uint32_t t = 0; t < len; ++t) {
        const std::uint32_t b = t / bs.tokens;
        mass_[std::size_t{h} * nb + b] += p[t];
        float* nu = numer_.data() + (std::size_t{h} * nb + b) * D;
        const float* v = values + std::size_t{t} * kvd + voff;
        for (std::uint32_t x = 0; x < D; ++x) {
          nu[x] += p[t] * v[x];
        }
      }
    }
    // Raw scores [kv][block][row]: exact block max of q.k, exact block log-sum-exp (divided by
    // the scale, so softmax-mass aggregation over it gives each row's exact block mass), the
    // min/max summary's bound (f16, and int8: qminmax), and the int8 and int4 key summaries' max
    // and log-mass (what the library's predictor reads for max and for mass aggregation).
    raw_max_.resize(std::size_t{KH} * nb * rows);
    raw_lse_.resize(raw_max_.size());
    raw_sum_.resize(raw_max_.size());
    raw_i8max_.resize(raw_max_.size());
    raw_i8lse_.resize(raw_max_.size());
    raw_i4max_.resize(raw_max_.size());
    raw_i4lse_.resize(raw_max_.size());
    raw_qmm_.resize(raw_max_.size());
    for (std::uint32_t hk = 0; hk < KH; ++hk) {
      for (std::uint32_t r = 0; r < rows; ++r) {
        const float* s = logits_.data() + (std::size_t{hk} * rows + r) * len;
        const float mx = *std::max_element(s, s + len);
        for (std::uint32_t b = 0; b < nb; ++b) {
          const std::uint32_t t0 = b * bs.tokens, t1 = std::min(len, t0 + bs.tokens);
          float bm = -std::numeric_limits<float>::infinity();
          double e = 0;
          for (std::uint32_t t = t0; t < t1; ++t) {
            bm = std::max(bm, s[t]);
            e += std::exp(scale * (s[t] - mx));
          }
          const std::size_t at = (std::size_t{hk} * nb + b) * rows + r;
          raw_max_[at] = bm;
          raw_lse_[at] = mx + static_cast<float>(std::log(e)) / scale;
        }
      }
      summaries_[bs.index][layer].score(hk, std::span<const std::uint32_t>(ids_.data(), nb),
                                        qrows_.data() + std::size_t{hk} * rows * D, rows,
                                        raw_sum_.data() + std::size_t{hk} * nb * rows);
      const std::span<const std::uint32_t> ids(ids_.data(), nb);
      const float* qr = qrows_.data() + std::size_t{hk} * rows * D;
      int8_[bs.index][layer].score(hk, ids, qr, rows,
                                   raw_i8max_.data() + std::size_t{hk} * nb * rows);
      int8_[bs.index][layer].score_log_mass(hk, ids, qr, rows, scale,
                                            raw_i8lse_.data() + std::size_t{hk} * nb * rows);
      int4_[bs.index][layer].score(hk, ids, qr, rows,
                                   raw_i4max_.data() + std::size_t{hk} * nb * rows);
      int4_[bs.index][layer].score_log_mass(hk, ids, qr, rows, scale,
                                            raw_i4lse_.data() + std::size_t{hk} * nb * rows);
      qmm_[bs.index][layer].score(hk, ids, qr, rows, raw_qmm_.data() + std::size_t{hk} * nb * rows);
    }
    weights_.assign(w_prev, w_prev + n_prev);
    score_and_record(bs, nb, len);
  }
  ++samples_;
}

void evaluator::score_and_record(per_block_size& bs, std::uint32_t nb, std::uint32_t len) {
  const std::uint32_t H = s_.num_q_heads, KH = s_.num_kv_heads, D = s_.head_dim, G = H / KH;
  const std::uint32_t rows = ntok_ * G, n_prev = ntok_ - 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  (void)len;
  // Configurations of this block size start where the earlier block sizes' end.
  std::size_t idx = 0;
  for (std::size_t i = 0; i < bs.index; ++i) {
    idx += configs_.size() / block_sizes_.size();
  }
  table_set sel, oracle;
  std::vector<table_set> oracles(budgets_.size());
  // [scoring * 2 + (aggregation != max)][budget]: the current query's selections
  std::vector<std::vector<table_set>> nexts(2 * std::size(scorings),
                                            std::vector<table_set>(budgets_.size()));
  std::uint32_t next_slot = 0;
  bool is_cur = false;
  for (const char* gran : grans) {
    const bool per_head = std::string(gran) == "per_head";
    const std::uint32_t tables = per_head ? KH : 1;
    auto select_all_budgets = [&](std::size_t at) {  // from acc_, one config per budget
      for (std::size_t bi = 0; bi < budgets_.size(); ++bi) {
        const oasiskv::selection_params sp{std::max(budgets_[bi] / bs.tokens, 2u), sink_blocks,
                                           recent_blocks};
        sel.assign(tables, {});
        for (std::uint32_t t = 0; t < tables; ++t) {
          selector_.append_table(acc_.data() + std::size_t{t} * nb, nb, sp, sel[t]);
        }
        if (at == ~std::size_t{0}) {
          oracles[bi] = sel;
          continue;
        }
        if (is_cur) {
          nexts[next_slot][bi] = sel;
        }
        record(at + bi, sel, oracles[bi], nexts[next_slot][bi], nb, bs);
      }
    };
    // The oracle: each table's summed mass of the true query over its q heads.
    acc_.assign(std::size_t{tables} * nb, 0.0f);
    for (std::uint32_t h = 0; h < H; ++h) {
      float* a = acc_.data() + std::size_t{per_head ? h / G : 0} * nb;
      for (std::uint32_t b = 0; b < nb; ++b) {
        a[b] += mass_[std::size_t{h} * nb + b];
      }
    }
    select_all_budgets(~std::size_t{0});
    for (const scored_predictor& p : scored) {
      std::uint32_t t0 = 0, t1 = 0;
      if (p.drafts == ~0u) {
        t0 = n_prev;
        t1 = ntok_;
      } else {
        t1 = std::min(p.drafts + 1, n_prev);  // fewer drafts proposed: what there is
      }
      const std::uint32_t nsub = (t1 - t0) * G;
      for (std::uint32_t si = 0; si < std::size(scorings); ++si) {
        const std::uint32_t naggs = (p.drafts != 0 && p.drafts != ~0u) ? 3 : 2;
        for (std::uint32_t ai = 0; ai < naggs; ++ai) {
          is_cur = p.drafts == ~0u;
          next_slot = 2 * si + (ai == 0 ? 0u : 1u);
          const float* raw = si == 0   ? (ai == 0 ? raw_max_.data() : raw_lse_.data())
                             : si == 1 ? raw_sum_.data()
                             : si == 2 ? (ai == 0 ? raw_i8max_.data() : raw_i8lse_.data())
                             : si == 3 ? (ai == 0 ? raw_i4max_.data() : raw_i4lse_.data())
                                       : raw_qmm_.data();
          const oasiskv::aggregation_context ctx{nb, nsub, G, scale,
                                                 p.drafts == ~0u ? nullptr : weights_.data()};
          acc_.resize(std::size_t{tables} * nb);
          for (std::uint32_t hk = 0; hk < KH; ++hk) {
            sub_.resize(std::size_t{nb} * nsub);
            for (std::uint32_t b = 0; b < nb; ++b) {  // to the aggregations' [row][block]
              const float* src = raw + (std::size_t{hk} * nb + b) * rows + t0 * G;
              for (std::uint32_t r = 0; r < nsub; ++r) {
                sub_[std::size_t{r} * nb + b] = src[r];
              }
            }
            float* a = acc_.data() + std::size_t{per_head ? hk : 0} * nb;
            const bool first = per_head || hk == 0;
            if (ai == 0) {
              max_agg_.combine(ctx, sub_.data(), a, first);
            } else if (ai == 1) {
              mass_agg_.combine(ctx, sub_.data(), a, first);
            } else {
              conf_agg_.combine(ctx, sub_.data(), a, first);
            }
          }
          select_all_budgets(idx);
          idx += budgets_.size();
        }
      }
    }
    // Recency: the newest blocks first. Random: the floor. Both against Quest's selection.
    is_cur = false;
    next_slot = 2;
    acc_.resize(std::size_t{tables} * nb);
    for (std::uint32_t t = 0; t < tables; ++t) {
      for (std::uint32_t b = 0; b < nb; ++b) {
        acc_[std::size_t{t} * nb + b] = static_cast<float>(b);
      }
    }
    select_all_budgets(idx);
    idx += budgets_.size();
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (float& a : acc_) {
      a = u(rng_);
    }
    select_all_budgets(idx);
    idx += budgets_.size();
  }
}

void evaluator::record(std::size_t config, const table_set& sel, const table_set& oracle,
                       const table_set& next, std::uint32_t nb, const per_block_size&) {
  const std::uint32_t H = s_.num_q_heads, KH = s_.num_kv_heads, D = s_.head_dim, G = H / KH;
  metric_sums& m = configs_[config].sums;
  const auto tables = static_cast<std::uint32_t>(sel.size());
  // Blocks always kept: the sink block and the newest one; the free ones lie in [lo, hi).
  const oasiskv::block_window kept = oasiskv::kept_window(nb, sink_blocks, recent_blocks);
  const std::uint32_t lo = kept.sinks, hi = kept.recent_from;
  double agree_all = 0, agree_free = 0;
  std::uint32_t free_tables = 0;
  for (std::uint32_t t = 0; t < tables; ++t) {
    agree_all += double(intersect(sel[t], oracle[t], 0, nb)) / double(oracle[t].size());
    const std::uint32_t of = count_in(oracle[t], lo, hi);
    if (of > 0) {
      agree_free += double(intersect(sel[t], oracle[t], lo, hi)) / of;
      ++free_tables;
    }
  }
  m.agree_all += agree_all / tables;
  double agree_next = 0;
  for (std::uint32_t t = 0; t < tables; ++t) {
    agree_next += double(intersect(sel[t], next[t], 0, nb)) / double(next[t].size());
  }
  m.agree_next += agree_next / tables;
  if (free_tables > 0) {
    m.agree_free += agree_free / free_tables;
    ++m.n_free;
  }
  double recall = 0, orecall = 0, err = 0, ref = 0;
  std::vector<float> o(D);
  for (std::uint32_t h = 0; h < H; ++h) {
    const std::uint32_t t = tables == 1 ? 0 : h / G;
    double r = 0, orc = 0;
    std::fill(o.begin(), o.end(), 0.0f);
    for (std::uint32_t b : sel[t]) {
      r += mass_[std::size_t{h} * nb + b];
      const float* nu = numer_.data() + (std::size_t{h} * nb + b) * D;
      for (std::uint32_t x = 0; x < D; ++x) {
        o[x] += nu[x];
      }
    }
    for (std::uint32_t b : oracle[t]) {
      orc += mass_[std::size_t{h} * nb + b];
    }
    recall += r;
    orecall += orc;
    const float* od = dense_out_.data() + std::size_t{h} * D;
    for (std::uint32_t x = 0; x < D; ++x) {
      const double v = r > 0 ? o[x] / r : 0.0;
      err += (v - od[x]) * (v - od[x]);
      ref += double(od[x]) * od[x];
    }
  }
  (void)KH;
  m.recall += recall / H;
  m.rel_recall += orecall > 0 ? recall / orecall : 1.0;
  m.l2 += ref > 0 ? std::sqrt(err / ref) : 0.0;
  ++m.n;
}

}  // namespace accuracy
