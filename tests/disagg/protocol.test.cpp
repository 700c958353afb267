// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/disagg/protocol.hpp"
#include "oasiskv/disagg/wire_summary.hpp"

using namespace oasiskv::disagg;
using oasiskv::errc;

namespace {

const oasiskv::kv_layout layout{2, 4, 2, 64, 16, oasiskv::dtype::f16};

hello_ack_msg sample_ack() {
  hello_ack_msg a;
  a.session = 7;
  a.lease_ms = 500;
  a.layout = layout;
  a.num_slots = 16;
  a.slot_bytes = layout.block_bytes();
  a.arena = {0x10000, 16 * layout.block_bytes(), std::vector<std::byte>(40, std::byte{3})};
  a.generations = {0x90000, 16 * 8, std::vector<std::byte>(40, std::byte{4})};
  a.worker_address = std::vector<std::byte>(100, std::byte{5});
  return a;
}

opened_msg sample_opened(std::uint32_t tokens = 40) {
  opened_msg o;
  o.seq = 3;
  o.tokens = tokens;
  o.num_layers = layout.num_layers;
  o.blocks_per_layer = layout.blocks_for(tokens);
  for (std::uint32_t i = 0; i < o.num_layers * o.blocks_per_layer; ++i) {
    o.blocks.push_back({i, 1 + i});
  }
  o.summary_bytes = static_cast<std::uint32_t>(summary_bytes(layout));
  return o;  // the summaries travel in summary_chunk frames
}

std::vector<message> samples() {
  hello_msg h;
  h.nonce[0] = std::byte{1};
  h.client = "decode-0";
  h.resume_session = 77;
  challenge_msg c;
  c.nonce[3] = std::byte{4};
  c.proof[5] = std::byte{6};
  auth_msg a;
  a.proof[31] = std::byte{8};
  summary_chunk_msg sc;
  sc.seq = 3;
  sc.offset = 4096;
  sc.bytes.assign(100, std::byte{9});
  return {h,
          sample_ack(),
          open_msg{3, 1},
          sample_opened(),
          heartbeat_msg{{3, 5, 8}},
          heartbeat_ack_msg{500, 2, 1},
          release_msg{3},
          released_msg{3},
          error_msg{static_cast<std::uint32_t>(errc::unknown_sequence), "no such request"},
          c,
          a,
          sc};
}

message round_trip(const message& m, std::uint64_t id = 42) {
  const auto bytes = encode(m, id);
  const frame_header h = decode_header(std::span(bytes).first(header_bytes));
  CHECK(h.request_id == id);
  CHECK(h.type == type_of(m));
  CHECK(h.payload_bytes == bytes.size() - header_bytes);
  return parse_payload(h.type, std::span(bytes).subspan(header_bytes));
}

errc code_of(auto&& f) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    return e.code();
  }
  return errc{};
}

}  // namespace

TEST_CASE("every message survives a round trip") {
  for (const message& m : samples()) {
    CHECK(round_trip(m) == m);
  }
}

TEST_CASE("headers are validated before the payload is read") {
  auto bytes = encode(heartbeat_msg{}, 1);
  auto header = [&] {
    return decode_header(std::span(bytes).first(header_bytes));
  };
  CHECK_NOTHROW(header());
  bytes[0] = std::byte{0};  // magic
  CHECK(code_of(header) == errc::invalid_argument);
  bytes = encode(heartbeat_msg{}, 1);
  bytes[4] = std::byte{static_cast<unsigned char>(protocol_version + 1)};  // a newer version
  CHECK(code_of(header) == errc::unsupported);
  bytes = encode(heartbeat_msg{}, 1);
  bytes[6] = std::byte{99};  // type
  CHECK(code_of(header) == errc::invalid_argument);
  bytes = encode(heartbeat_msg{}, 1);
  bytes[20] = std::byte{1};  // reserved
  CHECK(code_of(header) == errc::invalid_argument);
  bytes = encode(heartbeat_msg{}, 1);
  bytes[19] = std::byte{0x7f};  // payload length ~2 GiB
  CHECK(code_of(header) == errc::invalid_argument);
  CHECK(code_of([&] { decode_header(std::span(bytes).first(10)); }) == errc::invalid_argument);
}

TEST_CASE("every truncation and every trailing byte is refused") {
  for (const message& m : samples()) {
    const auto bytes = encode(m, 1);
    const auto payload = std::span(bytes).subspan(header_bytes);
    for (std::size_t n = 0; n < payload.size(); ++n) {
      CHECK_THROWS_AS(parse_payload(type_of(m), payload.first(n)), oasiskv::error);
    }
    auto longer = std::vector<std::byte>(payload.begin(), payload.end());
    longer.push_back(std::byte{0});
    CHECK_THROWS_AS(parse_payload(type_of(m), longer), oasiskv::error);
  }
}

TEST_CASE("inconsistent sizes and layouts are refused") {
  hello_ack_msg a = sample_ack();
  a.arena.length = 8;  // smaller than the slots it claims
  CHECK_THROWS_AS(round_trip(a), oasiskv::error);
  a = sample_ack();
  a.layout.num_kv_heads = 3;  // 4 q heads are not a multiple of 3
  CHECK(code_of([&] { round_trip(a); }) == errc::invalid_layout);
  a = sample_ack();
  a.arena.rkey.clear();
  CHECK_THROWS_AS(round_trip(a), oasiskv::error);
  opened_msg o = sample_opened();
  o.summaries.assign(8, std::byte{1});  // summaries belong in summary_chunk frames
  CHECK(code_of([&] { round_trip(o); }) == errc::invalid_argument);
  a = sample_ack();
  a.num_slots = 0xffffffffu;  // a decode node would keep state for 4G slots
  a.arena.length = ~std::uint64_t{0};
  a.generations.length = ~std::uint64_t{0};
  CHECK(code_of([&] { round_trip(a); }) == errc::invalid_argument);
  summary_chunk_msg big;
  big.bytes.assign(limits::max_summary_chunk + 1, std::byte{0});
  CHECK(code_of([&] { encode(big, 1); }) == errc::capacity_exceeded);
  heartbeat_msg many;
  many.seqs.assign(limits::max_leases + 1, 1);
  CHECK(code_of([&] { encode(many, 1); }) == errc::capacity_exceeded);
  // A block count that would need gigabytes: refused from the counts, before any allocation.
  std::vector<std::byte> huge;
  wire_writer w(huge);
  w.u64(1);
  w.u32(100);
  w.u32(0xffffffffu);
  w.u32(1000);
  CHECK(code_of([&] { parse_payload(msg_type::opened, huge); }) == errc::invalid_argument);
}

TEST_CASE("an opened table must stay inside the registered arena") {
  const hello_ack_msg a = sample_ack();
  opened_msg o = sample_opened();
  CHECK_NOTHROW(validate_opened(o, a, 3, true));
  CHECK_THROWS_AS(validate_opened(o, a, 4, true), oasiskv::error);   // another request
  CHECK_THROWS_AS(validate_opened(o, a, 3, false), oasiskv::error);  // summaries not asked for
  o.blocks[1].slot = a.num_slots;                                    // one past the arena
  CHECK(code_of([&] { validate_opened(o, a, 3, true); }) == errc::invalid_slot);
  o = sample_opened();
  o.blocks[1].slot = o.blocks[0].slot;  // twice
  CHECK(code_of([&] { validate_opened(o, a, 3, true); }) == errc::invalid_slot);
  o = sample_opened();
  o.tokens = 100;  // 7 blocks per layer, the table has 3
  CHECK_THROWS_AS(validate_opened(o, a, 3, true), oasiskv::error);
}

TEST_CASE("random bytes never crash the parser") {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::vector<std::byte> payload(rng() % 200);
    for (auto& b : payload) {
      b = static_cast<std::byte>(rng());
    }
    const auto type = static_cast<msg_type>(1 + rng() % 12);
    try {
      const message m = parse_payload(type, payload);
      CHECK(encode(m, 1).size() == header_bytes + payload.size());
    } catch (const oasiskv::error&) {
    }
  }
}

TEST_CASE("SHA-256 and HMAC-SHA-256 match FIPS 180-4 and RFC 4231") {
  auto hex = [](const detail::digest& d) {
    std::string s;
    for (const std::byte b : d) {
      static constexpr char digits[] = "0123456789abcdef";
      s += digits[std::to_integer<int>(b) >> 4];
      s += digits[std::to_integer<int>(b) & 15];
    }
    return s;
  };
  auto bytes = [](const std::string& t) {
    return std::as_bytes(std::span(t.data(), t.size()));
  };
  CHECK(hex(detail::sha256().update(bytes("abc")).finish()) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(detail::sha256().update(bytes("")).finish()) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(detail::sha256()
                .update(bytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))
                .finish()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(hex(detail::sha256().update(bytes(million)).finish()) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  const std::vector<std::byte> k1(20, std::byte{0x0b});
  CHECK(hex(detail::hmac_sha256(k1, {bytes("Hi There")})) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(
      hex(detail::hmac_sha256(bytes("Jefe"), {bytes("what do ya want "), bytes("for nothing?")})) ==
      "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::vector<std::byte> k6(131, std::byte{0xaa});
  CHECK(hex(detail::hmac_sha256(
            k6, {bytes("Test Using Larger Than Block-Size Key - Hash Key First")})) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST_CASE("the handshake's proofs bind the token, both nonces and every hello_ack field") {
  std::array<std::byte, token_bytes> t{}, other{};
  t.fill(std::byte{1});
  other.fill(std::byte{2});
  nonce_type n1{}, n2{};
  n1[0] = std::byte{1};
  n2[0] = std::byte{2};
  const auto p = exporter_proof(t, n1, n2);
  CHECK(p != exporter_proof(other, n1, n2));
  CHECK(p != exporter_proof(t, n2, n1));
  CHECK(p != decode_proof(t, n1, n2));  // one side's proof never stands for the other's
  const hello_ack_msg a = sample_ack();
  const auto mac = hello_ack_mac(t, n1, n2, a);
  hello_ack_msg changed = a;
  changed.worker_address[7] = std::byte{0};
  CHECK(mac != hello_ack_mac(t, n1, n2, changed));
  changed = a;
  changed.arena.rkey[0] = std::byte{0};
  CHECK(mac != hello_ack_mac(t, n1, n2, changed));
  changed = a;
  changed.mac[0] = std::byte{1};  // the MAC itself is not covered
  CHECK(mac == hello_ack_mac(t, n1, n2, changed));
  CHECK(mac != hello_ack_mac(t, n2, n1, a));
}

TEST_CASE("a summary bounds every key's dot product") {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<oasiskv::f16> block(layout.block_bytes() / 2);
  for (auto& x : block) {
    x = oasiskv::f16::from_float(n(rng));
  }
  std::vector<std::byte> s(summary_bytes(layout));
  const std::uint32_t tokens = 11;
  summarize_block(layout, reinterpret_cast<const std::byte*>(block.data()), tokens, s.data());
  std::vector<float> q(layout.num_q_heads * layout.head_dim);
  for (auto& x : q) {
    x = n(rng);
  }
  const float bound = score_summary(layout, s.data(), q.data());
  float best = -1e30f;
  for (std::uint32_t qh = 0; qh < layout.num_q_heads; ++qh) {
    const std::uint32_t h = qh / layout.group_size();
    const auto* keys = block.data() + layout.key_offset(h) / 2;
    for (std::uint32_t t = 0; t < tokens; ++t) {
      float dot = 0;
      for (std::uint32_t x = 0; x < layout.head_dim; ++x) {
        dot += q[qh * layout.head_dim + x] * keys[t * layout.head_dim + x].to_float();
      }
      best = std::max(best, dot);
    }
  }
  CHECK(bound >= best - 1e-3f * std::abs(best));
}
