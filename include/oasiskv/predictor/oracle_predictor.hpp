// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `oracle_predictor`: the blocks that receive the most exact attention mass. For
//! evaluation only: it reads every key, which is what a predictor exists to avoid.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/block_selector.hpp"

namespace oasiskv {

//! @brief Scores each block by the softmax attention mass the given (true) queries put on its
//! tokens, exactly, from the keys in `prediction_input::keys` / `key_slots`, summed over the
//! q heads of each GQA group and over the query tokens (and over KV heads for a shared
//! selection), and keeps the top blocks: the ceiling every predictor's recall is measured
//! against. Every query token sees all `seq_len` tokens. Throws `errc::unsupported` when the
//! exact keys are absent. `O(seq_len x rows x head_dim)` per KV head.
template <class Granularity = shared_selection>
class oracle_predictor {
 public:
  using summary_type = no_summary;
  using granularity_type = Granularity;
  static constexpr prediction_timing timing = prediction_timing::at_attention;

  void select(const prediction_input<no_summary>& in, const selection_params& sp, selection& out) {
    const kv_layout& l = in.layout;
    detail::check_prediction_basics(l, in.seq_len, sp);
    detail::check_queries(in.queries);
    const std::uint32_t blocks = l.blocks_for(in.seq_len);
    if (in.keys.base == nullptr || in.key_slots.empty()) [[unlikely]] {
      detail::raise(errc::unsupported,
                    "oracle_predictor needs the exact keys: prediction_input.keys and key_slots");
    }
    if (!(in.keys.layout == l)) [[unlikely]] {
      detail::raise(errc::layout_mismatch,
                    "oracle_predictor: prediction_input.keys.layout differs from "
                    "prediction_input.layout");
    }
    if (in.key_slots.size() != blocks) [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "prediction_input.key_slots.size() = ", in.key_slots.size(),
                    " but seq_len = ", in.seq_len, " needs ", blocks, " blocks");
    }
    for (std::uint32_t i = 0; i < blocks; ++i) {
      if (in.key_slots[i] >= in.keys.num_slots) [[unlikely]] {
        detail::raise(errc::out_of_range, "prediction_input.key_slots[", i, "] = ", in.key_slots[i],
                      " >= keys.num_slots = ", in.keys.num_slots);
      }
    }
    const std::uint32_t tables = Granularity::per_kv_head ? l.num_kv_heads : 1;
    acc_.assign(std::size_t{tables} * blocks, 0.0f);
    visit_dtype(l.kv_dtype, [&](auto elem) {
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        float* acc = acc_.data() + std::size_t{Granularity::per_kv_head ? h : 0} * blocks;
        add_head_mass<decltype(elem)>(in, h, acc);
      }
    });
    out.tables = tables;
    out.blocks.clear();
    out.offsets.resize(tables + 1);
    out.offsets[0] = 0;
    for (std::uint32_t t = 0; t < tables; ++t) {
      selector_.append_table(acc_.data() + std::size_t{t} * blocks, blocks, sp, out.blocks);
      out.offsets[t + 1] = static_cast<std::uint32_t>(out.blocks.size());
    }
  }

 private:
  // Adds to acc[block] the attention mass of every query row of KV head h's group.
  template <class T>
  void add_head_mass(const prediction_input<no_summary>& in, std::uint32_t h, float* acc) {
    const kv_layout& l = in.layout;
    const std::uint32_t d = l.head_dim, tpb = l.tokens_per_block;
    const std::uint32_t blocks = l.blocks_for(in.seq_len);
    const std::uint32_t rows = in.queries.num_tokens * l.group_size();
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    detail::gather_group_rows(l, in.queries, h, rows_);
    logits_.resize(std::size_t{rows} * in.seq_len);
    for (std::uint32_t i = 0; i < blocks; ++i) {
      const T* keys = in.keys.keys<T>(in.key_slots[i], h);
      const std::uint32_t fill = std::min(tpb, in.seq_len - i * tpb);
      for (std::uint32_t t = 0; t < fill; ++t) {
        const T* k = keys + std::size_t{t} * d;
        for (std::uint32_t r = 0; r < rows; ++r) {
          const float* q = rows_.data() + std::size_t{r} * d;
          double dot = 0.0;
          for (std::uint32_t x = 0; x < d; ++x) {
            dot += double{q[x]} * double{to_float(k[x])};
          }
          logits_[std::size_t{r} * in.seq_len + i * tpb + t] = scale * dot;
        }
      }
    }
    for (std::uint32_t r = 0; r < rows; ++r) {
      const double* lg = logits_.data() + std::size_t{r} * in.seq_len;
      const double m = *std::max_element(lg, lg + in.seq_len);
      double z = 0.0;
      for (std::uint32_t p = 0; p < in.seq_len; ++p) {
        z += std::exp(lg[p] - m);
      }
      for (std::uint32_t i = 0; i < blocks; ++i) {
        double mass = 0.0;
        for (std::uint32_t p = i * tpb; p < std::min(in.seq_len, (i + 1) * tpb); ++p) {
          mass += std::exp(lg[p] - m);
        }
        acc[i] += static_cast<float>(mass / z);
      }
    }
  }

  block_selector selector_;
  std::vector<float> rows_;
  std::vector<double> logits_;  // [rows][seq_len]
  std::vector<float> acc_;      // [tables][blocks]
};

}  // namespace oasiskv
