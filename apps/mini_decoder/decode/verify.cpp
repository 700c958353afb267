// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/verify.hpp>

#include <algorithm>
#include <cmath>

namespace mini_decoder {

verify_side::verify_side(const model_config& c)
    : heads_(c.num_heads),
      kv_heads_(c.num_kv_heads),
      head_dim_(c.head_dim),
      kv_dim_(c.num_kv_heads * c.head_dim),
      scale_(1.0f / std::sqrt(static_cast<float>(c.head_dim))),
      k_(c.num_layers),
      v_(c.num_layers),
      s_(max_tokens),
      acc_(c.head_dim) {}

void verify_side::push(std::uint32_t layer, const float* k, const float* v, std::uint32_t n) {
  std::vector<float>& tk = k_[layer];
  std::vector<float>& tv = v_[layer];
  tk.insert(tk.end(), k, k + std::size_t{n} * kv_dim_);
  tv.insert(tv.end(), v, v + std::size_t{n} * kv_dim_);
  const std::size_t keep = std::size_t{max_tokens} * kv_dim_;
  if (tk.size() > keep) {
    tk.erase(tk.begin(), tk.end() - static_cast<std::ptrdiff_t>(keep));
    tv.erase(tv.begin(), tv.end() - static_cast<std::ptrdiff_t>(keep));
  }
}

// Side entry i is position p - g + 1 + i: the last g - 1 committed tokens, then the n rows.
// Row j attends entries [j, j + g), merged with the cache's part through its log-sum-exp.
void verify_side::merge(std::uint32_t layer, const float* q, const float* k, const float* v,
                        std::uint32_t n, float* out, const float* lse) {
  const std::uint32_t g = n - 1;
  if (g == 0) {
    return;
  }
  const std::vector<float>& tk = k_[layer];
  const std::vector<float>& tv = v_[layer];
  const std::size_t from_tail = std::size_t{g - 1} * kv_dim_, rows = std::size_t{n} * kv_dim_;
  side_k_.assign(tk.end() - static_cast<std::ptrdiff_t>(from_tail), tk.end());
  side_v_.assign(tv.end() - static_cast<std::ptrdiff_t>(from_tail), tv.end());
  side_k_.insert(side_k_.end(), k, k + rows);
  side_v_.insert(side_v_.end(), v, v + rows);
  const float* sk = side_k_.data();
  const float* sv = side_v_.data();
  const std::uint32_t hd = head_dim_, group = heads_ / kv_heads_;
  for (std::uint32_t j = 0; j < n; ++j) {
    for (std::uint32_t h = 0; h < heads_; ++h) {
      const std::size_t row = std::size_t{j} * heads_ + h;
      const float* qv = q + row * hd;
      const std::size_t off = std::size_t{h / group} * hd;
      float mx = lse[row];
      for (std::uint32_t i = 0; i < g; ++i) {
        const float* kv = sk + std::size_t{j + i} * kv_dim_ + off;
        float dot = 0.0f;
        for (std::uint32_t x = 0; x < hd; ++x)
          dot += qv[x] * kv[x];
        s_[i] = scale_ * dot;
        mx = std::max(mx, s_[i]);
      }
      const float wc = std::isinf(lse[row]) ? 0.0f : std::exp(lse[row] - mx);
      float* o = out + row * hd;
      float den = wc;
      for (std::uint32_t x = 0; x < hd; ++x)
        acc_[x] = wc * o[x];
      for (std::uint32_t i = 0; i < g; ++i) {
        const float e = std::exp(s_[i] - mx);
        const float* vv = sv + std::size_t{j + i} * kv_dim_ + off;
        for (std::uint32_t x = 0; x < hd; ++x)
          acc_[x] += e * vv[x];
        den += e;
      }
      for (std::uint32_t x = 0; x < hd; ++x)
        o[x] = acc_[x] / den;
    }
  }
}

}  // namespace mini_decoder
