// SPDX-License-Identifier: Apache-2.0
// An engine's code: a policy of its own (a FIFO slot allocator) in a bundle with shipped ones,
// and one sparse decode step over blocks staged from a capacity tier.
#include <oasiskv/oasiskv.hpp>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <random>
#include <vector>

namespace engine {

// Hands slots out in the order they were freed: spreads wear over the pool. Not the library's.
class fifo_allocator {
 public:
  explicit fifo_allocator(std::size_t n) : held_(n, false) {
    for (std::size_t i = 0; i < n; ++i) {
      free_.push_back(static_cast<oasiskv::slot_id>(i));
    }
  }
  std::optional<oasiskv::slot_id> allocate() {
    if (free_.empty()) {
      return std::nullopt;
    }
    const auto s = free_.front();
    free_.pop_front();
    held_[s] = true;
    return s;
  }
  void deallocate(oasiskv::slot_id s) {
    if (s >= held_.size() || !held_[s]) {
      throw oasiskv::error(oasiskv::errc::double_free, "fifo_allocator: slot not held");
    }
    held_[s] = false;
    free_.push_back(s);
  }
  std::size_t capacity() const { return held_.size(); }
  std::size_t available() const { return free_.size(); }

 private:
  std::deque<oasiskv::slot_id> free_;
  std::vector<bool> held_;
};

struct policies {
  using allocator = fifo_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::host_tier;
  using transfer = oasiskv::cpu_copy_engine;
  using kernel = oasiskv::reference_decode;
};
static_assert(oasiskv::check_policy_bundle<policies>);

}  // namespace engine

int main() {
  const oasiskv::kv_layout layout{2, 4, 2, 16, 8, oasiskv::dtype::f32};
  const std::uint32_t tokens = 40, blocks = layout.blocks_for(tokens);
  engine::policies::slow_tier slow(layout, blocks);
  engine::policies::fast_tier fast(layout, 3);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (oasiskv::slot_id s = 0; s < blocks; ++s) {
    auto* p = reinterpret_cast<float*>(slow.slot_data(s));
    for (std::size_t i = 0; i < layout.block_bytes() / 4; ++i) {
      p[i] = u(rng);
    }
  }
  // Stage blocks 0 (sink), 2 and the last one into the fast tier.
  engine::policies::allocator alloc(fast.num_slots());
  std::vector<oasiskv::block_copy> copies;
  std::vector<oasiskv::block_ref> staged, direct;
  for (std::uint32_t b : {0u, 2u, blocks - 1}) {
    const auto slot = alloc.allocate().value();
    copies.push_back({b, slot});
    staged.push_back({slot, b});
    direct.push_back({b, b});
  }
  engine::policies::transfer engine_;
  engine_.wait(engine_.submit(slow, fast, copies));

  std::vector<float> q(layout.num_q_heads * layout.head_dim), out1(q.size()), out2(q.size());
  std::vector<float> lse1(layout.num_q_heads), lse2(layout.num_q_heads);
  for (float& x : q) {
    x = u(rng);
  }
  const std::uint32_t offsets[2] = {0, 3};
  oasiskv::decode_params p{q.data(), fast.view(), {staged.data(), offsets, 1, 1},
                           &tokens,  out1.data(), lse1.data(),
                           1,        1,           0.25f};
  engine::policies::kernel kernel;
  kernel.decode(p);
  p.pool = slow.view();  // the same blocks read in place from the capacity tier
  p.table.refs = direct.data();
  p.out = out2.data();
  p.lse = lse2.data();
  kernel.decode(p);
  if (out1 != out2 || lse1 != lse2) {
    std::puts("consumer: staged and in-place attention differ");
    return 1;
  }
  // A predictor over the same blocks: summaries, scoring kernels, aggregation and top-k.
  oasiskv::minmax_summary<> summary(layout, blocks);
  std::vector<std::uint32_t> ids(blocks);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::uint32_t first = b * layout.tokens_per_block;
    summary.update(b, slow.slot_data(b), 0, std::min(layout.tokens_per_block, tokens - first));
    ids[b] = b;
  }
  oasiskv::lookahead_predictor<oasiskv::minmax_summary<>> predictor;
  oasiskv::selection sel;
  predictor.select({layout, tokens, &summary, ids, {q.data(), nullptr, 1}}, {3, 1, 1}, sel);
  if (sel.blocks.size() != 3 || sel.blocks.front() != 0 || sel.blocks.back() != blocks - 1) {
    std::puts("consumer: the selection lacks the sink or the newest block");
    return 1;
  }
  std::printf("consumer ok (oasiskv %d.%d.%d, %zu of %zu fast slots used)\n",
              oasiskv::version.major, oasiskv::version.minor, oasiskv::version.patch,
              alloc.capacity() - alloc.available(), alloc.capacity());
  return 0;
}
