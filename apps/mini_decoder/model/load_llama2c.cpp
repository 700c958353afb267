// SPDX-License-Identifier: Apache-2.0
// A llama2.c checkpoint: a 7-integer header, then every weight in f32, with its tokenizer file
// beside it.
#include <cstring>
#include <filesystem>
#include <string>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/io/mapped_file.hpp>
#include <mini_decoder/model/model.hpp>

namespace mini_decoder {

std::unique_ptr<model> load_llama2c_model(const std::string& path,
                                          const std::string& tokenizer_path) {
  auto m = std::make_unique<model>();
  m->path = path;
  m->llama2c = mapped_file(path);
  const mapped_file& f = m->llama2c;
  if (f.size() < 7 * sizeof(std::int32_t)) {
    fail("'", path, "' is neither a GGUF file nor a llama2.c checkpoint (too short)", fetch_hint);
  }
  std::int32_t h[7];
  std::memcpy(h, f.data(), sizeof(h));
  model_config& c = m->config;
  const bool shared = h[5] > 0;
  for (int i = 0; i < 7; ++i) {
    if ((i == 5 ? (h[i] == 0) : (h[i] <= 0)) || h[i] > (1 << 24) || h[i] < -(1 << 24)) {
      fail("'", path, "' is neither a GGUF file (bad magic) nor a llama2.c checkpoint (header ",
           "field ", i, " = ", h[i], ")", fetch_hint);
    }
  }
  c.architecture = "llama2.c";
  c.dim = static_cast<std::uint32_t>(h[0]);
  c.hidden_dim = static_cast<std::uint32_t>(h[1]);
  c.num_layers = static_cast<std::uint32_t>(h[2]);
  c.num_heads = static_cast<std::uint32_t>(h[3]);
  c.num_kv_heads = static_cast<std::uint32_t>(h[4]);
  c.vocab_size = static_cast<std::uint32_t>(shared ? h[5] : -h[5]);
  c.context_length = static_cast<std::uint32_t>(h[6]);
  if (c.dim % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    fail("llama2.c checkpoint '", path, "' has inconsistent head counts");
  }
  c.head_dim = c.dim / c.num_heads;
  const std::uint64_t d = c.dim, hd = c.hidden_dim, L = c.num_layers, v = c.vocab_size;
  const std::uint64_t kv = std::uint64_t{c.num_kv_heads} * c.head_dim;
  const std::uint64_t floats = v * d + L * d + L * d * d + 2 * L * d * kv + L * d * d + L * d +
                               3 * L * d * hd + d + std::uint64_t{c.context_length} * c.head_dim +
                               (shared ? 0 : v * d);
  const std::uint64_t expected = 28 + floats * 4;
  if (f.size() != expected) {
    fail("llama2.c checkpoint '", path, "' is ", f.size(), " bytes, expected ", expected,
         f.size() < expected ? " (truncated)" : " (corrupt)", fetch_hint);
  }
  const auto* p = reinterpret_cast<const float*>(f.data() + 28);
  auto take = [&](std::uint64_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  auto mat = [](const float* data, std::uint64_t rows, std::uint64_t cols) {
    return weight_matrix{quant_type::f32, reinterpret_cast<const std::byte*>(data),
                         static_cast<std::uint32_t>(rows), static_cast<std::uint32_t>(cols),
                         cols * 4};
  };
  m->layers.resize(c.num_layers);
  m->embedding = mat(take(v * d), v, d);
  for (auto& l : m->layers)
    l.attn_norm = take(d);
  for (auto& l : m->layers)
    l.wq = mat(take(d * d), d, d);
  for (auto& l : m->layers)
    l.wk = mat(take(d * kv), kv, d);
  for (auto& l : m->layers)
    l.wv = mat(take(d * kv), kv, d);
  for (auto& l : m->layers)
    l.wo = mat(take(d * d), d, d);
  for (auto& l : m->layers)
    l.ffn_norm = take(d);
  for (auto& l : m->layers)
    l.gate = mat(take(d * hd), hd, d);
  for (auto& l : m->layers)
    l.down = mat(take(d * hd), d, hd);
  for (auto& l : m->layers)
    l.up = mat(take(d * hd), hd, d);
  m->final_norm = take(d);
  take(std::uint64_t{c.context_length} * c.head_dim);  // freq_cis real + imag: recomputed
  m->output = shared ? m->embedding : mat(take(v * d), v, d);
  std::string tok = tokenizer_path;
  if (tok.empty()) {
    const auto dir = std::filesystem::path(path).parent_path();
    tok = (dir / ("tok" + std::to_string(c.vocab_size) + ".bin")).string();
    if (!std::filesystem::exists(tok)) {
      tok = (dir / "tokenizer.bin").string();
    }
  }
  m->tok = make_llama2c_tokenizer(tok, c.vocab_size);
  return m;
}

}  // namespace mini_decoder
