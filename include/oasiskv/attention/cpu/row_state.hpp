// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The online-softmax state that the CPU decode kernels carry from block to block, the
//! per-block arguments of their SIMD block functions, and the log-sum-exp merge of partial
//! results.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>

namespace oasiskv::cpu {

namespace detail {

inline constexpr float log2e = 1.44269504088896340736f;
inline constexpr float ln2 = 0.69314718055994530942f;

//! @brief Running state of the query rows that one task serves: the `q_len x group_size` query
//! rows of one (sequence, KV head), over a range of that head's blocks. Row `r` is query token
//! `r / group_size`, q head `kv_head * group_size + r % group_size`. Scores are kept in log2 units
//! (queries are pre-multiplied by `scale * log2(e)`) so that the kernels' exponentials are
//! `exp2`, whose range reduction is exact.
struct row_state {
  std::uint32_t rows = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t s_stride = 0;          // floats per score row: tokens_per_block rounded up to 16
  float* q = nullptr;                  // [rows][head_dim] scaled queries
  float* acc = nullptr;                // [rows][head_dim] un-normalised output
  float* m = nullptr;                  // [rows] running max score (log2 units); -inf: none yet
  float* l = nullptr;                  // [rows] running softmax denominator relative to m
  float* s = nullptr;                  // [rows][s_stride] scores, then probabilities, of a block
  float* alpha = nullptr;              // [rows] rescale of acc by this block's new max
  float* lv = nullptr;                 // [rows][16] per-lane parts of l (AVX-512 path; zeroed)
  const std::uint32_t* vis = nullptr;  // [rows] tokens of the current block that row r sees
};

//! @brief One block of one KV head as a block function reads it. Tokens `[0, fill)` hold data;
//! no row sees past `vmax` (<= fill). `next_*` is the block that comes after, for prefetching
//! (null at the end of a range).
struct block_span {
  const void* k;       // [tokens_per_block][head_dim] of the element type
  const void* v;       // [tokens_per_block][head_dim]
  const void* next_k;  // same shape, or null
  const void* next_v;
  std::uint32_t fill;
  std::uint32_t vmax;
};

//! @brief Updates `st` with one block: scores, online-softmax rescale, value accumulation.
using block_fn = void (*)(const row_state& st, const block_span& b);

//! @brief Writes `acc / l` and the natural-log LSE of every row of `st`; rows that saw nothing
//! get zeros and -inf. `out_row(r)` is where row r's output goes, `lse_at(r)` its LSE.
template <class OutRow, class LseAt>
void finalize_rows(const row_state& st, OutRow&& out_row, LseAt&& lse_at) {
  for (std::uint32_t r = 0; r < st.rows; ++r) {
    float* out = out_row(r);
    const float* acc = st.acc + std::size_t{r} * st.head_dim;
    const float l = st.l[r];
    if (!(l > 0.0f)) {
      for (std::uint32_t x = 0; x < st.head_dim; ++x) {
        out[x] = 0.0f;
      }
      lse_at(r) = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float inv = 1.0f / l;
    for (std::uint32_t x = 0; x < st.head_dim; ++x) {
      out[x] = acc[x] * inv;
    }
    lse_at(r) = (st.m[r] + std::log2(l)) * ln2;
  }
}

//! @brief A 64-byte aligned array of floats, zero-initialised (padding lanes that the SIMD code
//! loads and masks off are then well-defined).
class aligned_floats {
 public:
  explicit aligned_floats(std::size_t n)
      : data_(new (std::align_val_t{64}) float[n == 0 ? 1 : n]()) {}
  float* data() const noexcept { return data_.get(); }

 private:
  struct deleter {
    void operator()(float* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float[], deleter> data_;
};

}  // namespace detail

//! @brief Merges partial attention results over disjoint token sets in place: row `r` of
//! (`out`, `lse`) becomes the result over both sets, given row `r` of (`other_out`, `other_lse`).
//! Rows are `head_dim` floats apart; an LSE of -inf means "saw nothing" and contributes nothing.
//! Exact up to f32 rounding, which is what lets kernels split a sequence's blocks across threads
//! (and an engine combine results from several tiers or devices).
inline void merge_partial(float* out, float* lse, const float* other_out, const float* other_lse,
                          std::size_t rows, std::uint32_t head_dim) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float a = lse[r];
    const float b = other_lse[r];
    float* o = out + r * head_dim;
    const float* ob = other_out + r * head_dim;
    if (b == -std::numeric_limits<float>::infinity()) {
      continue;
    }
    if (a == -std::numeric_limits<float>::infinity()) {
      for (std::uint32_t x = 0; x < head_dim; ++x) {
        o[x] = ob[x];
      }
      lse[r] = b;
      continue;
    }
    const float mx = a > b ? a : b;
    const float wa = std::exp(a - mx);
    const float wb = std::exp(b - mx);
    const float inv = 1.0f / (wa + wb);
    for (std::uint32_t x = 0; x < head_dim; ++x) {
      o[x] = (wa * o[x] + wb * ob[x]) * inv;
    }
    lse[r] = mx + std::log(wa + wb);
  }
}

}  // namespace oasiskv::cpu
