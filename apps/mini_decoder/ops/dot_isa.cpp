// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/dot_isa.hpp>

#include "oasiskv/cpu/isa.hpp"

namespace mini_decoder {

const char* to_string(dot_isa i) {
  switch (i) {
    case dot_isa::scalar:
      return "scalar";
    case dot_isa::avx2:
      return "avx2";
    case dot_isa::avx512_vnni:
      return "avx512_vnni";
  }
  return "unknown";
}

bool dot_isa_supported(dot_isa i) {
  const oasiskv::cpu_features& f = oasiskv::detected_cpu_features();
  switch (i) {
    case dot_isa::scalar:
      return true;
    case dot_isa::avx2:
      return OASISKV_X86_KERNELS && f.avx2;
    case dot_isa::avx512_vnni:
      return OASISKV_X86_KERNELS && f.avx512_vnni;
  }
  return false;
}

}  // namespace mini_decoder
