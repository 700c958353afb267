// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the disaggregation control protocol's parser (libFuzzer entry point; the
// mutation driver in mutation_driver.cpp calls it where libFuzzer is not available).
//
// Input: first byte even -> the rest is a whole frame (header, then payload); odd -> byte 1
// picks the message type and the rest is its payload, which reaches the payload parsers without
// the fuzzer having to find the magic first. Whatever parses must encode back to something that
// parses to the same message, and an `opened` table that parses goes through `validate_opened`
// against a session; anything else must be refused with oasiskv::error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "oasiskv/disagg/protocol.hpp"
#include "seed_messages.hpp"

namespace {
void check_round_trip(const oasiskv::disagg::message& m) {
  using namespace oasiskv::disagg;
  const auto bytes = encode(m, 9);
  const frame_header h = decode_header(std::span(bytes).first(header_bytes));
  if (!(parse_payload(h.type, std::span(bytes).subspan(header_bytes)) == m)) {
    std::abort();  // the parser and the encoder disagree: a real bug
  }
  if (const auto* o = std::get_if<opened_msg>(&m)) {
    try {
      validate_opened(*o, fuzz::seed_ack(), o->seq, o->summary_bytes != 0);
    } catch (const oasiskv::error&) {
      // Refused: a table that does not fit the session.
    }
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace oasiskv::disagg;
  if (size < 2) {
    return 0;
  }
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  try {
    if ((data[0] & 1) == 0) {
      const auto frame = in.subspan(1);
      if (frame.size() < header_bytes) {
        return 0;
      }
      const frame_header h = decode_header(frame.first(header_bytes));
      const auto payload = frame.subspan(header_bytes);
      if (payload.size() != h.payload_bytes) {
        return 0;  // the socket layer reads exactly payload_bytes
      }
      check_round_trip(parse_payload(h.type, payload));
    } else {
      const auto type = static_cast<msg_type>(1 + data[1] % 12);
      check_round_trip(parse_payload(type, in.subspan(2)));
    }
  } catch (const oasiskv::error&) {
    // Refused: the expected outcome for almost every input.
  }
  return 0;
}

// Each seed message as a whole frame (first byte even) and as a typed payload (odd).
std::vector<std::vector<std::uint8_t>> fuzz_seeds() {
  using namespace oasiskv::disagg;
  std::vector<std::vector<std::uint8_t>> out;
  for (const message& m : fuzz::seed_messages()) {
    const auto f = encode(m, 5);
    std::vector<std::uint8_t> frame{0};
    for (std::byte b : f) {
      frame.push_back(static_cast<std::uint8_t>(b));
    }
    out.push_back(frame);
    std::vector<std::uint8_t> direct(2 + f.size() - header_bytes);
    direct[0] = 1;
    direct[1] = static_cast<std::uint8_t>(m.index());
    for (std::size_t i = header_bytes; i < f.size(); ++i) {
      direct[2 + i - header_bytes] = static_cast<std::uint8_t>(f[i]);
    }
    out.push_back(direct);
  }
  return out;
}
