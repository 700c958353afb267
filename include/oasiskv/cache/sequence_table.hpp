// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::sequence_table`: the sequences of a cache, each a `layer_state` per layer, and
//! the lookups that name what a call got wrong.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oasiskv/cache/layer_blocks.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv::cache {

//! @brief One (sequence, layer): its blocks in the capacity tier and the selection the last
//! `lookahead` made for its next step.
struct layer_state : layer_blocks {
  std::optional<selection> pending;
};

//! @brief Sequence ids to their layers. Not thread-safe: the cache calls it under its lock.
//! Every lookup that fails raises `errc::unknown_sequence` or `errc::out_of_range`, naming the
//! call (`what`), the sequence and the layer.
class sequence_table {
 public:
  explicit sequence_table(std::uint32_t num_layers) noexcept : num_layers_(num_layers) {}

  //! @brief Adds a sequence of `layers` (one per layer of the model); returns its new id.
  sequence_id insert(std::vector<layer_state> layers) {
    const sequence_id id{next_++};
    sequences_.emplace(id, std::move(layers));
    return id;
  }
  //! @brief The layers of an adopted sequence of `tokens` tokens: `slots` is
  //! `[num_layers][blocks]`, layer-major.
  std::vector<layer_state> adopted(std::uint32_t tokens, std::span<const slot_id> slots,
                                   std::uint32_t blocks) const {
    std::vector<layer_state> layers(num_layers_);
    for (std::uint32_t l = 0; l < num_layers_; ++l) {
      layers[l].tokens = tokens;
      layers[l].blocks.assign(slots.begin() + std::ptrdiff_t{l} * blocks,
                              slots.begin() + std::ptrdiff_t{l + 1} * blocks);
    }
    return layers;
  }
  //! @brief Adds an empty sequence.
  sequence_id insert_empty() { return insert(std::vector<layer_state>(num_layers_)); }

  //! @brief Every layer of `seq`.
  std::vector<layer_state>& layers(sequence_id seq, const char* what) {
    const auto it = sequences_.find(seq);
    if (it == sequences_.end()) [[unlikely]] {
      detail::raise(errc::unknown_sequence, what, ": sequence ", static_cast<std::uint64_t>(seq),
                    " is not in the cache");
    }
    return it->second;
  }
  const std::vector<layer_state>& layers(sequence_id seq, const char* what) const {
    return const_cast<sequence_table*>(this)->layers(seq, what);
  }

  //! @brief Layer `layer` of `seq`.
  layer_state& at(sequence_id seq, std::uint32_t layer, const char* what) {
    std::vector<layer_state>& ls = layers(seq, what);
    if (layer >= num_layers_) [[unlikely]] {
      detail::raise(errc::out_of_range, what, ": layer ", layer, " is outside the model's ",
                    num_layers_, " layers");
    }
    return ls[layer];
  }
  const layer_state& at(sequence_id seq, std::uint32_t layer, const char* what) const {
    return const_cast<sequence_table*>(this)->at(seq, layer, what);
  }

  //! @brief Layer `layer` of each of `seqs`, into `out` (cleared first), in order. Raises for
  //! an unknown sequence, a layer out of range, or a sequence named twice.
  void gather(std::span<const sequence_id> seqs, std::uint32_t layer, const char* what,
              std::vector<layer_state*>& out) {
    out.clear();
    for (const sequence_id seq : seqs) {
      layer_state* ls = &at(seq, layer, what);
      if (std::find(out.begin(), out.end(), ls) != out.end()) [[unlikely]] {
        detail::raise(errc::invalid_argument, what, ": sequence ", static_cast<std::uint64_t>(seq),
                      " appears more than once");
      }
      out.push_back(ls);
    }
  }

  //! @brief Every layer of `seq`, into `out` (cleared first), in layer order.
  void gather(sequence_id seq, const char* what, std::vector<layer_blocks*>& out) {
    out.clear();
    for (layer_state& ls : layers(seq, what)) {
      out.push_back(&ls);
    }
  }

  //! @brief Drops `seq` (which must be in the table).
  void erase(sequence_id seq) { sequences_.erase(seq); }
  std::size_t size() const noexcept { return sequences_.size(); }
  std::uint32_t num_layers() const noexcept { return num_layers_; }

  //! @brief Calls `f(layer_state&)` for every layer of every sequence.
  template <class F>
  void for_each_layer(F&& f) {
    for (auto& [id, layers] : sequences_) {
      for (layer_state& ls : layers) {
        f(ls);
      }
    }
  }

 private:
  std::uint32_t num_layers_;
  std::unordered_map<sequence_id, std::vector<layer_state>> sequences_;
  std::uint64_t next_ = 1;
};

}  // namespace oasiskv::cache
