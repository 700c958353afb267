// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What FlashInfer 0.7.4's headers need from CCCL that CCCL 3.0 (CUDA 13.0) lacks:
//! `cuda::fast_mod_div<std::uint32_t>` (`<cuda/cmath>`, CCCL 3.1), the divisor wrapper of
//! `flashinfer/fastdiv.cuh`. Must be included before any FlashInfer header;
//! `oasiskv/attention/cuda/flashinfer_decode.cuh` does so. With CCCL 3.1 or newer it adds nothing.
#pragma once

#include <cuda/cmath>
#include <cuda/version>

#include <cstdint>

#if CCCL_MAJOR_VERSION < 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION < 1)
//! @cond
namespace cuda {

// Division of 32-bit unsigned values by a fixed divisor, exact for every dividend: the quotient
// is the high 64 bits of m * n with m = floor((2^64 - 1) / d) + 1 (Lemire, Kaser and Kurz,
// "Faster remainder by direct computation", 2019); d = 1 is passed through.
template <class T>
class fast_mod_div {
  static_assert(sizeof(T) == 4 && static_cast<T>(-1) > T{0},
                "this stand-in covers the 32-bit unsigned divisors FlashInfer uses");

 public:
  __host__ __device__ explicit fast_mod_div(T d) noexcept
      : d_(d), m_(d > 1 ? ~std::uint64_t{0} / d + 1 : 0) {}

  __host__ __device__ friend T operator/(T n, const fast_mod_div& f) noexcept {
    if (f.d_ <= 1) {
      return n;
    }
#if defined(__CUDA_ARCH__)
    return static_cast<T>(__umul64hi(f.m_, n));
#else
    return static_cast<T>((static_cast<unsigned __int128>(f.m_) * n) >> 64);
#endif
  }
  __host__ __device__ friend T operator%(T n, const fast_mod_div& f) noexcept {
    return n - (n / f) * f.d_;
  }

 private:
  T d_;
  std::uint64_t m_;
};

}  // namespace cuda
//! @endcond
#endif
