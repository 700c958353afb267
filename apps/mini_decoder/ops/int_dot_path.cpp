// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/int_dot_path.hpp>

namespace mini_decoder {

oasiskv::cpu_isa int_dot_path(oasiskv::cpu_isa isa) {
  using oasiskv::cpu_isa;
  if (isa == cpu_isa::best) {
    isa = oasiskv::resolve_isa(cpu_isa::best, cpu_isa::avx512_vnni);
  }
  if (!oasiskv::isa_supported(isa) || isa == cpu_isa::best) {
    fail("integer dot path ", oasiskv::to_string(isa), " is not supported by this build or CPU");
  }
  switch (isa) {
    case cpu_isa::avx512_vnni:
      return cpu_isa::avx512_vnni;
    case cpu_isa::avx512:  // without VNNI's int8 dot products: the AVX2 kernels
      return oasiskv::isa_supported(cpu_isa::avx512_vnni) ? cpu_isa::avx512_vnni : cpu_isa::avx2;
    case cpu_isa::avx2:
      return cpu_isa::avx2;
    default:
      return cpu_isa::scalar;
  }
}

}  // namespace mini_decoder
