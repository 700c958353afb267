// SPDX-License-Identifier: Apache-2.0
// A Llama-family model from GGUF: the architecture's hyperparameters (`llama.*` metadata), its
// tensors by name, and the BPE tokenizer the file carries.
#include <string>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/io/gguf.hpp>
#include <mini_decoder/model/model.hpp>

namespace mini_decoder {

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

}  // namespace mini_decoder
