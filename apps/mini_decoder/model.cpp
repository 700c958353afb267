// SPDX-License-Identifier: Apache-2.0
#include "model.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "quant_int8.hpp"

namespace mini_decoder {

std::unique_ptr<model> load_model(const std::string& path, const std::string& tokenizer_path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    fail("cannot open model file '", path, "'", fetch_hint);
  }
  char magic[4] = {};
  in.read(magic, 4);
  if (in.gcount() == 4 && std::string(magic, 4) == "GGUF") {
    return load_gguf_model(path);
  }
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".gguf") {
    fail("'", path, "' is not a GGUF file (bad magic)", fetch_hint);
  }
  return load_llama2c_model(path, tokenizer_path);
}

std::unique_ptr<model> load_gguf_model(const std::string& path) {
  auto m = std::make_unique<model>();
  m->path = path;
  m->gguf = std::make_unique<gguf_file>(path);
  const gguf_file& g = *m->gguf;
  const std::string arch = g.get_string("general.architecture");
  if (arch != "llama") {
    fail("GGUF file '", path, "' has architecture '", arch, "'; only 'llama' is supported");
  }
  model_config& c = m->config;
  c.architecture = g.get_string("general.name", arch);
  c.dim = static_cast<std::uint32_t>(g.get_int("llama.embedding_length"));
  c.hidden_dim = static_cast<std::uint32_t>(g.get_int("llama.feed_forward_length"));
  c.num_layers = static_cast<std::uint32_t>(g.get_int("llama.block_count"));
  c.num_heads = static_cast<std::uint32_t>(g.get_int("llama.attention.head_count"));
  c.num_kv_heads =
      static_cast<std::uint32_t>(g.get_int("llama.attention.head_count_kv", c.num_heads));
  c.context_length = static_cast<std::uint32_t>(g.get_int("llama.context_length", 2048));
  c.rope_theta = static_cast<float>(g.get_real("llama.rope.freq_base", 10000.0));
  c.norm_eps = static_cast<float>(g.get_real("llama.attention.layer_norm_rms_epsilon", 1e-5));
  if (c.num_heads == 0 || c.num_kv_heads == 0 || c.dim % c.num_heads != 0 ||
      c.num_heads % c.num_kv_heads != 0 || c.num_layers == 0 || c.num_layers > 1024) {
    fail("GGUF file '", path, "' has inconsistent head counts or dimensions");
  }
  c.head_dim = c.dim / c.num_heads;
  const gguf_tensor& embd = g.tensor("token_embd.weight");
  c.vocab_size = static_cast<std::uint32_t>(embd.dims.size() > 1 ? embd.dims[1] : 0);
  m->embedding = g.matrix("token_embd.weight", c.vocab_size, c.dim);
  m->output = g.find_tensor("output.weight") != nullptr
                  ? g.matrix("output.weight", c.vocab_size, c.dim)
                  : m->embedding;  // tied embeddings
  m->final_norm = g.vector_f32("output_norm.weight", c.dim);
  const std::uint32_t q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    layer_weights w;
    w.attn_norm = g.vector_f32(p + "attn_norm.weight", c.dim);
    w.ffn_norm = g.vector_f32(p + "ffn_norm.weight", c.dim);
    w.wq = g.matrix(p + "attn_q.weight", q_dim, c.dim);
    w.wk = g.matrix(p + "attn_k.weight", kv_dim, c.dim);
    w.wv = g.matrix(p + "attn_v.weight", kv_dim, c.dim);
    w.wo = g.matrix(p + "attn_output.weight", c.dim, q_dim);
    w.gate = g.matrix(p + "ffn_gate.weight", c.hidden_dim, c.dim);
    w.up = g.matrix(p + "ffn_up.weight", c.hidden_dim, c.dim);
    w.down = g.matrix(p + "ffn_down.weight", c.dim, c.hidden_dim);
    m->layers.push_back(w);
  }
  m->tok = make_bpe_tokenizer(g);
  pack_weight_panels(*m);
  return m;
}

void pack_weight_panels(model& m) {
  if (panel_matmul_kernel(quant_type::q4_1) == nullptr) {
    return;  // no AVX-512 VNNI: the row kernels read the stored rows
  }
  std::vector<weight_matrix*> mats{&m.output};
  for (layer_weights& l : m.layers) {
    for (weight_matrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down}) {
      mats.push_back(w);
    }
  }
  std::size_t total = 0;
  for (const weight_matrix* w : mats) {
    total += panel_bytes(*w);
  }
  m.panels = page_buffer(total);
  std::size_t at = 0;
  for (weight_matrix* w : mats) {
    const std::size_t bytes = panel_bytes(*w);
    if (bytes != 0) {
      pack_panels(*w, m.panels.data() + at);
      w->panels = m.panels.data() + at;
      at += bytes;
    }
  }
}

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
