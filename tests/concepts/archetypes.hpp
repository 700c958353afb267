// SPDX-License-Identifier: Apache-2.0
//! Archetypes: minimal types that model each concept exactly, and variants that each lack one
//! required expression. The concept tests check both sides of every concept.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/core/views.hpp"

namespace archetype {
using namespace oasiskv;

struct allocator {
  std::optional<slot_id> allocate();
  void deallocate(slot_id);
  std::size_t capacity() const;
  std::size_t available() const;
};
struct allocator_without_deallocate {
  std::optional<slot_id> allocate();
  std::size_t capacity() const;
  std::size_t available() const;
};
struct allocator_returning_raw_id {  // allocate() must say "full" without a sentinel
  slot_id allocate();
  void deallocate(slot_id);
  std::size_t capacity() const;
  std::size_t available() const;
};
struct allocator_with_mutating_capacity {  // capacity() must be callable on a const allocator
  std::optional<slot_id> allocate();
  void deallocate(slot_id);
  std::size_t capacity();
  std::size_t available() const;
};

struct tier {
  static constexpr memory_kind memory = memory_kind::host;
  const kv_layout& layout() const;
  std::uint32_t num_slots() const;
  std::size_t slot_bytes() const;
  std::byte* slot_data(slot_id);
  const std::byte* slot_data(slot_id) const;
  block_pool_view view() const;
};
struct device_tier {
  static constexpr memory_kind memory = memory_kind::device;
  const kv_layout& layout() const;
  std::uint32_t num_slots() const;
  std::size_t slot_bytes() const;
  std::byte* slot_data(slot_id);
  const std::byte* slot_data(slot_id) const;
  block_pool_view view() const;
};
struct device_tier_with_slot_io : device_tier {  // slot_io_tier
  void write_slot(slot_id, std::size_t, const std::byte*, std::size_t);
  void read_slot(slot_id, std::size_t, std::byte*, std::size_t) const;
};
struct device_tier_with_mutable_read : device_tier {  // near miss: read_slot not const
  void write_slot(slot_id, std::size_t, const std::byte*, std::size_t);
  void read_slot(slot_id, std::size_t, std::byte*, std::size_t);
};
struct io_tier {
  static constexpr memory_kind memory = memory_kind::file;
  const kv_layout& layout() const;
  std::uint32_t num_slots() const;
  std::size_t slot_bytes() const;
  void read_block(slot_id, std::byte*) const;
  void write_block(slot_id, const std::byte*);
};
// Optional tier hooks.
struct read_only_io_tier : io_tier {  // declares_read_only_tier
  static constexpr bool read_only = true;
};
struct writable_io_tier : io_tier {  // says read_only, but false
  static constexpr bool read_only = false;
};
struct io_tier_with_read_only_slots : io_tier {  // read_only_slot_tier
  std::uint32_t read_only_slots() const;
};
struct io_tier_with_flush : io_tier {  // flushable_tier
  void flush();
};
struct tier_without_memory_kind {
  const kv_layout& layout() const;
  std::uint32_t num_slots() const;
  std::size_t slot_bytes() const;
};
struct tier_without_slot_bytes {
  static constexpr memory_kind memory = memory_kind::host;
  const kv_layout& layout() const;
  std::uint32_t num_slots() const;
};

struct engine {
  struct ticket {};
  ticket submit(const tier&, tier&, std::span<const block_copy>);
  bool test(const ticket&);
  void wait(const ticket&);
};
struct engine_without_test {
  struct ticket {};
  ticket submit(const tier&, tier&, std::span<const block_copy>);
  void wait(const ticket&);
};
struct engine_without_ticket_type {
  int submit(const tier&, tier&, std::span<const block_copy>);
  bool test(int);
  void wait(int);
};

struct eviction {
  explicit eviction(std::uint32_t);
  void insert(slot_id, std::uint64_t);
  void touch(slot_id, std::uint64_t);
  void erase(slot_id);
  template <class Pred>
  std::optional<slot_id> victim(Pred&&) const;
};
struct eviction_returning_raw_slot {
  explicit eviction_returning_raw_slot(std::uint32_t);
  void insert(slot_id, std::uint64_t);
  void touch(slot_id, std::uint64_t);
  void erase(slot_id);
  template <class Pred>
  slot_id victim(Pred&&) const;
};

struct summary {
  summary(const kv_layout&, std::uint32_t);
  std::uint32_t capacity() const;
  void reset(std::uint32_t);
  void update(std::uint32_t, const std::byte*, std::uint32_t, std::uint32_t);
  void score(std::uint32_t, std::span<const std::uint32_t>, const float*, std::uint32_t,
             float*) const;
  std::size_t bytes_per_block() const;
};
// block_summary plus the two_stage_summary hook.
struct summary_with_two_stage : summary {
  using summary::summary;
  void score_two_stage(std::uint32_t, std::span<const std::uint32_t>, const float*, std::uint32_t,
                       float, std::uint32_t, float*) const;
};
struct summary_without_update {
  summary_without_update(const kv_layout&, std::uint32_t);
  std::uint32_t capacity() const;
  void reset(std::uint32_t);
  void score(std::uint32_t, std::span<const std::uint32_t>, const float*, std::uint32_t,
             float*) const;
  std::size_t bytes_per_block() const;
};

struct predictor {
  using summary_type = summary;
  static constexpr prediction_timing timing = prediction_timing::lookahead;
  void select(const prediction_input<summary>&, const selection_params&, selection&);
};
struct summaryless_predictor {
  using summary_type = no_summary;
  static constexpr prediction_timing timing = prediction_timing::at_attention;
  void select(const prediction_input<no_summary>&, const selection_params&, selection&);
};
struct predictor_over_a_non_summary {
  using summary_type = int;
  static constexpr prediction_timing timing = prediction_timing::lookahead;
  void select(const prediction_input<int>&, const selection_params&, selection&);
};

struct predictor_without_timing {
  using summary_type = summary;
  void select(const prediction_input<summary>&, const selection_params&, selection&);
};

struct scheduler {
  void prefetch(std::span<const slot_id>);
  acquire_stats acquire(std::span<const slot_id>, std::span<slot_id>);
  void release(std::span<const slot_id>);
  std::optional<slot_id> settle(slot_id);
  void forget(slot_id);
  std::size_t resident_blocks() const;
};
struct scheduler_without_release {
  void prefetch(std::span<const slot_id>);
  acquire_stats acquire(std::span<const slot_id>, std::span<slot_id>);
  std::optional<slot_id> settle(slot_id);
  void forget(slot_id);
  std::size_t resident_blocks() const;
};

struct kernel {
  void decode(const decode_params&);
};
struct kernel_taking_mutable_params {  // decode must accept a const decode_params&
  void decode(decode_params&);
};

// Optional hooks of allocators, kernels, engines and schedulers.
struct allocator_with_take : allocator {  // claimable_allocator
  void take(slot_id);
};
struct kernel_with_host_tables : kernel {  // host_table_kernel
  void decode_host_tables(const decode_params&);
};
struct engine_bound_to_io_tier : engine {  // tier_bound_engine<_, io_tier>
  explicit engine_bound_to_io_tier(io_tier&);
};
struct scheduler_with_hooks : scheduler {  // drainable, new-block staging, moded
  static constexpr prefetch_mode mode = prefetch_mode::lookahead;
  void drain();
  std::optional<slot_id> stage_new(slot_id);
};
struct scheduler_with_raw_stage_new : scheduler {  // stage_new must return an optional
  slot_id stage_new(slot_id);
};

}  // namespace archetype
