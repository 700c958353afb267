// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The server's counters and latency histograms, and `/metrics` in Prometheus' text
//! format (0.0.4), as vLLM and llama-server expose theirs.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <mini_decoder/server/http_server.hpp>
#include <mini_decoder/server/request_queue.hpp>

namespace mini_decoder::serving {

//! A histogram of seconds with fixed buckets (upper bounds, cumulative when written).
class histogram {
 public:
  static constexpr std::array<double, 14> bounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                    1,     2.5,  5,     10,   30,  60,   120};
  void observe(double seconds);
  //! `name_bucket{le=...}`, `name_sum`, `name_count`, after `# HELP` and `# TYPE`.
  std::string text(const std::string& name, const std::string& help) const;

 private:
  std::array<std::uint64_t, bounds.size() + 1> counts_{};
  double sum_ = 0;
  std::uint64_t count_ = 0;
};

//! What the server counts. Safe to use from any thread.
class server_metrics {
 public:
  //! An HTTP request answered (the HTTP loop's observer).
  void request(const std::string& path, int status, double seconds);
  //! A generation ended: its jobs' timings and finish reasons.
  void generation(const std::vector<std::shared_ptr<job>>& jobs, std::uint32_t max_tokens);
  //! Everything, in Prometheus' text format: these counts, the engine's (`e`), the HTTP loop's
  //! (`h`) and the tokenizer's cache.
  std::string text(const engine_stats& e, const http_counters& h,
                   std::size_t tokenizer_cache_bytes) const;

 private:
  mutable std::mutex m_;
  std::map<std::pair<std::string, int>, std::uint64_t> requests_;  // (endpoint, status)
  std::map<std::string, std::uint64_t> finished_;                  // finish reason
  histogram ttft_, e2e_, per_token_, queue_time_;
};

}  // namespace mini_decoder::serving
