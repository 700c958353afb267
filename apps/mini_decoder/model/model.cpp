// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/model/model.hpp>

#include <fstream>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/int8_matmul.hpp>

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

}  // namespace mini_decoder
