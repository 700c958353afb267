// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The control protocol between a prefill node's `kv_exporter` and a decode node: framed,
//! versioned, little-endian messages, each parsed and validated in full before any field is used.
//!
//! A frame is a 24-byte header (magic "OKVC", version, type, request id, payload length, a zero
//! reserved word) and a payload of at most `limits::max_payload` bytes. The request id is the
//! caller's correlation id; a reply echoes it (an `opened` is followed by `summary_chunk` frames
//! with the same id, so no frame bounds a prompt's length).
//!
//! The handshake proves the shared token both ways without sending it: `hello` (the decode
//! node's nonce) -> `challenge` (the exporter's nonce and its proof, an HMAC-SHA-256 of both
//! nonces under the token) -> `auth` (the decode node's proof) -> `hello_ack`, whose fields
//! carry an HMAC under the token and both nonces, so the decode node passes a UCX worker address
//! and rkeys to UCX only from a peer that holds the token. Anything else before the handshake
//! completes closes the connection.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/disagg/hmac.hpp"
#include "oasiskv/disagg/wire.hpp"

namespace oasiskv::disagg {

inline constexpr std::uint32_t protocol_magic = 0x43564b4fu;  // "OKVC" in little-endian bytes
inline constexpr std::uint16_t protocol_version = 2;
inline constexpr std::size_t header_bytes = 24;
inline constexpr std::size_t token_bytes = 32;

//! @brief Bounds on every variable-size field: a garbage length becomes an error, never a huge
//! allocation.
struct limits {
  static constexpr std::uint32_t max_payload = 64u << 20;
  static constexpr std::size_t max_rkey = 4096;
  static constexpr std::size_t max_worker_address = 64 * 1024;
  static constexpr std::size_t max_name = 256;
  static constexpr std::size_t max_error_text = 4096;
  static constexpr std::uint32_t max_blocks = 1u << 22;  //!< (layer, block) entries per request
  //! Slots of an exporter's arena: the decode node keeps state per slot.
  static constexpr std::uint32_t max_slots = 1u << 24;
  //! Requests one heartbeat names.
  static constexpr std::uint32_t max_leases = 1u << 16;
  //! Summary bytes one `summary_chunk` frame carries.
  static constexpr std::uint32_t max_summary_chunk = 16u << 20;
};

enum class msg_type : std::uint16_t {
  hello = 1,      //!< decode -> exporter: nonce, client name, a session to resume
  hello_ack,      //!< exporter -> decode: session, layout, regions, rkeys, worker address, MAC
  open,           //!< decode -> exporter: lease a request's blocks and describe them
  opened,         //!< exporter -> decode: block table, generations (summaries follow in chunks)
  heartbeat,      //!< decode -> exporter: the requests it holds (their leases are extended)
  heartbeat_ack,  //!< exporter -> decode
  release,        //!< decode -> exporter: done with a request
  released,       //!< exporter -> decode
  error,          //!< either way: a refusal, with an `errc` and a message
  challenge,      //!< exporter -> decode: its nonce and its proof of the token
  auth,           //!< decode -> exporter: the decode node's proof of the token
  summary_chunk,  //!< exporter -> decode: part of an opened request's summaries
};

struct frame_header {
  msg_type type = msg_type::error;
  std::uint64_t request_id = 0;
  std::uint32_t payload_bytes = 0;
};

//! @brief A registered memory region of the exporter and the packed rkey that reaches it.
struct region_desc {
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  std::vector<std::byte> rkey;
  friend bool operator==(const region_desc&, const region_desc&) = default;
};

inline constexpr std::size_t nonce_bytes = 32;
using nonce_type = std::array<std::byte, nonce_bytes>;
using proof_type = std::array<std::byte, 32>;  //!< an HMAC-SHA-256

struct hello_msg {
  nonce_type nonce{};
  std::string client;
  std::uint64_t resume_session = 0;  //!< a session whose connection was lost; 0: none
  friend bool operator==(const hello_msg&, const hello_msg&) = default;
};
struct challenge_msg {
  nonce_type nonce{};
  proof_type proof{};  //!< HMAC(token, "oasiskv exporter" | hello nonce | this nonce)
  friend bool operator==(const challenge_msg&, const challenge_msg&) = default;
};
struct auth_msg {
  proof_type proof{};  //!< HMAC(token, "oasiskv decode" | challenge nonce | hello nonce)
  friend bool operator==(const auth_msg&, const auth_msg&) = default;
};
struct hello_ack_msg {
  std::uint64_t session = 0;
  std::uint32_t lease_ms = 0;
  kv_layout layout{};
  std::uint32_t num_slots = 0;
  std::uint64_t slot_bytes = 0;
  region_desc arena;        //!< the KV slots: slot s at arena.base + s * slot_bytes
  region_desc generations;  //!< one little-endian u64 per slot
  std::vector<std::byte> worker_address;
  //! HMAC(token, "oasiskv hello_ack" | hello nonce | challenge nonce | the fields above).
  proof_type mac{};
  friend bool operator==(const hello_ack_msg&, const hello_ack_msg&) = default;
};
struct open_msg {
  std::uint64_t seq = 0;
  std::uint8_t want_summaries = 1;
  friend bool operator==(const open_msg&, const open_msg&) = default;
};
//! @brief Where one (layer, block) of a request lives on the exporter, and its generation then.
struct block_entry {
  std::uint32_t slot = 0;
  std::uint64_t generation = 0;
  friend bool operator==(const block_entry&, const block_entry&) = default;
};
struct opened_msg {
  std::uint64_t seq = 0;
  std::uint32_t tokens = 0;
  std::uint32_t num_layers = 0;
  std::uint32_t blocks_per_layer = 0;
  std::vector<block_entry> blocks;  //!< [num_layers][blocks_per_layer]
  std::uint32_t summary_bytes = 0;  //!< per block; 0 when none were asked for
  //! [num_layers][blocks_per_layer][summary_bytes]: not on the wire in `opened` (it must be
  //! empty there) but in the `summary_chunk` frames that follow; the decode node assembles it.
  std::vector<std::byte> summaries;
  friend bool operator==(const opened_msg&, const opened_msg&) = default;
};
struct summary_chunk_msg {
  std::uint64_t seq = 0;
  std::uint64_t offset = 0;      //!< into the request's summaries
  std::vector<std::byte> bytes;  //!< at most `limits::max_summary_chunk`
  friend bool operator==(const summary_chunk_msg&, const summary_chunk_msg&) = default;
};
struct heartbeat_msg {
  //! Every request the decode node holds from this exporter: their leases are extended, and any
  //! other lease of the session (an open whose reply it never took) is released.
  std::vector<std::uint64_t> seqs;
  friend bool operator==(const heartbeat_msg&, const heartbeat_msg&) = default;
};
struct heartbeat_ack_msg {
  std::uint32_t lease_ms = 0;
  std::uint32_t leases = 0;    //!< leases extended
  std::uint32_t released = 0;  //!< leases the decode node no longer named, released
  friend bool operator==(const heartbeat_ack_msg&, const heartbeat_ack_msg&) = default;
};
struct release_msg {
  std::uint64_t seq = 0;
  friend bool operator==(const release_msg&, const release_msg&) = default;
};
struct released_msg {
  std::uint64_t seq = 0;
  friend bool operator==(const released_msg&, const released_msg&) = default;
};
struct error_msg {
  std::uint32_t code = 0;
  std::string text;
  friend bool operator==(const error_msg&, const error_msg&) = default;
};

using message =
    std::variant<hello_msg, hello_ack_msg, open_msg, opened_msg, heartbeat_msg, heartbeat_ack_msg,
                 release_msg, released_msg, error_msg, challenge_msg, auth_msg, summary_chunk_msg>;

//! @brief The wire type of a message (the variant index + 1, by construction).
inline msg_type type_of(const message& m) noexcept {
  return static_cast<msg_type>(m.index() + 1);
}

//! @brief Parses and validates a frame header. Throws `errc::invalid_argument` on a bad magic,
//! an unknown version or type, a nonzero reserved word, or a payload over the limit.
inline frame_header decode_header(std::span<const std::byte> in) {
  if (in.size() != header_bytes) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control header must be ", header_bytes,
                           " bytes, got ", in.size());
  }
  wire_reader r(in);
  const std::uint32_t magic = r.u32("magic");
  const std::uint16_t version = r.u16("version");
  const std::uint16_t type = r.u16("type");
  frame_header h;
  h.request_id = r.u64("request_id");
  h.payload_bytes = r.u32("payload_bytes");
  const std::uint32_t reserved = r.u32("reserved");
  if (magic != protocol_magic) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control header: bad magic ", magic);
  }
  if (version != protocol_version) [[unlikely]] {
    oasiskv::detail::raise(errc::unsupported, "control header: protocol version ", version,
                           " (this build speaks ", protocol_version, ")");
  }
  if (type < 1 || type > static_cast<std::uint16_t>(msg_type::summary_chunk)) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control header: unknown message type ", type);
  }
  if (reserved != 0) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control header: reserved word is ", reserved);
  }
  if (h.payload_bytes > limits::max_payload) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control header: payload of ", h.payload_bytes,
                           " bytes exceeds ", limits::max_payload);
  }
  h.type = static_cast<msg_type>(type);
  return h;
}

namespace detail {

inline void put_layout(wire_writer& w, const kv_layout& l) {
  w.u32(l.num_layers);
  w.u32(l.num_q_heads);
  w.u32(l.num_kv_heads);
  w.u32(l.head_dim);
  w.u32(l.tokens_per_block);
  w.u8(static_cast<std::uint8_t>(l.kv_dtype));
}
inline kv_layout get_layout(wire_reader& r) {
  kv_layout l;
  l.num_layers = r.u32("layout.num_layers");
  l.num_q_heads = r.u32("layout.num_q_heads");
  l.num_kv_heads = r.u32("layout.num_kv_heads");
  l.head_dim = r.u32("layout.head_dim");
  l.tokens_per_block = r.u32("layout.tokens_per_block");
  l.kv_dtype = static_cast<dtype>(r.u8("layout.kv_dtype"));
  l.validate();  // before any size is derived from it
  return l;
}
inline void put_region(wire_writer& w, const region_desc& d) {
  w.u64(d.base);
  w.u64(d.length);
  w.blob(d.rkey);
}
inline region_desc get_region(wire_reader& r, const char* what) {
  region_desc d;
  d.base = r.u64(what);
  d.length = r.u64(what);
  auto k = r.blob(limits::max_rkey, what);
  d.rkey.assign(k.begin(), k.end());
  if (d.base == 0 || d.length == 0 || d.base + d.length < d.base || d.rkey.empty()) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "control message: region ", what, " [", d.base,
                           ", +", d.length, ") with a ", d.rkey.size(),
                           "-byte rkey is not a valid region");
  }
  return d;
}

//! @brief The payload of `m`, without the header.
inline void encode_payload(wire_writer& w, const message& m) {
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, hello_msg>) {
          w.bytes(v.nonce);
          w.str(v.client);
          w.u64(v.resume_session);
        } else if constexpr (std::is_same_v<T, challenge_msg>) {
          w.bytes(v.nonce);
          w.bytes(v.proof);
        } else if constexpr (std::is_same_v<T, auth_msg>) {
          w.bytes(v.proof);
        } else if constexpr (std::is_same_v<T, summary_chunk_msg>) {
          if (v.bytes.size() > limits::max_summary_chunk) [[unlikely]] {
            oasiskv::detail::raise(errc::capacity_exceeded, "summary_chunk of ", v.bytes.size(),
                                   " bytes exceeds ", limits::max_summary_chunk);
          }
          w.u64(v.seq);
          w.u64(v.offset);
          w.blob(v.bytes);
        } else if constexpr (std::is_same_v<T, hello_ack_msg>) {
          w.u64(v.session);
          w.u32(v.lease_ms);
          put_layout(w, v.layout);
          w.u32(v.num_slots);
          w.u64(v.slot_bytes);
          put_region(w, v.arena);
          put_region(w, v.generations);
          w.blob(v.worker_address);
          w.bytes(v.mac);
        } else if constexpr (std::is_same_v<T, open_msg>) {
          w.u64(v.seq);
          w.u8(v.want_summaries);
        } else if constexpr (std::is_same_v<T, opened_msg>) {
          w.u64(v.seq);
          w.u32(v.tokens);
          w.u32(v.num_layers);
          w.u32(v.blocks_per_layer);
          for (const block_entry& b : v.blocks) {
            w.u32(b.slot);
            w.u64(b.generation);
          }
          w.u32(v.summary_bytes);
          if (!v.summaries.empty()) [[unlikely]] {
            oasiskv::detail::raise(errc::invalid_argument, "opened: the summaries of request ",
                                   v.seq, " travel in summary_chunk frames, not in opened");
          }
        } else if constexpr (std::is_same_v<T, heartbeat_msg>) {
          if (v.seqs.size() > limits::max_leases) [[unlikely]] {
            oasiskv::detail::raise(errc::capacity_exceeded, "heartbeat naming ", v.seqs.size(),
                                   " requests exceeds ", limits::max_leases);
          }
          w.u32(static_cast<std::uint32_t>(v.seqs.size()));
          for (const std::uint64_t q : v.seqs) {
            w.u64(q);
          }
        } else if constexpr (std::is_same_v<T, heartbeat_ack_msg>) {
          w.u32(v.lease_ms);
          w.u32(v.leases);
          w.u32(v.released);
        } else if constexpr (std::is_same_v<T, release_msg> || std::is_same_v<T, released_msg>) {
          w.u64(v.seq);
        } else {
          w.u32(v.code);
          w.str(v.text);
        }
      },
      m);
}

}  // namespace detail

//! @brief A whole frame (header and payload) for `m`.
inline std::vector<std::byte> encode(const message& m, std::uint64_t request_id) {
  std::vector<std::byte> out;
  wire_writer w(out);
  w.u32(protocol_magic);
  w.u16(protocol_version);
  w.u16(static_cast<std::uint16_t>(type_of(m)));
  w.u64(request_id);
  w.u32(0);  // payload length, patched below
  w.u32(0);
  detail::encode_payload(w, m);
  const std::size_t n = out.size() - header_bytes;
  if (n > limits::max_payload) [[unlikely]] {
    oasiskv::detail::raise(errc::capacity_exceeded, "control message of ", n, " bytes exceeds ",
                           limits::max_payload);
  }
  for (int i = 0; i < 4; ++i) {
    out[16 + static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  }
  return out;
}

//! @brief Parses the payload of a frame whose header said `type`. Validates every field that
//! is checkable without session context (layout, counts, sizes, consistency, no trailing
//! bytes); throws `oasiskv::error` otherwise.
inline message parse_payload(msg_type type, std::span<const std::byte> payload) {
  wire_reader r(payload);
  message m;
  switch (type) {
    case msg_type::hello: {
      hello_msg v;
      auto t = r.bytes(nonce_bytes, "hello.nonce");
      std::copy(t.begin(), t.end(), v.nonce.begin());
      v.client = r.str(limits::max_name, "hello.client");
      v.resume_session = r.u64("hello.resume_session");
      m = std::move(v);
      break;
    }
    case msg_type::challenge: {
      challenge_msg v;
      auto n = r.bytes(nonce_bytes, "challenge.nonce");
      std::copy(n.begin(), n.end(), v.nonce.begin());
      auto p = r.bytes(v.proof.size(), "challenge.proof");
      std::copy(p.begin(), p.end(), v.proof.begin());
      m = v;
      break;
    }
    case msg_type::auth: {
      auth_msg v;
      auto p = r.bytes(v.proof.size(), "auth.proof");
      std::copy(p.begin(), p.end(), v.proof.begin());
      m = v;
      break;
    }
    case msg_type::summary_chunk: {
      summary_chunk_msg v;
      v.seq = r.u64("summary_chunk.seq");
      v.offset = r.u64("summary_chunk.offset");
      auto b = r.blob(limits::max_summary_chunk, "summary_chunk.bytes");
      v.bytes.assign(b.begin(), b.end());
      m = std::move(v);
      break;
    }
    case msg_type::hello_ack: {
      hello_ack_msg v;
      v.session = r.u64("hello_ack.session");
      v.lease_ms = r.u32("hello_ack.lease_ms");
      v.layout = detail::get_layout(r);
      v.num_slots = r.u32("hello_ack.num_slots");
      v.slot_bytes = r.u64("hello_ack.slot_bytes");
      v.arena = detail::get_region(r, "hello_ack.arena");
      v.generations = detail::get_region(r, "hello_ack.generations");
      auto a = r.blob(limits::max_worker_address, "hello_ack.worker_address");
      v.worker_address.assign(a.begin(), a.end());
      auto mac = r.bytes(v.mac.size(), "hello_ack.mac");
      std::copy(mac.begin(), mac.end(), v.mac.begin());
      if (v.num_slots > limits::max_slots) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "hello_ack: ", v.num_slots,
                               " slots exceed the ", limits::max_slots, " a decode node accepts");
      }
      if (v.num_slots == 0 || v.slot_bytes < v.layout.block_bytes() ||
          v.slot_bytes > (std::uint64_t{1} << 31) || v.worker_address.empty() ||
          v.arena.length / v.slot_bytes < v.num_slots || v.generations.length / 8 < v.num_slots ||
          v.lease_ms == 0) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "hello_ack: ", v.num_slots, " slots of ",
                               v.slot_bytes, " bytes (block ", v.layout.block_bytes(),
                               ") do not fit an ", "arena of ", v.arena.length,
                               " bytes and a generation table of ", v.generations.length,
                               " bytes, or the lease / worker address is empty");
      }
      m = std::move(v);
      break;
    }
    case msg_type::open: {
      open_msg v;
      v.seq = r.u64("open.seq");
      v.want_summaries = r.u8("open.want_summaries");
      if (v.want_summaries > 1) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "open.want_summaries = ", v.want_summaries);
      }
      m = v;
      break;
    }
    case msg_type::opened: {
      opened_msg v;
      v.seq = r.u64("opened.seq");
      v.tokens = r.u32("opened.tokens");
      v.num_layers = r.u32("opened.num_layers");
      v.blocks_per_layer = r.u32("opened.blocks_per_layer");
      const std::uint64_t n = std::uint64_t{v.num_layers} * v.blocks_per_layer;
      if (v.num_layers == 0 || v.blocks_per_layer == 0 || n > limits::max_blocks ||
          n * 12 > r.remaining()) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "opened: ", v.num_layers, " layers x ",
                               v.blocks_per_layer, " blocks is empty, over ", limits::max_blocks,
                               " or longer than the message");
      }
      v.blocks.resize(n);
      for (block_entry& b : v.blocks) {
        b.slot = r.u32("opened.slot");
        b.generation = r.u64("opened.generation");
      }
      v.summary_bytes = r.u32("opened.summary_bytes");
      if (v.summary_bytes > (1u << 20)) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "opened: summaries of ", v.summary_bytes,
                               " bytes per block");
      }
      m = std::move(v);
      break;
    }
    case msg_type::heartbeat: {
      heartbeat_msg v;
      const std::uint32_t n = r.u32("heartbeat.count");
      if (n > limits::max_leases || std::uint64_t{n} * 8 != r.remaining()) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "heartbeat: ", n, " requests (at most ",
                               limits::max_leases, ") do not match the ", r.remaining(),
                               " bytes left");
      }
      v.seqs.resize(n);
      for (std::uint64_t& q : v.seqs) {
        q = r.u64("heartbeat.seq");
      }
      m = std::move(v);
      break;
    }
    case msg_type::heartbeat_ack: {
      heartbeat_ack_msg v;
      v.lease_ms = r.u32("heartbeat_ack.lease_ms");
      v.leases = r.u32("heartbeat_ack.leases");
      v.released = r.u32("heartbeat_ack.released");
      m = v;
      break;
    }
    case msg_type::release:
      m = release_msg{r.u64("release.seq")};
      break;
    case msg_type::released:
      m = released_msg{r.u64("released.seq")};
      break;
    case msg_type::error: {
      error_msg v;
      v.code = r.u32("error.code");
      v.text = r.str(limits::max_error_text, "error.text");
      m = std::move(v);
      break;
    }
  }
  r.finish("payload");
  return m;
}

//! @brief Checks an `opened` reply against the session's `hello_ack` and the `open` it answers:
//! the layer count, the block count for the token count, every slot inside the registered arena
//! and no slot twice, and the summary size. After this, every remote address derived from the
//! table lies inside the region the exporter registered.
inline void validate_opened(const opened_msg& o, const hello_ack_msg& session,
                            std::uint64_t expected_seq, bool summaries_expected) {
  const kv_layout& l = session.layout;
  if (o.seq != expected_seq || o.num_layers != l.num_layers || o.tokens == 0 ||
      o.blocks_per_layer != l.blocks_for(o.tokens)) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "opened: request ", o.seq, " (expected ",
                           expected_seq, ") with ", o.num_layers, " layers, ", o.tokens,
                           " tokens, ", o.blocks_per_layer,
                           " blocks per layer does not match the layout");
  }
  std::vector<bool> seen(session.num_slots, false);
  for (const block_entry& b : o.blocks) {
    if (b.slot >= session.num_slots || seen[b.slot]) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_slot, "opened: slot ", b.slot,
                             " is outside the arena of ", session.num_slots,
                             " slots or listed twice");
    }
    seen[b.slot] = true;
  }
  const std::uint64_t want = summaries_expected ? 2ull * l.num_kv_heads * l.head_dim * 2 : 0;
  if (o.summary_bytes != want) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "opened: summary of ", o.summary_bytes,
                           " bytes per block, expected ", want);
  }
}

//! @brief The handshake's proofs and MAC (see the file comment). `token` is the shared secret.
inline proof_type exporter_proof(std::span<const std::byte> token, const nonce_type& hello_nonce,
                                 const nonce_type& challenge_nonce) {
  static constexpr char label[] = "oasiskv exporter";
  return detail::hmac_sha256(
      token, {std::as_bytes(std::span(label, sizeof label - 1)), hello_nonce, challenge_nonce});
}
inline proof_type decode_proof(std::span<const std::byte> token, const nonce_type& hello_nonce,
                               const nonce_type& challenge_nonce) {
  static constexpr char label[] = "oasiskv decode";
  return detail::hmac_sha256(
      token, {std::as_bytes(std::span(label, sizeof label - 1)), challenge_nonce, hello_nonce});
}
//! @brief The MAC of `ack`'s fields (its own `mac` left out).
inline proof_type hello_ack_mac(std::span<const std::byte> token, const nonce_type& hello_nonce,
                                const nonce_type& challenge_nonce, hello_ack_msg ack) {
  static constexpr char label[] = "oasiskv hello_ack";
  ack.mac = {};
  std::vector<std::byte> fields;
  wire_writer w(fields);
  detail::encode_payload(w, ack);
  return detail::hmac_sha256(token, {std::as_bytes(std::span(label, sizeof label - 1)), hello_nonce,
                                     challenge_nonce, fields});
}

}  // namespace oasiskv::disagg
