// SPDX-License-Identifier: Apache-2.0
// The report of the CUDA benchmark (cuda_attention_decode.bench.cu): rows of named figures, the
// targets read back from those rows by what they measured (never from variables of the loops that
// made them), and the JSON of both. Host code only: tests/cuda/host_plans.test.cu checks it
// without a device.
#pragma once

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace oasiskv::bench {

//! One measured row: a name and its fields in order (numbers, strings, flags).
struct row {
  using value = std::variant<double, std::string, bool>;
  std::string name;
  std::vector<std::pair<std::string, value>> fields;

  row& num(const std::string& key, double v) {
    fields.emplace_back(key, v);
    return *this;
  }
  row& str(const std::string& key, std::string v) {
    fields.emplace_back(key, std::move(v));
    return *this;
  }
  row& flag(const std::string& key, bool v) {
    fields.emplace_back(key, v);
    return *this;
  }
  //! The number under `key`, or null.
  const double* number(const std::string& key) const {
    for (const auto& [k, v] : fields) {
      if (k == key) {
        return std::get_if<double>(&v);
      }
    }
    return nullptr;
  }
  //! The string under `key`, or null.
  const std::string* text(const std::string& key) const {
    for (const auto& [k, v] : fields) {
      if (k == key) {
        return std::get_if<std::string>(&v);
      }
    }
    return nullptr;
  }
  //! Whether the number under `key` is `v`.
  bool is(const std::string& key, double v) const {
    const double* x = number(key);
    return x != nullptr && *x == v;
  }
  //! Whether the string under `key` is `v`.
  bool is(const std::string& key, const char* v) const {
    const std::string* x = text(key);
    return x != nullptr && *x == v;
  }
};

//! A JSON string literal.
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

//! A JSON number (null where not finite: JSON has no NaN or infinity).
inline std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

//! `{"name": ..., fields...}` on one line.
inline std::string to_json(const row& r) {
  std::string s = "{\"name\": " + json_string(r.name);
  for (const auto& [k, v] : r.fields) {
    s += ", " + json_string(k) + ": ";
    if (const double* d = std::get_if<double>(&v)) {
      s += json_number(*d);
    } else if (const std::string* t = std::get_if<std::string>(&v)) {
      s += json_string(*t);
    } else {
      s += std::get<bool>(v) ? "true" : "false";
    }
  }
  return s + "}";
}

//! A target of the benchmark: a ratio read from one row, and the bound it must meet.
struct target {
  std::string name;       //!< e.g. "sparse_decode_batch32_over_read_probe"
  std::string what;       //!< the row and field it reads, in words
  bool at_least = true;   //!< value >= bound (else value <= bound)
  double bound = 0.0;     //!< the bound
  bool measured = false;  //!< the row was found (and its field is a finite number)
  double value = 0.0;     //!< the figure when measured
  //! Measured and within the bound.
  bool pass() const { return measured && (at_least ? value >= bound : value <= bound); }
};

//! A target's definition: which row (the first that `match` accepts) and which field.
struct target_rule {
  std::string name, what;
  std::string row_name, field;
  std::function<bool(const row&)> match;
  bool at_least = true;
  double bound = 0.0;
};

//! The rules of the CUDA benchmark's targets (docs/cuda.md, "Running on a GPU").
inline std::vector<target_rule> cuda_bench_rules() {
  auto at = [](double seqs) {  // budget 2048 tokens of a 32k context, one query token
    return [seqs](const row& r) {
      return r.is("num_seqs", seqs) && r.is("q_len", 1.0) && r.is("budget_tokens", 2048.0) &&
             r.is("context", 32768.0);
    };
  };
  return {
      {"sparse_decode_batch32_over_read_probe",
       "sparse_decode, 32 sequences, budget 2048 of 32k: selected K/V bytes per second over the "
       "read probe's",
       "sparse_decode", "ratio_to_read_probe", at(32), true, 0.80},
      {"sparse_decode_batch1_over_read_probe",
       "sparse_decode, 1 sequence (L2 flushed), budget 2048 of 32k: the same ratio",
       "sparse_decode", "ratio_to_read_probe", at(1), true, 0.60},
      {"selection_over_sparse_decode",
       "topk_selector (int8 bounds) over sparse_decode, 32 sequences at 32k, budget 2048",
       "selection", "over_sparse_decode",
       [](const row& r) { return r.is("num_seqs", 32.0) && r.is("summary", "int8"); }, false, 0.30},
      {"facade_step_tiered_over_resident",
       "tiered_kv_cache step with lookahead prefetch over the same step all-resident, 8 sequences",
       "facade_step", "ratio", [](const row& r) { return r.is("num_seqs", 8.0); }, false, 1.05},
      {"copy_engine_over_pinned_memcpy",
       "copy_engine (automatic path), scattered 64 KiB blocks, over one pinned cudaMemcpyAsync",
       "copy_engine", "ratio_to_pinned_memcpy",
       [](const row& r) { return r.is("path", "automatic") && r.is("block_bytes", 65536.0); }, true,
       0.80},
      {"sparse_decode_over_flashinfer",
       "cuda::sparse_decode's time over FlashInfer's on the same selection, 32 sequences "
       "(only where FlashInfer's headers were built in)",
       "sparse_decode_vs_flashinfer", "own_over_flashinfer",
       [](const row& r) { return r.is("num_seqs", 32.0); }, false, 1.05},
  };
}

//! Each rule's target, read from `rows`.
inline std::vector<target> evaluate(const std::vector<row>& rows,
                                    const std::vector<target_rule>& rules) {
  std::vector<target> out;
  for (const target_rule& rule : rules) {
    target t{rule.name, rule.what, rule.at_least, rule.bound};
    for (const row& r : rows) {
      if (r.name != rule.row_name || !rule.match(r)) {
        continue;
      }
      if (const double* v = r.number(rule.field); v != nullptr && std::isfinite(*v)) {
        t.measured = true;
        t.value = *v;
      }
      break;
    }
    out.push_back(t);
  }
  return out;
}

//! `{"rows": [...], "targets": [...], "targets_met": n, "targets_measured": m}`: every figure and
//! each target's pass (null when unmeasured).
inline std::string report_json(const std::vector<row>& rows, const std::vector<target>& targets) {
  std::string s = "{\n  \"rows\": [\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    s += "    " + to_json(rows[i]) + (i + 1 < rows.size() ? ",\n" : "\n");
  }
  s += "  ],\n  \"targets\": [\n";
  int met = 0, measured = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const target& t = targets[i];
    met += t.pass() ? 1 : 0;
    measured += t.measured ? 1 : 0;
    s += "    {\"name\": " + json_string(t.name) + ", \"what\": " + json_string(t.what) +
         ", \"value\": " + (t.measured ? json_number(t.value) : "null") + ", \"bound\": " +
         json_string(std::string(t.at_least ? ">= " : "<= ") + json_number(t.bound)) +
         ", \"pass\": " + (t.measured ? (t.pass() ? "true" : "false") : "null") + "}" +
         (i + 1 < targets.size() ? ",\n" : "\n");
  }
  s += "  ],\n  \"targets_met\": " + std::to_string(met) +
       ",\n  \"targets_measured\": " + std::to_string(measured) + "\n}\n";
  return s;
}

}  // namespace oasiskv::bench
