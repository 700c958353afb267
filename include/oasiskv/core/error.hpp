// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `oasiskv::error`: the one exception type of the library, with an error code.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace oasiskv {

//! @brief What went wrong. Every `oasiskv::error` carries one; tests and callers branch on it.
enum class errc : std::uint8_t {
  invalid_layout = 1,  //!< a `kv_layout` field is zero, absurd, or inconsistent
  invalid_argument,    //!< an argument is malformed (empty table, bad query shape, ...)
  out_of_range,        //!< an index or size exceeds what it refers to
  invalid_slot,        //!< a slot id that this pool did not hand out or cannot hold
  double_free,         //!< a slot released twice
  slot_in_flight,      //!< a slot that an unfinished transfer reads or writes
  layout_mismatch,     //!< two tiers, views or buffers disagree on the KV layout
  misaligned,          //!< a pointer or size breaks an alignment the kernels rely on
  out_of_memory,       //!< an allocation of backing memory failed
  unknown_ticket,      //!< a transfer ticket that the engine never issued
  transfer_failed,     //!< a transfer batch failed while it ran
  unsupported,         //!< a valid request that this build or machine cannot serve
  capacity_exceeded,   //!< a tier or budget has no room left for a request that needs it
  unknown_sequence,    //!< a sequence id the cache does not hold
  io_error,            //!< a read or write of storage failed (the message names slot and errno)
};

//! @brief The name of an error code, for messages and logs.
constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
    case errc::invalid_layout:
      return "invalid_layout";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::out_of_range:
      return "out_of_range";
    case errc::invalid_slot:
      return "invalid_slot";
    case errc::double_free:
      return "double_free";
    case errc::slot_in_flight:
      return "slot_in_flight";
    case errc::layout_mismatch:
      return "layout_mismatch";
    case errc::misaligned:
      return "misaligned";
    case errc::out_of_memory:
      return "out_of_memory";
    case errc::unknown_ticket:
      return "unknown_ticket";
    case errc::transfer_failed:
      return "transfer_failed";
    case errc::unsupported:
      return "unsupported";
    case errc::io_error:
      return "io_error";
    case errc::capacity_exceeded:
      return "capacity_exceeded";
    case errc::unknown_sequence:
      return "unknown_sequence";
  }
  return "unknown";
}

//! @brief The `std::error_category` of `oasiskv::errc`, so codes compose with `std::error_code`.
inline const std::error_category& error_category() noexcept {
  struct category final : std::error_category {
    const char* name() const noexcept override { return "oasiskv"; }
    std::string message(int c) const override {
      return std::string(to_string(static_cast<errc>(c)));
    }
  };
  static const category instance;
  return instance;
}

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

//! @brief The exception the library throws for bad input and failed operations. `what()` starts
//! with "oasiskv: " and names the offending values; `code()` tells which kind of failure it is.
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message)
      : std::runtime_error("oasiskv: " + message), code_(code) {}
  errc code() const noexcept { return code_; }
  std::error_code error_code() const noexcept { return make_error_code(code_); }

 private:
  errc code_;
};

namespace detail {

template <class T>
void append_arg(std::ostringstream& os, const T& v) {
  if constexpr (std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::int8_t>) {
    os << static_cast<int>(v);
  } else if constexpr (std::is_enum_v<T>) {
    // Unary plus: an enum over (u)int8_t must print as a number, not as a character.
    os << +static_cast<std::underlying_type_t<T>>(v);
  } else {
    os << v;
  }
}

//! @brief Throws `oasiskv::error{code, concatenation of parts}`. Kept out of line in spirit: it
//! is only reached on the cold path, so callers write `if (bad) [[unlikely]] raise(...)`.
template <class... Parts>
[[noreturn]] void raise(errc code, const Parts&... parts) {
  std::ostringstream os;
  (append_arg(os, parts), ...);
  throw error(code, os.str());
}

}  // namespace detail
}  // namespace oasiskv

// A standard-library specialisation, not API: the reference leaves it out.
//! @cond
template <>
struct std::is_error_code_enum<oasiskv::errc> : std::true_type {};
//! @endcond
