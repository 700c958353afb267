// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `reference_decode`: the naive decode attention every kernel is checked against.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "oasiskv/attention/validate.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"

namespace oasiskv {

//! @brief Decode attention computed the obvious way, in double precision, with two passes over
//! the scores. Slow on purpose: it is the definition that faster kernels must reproduce.
//! Models `sparse_attention_kernel`.
struct reference_decode {
  void decode(const decode_params& p) const {
    validate(p);
    visit_dtype(p.pool.layout.kv_dtype, [&](auto elem) { run<decltype(elem)>(p); });
  }

 private:
  struct token_ref {
    const void* key;
    const void* value;
  };

  template <class T>
  static void run(const decode_params& p) {
    const kv_layout& l = p.pool.layout;
    const std::uint32_t d = l.head_dim;
    std::vector<token_ref> tokens;
    std::vector<double> scores;
    std::vector<double> acc(d);
    for (std::uint32_t s = 0; s < p.num_seqs; ++s) {
      const std::uint32_t len = p.seq_lens[s];
      for (std::uint32_t j = 0; j < p.q_len; ++j) {
        const std::uint32_t pos = len - p.q_len + j;  // this query token's position
        for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
          const std::uint32_t kvh = h / l.group_size();
          const std::uint32_t t = p.table.table_index(s, kvh);
          tokens.clear();
          for (std::uint32_t i = 0; i < p.table.size(t); ++i) {
            const block_ref r = p.table.begin(t)[i];
            const std::uint32_t fill = block_fill(l, r.index, len);
            for (std::uint32_t k = 0; k < fill; ++k) {
              if (r.index * l.tokens_per_block + k > pos) {
                break;
              }
              tokens.push_back({p.pool.keys<T>(r.slot, kvh) + std::size_t{k} * d,
                                p.pool.values<T>(r.slot, kvh) + std::size_t{k} * d});
            }
          }
          const float* q = p.q + p.q_row(s, j, h);
          float* out = p.out + p.q_row(s, j, h);
          scores.resize(tokens.size());
          double max_score = -std::numeric_limits<double>::infinity();
          for (std::size_t i = 0; i < tokens.size(); ++i) {
            const T* k = static_cast<const T*>(tokens[i].key);
            double dot = 0.0;
            for (std::uint32_t x = 0; x < d; ++x) {
              dot += double{q[x]} * double{to_float(k[x])};
            }
            scores[i] = double{p.scale} * dot;
            max_score = std::max(max_score, scores[i]);
          }
          if (tokens.empty()) {
            for (std::uint32_t x = 0; x < d; ++x) {
              out[x] = 0.0f;
            }
            p.lse[p.lse_index(s, j, h)] = -std::numeric_limits<float>::infinity();
            continue;
          }
          double denom = 0.0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (std::size_t i = 0; i < tokens.size(); ++i) {
            const double w = std::exp(scores[i] - max_score);
            denom += w;
            const T* v = static_cast<const T*>(tokens[i].value);
            for (std::uint32_t x = 0; x < d; ++x) {
              acc[x] += w * double{to_float(v[x])};
            }
          }
          for (std::uint32_t x = 0; x < d; ++x) {
            out[x] = static_cast<float>(acc[x] / denom);
          }
          p.lse[p.lse_index(s, j, h)] = static_cast<float>(max_score + std::log(denom));
        }
      }
    }
  }
};

}  // namespace oasiskv
