// SPDX-License-Identifier: Apache-2.0
// SmolLM2-135M-Instruct (GGUF Q4_1): prefill logits against an independent numpy reference
// (tools/smollm2_reference.py), and the decode paths on a real 30-layer GQA model. Needs the
// model in ./models/ (tests never download: scripts/fetch-models.sh fetches it, and
// scripts/test.sh runs that first); without it every case here fails, naming that command.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <mini_decoder/decode/decoder.hpp>
#include <mini_decoder/ops/kquants.hpp>
#include <mini_decoder/ops/matmul.hpp>

#include "models.hpp"

using namespace mini_decoder;

namespace {

struct reference {
  std::string prompt;
  std::vector<int> tokens;
  std::vector<std::pair<int, float>> logits;
};

reference read_reference() {
  std::ifstream in(std::string(MINI_DECODER_TEST_DIR) + "/smollm2_reference.txt");
  REQUIRE(in.good());
  reference r;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string key;
    s >> key;
    if (key == "prompt") {
      std::getline(s >> std::ws, r.prompt);
    } else if (key == "tokens") {
      for (int t; s >> t;)
        r.tokens.push_back(t);
    } else if (key == "logit") {
      int id;
      float v;
      s >> id >> v;
      r.logits.emplace_back(id, v);
    }
  }
  return r;
}

}  // namespace

TEST_CASE("SmolLM2: metadata as documented") {
  const model* m = &test::smollm2();
  const model_config& c = m->config;
  CHECK(c.num_layers == 30);
  CHECK(c.num_heads == 9);
  CHECK(c.num_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.context_length == 8192);
  CHECK(c.rope_theta == 100000.0f);
  CHECK(c.vocab_size == 49152);
  CHECK(m->output.data == m->embedding.data);  // tied embeddings
  CHECK(m->layers[0].wq.type == quant_type::q4_1);
  CHECK(m->embedding.type == quant_type::q8_0);
}

// Restores the process-wide matmul activation mode at scope exit.
struct activations_guard {
  matmul_activations before = get_matmul_activations();
  explicit activations_guard(matmul_activations a) { set_matmul_activations(a); }
  ~activations_guard() { set_matmul_activations(before); }
};

std::vector<float> prefill_logits(const model& m, const std::vector<int>& tokens) {
  transformer tf(m);
  std::vector<float> logits(m.config.vocab_size);
  tf.prefill(
      tokens.data(), static_cast<std::uint32_t>(tokens.size()),
      [](std::uint32_t, const float*, const float*, std::uint32_t) {}, logits.data());
  return logits;
}

std::vector<float> prefill_logits(const model& m, const reference& ref) {
  return prefill_logits(m, ref.tokens);
}

// Greedy speculative decoding against plain greedy decoding. With f32 products they must agree
// token for token. With int8 activations a verification pass (attention over the cache merged
// with the drafts' side entries) and a plain step differ in the last bits of attention, which
// the next product's activation rounding can turn into a different choice where two tokens
// tie: there the runs may part, but only at a near-tie of the exact model. Checked by
// recomputing the logits at the first differing position with a dense prefill of the common
// prefix: the two tokens chosen must be within 1% of the logit scale of each other.
void check_speculative_matches(const model& m, const std::vector<int>& prompt,
                               const std::vector<int>& plain, const std::vector<int>& spec) {
  if (get_matmul_activations() == matmul_activations::f32 || spec == plain) {
    CHECK(spec == plain);
    return;
  }
  const auto diff = std::mismatch(plain.begin(), plain.end(), spec.begin(), spec.end());
  REQUIRE(diff.first != plain.end());
  REQUIRE(diff.second != spec.end());  // equal lengths: one cannot be a prefix of the other
  std::vector<int> prefix = prompt;
  prefix.insert(prefix.end(), plain.begin(), diff.first);
  const std::vector<float> logits = prefill_logits(m, prefix);
  float scale = 0.0f;
  for (float v : logits)
    scale = std::max(scale, std::abs(v));
  const float gap = std::abs(logits[static_cast<std::size_t>(*diff.first)] -
                             logits[static_cast<std::size_t>(*diff.second)]);
  MESSAGE("speculative and plain part at token "
          << (diff.first - plain.begin()) << " (" << *diff.first << " vs " << *diff.second
          << "), logit gap " << gap / scale << " of the scale");
  CHECK(gap <= 0.01f * scale);
}

TEST_CASE("SmolLM2: prefill logits match the numpy reference to 1e-3 relative (f32 products)") {
  const model* m = &test::smollm2();
  const reference ref = read_reference();
  REQUIRE(ref.logits.size() >= 32);
  CHECK(m->tok->encode(m->tok->chat_prompt(ref.prompt), true) == ref.tokens);
  // The reference multiplies f32 activations with the dequantized weights: so does f32 mode.
  const activations_guard guard(matmul_activations::f32);
  const std::vector<float> logits = prefill_logits(*m, ref);
  // Relative to the logits' scale (the largest |logit|): rounding K,V to f16 is discontinuous,
  // so two correct f32 implementations differ by ~0.01 absolute (f16 vs f32 KV in the reference
  // itself moves logits by 0.0066), which is 4e-4 of a 25-logit scale but more than 1e-3 of a
  // logit near zero.
  float scale = 0.0f;
  for (const auto& [id, want] : ref.logits)
    scale = std::max(scale, std::abs(want));
  double worst = 0.0;
  for (const auto& [id, want] : ref.logits) {
    CAPTURE(id);
    const float err = std::abs(logits[static_cast<std::size_t>(id)] - want);
    worst = std::max<double>(worst, err / scale);
    CHECK(err <= 1e-3f * scale);
  }
  MESSAGE("SmolLM2 prefill logits: worst error " << worst << " of the logit scale " << scale);
  CHECK(argmax(logits.data(), m->config.vocab_size) == ref.logits.front().first);
}

TEST_CASE("SmolLM2: with int8 activations the prefill logits stay within 2% of the reference") {
  const model* m = &test::smollm2();
  const reference ref = read_reference();
  REQUIRE(ref.logits.size() >= 32);
  const activations_guard guard(matmul_activations::int8);
  const std::vector<float> logits = prefill_logits(*m, ref);
  float scale = 0.0f;
  for (const auto& [id, want] : ref.logits)
    scale = std::max(scale, std::abs(want));
  // Rounding each activation to 8 bits per 32 (or 256) values moves every logit a little; the
  // model's ranking of its top tokens and the logits' values stay close to the exact ones.
  float worst = 0.0f;
  for (const auto& [id, want] : ref.logits) {
    CAPTURE(id);
    const float err = std::abs(logits[static_cast<std::size_t>(id)] - want);
    CHECK(err <= 0.02f * scale);
    worst = err > worst ? err : worst;
  }
  MESSAGE("SmolLM2 prefill logits, int8 activations: worst error " << worst / scale
                                                                   << " of the logit scale");
  // The reference's two best tokens are 0.08 apart (a near-tie that 8-bit activations may
  // flip): the token chosen must be one of the reference's within that tolerance of its best.
  const int chosen = argmax(logits.data(), m->config.vocab_size);
  bool near_best = false;
  for (const auto& [id, want] : ref.logits) {
    near_best = near_best || (id == chosen && want >= ref.logits.front().second - 0.02f * scale);
  }
  CHECK_MESSAGE(near_best, "token " << chosen << " is not within 2% of the reference's best");
}

// A chunked prefill computes what a whole one does: the attention's row blocks are the same, and
// the products differ at most in rounding (OpenBLAS's sgemm need not compute a row alike for
// every number of rows: its SkylakeX kernels do, its Haswell ones do not). A rounding difference
// that flips a K or V value's f16 rounding moves the next layers a little more: the bounds are
// those of two correct f32 implementations (see the reference case above).
TEST_CASE("SmolLM2: a prefill in chunks equals one whole prefill up to the products' rounding") {
  const model* m = &test::smollm2();
  const model_config& c = m->config;
  std::string text;
  for (int i = 0; i < 13; ++i) {
    text +=
        "The lighthouse keeper counted the ships that passed the rocks each night, and wrote "
        "their names in a book. ";
  }
  const std::vector<int> prompt = m->tok->encode(text, true);
  const auto P = static_cast<std::uint32_t>(prompt.size());
  CAPTURE(P);
  REQUIRE(P > 3 * transformer::prefill_rows);
  const std::size_t kvd = std::size_t{c.num_kv_heads} * c.head_dim;
  // The whole prompt: every layer's K,V and the last logits.
  std::vector<std::vector<float>> k(c.num_layers), v(c.num_layers);
  std::vector<float> whole(c.vocab_size), chunked(c.vocab_size);
  transformer tf(*m);
  tf.prefill(
      prompt.data(), P,
      [&](std::uint32_t l, const float* kl, const float* vl, std::uint32_t n) {
        k[l].assign(kl, kl + n * kvd);
        v[l].assign(vl, vl + n * kvd);
      },
      whole.data());
  // The same in chunks of 128 and the rest (over 64), the second reading the first's K,V back.
  std::vector<std::vector<float>> ck(c.num_layers), cv(c.num_layers);
  const std::uint32_t bounds[] = {0, 2 * transformer::prefill_rows, P};
  for (int i = 0; i < 2; ++i) {
    const std::uint32_t from = bounds[i], n = bounds[i + 1] - from;
    tf.prefill(
        prompt.data() + from, n, from,
        [&](std::uint32_t l, std::uint32_t past, float* kp, float* vp) {
          REQUIRE(past == from);
          std::copy(ck[l].begin(), ck[l].begin() + std::ptrdiff_t(past * kvd), kp);
          std::copy(cv[l].begin(), cv[l].begin() + std::ptrdiff_t(past * kvd), vp);
        },
        [&](std::uint32_t l, const float* kl, const float* vl, std::uint32_t rows) {
          ck[l].insert(ck[l].end(), kl, kl + rows * kvd);
          cv[l].insert(cv[l].end(), vl, vl + rows * kvd);
        },
        chunked.data());
  }
  float scale = 0.0f, worst_kv = 0.0f, worst = 0.0f;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    REQUIRE(ck[l].size() == k[l].size());
    REQUIRE(cv[l].size() == v[l].size());
    for (std::size_t i = 0; i < k[l].size(); ++i) {
      worst_kv = std::max({worst_kv, std::abs(ck[l][i] - k[l][i]) / (1.0f + std::abs(k[l][i])),
                           std::abs(cv[l][i] - v[l][i]) / (1.0f + std::abs(v[l][i]))});
    }
  }
  for (std::uint32_t i = 0; i < c.vocab_size; ++i) {
    scale = std::max(scale, std::abs(whole[i]));
    worst = std::max(worst, std::abs(chunked[i] - whole[i]));
  }
  MESSAGE("chunked prefill: worst K,V difference " << worst_kv << ", worst logit difference "
                                                   << worst / scale << " of the scale");
  CHECK(worst_kv <= 0.05f);
  CHECK(worst <= 5e-3f * scale);
  CHECK(argmax(chunked.data(), c.vocab_size) == argmax(whole.data(), c.vocab_size));
  // A short later chunk takes the decode rows' products (int8 activations): within what int8
  // activations move the logits (the case above: 2% of the scale for a whole prompt).
  const std::uint32_t tail = 20;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    ck[l].resize((P - tail) * kvd);
    cv[l].resize((P - tail) * kvd);
  }
  tf.prefill(
      prompt.data() + (P - tail), tail, P - tail,
      [&](std::uint32_t l, std::uint32_t past, float* kp, float* vp) {
        std::copy(ck[l].begin(), ck[l].begin() + std::ptrdiff_t(past * kvd), kp);
        std::copy(cv[l].begin(), cv[l].begin() + std::ptrdiff_t(past * kvd), vp);
      },
      [](std::uint32_t, const float*, const float*, std::uint32_t) {}, chunked.data());
  worst = 0.0f;
  for (std::uint32_t i = 0; i < c.vocab_size; ++i) {
    worst = std::max(worst, std::abs(chunked[i] - whole[i]));
  }
  MESSAGE("a 20-token last chunk on int8 products: worst logit difference " << worst / scale
                                                                            << " of the scale");
  CHECK(worst <= 0.05f * scale);
}

TEST_CASE("SmolLM2: chat answer, and speculative == plain greedy through OasisKV") {
  const model* m = &test::smollm2();
  const auto prompt = m->tok->encode(m->tok->chat_prompt("What is the capital of France?"), true);
  for (const matmul_activations a : {matmul_activations::f32, matmul_activations::int8}) {
    CAPTURE(std::string(to_string(a)));
    const activations_guard guard(a);
    decoder_options o;
    o.max_tokens = 24;
    decoder plain(*m, o);
    const auto tokens = plain.generate(prompt);
    std::string text;
    for (int t : tokens)
      text += m->tok->decode(-1, t);
    if (a == matmul_activations::f32) {
      // With exact products the model answers; with int8 activations its first token is a
      // near-tie (see the prefill case above) that goes the other way on this prompt.
      CHECK(text.find("Paris") != std::string::npos);
    }
    for (const draft_kind k : {draft_kind::self, draft_kind::ngram}) {
      if (a == matmul_activations::f32 && k == draft_kind::self) {
        continue;  // the f32 products are slow (the sanitizer build): one draft kind there
      }
      CAPTURE(std::string(to_string(k)));
      decoder_options s = o;
      s.draft = k;
      decoder d(*m, s);
      check_speculative_matches(*m, prompt, tokens, d.generate(prompt));
    }
    if (a == matmul_activations::f32) {
      continue;
    }
    decoder_options sparse = o;
    sparse.mode = attention_mode::oasis;
    sparse.budget_tokens = 64;
    sparse.draft = draft_kind::self;
    decoder d(*m, sparse);
    // 37 + 24 tokens fit in a 64-token budget
    check_speculative_matches(*m, prompt, tokens, d.generate(prompt));
  }
}

TEST_CASE("SmolLM2 with K-quant FFN down projections: int8 dots, exact products, decode paths") {
  // No Q4_K_M file of SmolLM2 ships anywhere this suite can reach, so the model's own weights
  // are re-quantized: every layer's down projection (1536 columns: 6 super-blocks a row) to
  // Q4_K in even layers and Q6_K in odd ones, the mix a Q4_K_M file has.
  (void)test::smollm2();  // fails the case, naming how to fetch it, when the file is missing
  const std::unique_ptr<model> m = load_model(test::smollm2_path);
  std::vector<std::vector<std::byte>> storage;
  std::vector<float> row;
  for (std::uint32_t l = 0; l < m->config.num_layers; ++l) {
    weight_matrix& w = m->layers[l].down;
    REQUIRE(w.cols % qk_k == 0);
    const quant_type t = l % 2 == 0 ? quant_type::q4_k : quant_type::q6_k;
    const std::size_t rb = row_bytes(t, w.cols);
    std::vector<std::byte> bytes(rb * w.rows);
    row.resize(w.cols);
    for (std::uint32_t r = 0; r < w.rows; ++r) {
      dequantize_row(w, r, row.data());
      if (t == quant_type::q4_k) {
        quantize_q4_k(row.data(), w.cols, bytes.data() + r * rb);
      } else {
        quantize_q6_k(row.data(), w.cols, bytes.data() + r * rb);
      }
    }
    storage.push_back(std::move(bytes));
    w = weight_matrix{t, storage.back().data(), w.rows, w.cols, rb};
  }
  const reference ref = read_reference();
  float scale = 0.0f;
  for (const auto& [id, want] : ref.logits)
    scale = std::max(scale, std::abs(want));
  std::vector<float> exact, int8;
  {
    const activations_guard guard(matmul_activations::f32);
    exact = prefill_logits(*m, ref);
  }
  {
    const activations_guard guard(matmul_activations::int8);
    int8 = prefill_logits(*m, ref);
  }
  // The int8 path against the exact product of the same K-quant weights, and both against the
  // numpy reference of the original weights (re-quantization moves them a little more).
  float worst_int8 = 0.0f, worst_requant = 0.0f;
  for (const auto& [id, want] : ref.logits) {
    CAPTURE(id);
    const auto i = static_cast<std::size_t>(id);
    const float e1 = std::abs(int8[i] - exact[i]), e2 = std::abs(exact[i] - want);
    CHECK(e1 <= 0.02f * scale);
    CHECK(e2 <= 0.03f * scale);
    worst_int8 = e1 > worst_int8 ? e1 : worst_int8;
    worst_requant = e2 > worst_requant ? e2 : worst_requant;
  }
  MESSAGE("K-quant SmolLM2: int8 vs exact " << worst_int8 / scale << ", exact vs reference "
                                            << worst_requant / scale << " of the logit scale");
  // The engine's invariants hold on K-quant weights: greedy speculative == greedy.
  const auto prompt = m->tok->encode(m->tok->chat_prompt("What is the capital of France?"), true);
  decoder_options o;
  o.max_tokens = 12;
  decoder plain(*m, o);
  const auto tokens = plain.generate(prompt);
  REQUIRE(!tokens.empty());
  decoder_options s = o;
  s.draft = draft_kind::ngram;
  decoder d(*m, s);
  check_speculative_matches(*m, prompt, tokens, d.generate(prompt));
}
