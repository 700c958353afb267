// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "concepts/archetypes.hpp"
#include "oasiskv/oasiskv.hpp"

using namespace oasiskv;

// block_allocator
static_assert(block_allocator<archetype::allocator>);
static_assert(!block_allocator<archetype::allocator_without_deallocate>);
static_assert(!block_allocator<archetype::allocator_returning_raw_id>);
static_assert(!block_allocator<archetype::allocator_with_mutating_capacity>);
static_assert(block_allocator<free_list_allocator>);
static_assert(block_allocator<refcounted_allocator<free_list_allocator>>);
static_assert(block_allocator<refcounted_allocator<refcounted_allocator<free_list_allocator>>>);

// tier_backend and its refinements
static_assert(tier_backend<archetype::tier> && addressable_tier<archetype::tier> &&
              host_accessible_tier<archetype::tier>);
static_assert(addressable_tier<archetype::device_tier> &&
              !host_accessible_tier<archetype::device_tier>);
static_assert(tier_backend<archetype::io_tier> && block_io_tier<archetype::io_tier> &&
              !addressable_tier<archetype::io_tier>);
static_assert(!tier_backend<archetype::tier_without_memory_kind>);
static_assert(!tier_backend<archetype::tier_without_slot_bytes>);
static_assert(host_accessible_tier<host_tier> && !block_io_tier<host_tier>);

// transfer_engine
static_assert(transfer_engine<archetype::engine, archetype::tier, archetype::tier>);
static_assert(!transfer_engine<archetype::engine_without_test, archetype::tier, archetype::tier>);
static_assert(
    !transfer_engine<archetype::engine_without_ticket_type, archetype::tier, archetype::tier>);
static_assert(!transfer_engine<archetype::engine, archetype::io_tier, archetype::tier>);
static_assert(transfer_engine<cpu_copy_engine, host_tier, host_tier>);
static_assert(transfer_engine<cpu_copy_engine, archetype::io_tier, host_tier>);
static_assert(transfer_engine<cpu_copy_engine, host_tier, archetype::io_tier>);
static_assert(!transfer_engine<cpu_copy_engine, archetype::device_tier, host_tier>);

// block_summary, importance_predictor
static_assert(block_summary<archetype::summary>);
static_assert(!block_summary<archetype::summary_without_update>);
// The tile the facade groups a layer's entries by: the summary's own, else 16.
struct summary_with_tiles_of_4 : archetype::summary {
  static constexpr std::uint32_t entries_per_tile = 4;
};
static_assert(summary_tile_entries_v<archetype::summary> == 16);
static_assert(summary_tile_entries_v<summary_with_tiles_of_4> == 4);
static_assert(summary_tile_entries_v<minmax_summary<f16>> == cpu::detail::minmax_tile_lanes);
static_assert(summary_tile_entries_v<quantized_minmax_summary> == cpu::detail::qminmax_lanes);
static_assert(importance_predictor<archetype::predictor>);
static_assert(importance_predictor<archetype::summaryless_predictor>);
static_assert(!importance_predictor<archetype::predictor_over_a_non_summary>);
static_assert(!importance_predictor<archetype::predictor_without_timing>);

// eviction_policy
static_assert(eviction_policy<archetype::eviction>);
static_assert(!eviction_policy<archetype::eviction_returning_raw_slot>);
static_assert(eviction_policy<lru_eviction> && eviction_policy<score_eviction>);

// score_aggregation, mass_aggregation, selection_granularity, log_mass_summary
struct aggregation_without_combine {};
struct granularity_not_constant {
  static inline bool per_kv_head = false;
};
static_assert(score_aggregation<max_aggregation> && !mass_aggregation<max_aggregation>);
static_assert(mass_aggregation<softmax_mass_aggregation>);
static_assert(!score_aggregation<aggregation_without_combine>);
static_assert(selection_granularity<shared_selection> &&
              selection_granularity<per_kv_head_selection>);
static_assert(!selection_granularity<granularity_not_constant>);
static_assert(log_mass_summary<int8_key_summary> && !log_mass_summary<minmax_summary<f16>>);
static_assert(!log_mass_summary<archetype::summary>);
static_assert(two_stage_summary<archetype::summary_with_two_stage>);
static_assert(two_stage_summary<qminmax_int4_cascade> && two_stage_summary<qminmax_int8_cascade>);
static_assert(!two_stage_summary<archetype::summary> && !two_stage_summary<int4_key_summary> &&
              !two_stage_summary<quantized_minmax_summary>);
static_assert(block_summary<qminmax_int4_cascade> && growable_summary<qminmax_int4_cascade> &&
              log_mass_summary<qminmax_int4_cascade>);
// Optional hooks only where both parts (loadable, growable) or the fine part (row scoring) have
// them: int4_key_summary loads nothing and writes no rows; both min/max summaries do both.
static_assert(!loadable_summary<qminmax_int4_cascade> &&
              !row_scoring_summary<qminmax_int4_cascade>);
static_assert(loadable_summary<cascade_summary<quantized_minmax_summary, minmax_summary<f16>>> &&
              row_scoring_summary<cascade_summary<quantized_minmax_summary, minmax_summary<f16>>>);
static_assert(!log_mass_summary<cascade_summary<quantized_minmax_summary, minmax_summary<f16>>>);
static_assert(summary_tile_entries_v<qminmax_int4_cascade> == cpu::detail::qminmax_lanes);

// prefetch_scheduler
static_assert(prefetch_scheduler<archetype::scheduler>);
static_assert(!prefetch_scheduler<archetype::scheduler_without_release>);

// sparse_attention_kernel
static_assert(sparse_attention_kernel<archetype::kernel>);
static_assert(!sparse_attention_kernel<archetype::kernel_taking_mutable_params>);
static_assert(sparse_attention_kernel<reference_decode>);

// Optional hooks: each satisfied by its archetype and the shipped models that have it, and not
// by a model without it.
static_assert(claimable_allocator<archetype::allocator_with_take> &&
              claimable_allocator<free_list_allocator>);
static_assert(!claimable_allocator<archetype::allocator>);
static_assert(declares_read_only_tier<archetype::read_only_io_tier>);
static_assert(!declares_read_only_tier<archetype::writable_io_tier> &&
              !declares_read_only_tier<archetype::io_tier> && !declares_read_only_tier<host_tier>);
static_assert(read_only_slot_tier<archetype::io_tier_with_read_only_slots> &&
              read_only_slot_tier<composite_tier<host_tier, host_tier>>);
static_assert(!read_only_slot_tier<archetype::io_tier> && !read_only_slot_tier<host_tier>);
static_assert(flushable_tier<archetype::io_tier_with_flush> && flushable_tier<file_tier>);
static_assert(!flushable_tier<archetype::io_tier> && !flushable_tier<host_tier>);
static_assert(slot_io_tier<archetype::device_tier_with_slot_io>);
static_assert(!slot_io_tier<archetype::device_tier> &&
              !slot_io_tier<archetype::device_tier_with_mutable_read> &&
              !slot_io_tier<archetype::io_tier> && !slot_io_tier<host_tier>);
static_assert(host_table_kernel<archetype::kernel_with_host_tables>);
static_assert(!host_table_kernel<archetype::kernel> && !host_table_kernel<reference_decode>);
static_assert(tier_bound_engine<archetype::engine_bound_to_io_tier, archetype::io_tier>);
static_assert(tier_bound_engine<routing_engine<cpu_copy_engine, cpu_copy_engine>,
                                composite_tier<host_tier, host_tier>>);
static_assert(!tier_bound_engine<cpu_copy_engine, host_tier>);
static_assert(drainable_scheduler<archetype::scheduler_with_hooks> &&
              new_block_staging_scheduler<archetype::scheduler_with_hooks> &&
              moded_scheduler<archetype::scheduler_with_hooks>);
static_assert(!drainable_scheduler<archetype::scheduler> &&
              !new_block_staging_scheduler<archetype::scheduler> &&
              !moded_scheduler<archetype::scheduler>);
static_assert(!new_block_staging_scheduler<archetype::scheduler_with_raw_stage_new>);
using shipped_scheduler =
    lookahead_prefetcher<lru_eviction>::bind<host_tier, host_tier, cpu_copy_engine,
                                             free_list_allocator>;
static_assert(drainable_scheduler<shipped_scheduler> &&
              new_block_staging_scheduler<shipped_scheduler> && moded_scheduler<shipped_scheduler>);

// A bundle of the shipped models, and one mixing in archetypes as an engine's own policies.
struct shipped_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = host_tier;
  using transfer = cpu_copy_engine;
  using kernel = reference_decode;
};
struct engine_bundle {
  using allocator = archetype::allocator;
  using fast_tier = host_tier;
  using slow_tier = archetype::io_tier;
  using transfer = cpu_copy_engine;
  using summary = archetype::summary;
  using predictor = archetype::predictor;
  using kernel = archetype::kernel;
};
static_assert(check_policy_bundle<shipped_bundle>);
static_assert(check_policy_bundle<engine_bundle>);

TEST_CASE("concept checks are compile-time; the static_asserts above are the test") {
  CHECK(check_policy_bundle<shipped_bundle>);
}
