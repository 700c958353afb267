// SPDX-License-Identifier: Apache-2.0
// The facade over a fast tier the CPU must not address (device memory, as `cuda::device_tier`):
// here host memory that declares itself device memory and refuses `slot_data`, so the cache can
// reach its slots only through `write_slot` / `read_slot` (what it writes and audits) and the
// transfer engine's block I/O (what it stages); the kernel reads the pool through `view()`, as
// a device kernel would. Appends, copy-on-write after a fork, the audit and attention are checked
// against `reference_decode` over the capacity tier, with a budget covering the context and with
// one far smaller than it.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/expect_error.hpp"
#include "support/gated_io_tier.hpp"
#include "support/kv_fixture.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;
using oasiskv::testing::max_rel_error;

namespace {

// Host memory playing device memory. Every way in or out is counted; `slot_data` also throws,
// so a cache that used it fails both the call and the zero-count check.
class opaque_tier {
 public:
  static constexpr memory_kind memory = memory_kind::device;

  opaque_tier(const kv_layout& l, std::uint32_t n) : slots_(l, n) {}

  const kv_layout& layout() const noexcept { return slots_.layout(); }
  std::uint32_t num_slots() const noexcept { return slots_.num_slots(); }
  std::size_t slot_bytes() const noexcept { return slots_.slot_bytes(); }

  // addressable_tier, which the policy check asks of a fast tier: the cache must never call
  // `slot_data` of a tier that is not host-accessible.
  std::byte* slot_data(slot_id) { throw forbidden(); }
  const std::byte* slot_data(slot_id) const { throw forbidden(); }
  block_pool_view view() const noexcept { return slots_.view(); }  // the kernel's way in

  // slot_io_tier: the cache's way in and out.
  void write_slot(slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
    check(s, offset, n);
    if (c_->fail_writes) {
      throw std::runtime_error("write_slot: injected failure");
    }
    std::memcpy(slots_.slot_data(s) + offset, in, n);
    ++c_->writes;
    if (n < layout().block_bytes()) {
      ++c_->partial_writes;
    }
  }
  void read_slot(slot_id s, std::size_t offset, std::byte* out, std::size_t n) const {
    check(s, offset, n);
    std::memcpy(out, slots_.slot_data(s) + offset, n);
    ++c_->reads;
  }

  // block_io_tier: the transfer engine's (the staging copies).
  void read_block(slot_id s, std::byte* out) const {
    std::memcpy(out, slots_.slot_data(s), layout().block_bytes());
  }
  void write_block(slot_id s, const std::byte* in) {
    std::memcpy(slots_.slot_data(s), in, layout().block_bytes());
    ++c_->staged;
  }

  // The test's own way in (corrupting a staged copy).
  std::byte* backdoor(slot_id s) { return slots_.slot_data(s); }

  struct counters {
    std::atomic<std::uint64_t> writes{0}, partial_writes{0}, reads{0}, staged{0}, forbidden{0};
    bool fail_writes = false;
  };
  counters& count() const noexcept { return *c_; }

 private:
  std::logic_error forbidden() const {
    ++c_->forbidden;
    return std::logic_error("slot_data of a tier the CPU must not address");
  }
  void check(slot_id s, std::size_t offset, std::size_t n) const {
    REQUIRE(s < num_slots());
    REQUIRE(offset <= layout().block_bytes());
    REQUIRE(n <= layout().block_bytes() - offset);
    REQUIRE(n > 0);
  }

  host_tier slots_;
  std::unique_ptr<counters> c_ = std::make_unique<counters>();  // the engine's thread counts too
};

static_assert(addressable_tier<opaque_tier> && slot_io_tier<opaque_tier>);
static_assert(!host_accessible_tier<opaque_tier>);

// `opaque_tier` that also queues writes (`async_slot_io_tier`), as a device tier's stream does: a
// queued write lands only at `complete_writes` (reading its source then), and a read or a
// staging copy of a slot with a write queued fails the test, so a cache that let anything reach
// such a slot before completing is caught. `fail_completion` makes the next completion throw
// after writing garbage where the queued writes were going (the partial bytes of a failed copy).
class queued_tier : public opaque_tier {
 public:
  queued_tier(const kv_layout& l, std::uint32_t n)
      : opaque_tier(l, n), q_(std::make_unique<queue_state>(n)) {}

  void write_slot_async(slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
    REQUIRE(s < num_slots());
    REQUIRE(offset <= layout().block_bytes());
    REQUIRE(n <= layout().block_bytes() - offset);
    REQUIRE(in != nullptr);
    q_->writes.push_back({s, offset, in, n});
    q_->pending[s] = true;
    ++q_->queued;
  }
  void complete_writes() {
    ++q_->completions;
    const auto writes = std::move(q_->writes);
    q_->writes.clear();
    for (const auto& w : writes) {
      q_->pending[w.s] = false;
      if (q_->fail_completion) {
        std::memset(backdoor(w.s) + w.offset, 0xab, w.n);
      } else {
        std::memcpy(backdoor(w.s) + w.offset, w.in, w.n);
      }
    }
    if (q_->fail_completion && !writes.empty()) {
      q_->fail_completion = false;
      throw std::runtime_error("complete_writes: injected failure");
    }
  }

  void write_slot(slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
    CHECK_FALSE(q_->pending[s]);  // a synchronous write may not overtake a queued one
    opaque_tier::write_slot(s, offset, in, n);
  }
  void read_slot(slot_id s, std::size_t offset, std::byte* out, std::size_t n) const {
    CHECK_FALSE(q_->pending[s]);
    opaque_tier::read_slot(s, offset, out, n);
  }
  void write_block(slot_id s, const std::byte* in) {  // the engine's thread: staging
    CHECK_FALSE(q_->pending[s]);
    opaque_tier::write_block(s, in);
  }

  struct queue_state {
    explicit queue_state(std::uint32_t n) : pending(std::make_unique<std::atomic<bool>[]>(n)) {}
    struct write {
      slot_id s;
      std::size_t offset;
      const std::byte* in;
      std::size_t n;
    };
    std::vector<write> writes;
    std::unique_ptr<std::atomic<bool>[]> pending;  // per slot: a write is queued
    std::uint64_t queued = 0, completions = 0;
    bool fail_completion = false;
  };
  queue_state& queue() const noexcept { return *q_; }

 private:
  std::unique_ptr<queue_state> q_;
};

static_assert(async_slot_io_tier<queued_tier> && !host_accessible_tier<queued_tier>);

template <class Slow, class Fast = opaque_tier>
struct opaque_bundle {
  using allocator = free_list_allocator;
  using fast_tier = Fast;
  using slow_tier = Slow;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = cpu::sparse_decode;
};
using over_host = opaque_bundle<host_tier>;
using over_block_io = opaque_bundle<oasiskv::testing::gated_io_tier>;  // appends keep the tail
using queued_over_host = opaque_bundle<host_tier, queued_tier>;
using queued_over_block_io = opaque_bundle<oasiskv::testing::gated_io_tier, queued_tier>;

// A CPU kernel posing as a device kernel: it takes host-built tables through
// `decode_host_tables`, so the facade treats its queries as memory the predictor cannot read.
struct host_table_cpu_kernel {
  void decode(const decode_params& p) { cpu::sparse_decode{}.decode(p); }
  void decode_host_tables(const decode_params& p) { decode(p); }
};
struct device_kernel_bundle : over_host {
  using kernel = host_table_cpu_kernel;
};

const kv_layout layout{2, 4, 2, 16, 4, dtype::f32};
constexpr float scale = 0.25f;

std::vector<std::byte> random_rows(std::uint32_t n, std::mt19937& rng) {
  std::vector<std::byte> rows(std::size_t{n} * layout.num_kv_heads * layout.row_bytes());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto* p = reinterpret_cast<float*>(rows.data());
  for (std::size_t i = 0; i < rows.size() / sizeof(float); ++i) {
    p[i] = u(rng);
  }
  return rows;
}

std::vector<float> random_queries(std::uint32_t n, std::mt19937& rng) {
  std::vector<float> q(std::size_t{n} * layout.num_q_heads * layout.head_dim);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& x : q) {
    x = u(rng);
  }
  return q;
}

template <class Cache>
void append_random(Cache& c, sequence_id s, std::uint32_t n, std::mt19937& rng) {
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    auto k = random_rows(n, rng), v = random_rows(n, rng);
    c.append(s, l, k.data(), v.data(), n);
  }
}

template <class Cache>
void read_capacity_block(Cache& c, slot_id slot, std::byte* dst) {
  if constexpr (host_accessible_tier<std::remove_cvref_t<decltype(c.capacity_tier())>>) {
    std::memcpy(dst, c.capacity_tier().slot_data(slot), layout.block_bytes());
  } else {
    c.capacity_tier().read_block(slot, dst);
  }
}

// `reference_decode` over the blocks `blocks` names, read from the capacity tier (the
// authoritative copy): what `attend` must equal.
template <class Cache>
void reference(Cache& c, sequence_id s, std::uint32_t l, const attended_blocks& blocks,
               const std::vector<float>& q, std::uint32_t q_len, std::vector<float>& out,
               std::vector<float>& lse) {
  const auto slots = c.block_slots(s, l);
  host_tier copy(layout,
                 static_cast<std::uint32_t>(std::max<std::size_t>(1, blocks.blocks.size())));
  std::vector<block_ref> refs;
  for (std::uint32_t i = 0; i < blocks.blocks.size(); ++i) {
    read_capacity_block(c, slots[blocks.blocks[i]], copy.slot_data(i));
    refs.push_back({i, blocks.blocks[i]});
  }
  const std::uint32_t len = c.length(s, l);
  out.assign(q.size(), 0.0f);
  lse.assign(std::size_t{q_len} * layout.num_q_heads, 0.0f);
  reference_decode{}.decode({q.data(),
                             copy.view(),
                             {refs.data(), blocks.offsets.data(), 1, blocks.tables_per_seq},
                             &len,
                             out.data(),
                             lse.data(),
                             1,
                             q_len,
                             scale});
}

attended_blocks all_blocks(std::size_t n) {
  attended_blocks a;
  for (std::uint32_t b = 0; b < n; ++b) {
    a.blocks.push_back(b);
  }
  a.offsets = {0, static_cast<std::uint32_t>(n)};
  a.tables_per_seq = 1;
  return a;
}

// One step of (s, l): lookahead, attend, and the output against the reference over the blocks
// attended (and, with `dense`, over every block). Returns how many blocks the tables read.
template <class Cache>
std::size_t step(Cache& c, sequence_id s, std::uint32_t l, std::uint32_t q_len, bool dense,
                 std::mt19937& rng) {
  auto draft = random_queries(1, rng);
  c.lookahead(s, l, {draft.data(), nullptr, 1});
  auto q = random_queries(q_len, rng);
  std::vector<float> out(q.size(), NAN), lse(std::size_t{q_len} * layout.num_q_heads, NAN);
  attended_blocks attended;
  const sequence_id one[1] = {s};
  c.attend(one, l, q.data(), q_len, out.data(), lse.data(), &attended);
  std::vector<float> ref, ref_lse;
  reference(c, s, l, attended, q, q_len, ref, ref_lse);
  CHECK(max_rel_error(out, ref) <= 1e-5);
  CHECK(max_rel_error(lse, ref_lse) <= 1e-5);
  const std::size_t blocks = c.block_slots(s, l).size();
  if (dense) {
    CHECK(attended.blocks.size() == blocks);
    reference(c, s, l, all_blocks(blocks), q, q_len, ref, ref_lse);
    CHECK(max_rel_error(out, ref) <= 1e-5);
    CHECK(max_rel_error(lse, ref_lse) <= 1e-5);
  }
  return attended.blocks.size();
}

// A staged block of `s` in the fast tier: (capacity slot, fast slot).
template <class Cache>
std::pair<slot_id, slot_id> some_staged_block(Cache& c, sequence_id s) {
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    for (slot_id x : c.block_slots(s, l)) {
      if (c.scheduler().is_ready(x)) {
        return {x, *c.scheduler().resident_slot(x)};
      }
    }
  }
  FAIL("no staged block");
  return {null_slot, null_slot};
}

template <class Bundle>
typename Bundle::slow_tier make_capacity(std::uint32_t slots) {
  return typename Bundle::slow_tier(layout, slots);
}

}  // namespace

TEST_CASE_TEMPLATE("tiered_kv_cache over a fast tier the CPU must not address", B, over_host,
                   over_block_io, queued_over_host) {
  for (const bool dense : {true, false}) {
    CAPTURE(dense);
    std::mt19937 rng(dense ? 11 : 12);
    // Small: 4 blocks of a context that grows to ~16 (and the fork's), 24 fast slots for two
    // layers of two sequences, so blocks are evicted and staged again.
    const std::uint32_t budget = dense ? 256 : 16;
    tiered_kv_cache<B> cache(
        make_capacity<B>(128), typename B::fast_tier(layout, dense ? 100 : 24),
        {.budget_tokens = budget, .sink_blocks = 1, .recent_blocks = 1, .scale = scale});
    auto& fast = cache.fast_tier().count();
    const sequence_id a = cache.add_sequence();
    append_random(cache, a, 37, rng);  // a partial last block
    std::size_t fewer = 0;             // steps whose tables read fewer blocks than the context
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t q_len = 1 + static_cast<std::uint32_t>(rng() % 3);
      append_random(cache, a, q_len, rng);
      for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
        fewer += step(cache, a, l, q_len, dense, rng) < cache.block_slots(a, l).size();
      }
    }
    if (dense) {
      CHECK(fewer == 0);
    } else {
      CHECK(fewer == 8 * layout.num_layers);  // a budget smaller than the context, every step
    }
    // Blocks created by appends were written in whole, appended rows into staged copies in
    // part: both through the hook.
    CHECK(fast.writes > fast.partial_writes);
    CHECK(fast.partial_writes > 0);
    CHECK(fast.staged > 0);  // and the engine staged the rest

    // Fork: the shared partial block is copied for the writer; the parent never sees the
    // child's tokens.
    if (cache.length(a) % layout.tokens_per_block == 0) {
      append_random(cache, a, 1, rng);  // leave a partial block to share
    }
    const sequence_id child = cache.fork(a);
    const std::vector<float> q = random_queries(1, rng), draft = random_queries(1, rng);
    std::vector<float> before(q.size(), NAN), after(q.size(), NAN);
    const sequence_id pa[1] = {a};
    cache.lookahead(a, 0, {draft.data(), nullptr, 1});
    cache.attend(pa, 0, q.data(), 1, before.data());
    append_random(cache, child, 3, rng);
    cache.lookahead(a, 0, {draft.data(), nullptr, 1});  // the same selection as before
    cache.attend(pa, 0, q.data(), 1, after.data());
    CHECK(max_rel_error(after, before) <= 0.0);
    const auto ps = cache.block_slots(a, 0), cs = cache.block_slots(child, 0);
    REQUIRE(ps.size() <= cs.size());
    CHECK(std::equal(ps.begin(), ps.end() - 1, cs.begin()));  // the full blocks: shared
    CHECK(ps.back() != cs[ps.size() - 1]);                    // the partial one: copied
    CHECK(cache.length(child) == cache.length(a) + 3);
    for (int i = 0; i < 3; ++i) {
      append_random(cache, child, 1, rng);
      append_random(cache, a, 1, rng);
      for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
        step(cache, child, l, 1, dense, rng);
        step(cache, a, l, 1, dense, rng);
      }
    }
    cache.remove(child);

    // The audit reads every staged copy back through the hook, one read per block compared.
    const std::uint64_t reads = fast.reads;
    const std::size_t compared = cache.audit();
    CHECK(compared > 0);
    CHECK(fast.reads - reads == compared);
    // ... and really compares: a corrupted staged copy is found.
    const auto [x, f] = some_staged_block(cache, a);
    std::byte* bytes = cache.fast_tier().backdoor(f) + layout.block_bytes() - 1;
    const std::byte saved = *bytes;
    *bytes = ~saved;
    expect_error([&] { cache.audit(); }, errc::invalid_argument,
                 "staged copy of capacity slot " + std::to_string(x));
    *bytes = saved;
    CHECK(cache.audit() == compared);
    CHECK(fast.forbidden == 0);
  }
}

TEST_CASE("tiered_kv_cache over a fast tier the CPU must not address: a failed write-through") {
  std::mt19937 rng(4);
  tiered_kv_cache<over_host> cache(host_tier(layout, 64), opaque_tier(layout, 40),
                                   {.budget_tokens = 64, .scale = scale});
  const sequence_id a = cache.add_sequence();
  append_random(cache, a, 6, rng);  // block 1 holds 2 tokens, staged as it was created
  REQUIRE(cache.scheduler().is_ready(cache.block_slots(a, 0)[1]));
  cache.fast_tier().count().fail_writes = true;
  auto k = random_rows(1, rng), v = random_rows(1, rng);
  CHECK_THROWS_AS(cache.append(a, 0, k.data(), v.data(), 1), std::runtime_error);
  cache.fast_tier().count().fail_writes = false;
  // Nothing changed but the dropped staged copy, which is fetched again from the capacity tier.
  CHECK(cache.length(a, 0) == 6);
  CHECK_FALSE(cache.scheduler().resident_slot(cache.block_slots(a, 0)[1]).has_value());
  CHECK(cache.audit() > 0);
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    step(cache, a, l, 1, true, rng);
  }
  CHECK(cache.audit() > 0);
  CHECK(cache.fast_tier().count().forbidden == 0);
}

TEST_CASE("tiered_kv_cache with a device kernel: the step's selection must come from lookahead") {
  static_assert(tiered_kv_cache<device_kernel_bundle>::host_table_kernel);
  std::mt19937 rng(6);
  tiered_kv_cache<device_kernel_bundle> cache(host_tier(layout, 64), opaque_tier(layout, 40),
                                              {.budget_tokens = 16, .scale = scale});
  const sequence_id a = cache.add_sequence();
  append_random(cache, a, 30, rng);
  auto q = random_queries(1, rng);
  std::vector<float> out(q.size());
  const sequence_id one[1] = {a};
  expect_error([&] { cache.attend(one, 1, q.data(), 1, out.data()); }, errc::invalid_argument,
               "sequence 1 layer 1 has no lookahead selection");
  CHECK(cache.stats().sequence_steps == 0);  // refused before anything was staged
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    CHECK(step(cache, a, l, 1, false, rng) < cache.block_slots(a, l).size());
  }
  CHECK(cache.audit() > 0);
  CHECK(cache.fast_tier().count().forbidden == 0);
}

namespace {

// The rows of `n` tokens for each of `seqs` sequences, as the batched append takes them, and
// the same rows one sequence at a time.
struct batch_rows {
  std::vector<std::byte> k, v;
  std::size_t per_seq;
  batch_rows(std::size_t seqs, std::uint32_t n, std::mt19937& rng)
      : k(random_rows(static_cast<std::uint32_t>(seqs * n), rng)),
        v(random_rows(static_cast<std::uint32_t>(seqs * n), rng)),
        per_seq(std::size_t{n} * layout.num_kv_heads * layout.row_bytes()) {}
  const std::byte* key(std::size_t i) const { return k.data() + i * per_seq; }
  const std::byte* value(std::size_t i) const { return v.data() + i * per_seq; }
};

template <class Cache>
std::vector<std::uint32_t> lengths(const Cache& c, const std::vector<sequence_id>& ids) {
  std::vector<std::uint32_t> out;
  for (const sequence_id s : ids) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      out.push_back(c.length(s, l));
    }
  }
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("a batched append equals one append per sequence, and queues its write-through",
                   B, over_host, queued_over_host, queued_over_block_io) {
  constexpr bool queues = std::is_same_v<typename B::fast_tier, queued_tier> &&
                          host_accessible_tier<typename B::slow_tier>;
  std::mt19937 rng(21);
  // Two caches fed the same rows: one by batched appends, one by an append per sequence (the
  // independent model). Fast memory for every block, so each sequence's last block is staged and
  // every append writes through.
  tiered_kv_cache<B> batched(make_capacity<B>(96), typename B::fast_tier(layout, 96),
                             {.budget_tokens = 16, .scale = scale});
  tiered_kv_cache<B> single(make_capacity<B>(96), typename B::fast_tier(layout, 96),
                            {.budget_tokens = 16, .scale = scale});
  std::vector<sequence_id> ids;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(batched.add_sequence());
    REQUIRE(single.add_sequence() == ids.back());
  }
  std::uint64_t calls_without_new_block = 0;
  for (int step_no = 0; step_no < 9; ++step_no) {
    const std::uint32_t n = step_no == 0 ? 10 : 1 + static_cast<std::uint32_t>(rng() % 2);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const batch_rows rows(ids.size(), n, rng);
      bool new_block = false;
      for (const sequence_id s : ids) {
        new_block = new_block || batched.length(s, l) % layout.tokens_per_block == 0 ||
                    batched.length(s, l) % layout.tokens_per_block + n > layout.tokens_per_block;
      }
      const auto before = [&] {
        if constexpr (queues) {
          return std::pair{batched.fast_tier().queue().queued,
                           batched.fast_tier().queue().completions};
        } else {
          return std::pair{std::uint64_t{0}, std::uint64_t{0}};
        }
      }();
      batched.append(ids, l, rows.k.data(), rows.v.data(), n);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        single.append(ids[i], l, rows.key(i), rows.value(i), n);
      }
      if constexpr (queues) {
        const auto& q = batched.fast_tier().queue();
        CHECK(q.writes.empty());  // nothing left queued when the call returns
        if (!new_block) {
          // Every sequence's staged last block written through; all waited for once.
          CHECK(q.queued - before.first == ids.size());
          CHECK(q.completions - before.second == 1);
          ++calls_without_new_block;
        }
      }
    }
    for (const sequence_id s : ids) {
      for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
        CHECK(batched.length(s, l) == single.length(s, l));
        // Attention over the batched cache equals the reference over its capacity tier, and
        // the capacity tiers of the two caches hold the same bytes.
        step(batched, s, l, 1, false, rng);
        const auto bs = batched.block_slots(s, l), ss = single.block_slots(s, l);
        REQUIRE(bs.size() == ss.size());
        std::vector<std::byte> x(layout.block_bytes()), y(layout.block_bytes());
        for (std::size_t b = 0; b < bs.size(); ++b) {
          read_capacity_block(batched, bs[b], x.data());
          read_capacity_block(single, ss[b], y.data());
          CHECK(x == y);
        }
      }
    }
  }
  if constexpr (queues) {
    CHECK(calls_without_new_block > 0);
  }
  CHECK(batched.audit() > 0);  // every staged copy equals its capacity block
  CHECK(batched.fast_tier().count().forbidden == 0);
}

TEST_CASE("a batched append checks every sequence before it writes any") {
  std::mt19937 rng(22);
  tiered_kv_cache<queued_over_host> cache(
      host_tier(layout, 64), queued_tier(layout, 64),
      {.budget_tokens = 16, .max_tokens_per_sequence = 12, .scale = scale});
  const sequence_id a = cache.add_sequence(), b = cache.add_sequence();
  append_random(cache, a, 5, rng);
  append_random(cache, b, 11, rng);
  const std::vector<std::uint32_t> held = lengths(cache, {a, b});
  const batch_rows rows(3, 1, rng);
  const std::uint64_t queued = cache.fast_tier().queue().queued;
  const std::vector<sequence_id> unknown{a, sequence_id{99}}, twice{a, b, a}, ab{a, b};
  expect_error([&] { cache.append(unknown, 0, rows.k.data(), rows.v.data(), 1); },
               errc::unknown_sequence, "99");
  expect_error(
      [&] { cache.append(twice, 0, rows.k.data(), rows.v.data(), 1); }, errc::invalid_argument,
      "sequence " + std::to_string(static_cast<std::uint64_t>(a)) + " appears more than once");
  expect_error([&] { cache.append(ab, 0, nullptr, rows.v.data(), 1); }, errc::invalid_argument,
               "null keys or values for 2 sequences");
  expect_error([&] { cache.append(ab, 0, rows.k.data(), rows.v.data(), 2); }, errc::out_of_range,
               "max_tokens_per_sequence = 12");
  expect_error([&] { cache.append(ab, 2, rows.k.data(), rows.v.data(), 1); }, errc::out_of_range,
               "layer 2 is outside");
  CHECK(lengths(cache, {a, b}) == held);
  CHECK(cache.fast_tier().queue().queued == queued);     // refused before anything was queued
  cache.append(ab, 0, rows.k.data(), rows.v.data(), 0);  // nothing to append
  CHECK(lengths(cache, {a, b}) == held);
  CHECK(cache.audit() > 0);
}

TEST_CASE("a batched append that fails part-way leaves every sequence as it was") {
  std::mt19937 rng(23);
  SUBCASE("the queued write-through fails: the staged copies it reached are dropped") {
    tiered_kv_cache<queued_over_host> cache(host_tier(layout, 64), queued_tier(layout, 64),
                                            {.budget_tokens = 16, .scale = scale});
    const std::vector<sequence_id> ids{cache.add_sequence(), cache.add_sequence()};
    for (const sequence_id s : ids) {
      append_random(cache, s, 6, rng);  // block 1 holds 2 tokens, staged as it was created
    }
    std::vector<slot_id> last;
    for (const sequence_id s : ids) {
      last.push_back(cache.block_slots(s, 0)[1]);
      REQUIRE(cache.scheduler().is_ready(last.back()));
    }
    const std::vector<std::uint32_t> held = lengths(cache, ids);
    cache.fast_tier().queue().fail_completion = true;
    const batch_rows rows(ids.size(), 1, rng);
    CHECK_THROWS_AS(cache.append(ids, 0, rows.k.data(), rows.v.data(), 1), std::runtime_error);
    CHECK(lengths(cache, ids) == held);
    for (const slot_id x : last) {  // garbage landed there: never attended, fetched again
      CHECK_FALSE(cache.scheduler().resident_slot(x).has_value());
    }
    CHECK(cache.audit() > 0);
    for (const sequence_id s : ids) {
      for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
        step(cache, s, l, 1, true, rng);
      }
    }
    cache.append(ids, 0, rows.k.data(), rows.v.data(), 1);  // and it works again
    CHECK(cache.length(ids[1], 0) == held[layout.num_layers] + 1);
    CHECK(cache.audit() > 0);
  }
  SUBCASE("no capacity slot is left for the last sequence: the earlier ones are undone") {
    // 3 sequences of 8 tokens (2 full blocks each, 2 layers): 12 of 13 slots used; the next
    // token of each needs a new block in layer 0, and only the first gets one.
    tiered_kv_cache<queued_over_host> cache(host_tier(layout, 13), queued_tier(layout, 40),
                                            {.budget_tokens = 16, .scale = scale});
    std::vector<sequence_id> ids;
    for (int i = 0; i < 3; ++i) {
      ids.push_back(cache.add_sequence());
      append_random(cache, ids.back(), 8, rng);
    }
    const std::vector<std::uint32_t> held = lengths(cache, ids);
    std::vector<std::vector<slot_id>> slots;
    for (const sequence_id s : ids) {
      slots.push_back(cache.block_slots(s, 0));
    }
    const batch_rows rows(ids.size(), 1, rng);
    CHECK_THROWS_AS(cache.append(ids, 0, rows.k.data(), rows.v.data(), 1), oasiskv::error);
    CHECK(lengths(cache, ids) == held);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      CHECK(cache.block_slots(ids[i], 0) == slots[i]);
    }
    CHECK(cache.fast_tier().queue().writes.empty());
    // The first sequence's new block was released: one sequence can append again.
    const std::vector<sequence_id> one{ids[2]};
    cache.append(one, 0, rows.key(2), rows.value(2), 1);
    CHECK(cache.length(ids[2], 0) == 9);
    CHECK(cache.audit() > 0);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      step(cache, ids[2], l, 1, true, rng);
    }
  }
}
