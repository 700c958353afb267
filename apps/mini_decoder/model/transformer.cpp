// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/model/transformer.hpp>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/ops/threads.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/math.hpp"
#include "oasiskv/cpu/thread_pool.hpp"

namespace mini_decoder {

void round_to_f16(float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = oasiskv::f16::from_float(x[i]).to_float();
  }
}

void to_f16_bits(const float* k, const float* v, std::size_t n, std::vector<std::uint16_t>& k16,
                 std::vector<std::uint16_t>& v16) {
  k16.resize(n);
  v16.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    k16[i] = oasiskv::f16::from_float(k[i]).bits;
    v16[i] = oasiskv::f16::from_float(v[i]).bits;
  }
}

transformer::transformer(const model& m, float rope_scale) : m_(m) {
  const model_config& c = m.config;
  if (!(rope_scale > 0.0f)) {
    fail("--rope-scale = ", rope_scale, " must be positive");
  }
  const float theta = c.rope_theta * rope_scale;
  for (std::uint32_t i = 0; i < c.head_dim; i += 2) {
    // llama2.c's exact float formula, so stories260K matches its reference bit for bit.
    inv_freq_.push_back(1.0f / powf(theta, static_cast<float>(i) / static_cast<float>(c.head_dim)));
  }
  reserve_tokens(max_step_tokens);
}

void transformer::reserve_tokens(std::uint32_t n) {
  if (n <= scratch_tokens_) {
    return;
  }
  const model_config& c = m_.config;
  const std::size_t t = n;
  x_.resize(t * c.dim);
  xb_.resize(t * std::max(c.dim, c.num_heads * c.head_dim));
  q_.resize(t * c.num_heads * c.head_dim);
  k_.resize(t * c.num_kv_heads * c.head_dim);
  v_.resize(k_.size());
  att_.resize(q_.size());
  hb_.resize(t * c.hidden_dim);
  hb2_.resize(hb_.size());
  scratch_tokens_ = n;
}

void transformer::rmsnorm(float* out, const float* x, const float* w, std::uint32_t n) const {
  const std::uint32_t d = m_.config.dim;
  for (std::uint32_t t = 0; t < n; ++t) {
    const float* xt = x + std::size_t{t} * d;
    float ss = 0.0f;
    for (std::uint32_t i = 0; i < d; ++i) {
      ss += xt[i] * xt[i];
    }
    ss /= static_cast<float>(d);
    ss += m_.config.norm_eps;
    ss = 1.0f / std::sqrt(ss);
    for (std::uint32_t i = 0; i < d; ++i) {
      out[std::size_t{t} * d + i] = w[i] * (ss * xt[i]);
    }
  }
}

void transformer::rope(float* x, std::uint32_t heads, std::uint32_t n, std::uint32_t pos0) const {
  std::vector<std::uint32_t> positions(n);
  for (std::uint32_t t = 0; t < n; ++t) {
    positions[t] = pos0 + t;
  }
  rope_at(x, heads, n, positions.data());
}

// Each token rotated by its own position: a token gets the same floats whether it came in a
// consecutive run (prefill, step) or in a batch of sequences (step_batch).
void transformer::rope_at(float* x, std::uint32_t heads, std::uint32_t n,
                          const std::uint32_t* positions) const {
  const std::uint32_t hd = m_.config.head_dim;
  for (std::uint32_t t = 0; t < n; ++t) {
    const auto pos = static_cast<float>(positions[t]);
    for (std::uint32_t i = 0; i < hd; i += 2) {
      const float val = pos * inv_freq_[i / 2];
      const float fcr = cosf(val), fci = sinf(val);
      for (std::uint32_t h = 0; h < heads; ++h) {
        float* v = x + (std::size_t{t} * heads + h) * hd + i;
        const float v0 = v[0], v1 = v[1];
        v[0] = v0 * fcr - v1 * fci;
        v[1] = v0 * fci + v1 * fcr;
      }
    }
  }
}

void transformer::embed(const int* tokens, std::uint32_t n, float* x) const {
  for (std::uint32_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || static_cast<std::uint32_t>(tokens[t]) >= m_.config.vocab_size) {
      fail("token id ", tokens[t], " is outside the vocabulary of ", m_.config.vocab_size);
    }
    dequantize_row(m_.embedding, static_cast<std::uint32_t>(tokens[t]),
                   x + std::size_t{t} * m_.config.dim);
  }
}

namespace {
void swiglu(float* gate, const float* up, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float v = gate[i];
    v *= 1.0f / (1.0f + expf(-v));
    gate[i] = v * up[i];
  }
}
}  // namespace

void transformer::step(const int* tokens, std::uint32_t n, std::uint32_t pos0, std::uint32_t layers,
                       const attention_fn& attend, float* logits) {
  if (n == 0 || n > max_step_tokens || layers > m_.config.num_layers) {
    fail("transformer::step: ", n, " tokens (1-16) through ", layers, " layers");
  }
  positions_.resize(n);
  for (std::uint32_t t = 0; t < n; ++t) {
    positions_[t] = pos0 + t;
  }
  forward(tokens, positions_.data(), n, layers, attend, logits);
}

void transformer::step_batch(const int* tokens, const std::uint32_t* positions, std::uint32_t n,
                             const batch_attention_fn& attend, float* logits,
                             std::uint32_t layers) {
  if (n == 0 || tokens == nullptr || positions == nullptr || layers > m_.config.num_layers) {
    fail("transformer::step_batch: ", n, " tokens (at least 1, with their positions) through ",
         layers, " layers");
  }
  reserve_tokens(n);
  forward(tokens, positions, n, layers == 0 ? m_.config.num_layers : layers, attend, logits);
}

void transformer::forward(const int* tokens, const std::uint32_t* positions, std::uint32_t n,
                          std::uint32_t layers, const attention_fn& attend, float* logits) {
  const model_config& c = m_.config;
  const std::uint32_t d = c.dim, kvd = c.num_kv_heads * c.head_dim;
  embed(tokens, n, x_.data());
  for (std::uint32_t l = 0; l < layers; ++l) {
    const layer_weights& w = m_.layers[l];
    rmsnorm(xb_.data(), x_.data(), w.attn_norm, n);
    matmul_quantized(w.wq, xb_.data(), n, q_.data());
    matmul_quantized(w.wk, xb_.data(), n, k_.data());
    matmul_quantized(w.wv, xb_.data(), n, v_.data());
    rope_at(q_.data(), c.num_heads, n, positions);
    rope_at(k_.data(), c.num_kv_heads, n, positions);
    round_to_f16(k_.data(), std::size_t{n} * kvd);
    round_to_f16(v_.data(), std::size_t{n} * kvd);
    attend(l, n, q_.data(), k_.data(), v_.data(), att_.data());
    matmul_quantized(w.wo, att_.data(), n, xb_.data());
    for (std::size_t i = 0; i < std::size_t{n} * d; ++i) {
      x_[i] += xb_[i];
    }
    rmsnorm(xb_.data(), x_.data(), w.ffn_norm, n);
    matmul_quantized(w.gate, xb_.data(), n, hb_.data());
    matmul_quantized(w.up, xb_.data(), n, hb2_.data());
    swiglu(hb_.data(), hb2_.data(), std::size_t{n} * c.hidden_dim);
    matmul_quantized(w.down, hb_.data(), n, xb_.data());
    for (std::size_t i = 0; i < std::size_t{n} * d; ++i) {
      x_[i] += xb_[i];
    }
  }
  rmsnorm(xb_.data(), x_.data(), m_.final_norm, n);
  matmul_quantized(m_.output, xb_.data(), n, logits);
}

void transformer::attention_prefill(const float* q, const float* k, const float* v, std::uint32_t n,
                                    std::uint32_t pos0, float* out) {
  const model_config& c = m_.config;
  const std::uint32_t hd = c.head_dim, qd = c.num_heads * hd, kvd = c.num_kv_heads * hd;
  const std::uint32_t group = c.num_heads / c.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const std::uint32_t end = pos0 + n;
  scores_.resize(std::size_t{prefill_rows} * end);  // one block of query rows: bounded scratch
  // Blocks of query rows at absolute multiples of prefill_rows, each against the keys up to its
  // last row: the same products whether the prompt comes whole or in aligned chunks.
  for (std::uint32_t a = pos0; a < end;) {
    const std::uint32_t keys = std::min(end, (a / prefill_rows + 1) * prefill_rows);
    const std::uint32_t rows = keys - a, r0 = a - pos0;
    for (std::uint32_t h = 0; h < c.num_heads; ++h) {
      const std::uint32_t g = h / group;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(keys), static_cast<int>(hd), scale,
                  q + std::size_t{r0} * qd + std::size_t{h} * hd, static_cast<int>(qd),
                  k + std::size_t{g} * hd, static_cast<int>(kvd), 0.0f, scores_.data(),
                  static_cast<int>(keys));
      engine_pool().parallel_for(rows, [&](std::size_t i) {
        float* s = scores_.data() + i * keys;
        const std::uint32_t last = a + static_cast<std::uint32_t>(i);
        // The library's vectorised softmax pieces: a scalar expf per score made the softmax,
        // not the two products, the larger part of a long prompt's prefill.
        const float mx = oasiskv::cpu::detail::clamp_finite_max(s, last + 1, s);
        const float sum = oasiskv::cpu::detail::exp_sum(s, mx, last + 1, 1.0f, s);
        const float inv = 1.0f / sum;
        for (std::uint32_t j = 0; j <= last; ++j)
          s[j] *= inv;
        for (std::uint32_t j = last + 1; j < keys; ++j)
          s[j] = 0.0f;
      });
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                  static_cast<int>(hd), static_cast<int>(keys), 1.0f, scores_.data(),
                  static_cast<int>(keys), v + std::size_t{g} * hd, static_cast<int>(kvd), 0.0f,
                  out + std::size_t{r0} * qd + std::size_t{h} * hd, static_cast<int>(qd));
    }
    a = keys;
  }
}

void transformer::prefill(const int* tokens, std::uint32_t n, const kv_sink_fn& sink,
                          float* logits) {
  prefill(tokens, n, 0, {}, sink, logits);
}

void transformer::prefill(const int* tokens, std::uint32_t n, std::uint32_t pos0,
                          const kv_source_fn& past, const kv_sink_fn& sink, float* logits) {
  const model_config& c = m_.config;
  if (n == 0) {
    fail("prefill: empty prompt");
  }
  if (pos0 > 0 && !past) {
    fail("prefill: a chunk at position ", pos0, " without the earlier chunks' keys and values");
  }
  const std::size_t d = c.dim, qd = std::size_t{c.num_heads} * c.head_dim,
                    kvd = std::size_t{c.num_kv_heads} * c.head_dim, hid = c.hidden_dim;
  const std::size_t all = std::size_t{pos0} + n;  // keys: the earlier chunks' and this one's
  px_.resize(n * d);
  pxb_.resize(n * std::max(d, qd));
  pq_.resize(n * qd);
  pk_.resize(all * kvd);
  pv_.resize(all * kvd);
  patt_.resize(n * qd);
  phb_.resize(n * hid);
  phb2_.resize(n * hid);
  float* const k = pk_.data() + std::size_t{pos0} * kvd;  // this chunk's rows
  float* const v = pv_.data() + std::size_t{pos0} * kvd;
  // A short later chunk takes the decode rows' products: expanding every weight matrix to f32
  // for a few rows would cost more than the rows themselves.
  const bool as_rows = pos0 > 0 && n < prefill_rows;
  const auto product = [&](const weight_matrix& w, const float* x, float* y) {
    if (as_rows) {
      matmul_quantized(w, x, n, y);
    } else {
      matmul_prefill(w, x, n, y, wscratch_);
    }
  };
  embed(tokens, n, px_.data());
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    const layer_weights& w = m_.layers[l];
    rmsnorm(pxb_.data(), px_.data(), w.attn_norm, n);
    product(w.wq, pxb_.data(), pq_.data());
    product(w.wk, pxb_.data(), k);
    product(w.wv, pxb_.data(), v);
    rope(pq_.data(), c.num_heads, n, pos0);
    rope(k, c.num_kv_heads, n, pos0);
    round_to_f16(k, n * kvd);
    round_to_f16(v, n * kvd);
    sink(l, k, v, n);
    if (pos0 > 0) {
      past(l, pos0, pk_.data(), pv_.data());
    }
    attention_prefill(pq_.data(), pk_.data(), pv_.data(), n, pos0, patt_.data());
    product(w.wo, patt_.data(), pxb_.data());
    for (std::size_t i = 0; i < n * d; ++i)
      px_[i] += pxb_[i];
    rmsnorm(pxb_.data(), px_.data(), w.ffn_norm, n);
    product(w.gate, pxb_.data(), phb_.data());
    product(w.up, pxb_.data(), phb2_.data());
    swiglu(phb_.data(), phb2_.data(), n * hid);
    product(w.down, phb_.data(), pxb_.data());
    for (std::size_t i = 0; i < n * d; ++i)
      px_[i] += pxb_[i];
  }
  rmsnorm(pxb_.data(), px_.data() + (n - 1) * d, m_.final_norm, 1);
  matmul_quantized(m_.output, pxb_.data(), 1, logits);
}

}  // namespace mini_decoder
