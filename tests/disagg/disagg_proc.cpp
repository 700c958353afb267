// SPDX-License-Identifier: Apache-2.0
// Helper process of the disaggregation tests.
//   disagg_proc export <requests> <tokens> <lease_ms> <lifetime_s> [first_seq] [kv]
//     publishes requests first_seq.. with the test pattern (`kv`: finite f16 KV), prints
//     "port <p>", serves.
//   disagg_proc decode <port> <seq> <lifetime_s>
//     opens <seq> (heartbeats on), prints "opened", then idles until killed or lifetime ends.
// Both exit by themselves after <lifetime_s>, and when their parent dies.
#include <sys/prctl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"

int main(int argc, char** argv) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  using namespace oasiskv::disagg;
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "export" && argc >= 6) {
      const auto requests = static_cast<std::uint32_t>(std::stoul(argv[2]));
      const auto tokens = static_cast<std::uint32_t>(std::stoul(argv[3]));
      exporter_options o;
      o.token = disagg_test::token();
      o.lease = std::chrono::milliseconds(std::stoul(argv[4]));
      const std::uint64_t first = argc > 6 ? std::stoull(argv[6]) : 1;
      const std::uint32_t per =
          disagg_test::layout.num_layers * disagg_test::layout.blocks_for(tokens);
      kv_exporter e(disagg_test::layout, requests * per + 8, o);
      for (std::uint64_t s = first; s < first + requests; ++s) {
        disagg_test::publish_pattern(e, s, tokens, argc > 7 && std::string(argv[7]) == "kv");
      }
      std::printf("port %u\n", e.port());
      std::fflush(stdout);
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::seconds(std::stoul(argv[5]));
      while (std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return 0;
    }
    if (mode == "decode" && argc >= 5) {
      ucx_engine engine;
      remote_tier_options o;
      o.port = static_cast<std::uint16_t>(std::stoul(argv[2]));
      o.token = disagg_test::token();
      o.client = "doomed-decode";
      ucx_remote_tier tier(engine, o);
      const opened_msg opened = tier.open(std::stoull(argv[3]));
      // Read a block first: the endpoint is then wired up both ways, as on any working node.
      oasiskv::host_tier local(tier.layout(), 1);
      const oasiskv::block_copy c{opened.blocks[0].slot, 0};
      engine.wait(engine.submit(tier, local, std::span(&c, 1)));
      std::printf("opened\n");
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::seconds(std::stoul(argv[4])));
      return 0;
    }
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    std::fflush(stdout);
    return 2;
  }
  std::fprintf(stderr, "usage: disagg_proc export|decode ...\n");
  return 1;
}
