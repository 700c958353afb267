// SPDX-License-Identifier: Apache-2.0
// OasisKV as llama.cpp's KV cache: the sequence operations (llama_memory_seq_rm, ...) on the
// cache's truncate, fork and remove, and what the memory refuses.
#include "llama-memory-oasis-impl.h"

#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace llama_oasis {

//
// sequence operations
//

void llama_memory_oasis::drop(llama_seq_id s) {
  if (seqs[s].used) {
    cache->remove(seqs[s].h);
  }
  seqs[s] = {};
}

void llama_memory_oasis::clear(bool data) {
  GGML_UNUSED(data);
  try {
    for (uint32_t s = 0; s < n_seq_max; ++s) {
      drop((llama_seq_id)s);
    }
  } catch (const std::exception& e) {
    LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
  }
}

bool llama_memory_oasis::rm_one(llama_seq_id s, llama_pos p0, llama_pos p1) {
  oasis_seq& q = seqs[s];
  if (!q.used || (uint32_t)p0 >= q.n || p0 >= p1) {
    return true;
  }
  if ((uint32_t)p1 < q.n) {
    // a range inside the sequence: its later tokens would have to move
    return false;
  }
  if (p0 == 0) {
    drop(s);
  } else {
    cache->truncate(q.h, (uint32_t)p0);
    q.n = (uint32_t)p0;
  }
  return true;
}

bool llama_memory_oasis::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
  if (p0 < 0) {
    p0 = 0;
  }
  if (p1 < 0) {
    p1 = std::numeric_limits<llama_pos>::max();
  }
  try {
    if (seq_id < 0) {
      bool ok = true;
      for (uint32_t s = 0; s < n_seq_max; ++s) {
        ok = rm_one((llama_seq_id)s, p0, p1) && ok;
      }
      return ok;
    }
    return valid_seq(seq_id) && rm_one(seq_id, p0, p1);
  } catch (const std::exception& e) {
    LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
    return false;
  }
}

void llama_memory_oasis::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0,
                                llama_pos p1) {
  if (seq_id_src == seq_id_dst || !valid_seq(seq_id_src) || !valid_seq(seq_id_dst)) {
    return;
  }
  if (p0 < 0) {
    p0 = 0;
  }
  if (p1 < 0) {
    p1 = std::numeric_limits<llama_pos>::max();
  }
  const oasis_seq& src = seqs[seq_id_src];
  if (!src.used || src.n == 0 || p0 >= p1) {
    return;
  }
  if (p0 > 0) {
    LLAMA_LOG_ERROR(
        "%s: OasisKV copies a sequence's first tokens only: the copy of positions [%d, %d) of "
        "sequence %d "
        "to %d is not made\n",
        __func__, p0, p1, seq_id_src, seq_id_dst);
    return;
  }
  try {
    // the copy replaces the destination (callers clear it first)
    drop(seq_id_dst);
    const uint32_t n = std::min<uint32_t>(src.n, (uint32_t)p1);
    oasis_seq& dst = seqs[seq_id_dst];
    dst.h = cache->fork(src.h, n);
    dst.used = true;
    dst.n = n;
  } catch (const std::exception& e) {
    LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
  }
}

void llama_memory_oasis::seq_keep(llama_seq_id seq_id) {
  try {
    for (uint32_t s = 0; s < n_seq_max; ++s) {
      if ((llama_seq_id)s != seq_id) {
        drop((llama_seq_id)s);
      }
    }
  } catch (const std::exception& e) {
    LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
  }
}

void llama_memory_oasis::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
  GGML_UNUSED(p0);
  GGML_UNUSED(p1);
  if (shift != 0) {
    LLAMA_LOG_ERROR(
        "%s: OasisKV keeps keys rotated at their positions and cannot shift them: the shift of "
        "sequence %d by %d is not made\n",
        __func__, seq_id, shift);
  }
}

void llama_memory_oasis::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
  GGML_UNUSED(p0);
  GGML_UNUSED(p1);
  if (d != 1) {
    LLAMA_LOG_ERROR(
        "%s: OasisKV keeps keys rotated at their positions and cannot move them: the division of "
        "sequence %d's positions by %d is not made\n",
        __func__, seq_id, d);
  }
}

llama_pos llama_memory_oasis::seq_pos_min(llama_seq_id seq_id) const {
  return valid_seq(seq_id) && seqs[seq_id].used && seqs[seq_id].n > 0 ? 0 : -1;
}

llama_pos llama_memory_oasis::seq_pos_max(llama_seq_id seq_id) const {
  return valid_seq(seq_id) && seqs[seq_id].used ? (llama_pos)seqs[seq_id].n - 1 : -1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_memory_oasis::memory_breakdown() const {
  const oasiskv_bridge::cache_report r = cache->report();
  size_t bytes = r.fast_bytes + r.summary_bytes;
  if (r.capacity_in_memory) {
    bytes += r.capacity_bytes_in_use;
  }
  return {{ggml_backend_cpu_buffer_type(), bytes}};
}

void llama_memory_oasis::state_write(llama_io_write_i& io, llama_seq_id seq_id,
                                     llama_state_seq_flags flags) const {
  GGML_UNUSED(io);
  GGML_UNUSED(seq_id);
  GGML_UNUSED(flags);
  throw std::runtime_error(
      "OasisKV does not save sequence state (llama_state_*: prompt caches, slot saves)");
}

void llama_memory_oasis::state_read(llama_io_read_i& io, llama_seq_id seq_id,
                                    llama_state_seq_flags flags) {
  GGML_UNUSED(io);
  GGML_UNUSED(seq_id);
  GGML_UNUSED(flags);
  throw std::runtime_error(
      "OasisKV does not restore sequence state (llama_state_*: prompt caches, slot saves)");
}

}  // namespace llama_oasis
