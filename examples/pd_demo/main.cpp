// Prefill/decode disaggregation demo: a prefill server process exports synthetic KV through a
// kv_exporter; decode client processes admit the same requests densely (full) and selectively,
// decode through block-sparse attention, and report bytes moved at admission and over the
// decode, decode-node host memory and tokens/s. All on 127.0.0.1; UCX_TLS picks the transport.
//
//   pd_demo [--contexts 8192,32768] [--budgets 1024,2048] [--steps 64] [--bandwidth-seconds 1]
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "decode.hpp"
#include "oasiskv/disagg/kv_exporter.hpp"
#include "synthetic.hpp"

extern char** environ;

namespace {

std::vector<std::uint32_t> parse_list(const std::string& s) {
  std::vector<std::uint32_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    out.push_back(static_cast<std::uint32_t>(std::stoul(item)));
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
  char buf[1024];
  if (std::fgets(buf, sizeof buf, c.out) == nullptr) {
    return {};
  }
  std::string s(buf);
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
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    return 2;
  }
  std::string contexts = "8192,32768", budgets = "1024,2048", steps = "64", bw_seconds = "1";
  for (std::size_t i = 0; i + 1 < a.size(); i += 2) {
    if (a[i] == "--contexts") {
      contexts = a[i + 1];
    } else if (a[i] == "--budgets") {
      budgets = a[i + 1];
    } else if (a[i] == "--steps") {
      steps = a[i + 1];
    } else if (a[i] == "--bandwidth-seconds") {
      bw_seconds = a[i + 1];
    } else {
      std::fprintf(stderr,
                   "usage: pd_demo [--contexts 8192,32768] [--budgets 1024,2048] "
                   "[--steps 64] [--bandwidth-seconds 1]\n");
      return 1;
    }
  }
  const auto ctx = parse_list(contexts);
  const auto bud = parse_list(budgets);
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
