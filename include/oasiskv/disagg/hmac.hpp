// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), for the control channel's
//! challenge-response: a decode node and an exporter each prove they hold the shared token
//! without sending it. Not a general-purpose crypto library: no key derivation, no encryption.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>

#include <sys/random.h>

#include <cerrno>

#include "oasiskv/core/error.hpp"

namespace oasiskv::disagg::detail {

//! @brief Fills `out` from the kernel's CSPRNG (getrandom); throws `errc::io_error` if it fails.
inline void random_bytes(std::span<std::byte> out) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      oasiskv::detail::raise(errc::io_error, "getrandom failed: ", std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

using digest = std::array<std::byte, 32>;

//! @brief Incremental SHA-256.
class sha256 {
 public:
  sha256() noexcept { reset(); }

  void reset() noexcept {
    state_ = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
              0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    used_ = 0;
    bytes_ = 0;
  }

  sha256& update(std::span<const std::byte> data) noexcept {
    bytes_ += data.size();
    for (const std::byte b : data) {
      block_[used_++] = static_cast<std::uint8_t>(b);
      if (used_ == 64) {
        compress();
        used_ = 0;
      }
    }
    return *this;
  }

  digest finish() noexcept {
    const std::uint64_t bits = bytes_ * 8;
    block_[used_++] = 0x80;
    if (used_ > 56) {
      std::memset(block_.data() + used_, 0, 64 - used_);
      compress();
      used_ = 0;
    }
    std::memset(block_.data() + used_, 0, 56 - used_);
    for (int i = 0; i < 8; ++i) {
      block_[56 + i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
    }
    compress();
    digest out;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) {
        out[4 * i + j] = static_cast<std::byte>(state_[i] >> (24 - 8 * j));
      }
    }
    reset();
    return out;
  }

 private:
  static constexpr std::uint32_t rotr(std::uint32_t x, int n) noexcept {
    return (x >> n) | (x << (32 - n));
  }

  void compress() noexcept {
    static constexpr std::array<std::uint32_t, 64> k = {
        0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
        0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
        0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
        0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
        0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
        0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
        0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
        0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
        0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
        0xc67178f2u};
    std::array<std::uint32_t, 64> w;
    for (int i = 0; i < 16; ++i) {
      w[i] = std::uint32_t{block_[4 * i]} << 24 | std::uint32_t{block_[4 * i + 1]} << 16 |
             std::uint32_t{block_[4 * i + 2]} << 8 | std::uint32_t{block_[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3], e = state_[4],
                  f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
      const std::uint32_t ch = (e & f) ^ (~e & g);
      const std::uint32_t t1 = h + s1 + ch + k[i] + w[i];
      const std::uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
      const std::uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
      const std::uint32_t t2 = s0 + maj;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  std::array<std::uint32_t, 8> state_{};
  std::array<std::uint8_t, 64> block_{};
  std::size_t used_ = 0;
  std::uint64_t bytes_ = 0;
};

//! @brief HMAC-SHA-256 of the concatenation of `parts` under `key`.
inline digest hmac_sha256(std::span<const std::byte> key,
                          std::initializer_list<std::span<const std::byte>> parts) noexcept {
  std::array<std::byte, 64> k{};
  if (key.size() > k.size()) {
    const digest hk = sha256().update(key).finish();
    std::memcpy(k.data(), hk.data(), hk.size());
  } else if (!key.empty()) {
    std::memcpy(k.data(), key.data(), key.size());
  }
  std::array<std::byte, 64> pad;
  for (std::size_t i = 0; i < pad.size(); ++i) {
    pad[i] = k[i] ^ std::byte{0x36};
  }
  sha256 inner;
  inner.update(pad);
  for (const auto& p : parts) {
    inner.update(p);
  }
  const digest ih = inner.finish();
  for (std::size_t i = 0; i < pad.size(); ++i) {
    pad[i] = k[i] ^ std::byte{0x5c};
  }
  return sha256().update(pad).update(ih).finish();
}

//! @brief Compares two digests in time independent of where they differ.
inline bool digests_equal(const digest& a, const digest& b) noexcept {
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace oasiskv::disagg::detail
