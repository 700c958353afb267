// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The narrow interface between llama.cpp's memory type (C++17, in libllama) and
//! OasisKV's `tiered_kv_cache` (C++20, in oasiskv-bridge.cpp): a virtual class over one cache
//! instance, whose bundle (capacity tier, block summary) is picked at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace oasiskv_bridge {

//! @brief Element type of the stored keys and values.
enum class kv_dtype : std::uint8_t { f16, bf16, f32 };

//! @brief What one cache holds and how it selects.
struct cache_config {
  std::uint32_t layers = 0;
  std::uint32_t q_heads = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  kv_dtype dtype = kv_dtype::f16;
  std::uint32_t block_tokens = 16;
  std::uint32_t budget_tokens = 1024;  //!< attended per (sequence, layer) and decode step
  std::uint32_t max_tokens = 0;        //!< per sequence
  std::uint32_t max_sequences = 1;     //!< held at once
  std::string capacity = "host";       //!< "host", or "file:PATH" (a directory or a file)
  std::string summary = "int2";        //!< one of `summary_names()`
};

//! @brief Counters and sizes, for logs and benchmarks.
struct cache_report {
  std::uint64_t steps = 0;        //!< (sequence, layer) attention steps
  std::uint64_t lookaheads = 0;   //!< predictions made ahead of their step
  std::uint64_t unpredicted = 0;  //!< steps that predicted at attention time
  std::uint64_t hits = 0, misses = 0;
  double predict_seconds = 0.0;
  std::uint64_t fast_bytes = 0;             //!< the staging pool
  std::uint64_t capacity_bytes_in_use = 0;  //!< blocks held in the capacity tier
  bool capacity_in_memory = true;           //!< false for a file
  std::uint64_t summary_bytes = 0;
};

//! @brief A sequence of the cache.
using seq_t = std::uint64_t;

//! @brief The threads that run one of the engine's operations together (ggml's threads in a
//! custom operation): the caller and the others, which wait inside the operation for work.
class team {
 public:
  //! @brief Threads, the caller included.
  virtual unsigned size() const = 0;
  //! @brief Runs `fn(ctx, i)` for every `i` in `[0, n)` on the team; returns when all are done.
  virtual void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) = 0;

 protected:
  ~team() = default;
};

//! @brief One `tiered_kv_cache`. Errors are `std::runtime_error`s whose message names the value
//! at fault (OasisKV's own errors pass through, `oasiskv: ...`).
class cache {
 public:
  virtual ~cache() = default;

  //! @brief The cache `c` describes; throws naming the bad setting.
  static std::unique_ptr<cache> create(const cache_config& c);
  //! @brief The block summaries `cache_config::summary` takes, '|'-separated.
  static const char* summary_names();

  virtual seq_t add_sequence() = 0;
  //! @brief A new sequence sharing the first `tokens` tokens of `parent`.
  virtual seq_t fork(seq_t parent, std::uint32_t tokens) = 0;
  //! @brief Drops every token of `s` past its first `tokens`.
  virtual void truncate(seq_t s, std::uint32_t tokens) = 0;
  virtual void remove(seq_t s) = 0;
  virtual std::uint32_t length(seq_t s, std::uint32_t layer) const = 0;
  //! @brief Whether `a` and `b` hold the same blocks in every layer (one is a fork of the other
  //! that neither has written since).
  virtual bool same_blocks(seq_t a, seq_t b) const = 0;

  //! @brief Appends `n` tokens to each of `seqs` in `layer`: `k`, `v` are
  //! `[n_seqs][n][kv_heads][head_dim]` of the dtype.
  virtual void append(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer, const void* k,
                      const void* v, std::uint32_t n) = 0;
  //! @brief Predicts the next step's blocks of `seqs` in `layer` from `q`
  //! (`[n_seqs][q_len][q_heads][head_dim]`) and starts staging them. The predictor scores over
  //! `t`'s threads (null: the calling thread alone).
  virtual void lookahead(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer,
                         const float* q, std::uint32_t q_len, team* t) = 0;
  //! @brief Attention of the last `q_len` tokens of each of `seqs` in `layer` over the blocks
  //! selected for them: `q`, `out` are `[n_seqs][q_len][q_heads][head_dim]`. The kernel splits
  //! the blocks over `t`'s threads (null: the calling thread alone).
  virtual void attend(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer, const float* q,
                      std::uint32_t q_len, float* out, team* t) = 0;
  //! @brief Copies tokens `[first, first + n)` of (`s`, `layer`) out of the capacity tier, whole
  //! blocks `[first / block_tokens, ...)` at a time: element `e` of KV head `h` of token `t`
  //! (counted from `first`) goes to `k + t * k_token + (h * head_dim + e) * k_elem`, and the
  //! same for V. `first` must be a multiple of `block_tokens`. Calls for distinct block ranges
  //! may run on several threads at once.
  virtual void read(seq_t s, std::uint32_t layer, std::uint32_t first, std::uint32_t n, void* k,
                    std::size_t k_token, std::size_t k_elem, void* v, std::size_t v_token,
                    std::size_t v_elem) = 0;

  virtual cache_report report() const = 0;
  virtual const cache_config& config() const = 0;
};

}  // namespace oasiskv_bridge
