// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief KV element types (f32, f16, bf16) and their conversions, usable on host and device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "oasiskv/config.hpp"

namespace oasiskv {

//! @brief The element type of the KV cache. Attention always accumulates in f32.
enum class dtype : std::uint8_t { f32, f16, bf16 };

//! @brief Bytes per element of `t`.
OASISKV_HOST_DEVICE constexpr std::size_t dtype_size(dtype t) noexcept {
  return t == dtype::f32 ? 4 : 2;
}

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
  }
  return "unknown";
}

namespace detail {
template <class To, class From>
OASISKV_HOST_DEVICE constexpr To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  return __builtin_bit_cast(To, from);
}
}  // namespace detail

//! @brief IEEE 754 binary16, stored as its bits. Conversions round to nearest even.
struct f16 {
  std::uint16_t bits;

  //! @brief Rounds `f` to the nearest binary16 (ties to even); overflow gives infinity, NaN
  //! stays NaN.
  OASISKV_HOST_DEVICE static constexpr f16 from_float(float f) noexcept {
    constexpr std::uint32_t f32_infinity = 255u << 23;
    constexpr std::uint32_t f16_overflow = (127u + 16u) << 23;  // 2^16: rounds past 65504
    constexpr std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    std::uint32_t u = detail::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = u & 0x80000000u;
    u ^= sign;
    std::uint16_t out;
    if (u >= f16_overflow) {
      out = u > f32_infinity ? 0x7e00 : 0x7c00;
    } else if (u < (113u << 23)) {
      // Below the smallest normal half: adding 0.5 aligns the mantissa so that the FPU's own
      // round-to-nearest-even produces the subnormal bits.
      const float sum = detail::bit_cast<float>(u) + detail::bit_cast<float>(denorm_magic);
      out = static_cast<std::uint16_t>(detail::bit_cast<std::uint32_t>(sum) - denorm_magic);
    } else {
      const std::uint32_t mantissa_odd = (u >> 13) & 1u;
      u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu;
      u += mantissa_odd;
      out = static_cast<std::uint16_t>(u >> 13);
    }
    return f16{static_cast<std::uint16_t>(out | (sign >> 16))};
  }

  //! @brief Exact widening to binary32.
  OASISKV_HOST_DEVICE constexpr float to_float() const noexcept {
    constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
    std::uint32_t u = (static_cast<std::uint32_t>(bits) & 0x7fffu) << 13;
    const std::uint32_t exp = shifted_exp & u;
    u += static_cast<std::uint32_t>(127 - 15) << 23;
    if (exp == shifted_exp) {
      u += static_cast<std::uint32_t>(128 - 16) << 23;  // infinity or NaN
    } else if (exp == 0) {
      u += 1u << 23;  // zero or subnormal: renormalise through a float subtraction
      u = detail::bit_cast<std::uint32_t>(detail::bit_cast<float>(u) -
                                          detail::bit_cast<float>(113u << 23));
    }
    u |= (static_cast<std::uint32_t>(bits) & 0x8000u) << 16;
    return detail::bit_cast<float>(u);
  }

  friend constexpr bool operator==(f16, f16) = default;
};

//! @brief bfloat16 (the upper half of binary32), stored as its bits. Rounds to nearest even.
struct bf16 {
  std::uint16_t bits;

  OASISKV_HOST_DEVICE static constexpr bf16 from_float(float f) noexcept {
    const std::uint32_t u = detail::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return bf16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};  // keep NaN a (quiet) NaN
    }
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return bf16{static_cast<std::uint16_t>((u + rounding) >> 16)};
  }

  OASISKV_HOST_DEVICE constexpr float to_float() const noexcept {
    return detail::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }

  friend constexpr bool operator==(bf16, bf16) = default;
};

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

//! @brief The `dtype` of an element type: `dtype_of<f16>` is `dtype::f16`.
template <class T>
inline constexpr dtype dtype_of = [] {
  static_assert(sizeof(T) == 0, "oasiskv: dtype_of<T> needs T in {float, f16, bf16}");
  return dtype::f32;
}();
template <>
inline constexpr dtype dtype_of<float> = dtype::f32;
template <>
inline constexpr dtype dtype_of<f16> = dtype::f16;
template <>
inline constexpr dtype dtype_of<bf16> = dtype::bf16;

//! @brief Widens one stored element to f32.
OASISKV_HOST_DEVICE constexpr float to_float(float v) noexcept {
  return v;
}
OASISKV_HOST_DEVICE constexpr float to_float(f16 v) noexcept {
  return v.to_float();
}
OASISKV_HOST_DEVICE constexpr float to_float(bf16 v) noexcept {
  return v.to_float();
}

//! @brief Narrows an f32 to the element type `T` (round to nearest even).
template <class T>
OASISKV_HOST_DEVICE constexpr T from_float(float v) noexcept {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    return T::from_float(v);
  }
}

//! @brief Calls `f(T{})` with `T` the element type of `t`: the one switch from a run-time dtype
//! to compile-time code.
template <class F>
decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f16:
      return f(f16{});
    case dtype::bf16:
      return f(bf16{});
    case dtype::f32:
      break;
  }
  return f(float{});
}

}  // namespace oasiskv
