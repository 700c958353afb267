// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A GGUF (v2/v3) reader: metadata and tensor directory over a memory-mapped file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <mini_decoder/io/mapped_file.hpp>
#include <mini_decoder/io/weight_format.hpp>

namespace mini_decoder {

//! One metadata value. Arrays keep strings and numbers apart; numbers of every width become
//! int64 or double, which is all a loader needs.
struct gguf_value {
  enum class kind : std::uint8_t { integer, real, boolean, string, array } what = kind::integer;
  std::int64_t i = 0;
  double f = 0.0;
  std::string s;
  std::vector<std::string> strings;  // array of strings
  std::vector<std::int64_t> ints;    // array of integers
  std::vector<double> reals;         // array of floats
};

struct gguf_tensor {
  std::string name;
  std::vector<std::uint64_t> dims;  // dims[0] is the fastest-varying (columns)
  quant_type type = quant_type::f32;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
};

class gguf_file {
 public:
  //! Maps and parses `path`; throws `decoder_error` on any inconsistency (bad magic, version,
  //! unknown quant type, data past the end of the file).
  explicit gguf_file(const std::string& path);

  bool has(const std::string& key) const { return meta_.count(key) != 0; }
  const gguf_value& get(const std::string& key) const;
  std::int64_t get_int(const std::string& key) const;
  std::int64_t get_int(const std::string& key, std::int64_t fallback) const;
  double get_real(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback = {}) const;

  const gguf_tensor* find_tensor(const std::string& name) const;
  const gguf_tensor& tensor(const std::string& name) const;
  //! A 2-D tensor as a weight matrix of `rows` x `cols` (checked).
  weight_matrix matrix(const std::string& name, std::uint32_t rows, std::uint32_t cols) const;
  //! A 1-D F32 tensor of `n` elements (norm weights).
  const float* vector_f32(const std::string& name, std::uint32_t n) const;

  const std::string& path() const { return file_.path(); }
  std::uint32_t version() const { return version_; }
  const std::vector<gguf_tensor>& tensors() const { return tensors_; }

 private:
  mapped_file file_;
  std::uint32_t version_ = 0;
  std::map<std::string, gguf_value> meta_;
  std::vector<gguf_tensor> tensors_;
  std::map<std::string, std::size_t> by_name_;
};

}  // namespace mini_decoder
