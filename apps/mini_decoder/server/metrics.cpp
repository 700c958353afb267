// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/metrics.hpp>

#include <chrono>
#include <cstdio>

namespace mini_decoder::serving {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string metric(const std::string& name, const char* type, const std::string& help,
                   double value) {
  return "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " +
         number(value) + "\n";
}

// The endpoints a label may name: the routes, and "other" for any path a client made up (a
// label per made-up path would let clients grow the metrics without bound).
std::string endpoint_of(const std::string& path) {
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics", "/tokenize", "/detokenize"}) {
    if (path == p) {
      return p;
    }
  }
  return path.rfind("/v1/models/", 0) == 0 ? "/v1/models/{id}" : "other";
}

double seconds(job::clock_type::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

void histogram::observe(double s) {
  std::size_t i = 0;
  while (i < bounds.size() && s > bounds[i]) {
    ++i;
  }
  ++counts_[i];
  sum_ += s;
  ++count_;
}

std::string histogram::text(const std::string& name, const std::string& help) const {
  std::string out = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  std::uint64_t acc = 0;
  for (std::size_t i = 0; i < bounds.size(); ++i) {
    acc += counts_[i];
    out += name + "_bucket{le=\"" + number(bounds[i]) + "\"} " + std::to_string(acc) + "\n";
  }
  acc += counts_[bounds.size()];
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(acc) + "\n";
  out += name + "_sum " + number(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
  return out;
}

void server_metrics::request(const std::string& path, int status, double) {
  std::lock_guard<std::mutex> lk(m_);
  ++requests_[{endpoint_of(path), status}];
}

void server_metrics::generation(const std::vector<std::shared_ptr<job>>& jobs,
                                std::uint32_t max_tokens) {
  std::lock_guard<std::mutex> lk(m_);
  for (const auto& jp : jobs) {
    job& j = *jp;
    std::lock_guard<std::mutex> jl(j.m);
    const char* reason = j.cancelled                                     ? "cancelled"
                         : j.ph == phase::failed                         ? "error"
                         : j.ph != phase::done                           ? "cancelled"
                         : j.aborted                                     ? "abort"
                         : j.stopped || j.completion_tokens < max_tokens ? "stop"
                                                                         : "length";
    ++finished_[reason];
    if (j.completion_tokens > 0) {
      ttft_.observe(seconds(j.first_token - j.submitted));
    }
    if (j.ph == phase::done && !j.aborted) {
      e2e_.observe(seconds(j.ended - j.submitted));
      if (j.completion_tokens > 1) {
        per_token_.observe(seconds(j.ended - j.first_token) / (j.completion_tokens - 1));
      }
    }
  }
}

std::string server_metrics::text(const engine_stats& e, const http_counters& h,
                                 std::size_t tokenizer_cache_bytes) const {
  std::string out;
  {
    std::lock_guard<std::mutex> lk(m_);
    out +=
        "# HELP mini_decoder_http_requests_total HTTP requests answered, by endpoint and "
        "status.\n# TYPE mini_decoder_http_requests_total counter\n";
    for (const auto& [key, n] : requests_) {
      out += "mini_decoder_http_requests_total{endpoint=\"" + key.first + "\",status=\"" +
             std::to_string(key.second) + "\"} " + std::to_string(n) + "\n";
    }
    out +=
        "# HELP mini_decoder_requests_finished_total Generations (one per choice) by how "
        "they ended.\n# TYPE mini_decoder_requests_finished_total counter\n";
    for (const auto& [reason, n] : finished_) {
      out += "mini_decoder_requests_finished_total{reason=\"" + reason + "\"} " +
             std::to_string(n) + "\n";
    }
    out += ttft_.text("mini_decoder_time_to_first_token_seconds",
                      "From a generation's submission to its first token.");
    out += e2e_.text("mini_decoder_request_latency_seconds",
                     "From a generation's submission to its last token.");
    out += per_token_.text("mini_decoder_time_per_output_token_seconds",
                           "Mean time between a generation's tokens after the first.");
  }
  out += metric("mini_decoder_requests_running", "gauge", "Sequences decoding.",
                static_cast<double>(e.active));
  out += metric("mini_decoder_requests_waiting", "gauge", "Requests waiting for admission.",
                static_cast<double>(e.waiting));
  out += metric("mini_decoder_requests_cancelled_total", "counter",
                "Requests ended because their client left.", static_cast<double>(e.cancelled));
  out += metric("mini_decoder_prompt_tokens_total", "counter", "Prompt tokens admitted.",
                static_cast<double>(e.prompt_tokens));
  out += metric("mini_decoder_generation_tokens_total", "counter", "Tokens generated.",
                static_cast<double>(e.generated_tokens));
  out += metric("mini_decoder_engine_steps_total", "counter", "Batched engine steps.",
                static_cast<double>(e.steps));
  out += metric("mini_decoder_fast_tier_bytes_reserved", "gauge",
                "Fast-tier bytes the running sequences hold.",
                static_cast<double>(e.fast_bytes_reserved));
  out += metric("mini_decoder_fast_tier_bytes", "gauge", "The fast tier's budget in bytes.",
                static_cast<double>(e.fast_bytes));
  const double fetches = static_cast<double>(e.prefetch_hits + e.prefetch_misses);
  out += metric("mini_decoder_prefetch_hits_total", "counter",
                "KV blocks attention found staged (prefetched).",
                static_cast<double>(e.prefetch_hits));
  out += metric("mini_decoder_prefetch_misses_total", "counter",
                "KV blocks attention had to fetch itself.", static_cast<double>(e.prefetch_misses));
  out += metric("mini_decoder_prefetch_hit_ratio", "gauge",
                "Prefetch hits over all blocks attended (1 with none).",
                fetches == 0 ? 1.0 : static_cast<double>(e.prefetch_hits) / fetches);
  out += metric("mini_decoder_http_connections_open", "gauge", "HTTP connections open.",
                static_cast<double>(h.open.load()));
  out += metric("mini_decoder_http_connections_total", "counter", "HTTP connections accepted.",
                static_cast<double>(h.connections_accepted.load()));
  out += metric("mini_decoder_http_connections_refused_total", "counter",
                "Connections refused at a connection limit.",
                static_cast<double>(h.connections_refused.load()));
  out += metric("mini_decoder_http_timeouts_total", "counter",
                "Connections closed by a header, body or write timeout.",
                static_cast<double>(h.timeouts.load()));
  out += metric("mini_decoder_http_client_gone_total", "counter",
                "Connections their client closed mid-request.",
                static_cast<double>(h.client_gone.load()));
  out += metric("mini_decoder_tokenizer_cache_bytes", "gauge",
                "Bytes held by the tokenizer's word cache (bounded).",
                static_cast<double>(tokenizer_cache_bytes));
  return out;
}

}  // namespace mini_decoder::serving
