// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/io/gguf.hpp>

#include <cstring>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {
namespace {

// Bounds-checked little-endian cursor: a truncated file becomes an error, never a wild read.
class cursor {
 public:
  cursor(const std::byte* p, std::size_t n, const std::string& path) : p_(p), n_(n), path_(path) {}
  template <class T>
  T read() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string read_string() {
    const auto len = read<std::uint64_t>();
    need(len);
    std::string s(reinterpret_cast<const char*>(p_ + at_), static_cast<std::size_t>(len));
    at_ += static_cast<std::size_t>(len);
    return s;
  }
  std::size_t offset() const { return at_; }

 private:
  void need(std::uint64_t k) const {
    if (k > n_ - at_) {
      fail("GGUF file '", path_, "' is truncated (header needs ", k, " bytes at offset ", at_,
           " of ", n_, ")", fetch_hint);
    }
  }
  const std::byte* p_;
  std::size_t n_;
  std::size_t at_ = 0;
  const std::string& path_;
};

enum gguf_type : std::uint32_t {
  t_u8 = 0,
  t_i8,
  t_u16,
  t_i16,
  t_u32,
  t_i32,
  t_f32,
  t_bool,
  t_string,
  t_array,
  t_u64,
  t_i64,
  t_f64
};

// Reads one scalar of `type` into `v` (integer, real or boolean).
void read_scalar(cursor& c, std::uint32_t type, gguf_value& v, const std::string& path) {
  v.what = gguf_value::kind::integer;
  switch (type) {
    case t_u8:
      v.i = c.read<std::uint8_t>();
      break;
    case t_i8:
      v.i = c.read<std::int8_t>();
      break;
    case t_u16:
      v.i = c.read<std::uint16_t>();
      break;
    case t_i16:
      v.i = c.read<std::int16_t>();
      break;
    case t_u32:
      v.i = c.read<std::uint32_t>();
      break;
    case t_i32:
      v.i = c.read<std::int32_t>();
      break;
    case t_u64:
      v.i = static_cast<std::int64_t>(c.read<std::uint64_t>());
      break;
    case t_i64:
      v.i = c.read<std::int64_t>();
      break;
    case t_f32:
      v.what = gguf_value::kind::real;
      v.f = c.read<float>();
      break;
    case t_f64:
      v.what = gguf_value::kind::real;
      v.f = c.read<double>();
      break;
    case t_bool:
      v.what = gguf_value::kind::boolean;
      v.i = c.read<std::uint8_t>() != 0;
      break;
    default:
      fail("GGUF file '", path, "' has a metadata value of unknown type ", type);
  }
}

}  // namespace

gguf_file::gguf_file(const std::string& path) : file_(path) {
  cursor c(file_.data(), file_.size(), path);
  const auto magic = c.read<std::uint32_t>();
  if (magic != 0x46554747u) {  // "GGUF"
    fail("'", path, "' is not a GGUF file (bad magic)", fetch_hint);
  }
  version_ = c.read<std::uint32_t>();
  if (version_ < 2 || version_ > 3) {
    fail("GGUF file '", path, "' has version ", version_, "; only versions 2 and 3 are supported");
  }
  const auto n_tensors = c.read<std::uint64_t>();
  const auto n_kv = c.read<std::uint64_t>();
  if (n_tensors > 1'000'000 || n_kv > 1'000'000) {
    fail("GGUF file '", path, "' claims ", n_tensors, " tensors and ", n_kv, " keys: corrupt");
  }
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string();
    const auto type = c.read<std::uint32_t>();
    gguf_value v;
    if (type == t_string) {
      v.what = gguf_value::kind::string;
      v.s = c.read_string();
    } else if (type == t_array) {
      v.what = gguf_value::kind::array;
      const auto elem = c.read<std::uint32_t>();
      const auto n = c.read<std::uint64_t>();
      if (n > file_.size()) {
        fail("GGUF file '", path, "' key ", key, " has an array of ", n, " elements: corrupt");
      }
      for (std::uint64_t j = 0; j < n; ++j) {
        if (elem == t_string) {
          v.strings.push_back(c.read_string());
        } else {
          gguf_value e;
          read_scalar(c, elem, e, path);
          if (e.what == gguf_value::kind::real) {
            v.reals.push_back(e.f);
          } else {
            v.ints.push_back(e.i);
          }
        }
      }
    } else {
      read_scalar(c, type, v, path);
    }
    meta_[std::move(key)] = std::move(v);
  }
  struct raw_info {
    std::uint64_t offset;
  };
  std::vector<raw_info> offsets;
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    gguf_tensor t;
    t.name = c.read_string();
    const auto nd = c.read<std::uint32_t>();
    if (nd == 0 || nd > 4) {
      fail("GGUF file '", path, "' tensor ", t.name, " has ", nd, " dimensions: corrupt");
    }
    std::uint64_t elems = 1;
    for (std::uint32_t d = 0; d < nd; ++d) {
      t.dims.push_back(c.read<std::uint64_t>());
      elems *= t.dims.back();
    }
    const auto type = c.read<std::uint32_t>();
    t.type = quant_type_from_gguf(type, t.name, path);
    offsets.push_back({c.read<std::uint64_t>()});
    if (t.dims[0] % block_elements(t.type) != 0) {
      fail("GGUF tensor ", t.name, " has ", t.dims[0], " columns, not a multiple of its ",
           block_elements(t.type), "-element quant blocks");
    }
    t.bytes = static_cast<std::size_t>(elems / block_elements(t.type) * block_bytes(t.type));
    tensors_.push_back(std::move(t));
  }
  const auto alignment = static_cast<std::size_t>(get_int("general.alignment", 32));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    fail("GGUF file '", path, "' has general.alignment = ", alignment, ": not a power of two");
  }
  const std::size_t data_start = (c.offset() + alignment - 1) / alignment * alignment;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    gguf_tensor& t = tensors_[i];
    const std::uint64_t begin = data_start + offsets[i].offset;
    if (begin > file_.size() || t.bytes > file_.size() - begin) {
      fail("GGUF file '", path, "' is truncated: tensor ", t.name, " ends past the file's ",
           file_.size(), " bytes", fetch_hint);
    }
    t.data = file_.data() + begin;
    by_name_[t.name] = i;
  }
}

const gguf_value& gguf_file::get(const std::string& key) const {
  const auto it = meta_.find(key);
  if (it == meta_.end()) {
    fail("GGUF file '", path(), "' lacks metadata key ", key);
  }
  return it->second;
}

std::int64_t gguf_file::get_int(const std::string& key) const {
  const gguf_value& v = get(key);
  if (v.what == gguf_value::kind::real) {
    return static_cast<std::int64_t>(v.f);
  }
  if (v.what != gguf_value::kind::integer && v.what != gguf_value::kind::boolean) {
    fail("GGUF metadata key ", key, " is not a number");
  }
  return v.i;
}

std::int64_t gguf_file::get_int(const std::string& key, std::int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double gguf_file::get_real(const std::string& key, double fallback) const {
  if (!has(key)) {
    return fallback;
  }
  const gguf_value& v = get(key);
  return v.what == gguf_value::kind::real ? v.f : static_cast<double>(v.i);
}

std::string gguf_file::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get(key).s : fallback;
}

const gguf_tensor* gguf_file::find_tensor(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const gguf_tensor& gguf_file::tensor(const std::string& name) const {
  const gguf_tensor* t = find_tensor(name);
  if (t == nullptr) {
    fail("GGUF file '", path(), "' lacks tensor ", name);
  }
  return *t;
}

weight_matrix gguf_file::matrix(const std::string& name, std::uint32_t rows,
                                std::uint32_t cols) const {
  const gguf_tensor& t = tensor(name);
  const std::uint64_t r = t.dims.size() > 1 ? t.dims[1] : 1;
  if (t.dims[0] != cols || r != rows || (t.dims.size() > 2 && t.dims[2] != 1)) {
    fail("GGUF tensor ", name, " has shape ", t.dims[0], " x ", r, ", expected ", cols, " x ",
         rows);
  }
  return weight_matrix{t.type, t.data, rows, cols, row_bytes(t.type, cols)};
}

const float* gguf_file::vector_f32(const std::string& name, std::uint32_t n) const {
  const gguf_tensor& t = tensor(name);
  if (t.type != quant_type::f32 || t.dims[0] != n) {
    fail("GGUF tensor ", name, " must be F32 of ", n, " elements (got ", to_string(t.type), " of ",
         t.dims[0], ")");
  }
  if (reinterpret_cast<std::uintptr_t>(t.data) % alignof(float) != 0) {
    fail("GGUF tensor ", name, " is misaligned");
  }
  return reinterpret_cast<const float*>(t.data);
}

}  // namespace mini_decoder
