// SPDX-License-Identifier: Apache-2.0
// Prefill/decode disaggregation demo: a prefill server process exports a request's KV through a
// kv_exporter; decode client processes admit the same request densely (full) and selectively,
// decode through block-sparse attention, and report bytes moved at admission and over the
// decode, decode-node host memory and tokens/s. All on 127.0.0.1; UCX_TLS picks the transport.
//
// With a model (the default; needs the mini-decoder): the prefill server prefills a real prompt,
// the decode clients decode greedily through a tiered_kv_cache over the exporter's memory, and
// their tokens are compared with a local dense run of the mini-decoder.
//
//   pd_demo [--model tests/data/stories260K/stories260K.bin] [--prompt-file F]
//           [--prompt-tokens N] [--budgets 64,512] [--steps 64] [--expect-agreement]
//   pd_demo --synthetic [--contexts 8192,32768] [--budgets 1024,2048] [--steps 64]
//           [--bandwidth-seconds 1]
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "decode.hpp"
#include "oasiskv/disagg/kv_exporter.hpp"
#include "synthetic.hpp"
#ifdef PD_DEMO_MODEL
#include "model_run.hpp"
#endif

extern char** environ;

namespace {

constexpr const char* usage_text =
    "usage: pd_demo [--model PATH] [--prompt-file F] [--prompt-tokens N] [--budgets 64,512]\n"
    "               [--steps 64] [--expect-agreement]\n"
    "       pd_demo --synthetic [--contexts 8192,32768] [--budgets 1024,2048] [--steps 64]\n"
    "               [--bandwidth-seconds 1]\n"
    "The model defaults to tests/data/stories260K/stories260K.bin; UCX_TLS picks the transport.\n";

// A bad command line: main prints "pd_demo: <what>" and the usage, and exits 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A positive integer of at most `max`; anything else is a usage_error naming the flag and value.
std::uint32_t parse_count(const std::string& flag, const std::string& v,
                          std::uint64_t max = 0xffffffffu) {
  std::uint64_t x = 0;
  const bool digits =
      !v.empty() && v.size() <= 10 && v.find_first_not_of("0123456789") == std::string::npos;
  if (digits) {
    x = std::stoull(v);
  }
  if (!digits || x == 0 || x > max) {
    throw usage_error(flag + " '" + v + "' is not a positive integer" +
                      (max < 0xffffffffu ? " of at most " + std::to_string(max) : std::string()));
  }
  return static_cast<std::uint32_t>(x);
}

// A comma-separated list of positive integers, e.g. "64,512".
std::vector<std::uint32_t> parse_list(const std::string& s, const std::string& flag = "list") {
  std::vector<std::uint32_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    out.push_back(parse_count(flag, item));
  }
  if (out.empty()) {
    throw usage_error(flag + " '" + s + "' names no value");
  }
  return out;
}

// seq = 100 * context index + j: j = 0 full, 1.. selective per budget, 99 bandwidth.
int run_prefill(const std::vector<std::uint32_t>& contexts, std::uint32_t budgets) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  using namespace oasiskv::disagg;
  const auto& l = pd_demo::layout;
  std::uint64_t slots = 0;
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    slots += std::uint64_t{l.num_layers} * l.blocks_for(contexts[i]) * (budgets + 1 + (i == 0));
  }
  exporter_options o;
  o.token.fill(std::byte{0x5a});
  o.lease = std::chrono::milliseconds(10000);
  kv_exporter ex(l, static_cast<std::uint32_t>(slots), o);
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    std::vector<std::uint32_t> js;
    for (std::uint32_t j = 0; j <= budgets; ++j) {
      js.push_back(j);
    }
    if (i == 0) {
      js.push_back(99);
    }
    std::vector<oasiskv::slot_id> first;
    for (std::uint32_t j : js) {  // the prefill "computes" one request's KV; copies are the same
      const std::uint64_t seq = 100 * i + j;
      const auto s = ex.allocate(seq, contexts[i]);
      const std::uint32_t blocks = l.blocks_for(contexts[i]);
      for (std::size_t b = 0; b < s.size(); ++b) {
        if (first.empty() || first.size() < s.size()) {
          pd_demo::fill_block(ex.slot_data(s[b]), i, static_cast<std::uint32_t>(b / blocks),
                              static_cast<std::uint32_t>(b % blocks));
        } else {
          std::memcpy(ex.slot_data(s[b]), ex.slot_data(first[b]), l.block_bytes());
        }
      }
      if (first.empty()) {
        first = s;
      }
      ex.publish(seq);
    }
  }
  std::printf("port %u\n", ex.port());
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(900));  // the parent kills it when done
  return 0;
}

struct child {
  pid_t pid = -1;
  std::FILE* out = nullptr;
};

child spawn(const std::vector<std::string>& args) {
  int fds[2];
  if (::pipe(fds) != 0) {
    std::perror("pipe");
    std::exit(1);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  std::vector<char*> argv;
  for (const auto& a : args) {
    argv.push_back(const_cast<char*>(a.c_str()));
  }
  argv.push_back(nullptr);
  child c;
  if (posix_spawn(&c.pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ) != 0) {
    std::perror("posix_spawn");
    std::exit(1);
  }
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  c.out = ::fdopen(fds[0], "r");
  return c;
}

std::string read_line(child& c) {
  char* buf = nullptr;
  std::size_t cap = 0;
  const ssize_t n = ::getline(&buf, &cap, c.out);
  std::string s = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  std::free(buf);
  if (!s.empty() && s.back() == '\n') {
    s.pop_back();
  }
  return s;
}

std::map<std::string, std::string> fields(const std::string& line) {
  std::map<std::string, std::string> m;
  std::stringstream ss(line);
  std::string kv;
  while (ss >> kv) {
    if (const auto eq = kv.find('='); eq != std::string::npos) {
      m[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  return m;
}

std::map<std::string, std::string> run_child(const std::vector<std::string>& args) {
  child c = spawn(args);
  std::string line = read_line(c), last;
  while (!line.empty()) {
    last = line;
    line = read_line(c);
  }
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  std::fclose(c.out);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || last.empty()) {
    std::fprintf(stderr, "pd_demo: %s %s failed (status %d): %s\n", args[1].c_str(),
                 args.size() > 3 ? args[3].c_str() : "", status, last.c_str());
    std::exit(1);
  }
  return fields(last);
}

double mib(const std::string& bytes) {
  return std::stod(bytes) / (1 << 20);
}

int run_synthetic(const std::vector<std::string>& a) {
  std::string contexts = "8192,32768", budgets = "1024,2048", steps = "64", bw_seconds = "1";
  for (std::size_t i = 1; i < a.size(); i += 2) {
    if (i + 1 >= a.size()) {
      throw usage_error("'" + a[i] + "' needs a value");
    }
    if (a[i] == "--contexts") {
      contexts = a[i + 1];
    } else if (a[i] == "--budgets") {
      budgets = a[i + 1];
    } else if (a[i] == "--steps") {
      steps = a[i + 1];
    } else if (a[i] == "--bandwidth-seconds") {
      bw_seconds = a[i + 1];
    } else {
      throw usage_error("unknown argument '" + a[i] + "'");
    }
  }
  const auto ctx = parse_list(contexts, "--contexts");
  const auto bud = parse_list(budgets, "--budgets");
  parse_count("--steps", steps);
  parse_count("--bandwidth-seconds", bw_seconds, 3600);
  const char* tls = std::getenv("UCX_TLS");
  std::printf(
      "pd_demo: UCX_TLS=%s, layout 8 layers x 2 kv heads x 64 (f16), 16-token blocks, "
      "%s decode steps\n",
      tls != nullptr ? tls : "(default)", steps.c_str());
  child prefill = spawn({"pd_demo", "prefill", contexts, std::to_string(bud.size())});
  const std::string hello = read_line(prefill);
  if (hello.rfind("port ", 0) != 0) {
    std::fprintf(stderr, "pd_demo: prefill server failed: %s\n", hello.c_str());
    return 1;
  }
  const std::string port = hello.substr(5);
  std::printf("%-9s %6s %6s | %10s %10s %7s | %10s | %9s %7s | %9s %8s\n", "mode", "ctx", "budget",
              "admit MiB", "decode MiB", "less", "host KV MiB", "HWM MiB", "less", "admit ms",
              "tok/s");
  for (std::size_t i = 0; i < ctx.size(); ++i) {
    auto full = run_child({"pd_demo", "decode", port, std::to_string(100 * i), "full", "0", steps});
    auto row = [&](const std::string& mode, const std::string& budget,
                   std::map<std::string, std::string>& r) {
      const double admit_less = std::stod(full["admitted"]) / std::stod(r["admitted"]);
      const double hwm_less =
          std::stod(full["hwm_delta_kib"]) / std::max(1.0, std::stod(r["hwm_delta_kib"]));
      std::printf("%-9s %6u %6s | %10.2f %10.2f %6.1fx | %10.2f | %9.1f %6.1fx | %9s %8s\n",
                  mode.c_str(), ctx[i], budget.c_str(), mib(r["admitted"]), mib(r["fetched"]),
                  admit_less, mib(r["host_kv"]), std::stod(r["hwm_delta_kib"]) / 1024, hwm_less,
                  r["admit_ms"].c_str(), r["tok_s"].c_str());
    };
    row("full", "-", full);
    for (std::size_t j = 0; j < bud.size(); ++j) {
      auto sel = run_child({"pd_demo", "decode", port, std::to_string(100 * i + j + 1), "selective",
                            std::to_string(bud[j]), steps});
      row("selective", std::to_string(bud[j]), sel);
    }
  }
  auto bw = run_child({"pd_demo", "bandwidth", port, "99", bw_seconds});
  std::printf(
      "remote gets of %s-byte blocks: engine %.2f GB/s, raw ucp_get_nbx loop %.2f GB/s "
      "(%.0f%%)\n",
      bw["block_bytes"].c_str(), std::stod(bw["engine_gbs"]), std::stod(bw["raw_gbs"]),
      100.0 * std::stod(bw["engine_gbs"]) / std::stod(bw["raw_gbs"]));
  ::kill(prefill.pid, SIGKILL);
  ::waitpid(prefill.pid, nullptr, 0);
  return 0;
}

#ifdef PD_DEMO_MODEL
pd_demo::real::setup setup_from(const std::vector<std::string>& a, std::size_t i) {
  pd_demo::real::setup s;
  s.model_path = a.at(i);
  s.prompt_file = a.at(i + 1);
  s.prompt_tokens = static_cast<std::uint32_t>(std::stoul(a.at(i + 2)));
  s.steps = static_cast<std::uint32_t>(std::stoul(a.at(i + 3)));
  return s;
}

std::vector<std::string> setup_args(const pd_demo::real::setup& s) {
  return {s.model_path, s.prompt_file, std::to_string(s.prompt_tokens), std::to_string(s.steps)};
}

std::vector<int> parse_tokens(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    out.push_back(std::stoi(item));
  }
  return out;
}

// Runs the demo on a model: 1 when the model cannot be read, or when
// `expect` is set and a run that attends the whole context disagrees with the local dense run.
int run_model(const std::vector<std::string>& a) {
  pd_demo::real::setup s;
  s.model_path = "tests/data/stories260K/stories260K.bin";
  std::string budgets = "64,512";
  bool expect = false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == "--expect-agreement") {
      expect = true;
      continue;
    }
    const bool known = a[i] == "--model" || a[i] == "--prompt-file" || a[i] == "--prompt-tokens" ||
                       a[i] == "--budgets" || a[i] == "--steps";
    if (!known) {
      throw usage_error("unknown argument '" + a[i] + "'");
    }
    if (i + 1 >= a.size()) {
      throw usage_error("'" + a[i] + "' needs a value");
    }
    const std::string& v = a[++i];
    if (a[i - 1] == "--model") {
      s.model_path = v;
    } else if (a[i - 1] == "--prompt-file") {
      s.prompt_file = v;
    } else if (a[i - 1] == "--prompt-tokens") {
      s.prompt_tokens = parse_count("--prompt-tokens", v);
    } else if (a[i - 1] == "--budgets") {
      budgets = v;
    } else {
      s.steps = parse_count("--steps", v);
    }
  }
  const auto bud = parse_list(budgets, "--budgets");
  if (::access(s.model_path.c_str(), R_OK) != 0) {
    throw std::runtime_error("cannot read model '" + s.model_path + "': " + std::strerror(errno) +
                             mini_decoder::fetch_hint);
  }
  const auto m = mini_decoder::load_model(s.model_path);
  const auto& c = m->config;
  const std::vector<int> prompt = pd_demo::real::prompt_tokens(*m, s);
  const auto P = static_cast<std::uint32_t>(prompt.size());
  const char* tls = std::getenv("UCX_TLS");
  const oasiskv::kv_layout l = pd_demo::real::layout_of(*m);
  std::printf(
      "pd_demo: UCX_TLS=%s, model %s (%u layers x %u kv heads x %u, f16 KV, 16-token blocks, "
      "%zu B per block and layer), prompt %u tokens, %u greedy tokens\n",
      tls != nullptr ? tls : "(default)", s.model_path.c_str(), c.num_layers, c.num_kv_heads,
      c.head_dim, l.block_bytes(), P, s.steps);
  std::fflush(stdout);

  std::vector<std::string> pargs{"pd_demo", "prefill-model"};
  for (const auto& x : setup_args(s)) {
    pargs.push_back(x);
  }
  pargs.push_back(std::to_string(bud.size() + 1));
  child prefill = spawn(pargs);

  // The local dense run (the mini-decoder, no disaggregation) while the server prefills.
  mini_decoder::decoder_options o;
  o.mode = mini_decoder::attention_mode::dense;
  o.max_tokens = s.steps;
  o.context = P + s.steps + 1;
  mini_decoder::decoder dense(*m, o);
  const std::vector<int> ref = dense.generate(prompt);
  const double dense_tok_s = dense.report().decode_tokens_per_second();

  const std::string hello = read_line(prefill);
  std::stringstream hs(hello);
  std::string w, port, prefill_s;
  int first = -1;
  std::uint32_t tokens = 0;
  while (hs >> w) {
    if (w == "port") {
      hs >> port;
    } else if (w == "first") {
      hs >> first;
    } else if (w == "tokens") {
      hs >> tokens;
    } else if (w == "prefill_s") {
      hs >> prefill_s;
    }
  }
  if (port.empty() || tokens != P) {
    std::fprintf(stderr, "pd_demo: prefill server failed: %s\n", hello.c_str());
    ::kill(prefill.pid, SIGKILL);
    ::waitpid(prefill.pid, nullptr, 0);
    return 1;
  }
  std::printf("prefill server: %u tokens in %s s, first token %d (local: %d)\n", P,
              prefill_s.c_str(), first, ref.empty() ? -1 : ref[0]);
  std::printf("%-9s %6s | %10s %10s %7s | %10s | %9s %7s | %9s %8s %6s | %7s\n", "mode", "budget",
              "admit MiB", "decode MiB", "less", "host KV MiB", "HWM MiB", "less", "admit ms",
              "tok/s", "hits", "agree");
  auto agree = [&](const std::vector<int>& t) {
    std::size_t k = 0;
    while (k < t.size() && k < ref.size() && t[k] == ref[k]) {
      ++k;
    }
    return k;
  };
  auto text = [&](const std::vector<int>& t) {
    std::string out;
    int prev = prompt.back();
    for (int tok : t) {
      out += m->tok->decode(prev, tok);
      prev = tok;
    }
    return out;
  };
  bool ok = true;
  std::map<std::string, std::string> full;
  std::vector<std::pair<std::string, std::vector<int>>> runs;
  for (std::size_t j = 0; j <= bud.size(); ++j) {
    const std::uint32_t budget = j == 0 ? 0 : bud[j - 1];
    std::vector<std::string> dargs{"pd_demo", "decode-model"};
    for (const auto& x : setup_args(s)) {
      dargs.push_back(x);
    }
    for (const auto& x : {port, std::to_string(j), std::to_string(budget), std::to_string(first),
                          std::to_string(P)}) {
      dargs.push_back(x);
    }
    auto r = run_child(dargs);
    if (j == 0) {
      full = r;
    }
    const std::vector<int> t = parse_tokens(r["tokens"]);
    const std::size_t k = agree(t);
    const bool same = k == ref.size() && t.size() == ref.size();
    const double admit_less = std::stod(full["admitted"]) / std::stod(r["admitted"]);
    const double hwm_less =
        std::stod(full["hwm_delta_kib"]) / std::max(1.0, std::stod(r["hwm_delta_kib"]));
    std::printf(
        "%-9s %6s | %10.3f %10.3f %6.1fx | %10.3f | %9.2f %6.1fx | %9s %8s %6s | %3zu/%-3zu\n",
        j == 0 ? "full" : "selective", j == 0 ? "-" : std::to_string(budget).c_str(),
        mib(r["admitted"]), mib(r["fetched"]), admit_less, mib(r["host_kv"]),
        std::stod(r["hwm_delta_kib"]) / 1024, hwm_less, r["admit_ms"].c_str(), r["tok_s"].c_str(),
        r["hit_rate"].c_str(), k, ref.size());
    std::fflush(stdout);
    runs.emplace_back(j == 0 ? "full" : "selective " + std::to_string(budget), t);
    // A budget that covers the context attends every block: the tokens must be the dense run's.
    if (expect && (j == 0 || budget >= P + s.steps) && !same) {
      std::printf("FAIL: %s generated other tokens than the local dense run\n",
                  runs.back().first.c_str());
      ok = false;
    }
    if (expect && j > 0 && budget < P &&
        !(std::stod(r["admitted"]) < std::stod(full["admitted"]))) {
      std::printf("FAIL: selective %u admitted no fewer bytes than full\n", budget);
      ok = false;
    }
  }
  ::kill(prefill.pid, SIGKILL);
  ::waitpid(prefill.pid, nullptr, 0);
  std::printf("local dense run (mini-decoder, same prompt): %zu tokens, %.2f tok/s\n", ref.size(),
              dense_tok_s);
  std::printf("[local dense] %s\n", text(ref).c_str());
  for (const auto& [name, t] : runs) {
    if (t == ref) {
      std::printf("[%s] (the same tokens)\n", name.c_str());
    } else {
      std::printf("[%s] %s\n", name.c_str(), text(t).c_str());
    }
  }
  return ok ? 0 : 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (!a.empty() && a[0] == "prefill" && a.size() == 3) {
      return run_prefill(parse_list(a[1]), static_cast<std::uint32_t>(std::stoul(a[2])));
    }
    if (!a.empty() && a[0] == "decode" && a.size() == 6) {
      return pd_demo::run_decode(static_cast<std::uint16_t>(std::stoul(a[1])), std::stoull(a[2]),
                                 a[3] == "selective", static_cast<std::uint32_t>(std::stoul(a[4])),
                                 static_cast<std::uint32_t>(std::stoul(a[5])));
    }
    if (!a.empty() && a[0] == "bandwidth" && a.size() == 4) {
      return pd_demo::run_bandwidth(static_cast<std::uint16_t>(std::stoul(a[1])), std::stoull(a[2]),
                                    std::stod(a[3]));
    }
#ifdef PD_DEMO_MODEL
    if (!a.empty() && a[0] == "prefill-model" && a.size() == 6) {
      return pd_demo::real::run_prefill(setup_from(a, 1),
                                        static_cast<std::uint32_t>(std::stoul(a[5])));
    }
    if (!a.empty() && a[0] == "decode-model" && a.size() == 10) {
      pd_demo::real::decode_args d;
      d.port = static_cast<std::uint16_t>(std::stoul(a[5]));
      d.seq = std::stoull(a[6]);
      d.budget = static_cast<std::uint32_t>(std::stoul(a[7]));
      d.first = std::stoi(a[8]);
      d.prompt = static_cast<std::uint32_t>(std::stoul(a[9]));
      return pd_demo::real::run_decode(setup_from(a, 1), d);
    }
#endif
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    return 2;
  }
  for (const auto& x : a) {
    if (x == "--help" || x == "-h") {
      std::fputs(usage_text, stdout);
      return 0;
    }
  }
  try {
    if (!a.empty() && a[0] == "--synthetic") {
      return run_synthetic(a);
    }
#ifdef PD_DEMO_MODEL
    return run_model(a);
#else
    std::fprintf(stderr, "pd_demo: built without the mini-decoder; run with --synthetic\n");
    return 1;
#endif
  } catch (const usage_error& e) {
    std::fprintf(stderr, "pd_demo: %s\n%s", e.what(), usage_text);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pd_demo: error: %s\n", e.what());
    return 1;
  }
}
