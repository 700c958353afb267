// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A Llama-family model's configuration and weights, loaded from GGUF or llama2.c files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mini_decoder/io/gguf.hpp>
#include <mini_decoder/io/mapped_file.hpp>
#include <mini_decoder/io/weight_format.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder {

struct model_config {
  std::uint32_t dim = 0, hidden_dim = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  std::uint32_t head_dim = 0, vocab_size = 0, context_length = 0;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  std::string architecture;  // "llama2.c" or the GGUF general.name
};

struct layer_weights {
  const float* attn_norm = nullptr;  // [dim]
  const float* ffn_norm = nullptr;   // [dim]
  weight_matrix wq, wk, wv, wo;      // [heads*hd][dim], [kv*hd][dim] x2, [dim][heads*hd]
  weight_matrix gate, up, down;      // [hidden][dim] x2, [dim][hidden]
};

struct model {
  model_config config;
  std::vector<layer_weights> layers;
  weight_matrix embedding;  // [vocab][dim]
  weight_matrix output;     // [vocab][dim] (the embedding itself when tied)
  const float* final_norm = nullptr;
  std::unique_ptr<tokenizer> tok;
  std::string path;
  // Backing storage: the mapped file(s); loaders keep whatever owns the bytes above here.
  std::unique_ptr<gguf_file> gguf;
  mapped_file llama2c;
  page_buffer panels;  // the products' panel copies of the matrices (`pack_weight_panels`)
};

//! Repacks every Q4_1 and Q8_0 matrix the forward pass multiplies (the layers' and the output's;
//! not the embedding, which is read by row) into panels of 16 rows for the AVX-512 VNNI
//! products, in one buffer owned by `m`, and points the matrices at it. Does nothing where the
//! CPU lacks AVX-512 VNNI (the other paths read rows). `load_model` calls it.
void pack_weight_panels(model& m);

//! Loads a GGUF (by magic) or llama2.c checkpoint. For llama2.c the tokenizer is
//! `tokenizer_path`, or tok<vocab>.bin / tokenizer.bin beside the model. Throws `decoder_error`.
std::unique_ptr<model> load_model(const std::string& path, const std::string& tokenizer_path = {});

std::unique_ptr<model> load_gguf_model(const std::string& path);
std::unique_ptr<model> load_llama2c_model(const std::string& path,
                                          const std::string& tokenizer_path);

}  // namespace mini_decoder
