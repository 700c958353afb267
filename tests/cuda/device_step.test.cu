// SPDX-License-Identifier: Apache-2.0
// cuda::device_decode_step: the option and shape checks and the staging arithmetic (on the
// host, no device needed), then on a device a step captured in a CUDA graph and replayed over
// several steps (new tokens, new queries) against the same step enqueued directly and against
// the CPU predictor + reference_decode, and the argument errors before anything is enqueued.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/attention/validate.hpp"
#include "oasiskv/cache/cuda/device_decode_step.cuh"
#include "oasiskv/cuda/cuda.cuh"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"

namespace {

using oasiskv::block_ref;
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;

// Two ctest entries run this binary (tests/cuda/CMakeLists.txt): the cases of the test suite
// "host" need no driver and always run (test_cuda_device_step_host); the others need a device
// and exit 77 (skipped) without one (test_cuda_device_step).

template <class F>
oasiskv::error caught(F&& f) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    return e;
  }
  FAIL("no oasiskv::error was thrown");
  return oasiskv::error(oasiskv::errc{}, "");
}

// Requires `f` to throw `code` with `text` in its message.
template <class F>
void require_error(F&& f, oasiskv::errc code, const std::string& text) {
  const oasiskv::error e = caught(f);
  CHECK(e.code() == code);
  CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
}

// A pool view whose base is never dereferenced: the host checks only read its fields.
oasiskv::block_pool_view fake_pool(const oasiskv::kv_layout& l, std::uint32_t slots,
                                   std::uintptr_t at) {
  return {reinterpret_cast<std::byte*>(at), l.block_bytes(), slots, l};
}

oc::device_decode_step_options host_options(const oasiskv::kv_layout& l) {
  oc::device_decode_step_options o;
  o.max_seqs = 4;
  o.max_blocks = 64;
  o.selection = {8, 1, 2};
  o.max_q_len = 4;
  o.max_lookahead = 2;
  o.first_slot = 5;
  o.fast = fake_pool(l, 5 + 4 * 8, 0x10000);
  o.capacity = fake_pool(l, 256, 0x20000000);
  return o;
}

}  // namespace

TEST_CASE("device_decode_step: options and step shapes are checked on the host" *
          doctest::test_suite("host")) {
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  using e = oasiskv::errc;
  const auto good = host_options(l);
  CHECK_NOTHROW(oc::device_decode_step::validate(good, l));
  auto bad = [&](auto edit, e code, const std::string& text) {
    auto o = good;
    edit(o);
    require_error([&] { oc::device_decode_step::validate(o, l); }, code, text);
  };
  bad([](auto& o) { o.max_seqs = 0; }, e::invalid_argument, "max_seqs = 0");
  bad([](auto& o) { o.max_seqs = 65536; }, e::invalid_argument, "max_seqs = 65536");
  bad([](auto& o) { o.max_blocks = 0; }, e::invalid_argument, "max_blocks is 0");
  bad([](auto& o) { o.selection.budget_blocks = 4097; }, e::invalid_argument,
      "budget_blocks = 4097");
  bad([](auto& o) { o.selection = {2, 1, 2}; }, e::invalid_argument, "budget_blocks = 2");
  bad([](auto& o) { o.selection.target_mass = 0.5f; }, e::unsupported, "target_mass = 0.5");
  bad([](auto& o) { o.max_q_len = 17; }, e::invalid_argument, "max_q_len = 17");
  bad([](auto& o) { o.max_q_len = 0; }, e::invalid_argument, "max_q_len = 0");
  bad([](auto& o) { o.max_lookahead = 17; }, e::invalid_argument, "max_lookahead = 17");
  bad([](auto& o) { o.gather_ctas = 0; }, e::invalid_argument, "gather_ctas is 0");
  bad([](auto& o) { o.scale = NAN; }, e::invalid_argument, "scale = nan");
  // 5 + 4 sequences x 8 slots = 37 slots: one more than the pool holds.
  bad([](auto& o) { o.first_slot = 6; }, e::out_of_range, "first_slot = 6");
  bad([](auto& o) { o.fast.base = nullptr; }, e::invalid_argument, "base is null");
  bad([](auto& o) { o.capacity.base += 8; }, e::misaligned, "16-byte aligned");
  bad([&](auto& o) { o.capacity.layout.tokens_per_block = 8; }, e::layout_mismatch, "layouts");
  {
    oasiskv::kv_layout l96 = l;
    l96.head_dim = 96;
    auto o = good;
    o.fast.layout = o.capacity.layout = l96;
    require_error([&] { oc::device_decode_step::validate(o, l96); }, e::unsupported,
                  "head_dim = 96");
  }

  oc::device_decode_step_io x;
  x.q = reinterpret_cast<const float*>(std::uintptr_t{0x1000});
  x.lookahead = x.q;
  x.out = reinterpret_cast<float*>(std::uintptr_t{0x2000});
  x.num_seqs = 4;
  x.q_len = 4;
  x.lookahead_tokens = 2;
  CHECK_NOTHROW(oc::device_decode_step::validate(good, x));
  auto bad_io = [&](auto edit, e code, const std::string& text) {
    auto y = x;
    edit(y);
    require_error([&] { oc::device_decode_step::validate(good, y); }, code, text);
  };
  bad_io([](auto& y) { y.num_seqs = 5; }, e::invalid_argument, "num_seqs = 5");
  bad_io([](auto& y) { y.num_seqs = 0; }, e::invalid_argument, "num_seqs = 0");
  bad_io([](auto& y) { y.q_len = 0; }, e::invalid_argument, "q_len = 0");
  bad_io([](auto& y) { y.q_len = 5; }, e::invalid_argument, "q_len = 5");
  bad_io([](auto& y) { y.lookahead_tokens = 3; }, e::invalid_argument, "lookahead_tokens = 3");
  bad_io([](auto& y) { y.q = nullptr; }, e::invalid_argument, "q is null");
  bad_io([](auto& y) { y.lookahead = nullptr; }, e::invalid_argument, "lookahead is null");
  bad_io([](auto& y) { y.out = nullptr; }, e::invalid_argument, "out is null");
  bad_io([](auto& y) { y.q += 1; }, e::misaligned, "q = ");
}

TEST_CASE("device_decode_step: staging layout, staging checks and block token arithmetic" *
          doctest::test_suite("host")) {
  using e = oasiskv::errc;
  const oc::device_step_staging_layout sl{3, 5};
  CHECK(sl.lens_offset() == 0);
  CHECK(sl.ids_offset() == 4);  // 3 lengths, rounded to 16 bytes
  CHECK(sl.map_words() == 16);  // 15 entries, rounded
  CHECK(sl.caps_offset() == 20);
  CHECK(sl.words() == 36);
  CHECK(sl.row(sl.ids_offset(), 2) == 14);
  CHECK(sl.row(sl.caps_offset(), 2) + 5 <= sl.words());
  const oc::device_step_staging_layout big{65535, 100003};
  CHECK(big.caps_offset() % 4 == 0);
  CHECK(big.words() == 65536 + 2 * ((std::size_t{65535} * 100003 + 3) / 4 * 4));

  using oc::detail::tokens_in_block;
  CHECK(tokens_in_block(33, 0, 16) == 16);
  CHECK(tokens_in_block(33, 1, 16) == 16);
  CHECK(tokens_in_block(33, 2, 16) == 1);
  CHECK(tokens_in_block(33, 3, 16) == 0);
  CHECK(tokens_in_block(32, 1, 16) == 16);
  CHECK(tokens_in_block(32, 2, 16) == 0);
  CHECK(tokens_in_block(0xffffffffu, 0xffffffffu, 1024) == 0);  // no overflow
  CHECK(tokens_in_block(0xffffffffu, 4194303u, 1024) == 1023);
  {
    // validate_staging over a host staging area: 2 of 4 sequences, 16-token blocks, at most 5
    // blocks each, a summary of 40 entries, a capacity pool of 256 slots.
    const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
    auto o = host_options(l);
    o.max_blocks = 5;
    const oc::device_step_staging_layout layout{o.max_seqs, o.max_blocks};
    std::vector<std::uint32_t> words(layout.words(), 0);
    auto lens = [&](std::uint32_t s) -> std::uint32_t& {
      return words[layout.lens_offset() + s];
    };
    auto id = [&](std::uint32_t s, std::uint32_t i) -> std::uint32_t& {
      return words[layout.row(layout.ids_offset(), s) + i];
    };
    auto cap = [&](std::uint32_t s, std::uint32_t i) -> std::uint32_t& {
      return words[layout.row(layout.caps_offset(), s) + i];
    };
    lens(0) = 80;  // 5 full blocks
    lens(1) = 33;  // 3 blocks
    lens(2) = 0;   // not in the step: never read
    id(2, 0) = 1000;
    for (std::uint32_t i = 0; i < 5; ++i) {
      id(0, i) = 39 - i;
      cap(0, i) = 255 - i;
      id(1, i) = i;
      cap(1, i) = i;
    }
    id(1, 3) = 1000;  // past sequence 1's blocks: never read
    cap(1, 4) = 1000;
    auto check = [&](std::uint32_t q_len) {
      oc::device_decode_step::validate_staging(o, 16, 40, words.data(), 2, q_len);
    };
    CHECK_NOTHROW(check(4));
    require_error([&] { check(34); }, e::invalid_argument, "seq_lens[1] = 33 is below q_len = 34");
    lens(0) = 81;  // 6 blocks
    require_error([&] { check(1); }, e::out_of_range, "seq_lens[0] = 81 takes 6 blocks");
    lens(0) = 80;
    id(1, 2) = 40;
    require_error([&] { check(1); }, e::out_of_range, "summary_ids(1)[2] = 40");
    id(1, 2) = 2;
    cap(0, 4) = 256;
    require_error([&] { check(1); }, e::invalid_slot, "capacity_slots(0)[4] = 256");
    cap(0, 4) = 251;
    CHECK_NOTHROW(check(1));
  }
  for (std::uint32_t len = 0; len < 70; ++len) {
    const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
    for (std::uint32_t b = 0; b < l.blocks_for(len); ++b) {
      CHECK(tokens_in_block(len, b, 16) == oasiskv::block_fill(l, b, len));
    }
  }
}

namespace {

// A step's world on the host: pinned capacity blocks, per sequence a scattered capacity slot
// (and summary entry: the same number) for each block, the host summary.
struct world {
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, max_blocks, slots;
  std::byte* capacity = nullptr;  // pinned: [slots][block_bytes]
  std::vector<std::uint32_t> lens, ids;
  oasiskv::minmax_summary<oasiskv::f16> summary;

  world(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t maxb, std::mt19937& rng)
      : l(layout), num_seqs(seqs), max_blocks(maxb), slots(seqs * maxb), summary(layout, slots) {
    void* p = nullptr;
    OASISKV_CUDA_CHECK(cudaHostAlloc(&p, std::size_t{slots} * l.block_bytes(), 0));
    capacity = static_cast<std::byte*>(p);
    fill(capacity, std::size_t{slots} * l.block_bytes() / l.elem_bytes(), rng);
    std::uniform_int_distribution<std::uint32_t> len(maxb * l.tokens_per_block / 2,
                                                     (maxb - 4) * l.tokens_per_block);
    ids.assign(std::size_t{seqs} * maxb, 0);
    for (std::uint32_t s = 0; s < seqs; ++s) {
      lens.push_back(len(rng));
      for (std::uint32_t i = 0; i < maxb; ++i) {
        ids[std::size_t{s} * maxb + i] = s * maxb + (i * 7919u) % maxb;  // scattered
      }
      for (std::uint32_t i = 0; i < l.blocks_for(lens[s]); ++i) {
        const std::uint32_t id = ids[std::size_t{s} * maxb + i];
        summary.update(id, block(id), 0, oasiskv::block_fill(l, i, lens[s]));
      }
    }
  }
  world(const world&) = delete;
  world& operator=(const world&) = delete;
  ~world() { (void)cudaFreeHost(capacity); }

  std::byte* block(std::uint32_t id) const { return capacity + std::size_t{id} * l.block_bytes(); }

  void fill(std::byte* at, std::size_t elems, std::mt19937& rng) const {
    oasiskv::testing::fill_random(at, l.kv_dtype, elems, rng, -2.0f, 2.0f);
  }

  // Appends `n` tokens to sequence s: fresh keys and values in the capacity blocks (so a staged
  // copy of the old partial block is stale), folded into the host summary. Returns the entries
  // it changed.
  std::vector<std::uint32_t> append(std::uint32_t s, std::uint32_t n, std::mt19937& rng) {
    std::set<std::uint32_t> touched;
    for (std::uint32_t t = lens[s]; t < lens[s] + n; ++t) {
      const std::uint32_t b = t / l.tokens_per_block, row = t % l.tokens_per_block;
      const std::uint32_t id = ids[std::size_t{s} * max_blocks + b];
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        fill(block(id) + l.key_offset(h) + row * l.row_bytes(), l.head_dim, rng);
        fill(block(id) + l.value_offset(h) + row * l.row_bytes(), l.head_dim, rng);
      }
      summary.update(id, block(id), row, 1);
      touched.insert(id);
    }
    lens[s] += n;
    return {touched.begin(), touched.end()};
  }

  // The CPU predictor's table per sequence (block indices).
  std::vector<std::vector<std::uint32_t>> select(const std::vector<float>& q, std::uint32_t tokens,
                                                 const oasiskv::selection_params& sp) const {
    std::vector<std::vector<std::uint32_t>> tables;
    for (std::uint32_t s = 0; s < num_seqs; ++s) {
      oasiskv::prediction_input<oasiskv::minmax_summary<oasiskv::f16>> in;
      in.layout = l;
      in.seq_len = lens[s];
      in.summaries = &summary;
      in.summary_ids = {ids.data() + std::size_t{s} * max_blocks, l.blocks_for(lens[s])};
      in.queries = {q.data() + std::size_t{s} * tokens * l.num_q_heads * l.head_dim, nullptr,
                    tokens};
      oasiskv::selection sel;
      oasiskv::lookahead_predictor<oasiskv::minmax_summary<oasiskv::f16>> p;
      p.select(in, sp, sel);
      const auto t = sel.table(0);
      tables.emplace_back(t.begin(), t.end());
    }
    return tables;
  }
};

double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    den += double{want[i]} * want[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE(
    "device_decode_step: a captured step replayed over several steps matches the direct "
    "enqueue and the CPU reference") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(2026);
  const oasiskv::kv_layout l{1, 8, 2, 128, 16, oasiskv::dtype::bf16};
  const std::uint32_t num_seqs = 3, max_blocks = 48, q_len = 2, tokens = 2;
  const oasiskv::selection_params sp{12, 1, 2};
  world w(l, num_seqs, max_blocks, rng);
  oc::device_minmax_summary ds(l, w.slots);
  {
    const std::vector<std::uint32_t> all = oasiskv::testing::iota(w.slots);
    ds.upload(w.summary, all);
  }
  const std::uint32_t first_slot = 3, fast_slots = first_slot + num_seqs * sp.budget_blocks + 2;
  // One fast pool per step object: each owns its staging slots.
  device_buffer<std::byte> fast_a(std::size_t{fast_slots} * l.block_bytes()),
      fast_b(std::size_t{fast_slots} * l.block_bytes());
  oc::device_decode_step_options o;
  o.max_seqs = num_seqs + 1;  // the step runs fewer sequences than it is sized for
  o.max_blocks = max_blocks;
  o.selection = sp;
  o.max_q_len = 4;
  o.max_lookahead = tokens;
  o.first_slot = first_slot;
  o.capacity = {w.capacity, l.block_bytes(), w.slots, l};
  o.fast = {fast_a.get(), l.block_bytes(), fast_slots, l};
  // Sized for one more sequence than the pool holds staging slots for: refused.
  CHECK(caught([&] { (void)oc::device_decode_step(ds, o); }).code() == oasiskv::errc::out_of_range);
  o.max_seqs = num_seqs;
  oc::device_decode_step direct(ds, o);
  o.fast.base = fast_b.get();
  oc::device_decode_step graph(ds, o);

  const std::size_t q_elems = std::size_t{num_seqs} * q_len * l.num_q_heads * l.head_dim;
  device_buffer<float> dq(q_elems),
      dlook(std::size_t{num_seqs} * tokens * l.num_q_heads * l.head_dim);
  device_buffer<float> out_a(q_elems), out_b(q_elems), lse_a(q_elems / l.head_dim),
      lse_b(q_elems / l.head_dim);
  oasiskv::testing::stream_guard s;
  oc::device_decode_step_io xa;
  xa.q = dq.get();
  xa.lookahead = dlook.get();
  xa.out = out_a.get();
  xa.lse = lse_a.get();
  xa.num_seqs = num_seqs;
  xa.q_len = q_len;
  xa.lookahead_tokens = tokens;
  oc::device_decode_step_io xb = xa;
  xb.out = out_b.get();
  xb.lse = lse_b.get();
  for (oc::device_decode_step* st : {&direct, &graph}) {
    for (std::uint32_t q = 0; q < num_seqs; ++q) {
      for (std::uint32_t i = 0; i < max_blocks; ++i) {
        st->summary_ids(q)[i] = w.ids[std::size_t{q} * max_blocks + i];
        st->capacity_slots(q)[i] = w.ids[std::size_t{q} * max_blocks + i];
      }
    }
  }
  graph.capture(xb, s);  // records only: nothing runs until replay
  REQUIRE(graph.captured());

  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    if (step > 0) {
      // q_len new tokens per sequence, their keys and values already in the capacity pool.
      for (std::uint32_t q = 0; q < num_seqs; ++q) {
        ds.upload(w.summary, w.append(q, q_len, rng));
      }
      OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
    }
    direct.wait_staging();
    graph.wait_staging();
    for (std::uint32_t q = 0; q < num_seqs; ++q) {
      direct.seq_lens()[q] = w.lens[q];
      graph.seq_lens()[q] = w.lens[q];
    }
    const auto q = oasiskv::testing::random_floats(dq.size(), rng);
    const auto look = oasiskv::testing::random_floats(dlook.size(), rng);
    dq.upload(q);
    dlook.upload(look);
    for (auto* b : {&out_a, &out_b}) {
      oasiskv::testing::fill_device(b->get(), 0xff, b->size() * sizeof(float));  // NaN
    }
    if (step == 3) {
      direct.invalidate(s);  // forgets what is staged: every selected block is copied again
    }
    direct.enqueue(xa, s);
    graph.replay(s);
    direct.check_status(s);
    graph.check_status(s);

    const auto ga = out_a.download(), gb = out_b.download();
    const auto la = lse_a.download(), lb = lse_b.download();
    for (std::size_t i = 0; i < ga.size(); ++i) {
      REQUIRE(std::isfinite(ga[i]));
    }
    // The same kernels on the same inputs: the replay gives the direct enqueue's bits.
    CHECK(std::memcmp(ga.data(), gb.data(), ga.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);

    // The table: the CPU predictor's blocks, each in a staging slot of its sequence that holds
    // the block's current tokens.
    const auto tables = w.select(look, tokens, sp);
    for (oc::device_decode_step* st : {&direct, &graph}) {
      const std::byte* fast = st == &direct ? fast_a.get() : fast_b.get();
      std::vector<std::uint32_t> off(num_seqs + 1);
      oasiskv::testing::copy_to_host(off.data(), st->device_offsets(), off.size() * 4);
      std::vector<block_ref> refs(off.back());
      oasiskv::testing::copy_to_host(refs.data(), st->device_refs(),
                                     refs.size() * sizeof(block_ref));
      std::uint32_t copies = 0;
      oasiskv::testing::copy_to_host(&copies, st->device_copy_count(), 4);
      if (step == 0 || (step == 3 && st == &direct)) {
        CHECK(copies == off.back());  // nothing was staged
      } else {
        // Every last block grew (copied again); every sink block is unchanged (not copied).
        CHECK(copies >= num_seqs);
        CHECK(copies <= off.back() - num_seqs);
      }
      std::vector<std::byte> slot(l.block_bytes());
      for (std::uint32_t q = 0; q < num_seqs; ++q) {
        CAPTURE(q);
        REQUIRE(off[q + 1] - off[q] == tables[q].size());
        std::set<oasiskv::slot_id> used;
        for (std::size_t i = 0; i < tables[q].size(); ++i) {
          const block_ref r = refs[off[q] + i];
          CHECK(r.index == tables[q][i]);
          REQUIRE(r.slot >= first_slot + q * sp.budget_blocks);
          REQUIRE(r.slot < first_slot + (q + 1) * sp.budget_blocks);
          CHECK(used.insert(r.slot).second);
          oasiskv::testing::copy_to_host(slot.data(), fast + std::size_t{r.slot} * l.block_bytes(),
                                         slot.size());
          const std::byte* want = w.block(w.ids[std::size_t{q} * max_blocks + r.index]);
          const std::uint32_t fill = oasiskv::block_fill(l, r.index, w.lens[q]);
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            CHECK(std::memcmp(slot.data() + l.key_offset(h), want + l.key_offset(h),
                              fill * l.row_bytes()) == 0);
            CHECK(std::memcmp(slot.data() + l.value_offset(h), want + l.value_offset(h),
                              fill * l.row_bytes()) == 0);
          }
        }
      }
    }

    // The CPU pipeline: those tables over the capacity pool, reference_decode.
    std::vector<block_ref> hrefs;
    std::vector<std::uint32_t> hoff{0};
    for (std::uint32_t q = 0; q < num_seqs; ++q) {
      for (const std::uint32_t b : tables[q]) {
        hrefs.push_back({w.ids[std::size_t{q} * max_blocks + b], b});
      }
      hoff.push_back(static_cast<std::uint32_t>(hrefs.size()));
    }
    std::vector<float> ref_out(q_elems), ref_lse(q_elems / l.head_dim);
    oasiskv::decode_params hp;
    hp.q = q.data();
    hp.pool = {w.capacity, l.block_bytes(), w.slots, l};
    hp.table = {hrefs.data(), hoff.data(), num_seqs, 1};
    hp.seq_lens = w.lens.data();
    hp.out = ref_out.data();
    hp.lse = ref_lse.data();
    hp.num_seqs = num_seqs;
    hp.q_len = q_len;
    hp.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
    oasiskv::reference_decode{}.decode(hp);
    const double err = relative_l2(ga, ref_out);
    CHECK(err < 1e-4);  // the check fails for NaN too (err would be NaN)
    for (std::size_t i = 0; i < la.size(); ++i) {
      REQUIRE(std::isfinite(ref_lse[i]));
      CHECK(std::fabs(la[i] - ref_lse[i]) <= 1e-3f * std::max(1.0f, std::fabs(ref_lse[i])));
    }
  }
  s.destroy();
}

TEST_CASE("device_decode_step over int8 bounds: topk_selector's tables, staged and decoded") {
  oasiskv::testing::require_cuda_device_or_skip();
  // The step reads a device_quantized_minmax_summary: its tables must be those of a
  // topk_selector over the same summary and queries (the same kernels), each selected block in
  // a slot of its sequence holding its current tokens, and its output the reference's over those
  // tables, across an append (the grown last blocks copied again).
  std::mt19937 rng(3131);
  const oasiskv::kv_layout l{1, 8, 2, 128, 16, oasiskv::dtype::bf16};
  const std::uint32_t num_seqs = 3, max_blocks = 40, tokens = 2;
  const oasiskv::selection_params sp{10, 1, 2};
  world w(l, num_seqs, max_blocks, rng);
  oasiskv::quantized_minmax_summary qs(l, w.slots);
  for (std::uint32_t s = 0; s < num_seqs; ++s) {
    for (std::uint32_t i = 0; i < l.blocks_for(w.lens[s]); ++i) {
      const std::uint32_t id = w.ids[std::size_t{s} * max_blocks + i];
      qs.update(id, w.block(id), 0, oasiskv::block_fill(l, i, w.lens[s]));
    }
  }
  const std::vector<std::uint32_t> all = oasiskv::testing::iota(w.slots);
  oc::device_quantized_minmax_summary ds(l, w.slots);
  ds.upload(qs, all);
  device_buffer<std::byte> fast(std::size_t{num_seqs} * sp.budget_blocks * l.block_bytes());
  oc::device_decode_step_options o;
  o.max_seqs = num_seqs;
  o.max_blocks = max_blocks;
  o.selection = sp;
  o.max_lookahead = tokens;
  o.capacity = {w.capacity, l.block_bytes(), w.slots, l};
  o.fast = {fast.get(), l.block_bytes(), num_seqs * sp.budget_blocks, l};
  oc::device_decode_step step(ds, o);
  CHECK(step.int8_bounds());
  const std::size_t q_elems = std::size_t{num_seqs} * l.num_q_heads * l.head_dim;
  device_buffer<float> dq(q_elems), dlook(q_elems * tokens), out(q_elems),
      lse(q_elems / l.head_dim);
  device_buffer<std::uint32_t> lens(num_seqs), ids(w.ids);
  device_buffer<oasiskv::slot_id> staged(w.ids.size());
  device_buffer<block_ref> refs(std::size_t{num_seqs} * sp.budget_blocks);
  device_buffer<std::uint32_t> offsets(num_seqs + 1);
  for (std::uint32_t q = 0; q < num_seqs; ++q) {
    for (std::uint32_t i = 0; i < max_blocks; ++i) {
      step.summary_ids(q)[i] = w.ids[std::size_t{q} * max_blocks + i];
      step.capacity_slots(q)[i] = w.ids[std::size_t{q} * max_blocks + i];
    }
  }
  oc::device_decode_step_io x;
  x.q = dq.get();
  x.lookahead = dlook.get();
  x.out = out.get();
  x.lse = lse.get();
  x.num_seqs = num_seqs;
  x.lookahead_tokens = tokens;
  oasiskv::testing::stream_guard s;
  oc::topk_selector alone;
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    if (round == 1) {  // a token more per sequence: fresh keys, the summary updated
      for (std::uint32_t q = 0; q < num_seqs; ++q) {
        const std::uint32_t b = w.lens[q] / l.tokens_per_block;
        const std::uint32_t id = w.ids[std::size_t{q} * max_blocks + b];
        w.append(q, 1, rng);
        qs.update(id, w.block(id), (w.lens[q] - 1) % l.tokens_per_block, 1);
        const std::uint32_t one[] = {id};
        ds.upload(qs, one);
      }
      OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
    }
    step.wait_staging();
    for (std::uint32_t q = 0; q < num_seqs; ++q) {
      step.seq_lens()[q] = w.lens[q];
    }
    const auto q = oasiskv::testing::random_floats(dq.size(), rng);
    const auto look = oasiskv::testing::random_floats(dlook.size(), rng);
    dq.upload(q);
    dlook.upload(look);
    out.fill(0xff);
    step.enqueue(x, s);
    step.check_status(s);
    // The same selection by a topk_selector alone.
    lens.upload(w.lens);
    oc::topk_request r;
    r.queries = dlook.get();
    r.num_tokens = tokens;
    r.seq_lens = lens.get();
    r.summary_ids = ids.get();
    r.staged_slots = staged.get();
    r.refs = refs.get();
    r.offsets = offsets.get();
    r.num_seqs = num_seqs;
    r.max_blocks = max_blocks;
    r.params = sp;
    alone.select(ds, r);
    alone.check_status();
    const auto want_off = offsets.download();
    const auto want_refs = refs.download();
    std::vector<std::uint32_t> off(num_seqs + 1);
    oasiskv::testing::copy_to_host(off.data(), step.device_offsets(), off.size() * 4);
    REQUIRE(off == want_off);
    std::vector<block_ref> got(off.back());
    oasiskv::testing::copy_to_host(got.data(), step.device_refs(), got.size() * sizeof(block_ref));
    std::vector<block_ref> hrefs;
    std::vector<std::byte> slot(l.block_bytes());
    for (std::uint32_t i = 0; i < off.back(); ++i) {
      CHECK(got[i].index == want_refs[i].index);
      const std::uint32_t seq =
          static_cast<std::uint32_t>(std::upper_bound(off.begin(), off.end(), i) - off.begin() - 1);
      const std::uint32_t id = w.ids[std::size_t{seq} * max_blocks + got[i].index];
      hrefs.push_back({id, got[i].index});
      oasiskv::testing::copy_to_host(
          slot.data(), fast.get() + std::size_t{got[i].slot} * l.block_bytes(), slot.size());
      const std::uint32_t fill = oasiskv::block_fill(l, got[i].index, w.lens[seq]);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        CHECK(std::memcmp(slot.data() + l.key_offset(h), w.block(id) + l.key_offset(h),
                          fill * l.row_bytes()) == 0);
        CHECK(std::memcmp(slot.data() + l.value_offset(h), w.block(id) + l.value_offset(h),
                          fill * l.row_bytes()) == 0);
      }
    }
    std::vector<float> ref_out(q_elems), ref_lse(q_elems / l.head_dim);
    oasiskv::decode_params hp;
    hp.q = q.data();
    hp.pool = {w.capacity, l.block_bytes(), w.slots, l};
    hp.table = {hrefs.data(), off.data(), num_seqs, 1};
    hp.seq_lens = w.lens.data();
    hp.out = ref_out.data();
    hp.lse = ref_lse.data();
    hp.num_seqs = num_seqs;
    hp.q_len = 1;
    hp.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
    oasiskv::reference_decode{}.decode(hp);
    CHECK(relative_l2(out.download(), ref_out) < 1e-4);
  }
  s.destroy();
}

TEST_CASE("device_decode_step: argument errors are thrown before anything is enqueued") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(5);
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  using e = oasiskv::errc;
  world w(l, 2, 16, rng);
  oc::device_minmax_summary ds(l, w.slots);
  device_buffer<std::byte> fast(std::size_t{16} * l.block_bytes());
  std::vector<std::byte> pageable(std::size_t{w.slots} * l.block_bytes());
  oc::device_decode_step_options o;
  o.max_seqs = 2;
  o.max_blocks = 16;
  o.selection = {8, 1, 2};
  o.max_q_len = 2;
  o.fast = {fast.get(), l.block_bytes(), 16, l};
  o.capacity = {pageable.data(), l.block_bytes(), w.slots, l};
  require_error([&] { (void)oc::device_decode_step(ds, o); }, e::invalid_argument,
                "pageable host memory");
  o.capacity.base = w.capacity;
  {
    auto h = o;
    h.fast.base = w.capacity;  // pinned host memory is not device memory
    require_error([&] { (void)oc::device_decode_step(ds, h); }, e::invalid_argument,
                  "device_decode_step_options.fast");
  }
  oc::device_decode_step step(ds, o);
  device_buffer<float> dq(std::size_t{2} * 2 * l.num_q_heads * l.head_dim);
  device_buffer<float> out(dq.size());
  std::vector<float> host_q(dq.size());
  oc::device_decode_step_io x;
  x.q = dq.get();
  x.lookahead = dq.get();
  x.out = out.get();
  x.num_seqs = 2;
  x.q_len = 1;
  x.lookahead_tokens = 1;

  oasiskv::testing::stream_guard s;
  require_error([&] { step.replay(s); }, e::invalid_argument, "nothing was captured");
  require_error([&] { step.capture(x, nullptr); }, e::invalid_argument, "legacy default stream");

  // Each bad enqueue is made inside a capture of our own: the captured graph must stay empty.
  auto nothing_enqueued = [&](auto edit, e code, const std::string& text) {
    auto y = x;
    edit(y);
    OASISKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    require_error([&] { step.enqueue(y, s); }, code, text);
    cudaGraph_t g = nullptr;
    OASISKV_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    std::size_t nodes = 1;
    OASISKV_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
    CHECK(nodes == 0);
    OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  };
  nothing_enqueued([](auto& y) { y.num_seqs = 3; }, e::invalid_argument, "num_seqs = 3");
  nothing_enqueued([](auto& y) { y.q_len = 0; }, e::invalid_argument, "q_len = 0");
  nothing_enqueued([](auto& y) { y.q_len = 3; }, e::invalid_argument, "q_len = 3");
  nothing_enqueued([](auto& y) { y.lookahead_tokens = 2; }, e::invalid_argument,
                   "lookahead_tokens = 2");
  nothing_enqueued([](auto& y) { y.lookahead = nullptr; }, e::invalid_argument,
                   "lookahead is null");
  nothing_enqueued([&](auto& y) { y.q = host_q.data(); }, e::invalid_argument,
                   "device_decode_step_io.q");
  nothing_enqueued([&](auto& y) { y.out = host_q.data(); }, e::invalid_argument,
                   "device_decode_step_io.out");

  // capture() on a stream that is being captured already: refused, and the outer capture holds
  // nothing of the step.
  OASISKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  require_error([&] { step.capture(x, s); }, e::invalid_argument, "being captured already");
  cudaGraph_t g = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  std::size_t nodes = 1;
  OASISKV_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
  CHECK(nodes == 0);
  OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  CHECK_FALSE(step.captured());
  require_error([&] { (void)step.summary_ids(2); }, e::out_of_range, "sequence 2");

  // The staging area, checked on the host before anything is enqueued.
  for (std::uint32_t q = 0; q < 2; ++q) {
    step.seq_lens()[q] = 40;  // 3 blocks
    for (std::uint32_t i = 0; i < 16; ++i) {
      step.summary_ids(q)[i] = q * 16 + i;
      step.capacity_slots(q)[i] = q * 16 + i;
    }
  }
  auto staging_refused = [&](auto edit, auto undo, e code, const std::string& text) {
    edit();
    OASISKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    require_error([&] { step.enqueue(x, s); }, code, text);
    cudaGraph_t g2 = nullptr;
    OASISKV_CUDA_CHECK(cudaStreamEndCapture(s, &g2));
    std::size_t n2 = 1;
    OASISKV_CUDA_CHECK(cudaGraphGetNodes(g2, nullptr, &n2));
    CHECK(n2 == 0);
    OASISKV_CUDA_CHECK(cudaGraphDestroy(g2));
    undo();
  };
  staging_refused([&] { step.seq_lens()[1] = 0; }, [&] { step.seq_lens()[1] = 40; },
                  e::invalid_argument, "seq_lens[1] = 0 is below q_len = 1");
  staging_refused([&] { step.seq_lens()[0] = 16 * 16 + 1; }, [&] { step.seq_lens()[0] = 40; },
                  e::out_of_range, "more than max_blocks = 16");
  staging_refused([&] { step.summary_ids(1)[2] = w.slots; }, [&] { step.summary_ids(1)[2] = 18; },
                  e::out_of_range, "summary_ids(1)[2]");
  staging_refused([&] { step.capacity_slots(1)[0] = w.slots; },
                  [&] { step.capacity_slots(1)[0] = 16; }, e::invalid_slot, "capacity_slots(1)[0]");
  // replay checks the staging area too, for the captured shape.
  step.capture(x, s);
  step.seq_lens()[0] = 0;
  require_error([&] { step.replay(s); }, e::invalid_argument, "seq_lens[0] = 0");
  step.seq_lens()[0] = 40;

  // Unchecked, a capacity slot outside the pool is not copied and check_status reports it.
  o.check_staging = false;
  oc::device_decode_step unchecked(ds, o);
  for (std::uint32_t q = 0; q < 2; ++q) {
    unchecked.seq_lens()[q] = 40;
    for (std::uint32_t i = 0; i < 16; ++i) {
      unchecked.summary_ids(q)[i] = q * 16 + i;
      unchecked.capacity_slots(q)[i] = q * 16 + i;
    }
  }
  unchecked.capacity_slots(1)[0] = w.slots;  // the sink block of sequence 1
  unchecked.enqueue(x, s);
  require_error([&] { unchecked.check_status(s); }, e::invalid_slot, "capacity_slots");
  CHECK_NOTHROW(unchecked.check_status(s));  // cleared
  s.destroy();
}
