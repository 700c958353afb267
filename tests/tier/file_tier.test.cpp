// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"
#include "support/paths.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "oasiskv/tier/file_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "support/engine_conformance.hpp"
#include "support/tier_conformance.hpp"

using oasiskv::block_read;
using oasiskv::block_write;
using oasiskv::dtype;
using oasiskv::errc;
using oasiskv::file_backend;
using oasiskv::file_tier;
using oasiskv::file_tier_options;
using oasiskv::kv_layout;
using oasiskv::slot_id;
namespace fs = std::filesystem;

static_assert(oasiskv::batched_block_io_tier<file_tier>);
static_assert(!oasiskv::addressable_tier<file_tier>);
static_assert(file_tier::memory == oasiskv::memory_kind::file);
static_assert(oasiskv::transfer_engine<oasiskv::cpu_copy_engine, file_tier, oasiskv::host_tier>);
static_assert(oasiskv::transfer_engine<oasiskv::cpu_copy_engine, oasiskv::host_tier, file_tier>);
static_assert(oasiskv::transfer_engine<oasiskv::cpu_copy_engine, file_tier, file_tier>);

namespace {
// 12 KiB blocks: three whole O_DIRECT units, so aligned buffers need no bounce.
const kv_layout smollm2{30, 9, 3, 64, 16, dtype::f16};
// 96-byte blocks: O_DIRECT always bounces, and the slot's padding must not leak out.
const kv_layout odd{1, 2, 1, 8, 3, dtype::bf16};

// A directory under /tmp for one test, removed with everything in it.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string templ = (fs::temp_directory_path() / "oasiskv-file-tier-test-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, ec);
    fs::remove_all(path, ec);
  }
};

// The backends this machine can run: the pread pool always, io_uring where it works.
std::vector<file_backend> backends() {
  std::vector<file_backend> b{file_backend::pread_pool};
  if (file_tier::io_uring_available()) {
    b.push_back(file_backend::io_uring);
    oasiskv::testing::note_path("file_tier: io_uring");
  } else {
#if defined(OASISKV_WITH_LIBURING)
    MESSAGE("io_uring is refused by this kernel or sandbox: its tests are skipped");
#else
    MESSAGE("built without liburing (no oasiskv::file): io_uring tests are skipped");
#endif
  }
  return b;
}

// Buffers with a chosen misalignment from 4096: 0 exercises the direct path, others the bounce.
struct test_buffers {
  std::size_t stride;
  std::size_t skew;
  std::unique_ptr<std::byte[], void (*)(std::byte*)> mem;
  test_buffers(std::size_t n, std::size_t bytes, std::size_t misalign)
      : stride((bytes + 4095) / 4096 * 4096 + 4096),
        skew(misalign),
        mem(static_cast<std::byte*>(::operator new[](n* stride, std::align_val_t{4096})),
            [](std::byte* p) { ::operator delete[](p, std::align_val_t{4096}); }) {}
  std::byte* operator[](std::size_t i) const { return mem.get() + i * stride + skew; }
};

void fill_random(std::byte* p, std::size_t n, std::mt19937_64& rng) {
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = static_cast<std::byte>(rng());
  }
}

using oasiskv::testing::expect_error;
}  // namespace

TEST_CASE("file_tier: geometry, backend selection and direct I/O on this machine") {
  temp_dir dir;
  file_tier t(odd, 10, {.path = dir.path.string()});
  CHECK(t.layout() == odd);
  CHECK(t.num_slots() == 10);
  CHECK(t.slot_bytes() == 4096);
  CHECK(t.file_bytes() == 40960);
  CHECK(t.temporary());
  CHECK(fs::is_empty(dir.path));  // the temporary file has no name
  struct stat st {};
  REQUIRE(::fstat(t.native_handle(), &st) == 0);
  CHECK(static_cast<std::uint64_t>(st.st_size) >= t.file_bytes());
  CHECK(file_tier(smollm2, 1, {.path = dir.path.string()}).slot_bytes() == 12288);
  // automatic picks io_uring whenever it works.
  if (t.direct_io()) {
    oasiskv::testing::note_path("file_tier: O_DIRECT");
  }
  MESSAGE("direct_io on " << dir.path << ": " << t.direct_io()
                          << ", automatic backend: " << oasiskv::to_string(t.backend()));
  CHECK(t.backend() ==
        (file_tier::io_uring_available() ? file_backend::io_uring : file_backend::pread_pool));
  // A moved tier keeps working; the moved-from one only needs to be destroyable.
  file_tier moved(std::move(t));
  std::vector<std::byte> a(odd.block_bytes(), std::byte{7}), b(odd.block_bytes());
  moved.write_block(3, a.data());
  moved.read_block(3, b.data());
  CHECK(a == b);
}

TEST_CASE("file_tier: a filesystem that refuses O_DIRECT gets buffered I/O") {
  // tmpfs refused O_DIRECT (EINVAL) before Linux 6.6; newer kernels accept it, and then there is
  // no filesystem here to exercise the fallback with.
  if (!fs::is_directory("/dev/shm")) {
    MESSAGE("no /dev/shm: the O_DIRECT fallback is not exercised");
    return;
  }
  file_tier t(odd, 4, {.path = "/dev/shm"});
  const std::string what =
      t.direct_io() ? "true (the fallback is not exercised)" : "false (buffered fallback)";
  MESSAGE("direct_io on /dev/shm (tmpfs): " << what);
  if (!t.direct_io()) {
    oasiskv::testing::note_path("file_tier: buffered fallback where O_DIRECT is refused");
  }
  std::vector<std::byte> a(odd.block_bytes(), std::byte{9}), b(odd.block_bytes());
  t.write_block(1, a.data());
  t.read_block(1, b.data());
  CHECK(a == b);
}

TEST_CASE("file_tier: round trips through every backend, direct and buffered, any alignment") {
  std::mt19937_64 rng(42);
  temp_dir dir;
  for (const file_backend backend : backends()) {
    for (const bool direct : {true, false}) {
      for (const kv_layout& layout : {smollm2, odd}) {
        for (const std::size_t misalign : {std::size_t{0}, std::size_t{64}, std::size_t{3}}) {
          CAPTURE(oasiskv::to_string(backend));
          CAPTURE(direct);
          CAPTURE(layout.block_bytes());
          CAPTURE(misalign);
          const std::uint32_t n = 40;
          file_tier t(layout, n,
                      {.path = dir.path.string(),
                       .direct_io = direct,
                       .backend = backend,
                       .queue_depth = 8,
                       .pool_threads = 3});
          CHECK(t.backend() == backend);
          CHECK(t.direct_io() == direct);
          const std::size_t bb = layout.block_bytes();
          test_buffers src(n, bb, misalign), dst(n, bb, misalign);
          std::vector<slot_id> perm(n);
          std::iota(perm.begin(), perm.end(), 0u);
          std::shuffle(perm.begin(), perm.end(), rng);
          // Batched writes (more than the queue depth, so the window refills), single reads.
          std::vector<block_write> writes;
          for (std::uint32_t i = 0; i < n; ++i) {
            fill_random(src[i], bb, rng);
            writes.push_back({perm[i], src[i]});
          }
          t.write_blocks(writes);
          for (std::uint32_t i = 0; i < n; ++i) {
            std::memset(dst[i], 0xee, bb + 1);
            t.read_block(perm[i], dst[i]);
            REQUIRE(std::memcmp(dst[i], src[i], bb) == 0);
            CHECK(dst[i][bb] == std::byte{0xee});  // exactly block_bytes, not the padded slot
          }
          // Single writes, batched reads.
          std::vector<block_read> reads;
          for (std::uint32_t i = 0; i < n; ++i) {
            fill_random(src[i], bb, rng);
            t.write_block(perm[i], src[i]);
            reads.push_back({perm[i], dst[i]});
          }
          t.read_blocks(reads);
          for (std::uint32_t i = 0; i < n; ++i) {
            REQUIRE(std::memcmp(dst[i], src[i], bb) == 0);
          }
          t.read_blocks({});  // an empty batch is a no-op
        }
      }
    }
  }
}

TEST_CASE("file_tier: the tier and transfer contracts through every backend, direct and buffered") {
  temp_dir dir;
  for (const file_backend backend : backends()) {
    for (const bool direct : {true, false}) {
      for (const bool behind : {false, true}) {
        CAPTURE(oasiskv::to_string(backend));
        CAPTURE(direct);
        CAPTURE(behind);
        file_tier t(odd, 24,
                    {.path = dir.path.string(),
                     .direct_io = direct,
                     .backend = backend,
                     .write_behind = behind});
        oasiskv::testing::check_tier_conformance(t, 3);
        t.flush();
        oasiskv::host_tier fast(odd, 10);
        oasiskv::cpu_copy_engine e;
        oasiskv::testing::check_engine_conformance(e, t, fast, 6);
        oasiskv::testing::check_engine_conformance(e, fast, t, 7);
        t.flush();
      }
    }
  }
}

TEST_CASE("file_tier: 100k randomized block reads and writes against an in-memory model") {
  std::mt19937_64 rng(7);
  temp_dir dir;
  for (const file_backend backend : backends()) {
    // Write-through; write-behind whose writer starts at once; write-behind that lingers.
    for (const int mode : {0, 1, 2}) {
      const bool behind = mode != 0;
      CAPTURE(oasiskv::to_string(backend));
      CAPTURE(mode);
      const std::uint32_t n = 96;
      // queue_depth 16 < the largest batch (32): write-behind must wait for room.
      file_tier t(odd, n,
                  {.path = dir.path.string(),
                   .backend = backend,
                   .queue_depth = 16,
                   .write_behind = behind,
                   .write_linger_us = mode == 2 ? 1000u : 0u});
      CHECK(t.write_behind() == behind);
      if (behind) {
        WARN_MESSAGE(t.background_writer(), "the system refused SCHED_IDLE for the writer");
      } else {
        CHECK_FALSE(t.background_writer());
      }
      const std::size_t bb = odd.block_bytes();
      std::vector<std::byte> model(n * bb, std::byte{0});  // unwritten slots read as zeros
      test_buffers buf(32, bb, 0);
      test_buffers skewed(32, bb, 64);
      std::vector<slot_id> perm(n);
      std::iota(perm.begin(), perm.end(), 0u);
      std::size_t ops = 0;
      while (ops < 100000) {
        const auto k = static_cast<std::uint32_t>(1 + rng() % 32);  // 1: the single-block calls
        const bool write = rng() % 2 == 0;
        const test_buffers& b = rng() % 2 == 0 ? buf : skewed;
        for (std::uint32_t i = 0; i < k; ++i) {  // k distinct slots
          std::swap(perm[i], perm[i + rng() % (n - i)]);
        }
        if (write) {
          std::vector<block_write> w;
          for (std::uint32_t i = 0; i < k; ++i) {
            fill_random(b[i], bb, rng);
            std::memcpy(model.data() + perm[i] * bb, b[i], bb);
            w.push_back({perm[i], b[i]});
          }
          k == 1 ? t.write_block(w[0].slot, w[0].in) : t.write_blocks(w);
        } else {
          std::vector<block_read> r;
          for (std::uint32_t i = 0; i < k; ++i) {
            r.push_back({perm[i], b[i]});
          }
          k == 1 ? t.read_block(r[0].slot, r[0].out) : t.read_blocks(r);
          for (std::uint32_t i = 0; i < k; ++i) {
            REQUIRE(std::memcmp(b[i], model.data() + perm[i] * bb, bb) == 0);
          }
        }
        ops += k;
      }
      // After flush the file itself holds the model (read behind the tier's back, buffered).
      t.flush();
      CHECK(t.pending_writes() == 0);
      CHECK(t.failed_writes() == 0);
      const test_buffers slot(1, t.slot_bytes(), 0);  // aligned: the descriptor has O_DIRECT
      for (slot_id s = 0; s < n; ++s) {
        REQUIRE(::pread(t.native_handle(), slot[0], t.slot_bytes(),
                        static_cast<off_t>(s * t.slot_bytes())) ==
                static_cast<ssize_t>(t.slot_bytes()));
        REQUIRE(std::memcmp(slot[0], model.data() + s * bb, bb) == 0);
      }
    }
  }
}

TEST_CASE("file_tier: concurrent readers and writers on distinct slots") {
  temp_dir dir;
  for (const file_backend backend : backends()) {
    for (const bool behind : {false, true}) {
      CAPTURE(oasiskv::to_string(backend));
      CAPTURE(behind);
      constexpr std::uint32_t threads = 4, per_thread = 16, rounds = 60;
      file_tier t(odd, threads * per_thread,
                  {.path = dir.path.string(),
                   .backend = backend,
                   .queue_depth = 8,
                   .write_behind = behind,
                   .background_writer = false});  // the randomized test runs it at SCHED_IDLE
      const std::size_t bb = odd.block_bytes();
      std::vector<std::thread> pool;
      std::vector<int> bad(threads, 0);
      for (std::uint32_t id = 0; id < threads; ++id) {
        pool.emplace_back([&, id] {
          std::mt19937_64 rng(id);
          test_buffers in(per_thread, bb, id % 2 == 0 ? 0 : 64), out(per_thread, bb, 0);
          std::vector<block_write> w;
          std::vector<block_read> r;
          for (std::uint32_t i = 0; i < per_thread; ++i) {
            w.push_back({id * per_thread + i, in[i]});
            r.push_back({id * per_thread + i, out[i]});
          }
          for (std::uint32_t round = 0; round < rounds; ++round) {
            for (std::uint32_t i = 0; i < per_thread; ++i) {
              fill_random(in[i], bb, rng);
            }
            if (round % 3 == 0) {
              for (const block_write& x : w) {
                t.write_block(x.slot, x.in);
              }
            } else {
              t.write_blocks(w);
            }
            t.read_blocks(r);
            for (std::uint32_t i = 0; i < per_thread; ++i) {
              bad[id] += std::memcmp(in[i], out[i], bb) != 0;
            }
          }
        });
      }
      for (std::thread& th : pool) {
        th.join();
      }
      CHECK(std::accumulate(bad.begin(), bad.end(), 0) == 0);
      t.flush();
      CHECK(t.pending_writes() == 0);
    }
  }
}

TEST_CASE("file_tier: cpu_copy_engine moves blocks between host_tier and file_tier") {
  std::mt19937_64 rng(3);
  temp_dir dir;
  for (const file_backend backend : backends()) {
    for (const auto align : {oasiskv::host_tier_options::alignment::cache_line,
                             oasiskv::host_tier_options::alignment::page}) {
      CAPTURE(oasiskv::to_string(backend));
      const std::uint32_t n = 48;
      const std::size_t bb = smollm2.block_bytes();
      oasiskv::host_tier host(smollm2, n, {.align = align});
      oasiskv::host_tier back(smollm2, n, {.align = align});
      // The first file writes behind: the engine's reads of it must see the newest blocks.
      file_tier file(smollm2, n,
                     {.path = dir.path.string(), .backend = backend, .write_behind = true});
      file_tier file2(smollm2, n, {.path = dir.path.string(), .backend = backend});
      for (slot_id s = 0; s < n; ++s) {
        fill_random(host.slot_data(s), bb, rng);
      }
      std::vector<oasiskv::block_copy> out, in, across;
      for (slot_id s = 0; s < n; ++s) {
        out.push_back({s, (s * 7) % n});  // scattered: host slot s -> file slot 7s mod 48
        across.push_back({(s * 7) % n, n - 1 - s});
        in.push_back({n - 1 - s, s});
      }
      oasiskv::cpu_copy_engine engine;
      engine.wait(engine.submit(host, file, out));
      engine.wait(engine.submit(file, file2, across));
      engine.wait(engine.submit(file2, back, in));
      for (slot_id s = 0; s < n; ++s) {
        REQUIRE(std::memcmp(back.slot_data(s), host.slot_data(s), bb) == 0);
      }
      CHECK(engine.stats().bytes == 3 * n * bb);
      CHECK(engine.stats().failed_batches == 0);
    }
  }
}

TEST_CASE("file_tier: a named file keeps its blocks for the next tier, and is locked meanwhile") {
  temp_dir dir;
  const std::string path = (dir.path / "kv.bin").string();
  std::vector<std::byte> a(smollm2.block_bytes()), b(smollm2.block_bytes());
  std::mt19937_64 rng(5);
  fill_random(a.data(), a.size(), rng);
  {
    file_tier t(smollm2, 4, {.path = path});
    CHECK_FALSE(t.temporary());
    t.write_block(2, a.data());
    expect_error([&] { file_tier again(smollm2, 4, {.path = path}); }, errc::io_error,
                 "is locked by another user");
  }
  CHECK(fs::file_size(path) == 4 * 12288);
  {
    file_tier t(smollm2, 4, {.path = path});
    t.read_block(2, b.data());
    CHECK(a == b);
  }
  // A tier that writes behind leaves its last writes in the file when it is destroyed.
  fill_random(a.data(), a.size(), rng);
  {
    file_tier t(smollm2, 4, {.path = path, .write_behind = true});
    t.write_block(3, b.data());
    t.write_block(3, a.data());  // the newer content wins
  }
  file_tier t(smollm2, 4, {.path = path});
  t.read_block(3, b.data());
  CHECK(a == b);
}

TEST_CASE("file_tier: a lingering writer gathers writes, and never strands one") {
  temp_dir dir;
  std::mt19937_64 rng(13);
  std::vector<std::byte> a(smollm2.block_bytes()), b(smollm2.block_bytes());
  for (const file_backend backend : backends()) {
    CAPTURE(oasiskv::to_string(backend));
    {
      // A 1 s linger: writes stay queued, and a slot written again is queued once.
      file_tier t(smollm2, 8,
                  {.path = dir.path.string(),
                   .backend = backend,
                   .write_behind = true,
                   .write_linger_us = 1'000'000});
      fill_random(a.data(), a.size(), rng);
      t.write_block(2, b.data());
      t.write_block(2, a.data());
      t.write_block(6, b.data());
      CHECK(t.pending_writes() == 2);
      t.read_block(2, b.data());  // served from the queued copy
      CHECK(a == b);
      // flush does not wait out the linger.
      const auto t0 = std::chrono::steady_clock::now();
      t.flush();
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(900));
      CHECK(t.pending_writes() == 0);
    }
    {
      // A 2 ms linger and no flush: the writes reach the device on their own.
      file_tier t(smollm2, 8,
                  {.path = dir.path.string(),
                   .backend = backend,
                   .write_behind = true,
                   .write_linger_us = 2000});
      for (int round = 0; round < 3; ++round) {  // each round finds the writer asleep
        fill_random(a.data(), a.size(), rng);
        t.write_block(5, a.data());
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (t.pending_writes() != 0 && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        REQUIRE(t.pending_writes() == 0);
        // The file itself holds it (aligned: the descriptor has O_DIRECT).
        const test_buffers file(1, t.slot_bytes(), 0);
        REQUIRE(::pread(t.native_handle(), file[0], t.slot_bytes(),
                        static_cast<off_t>(5 * t.slot_bytes())) ==
                static_cast<ssize_t>(t.slot_bytes()));
        CHECK(std::memcmp(file[0], a.data(), a.size()) == 0);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the writer falls asleep
      }
    }
  }
}

TEST_CASE("file_tier: I/O failures name the slot, the offset and the system's reason") {
  temp_dir dir;
  for (const file_backend backend : backends()) {
    CAPTURE(oasiskv::to_string(backend));
    file_tier t(smollm2, 8, {.path = dir.path.string(), .backend = backend});
    // Swap the file for a read-only /dev/null behind the tier's back: writes fail with EBADF,
    // reads find end of file at once.
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(null_fd >= 0);
    REQUIRE(::dup2(null_fd, t.native_handle()) == t.native_handle());
    ::close(null_fd);
    std::vector<std::byte> buf(smollm2.block_bytes() * 4);
    expect_error([&] { t.write_block(5, buf.data()); }, errc::io_error,
                 "write of slot 5 at offset 61440 (12288 bytes) failed: Bad file descriptor");
    expect_error([&] { t.read_block(3, buf.data()); }, errc::io_error,
                 "short read of slot 3 at offset 36864: 0 of 12288 bytes");
    const std::vector<block_write> w{{1, buf.data()}, {2, buf.data() + 12288}};
    expect_error([&] { t.write_blocks(w); }, errc::io_error, "failed: Bad file descriptor");
    // The copy engine reports the tier's failure through wait.
    oasiskv::host_tier host(smollm2, 4);
    oasiskv::cpu_copy_engine engine;
    const auto ticket = engine.submit(t, host, std::vector<oasiskv::block_copy>{{0, 0}, {1, 1}});
    expect_error([&] { engine.wait(ticket); }, errc::transfer_failed, "short read of slot");
  }
}

TEST_CASE("file_tier: a write-behind failure keeps the block, and flush names it") {
  temp_dir dir;
  std::mt19937_64 rng(9);
  for (const file_backend backend : backends()) {
    CAPTURE(oasiskv::to_string(backend));
    file_tier t(smollm2, 8, {.path = dir.path.string(), .backend = backend, .write_behind = true});
    std::vector<std::byte> a(smollm2.block_bytes()), b(smollm2.block_bytes()),
        c(smollm2.block_bytes());
    fill_random(a.data(), a.size(), rng);
    fill_random(c.data(), c.size(), rng);
    t.write_block(1, c.data());
    t.flush();  // slot 1 is on the device before the file goes bad
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(null_fd >= 0);
    REQUIRE(::dup2(null_fd, t.native_handle()) == t.native_handle());
    ::close(null_fd);
    t.write_block(5, a.data());  // returns: the device's refusal comes later
    expect_error([&] { t.flush(); }, errc::io_error,
                 "1 block(s) could not be written and are held in memory; the first: oasiskv: "
                 "file_tier: write of slot 5 at offset 61440 (12288 bytes) failed: Bad file "
                 "descriptor");
    CHECK(t.failed_writes() == 1);
    CHECK(t.pending_writes() == 0);
    t.read_block(5, b.data());  // no data lost: the refused block reads back from memory
    CHECK(a == b);
    const std::vector<block_read> r{{5, b.data()}, {1, c.data()}};
    expect_error([&] { t.read_blocks(r); }, errc::io_error, "short read of slot 1");
    expect_error([&] { t.flush(); }, errc::io_error, "1 block(s) could not be written");
    // A newer write of the slot supersedes the held block (and fails in its turn).
    std::vector<std::byte> d(smollm2.block_bytes(), std::byte{7});
    t.write_block(5, d.data());
    t.read_block(5, b.data());
    CHECK(b == d);
  }
}

TEST_CASE("file_tier: bad arguments") {
  temp_dir dir;
  const std::string d = dir.path.string();
  file_tier t(odd, 4, {.path = d});
  std::vector<std::byte> buf(odd.block_bytes());
  expect_error([&] { t.read_block(4, buf.data()); }, errc::invalid_slot,
               "request 0: slot 4 is outside the pool of 4 slots");
  expect_error([&] { t.write_block(oasiskv::null_slot, buf.data()); }, errc::invalid_slot,
               "slot 4294967295 is outside the pool of 4 slots");
  const std::vector<block_read> r{{0, buf.data()}, {1, buf.data()}, {9, buf.data()}};
  expect_error([&] { t.read_blocks(r); }, errc::invalid_slot, "read_blocks: request 2: slot 9");
  expect_error([&] { t.write_block(1, nullptr); }, errc::invalid_argument,
               "request 0 (slot 1) has a null buffer");

  expect_error([] { file_tier x(odd, 4, {}); }, errc::invalid_argument,
               "file_tier_options.path is empty");
  expect_error([] { file_tier x(odd, 4, {.path = "/nonexistent-oasiskv/dir/kv.bin"}); },
               errc::invalid_argument,
               "path = '/nonexistent-oasiskv/dir/kv.bin': directory '/nonexistent-oasiskv/dir' "
               "does not exist");
  expect_error([] { file_tier x(odd, 4, {.path = "/dev/null"}); }, errc::invalid_argument,
               "'/dev/null' is neither a directory nor a regular file");
  expect_error([&] { file_tier x(odd, 0, {.path = d}); }, errc::invalid_argument, "num_slots = 0");
  expect_error([&] { file_tier x(odd, 4, {.path = d, .queue_depth = 0}); }, errc::invalid_argument,
               "queue_depth = 0 must be in [1, 4096]");
  expect_error([&] { file_tier x(odd, 4, {.path = d, .pool_threads = 0}); }, errc::invalid_argument,
               "pool_threads = 0 must be in [1, 256]");
  expect_error([&] { file_tier x(odd, 4, {.path = d, .write_linger_us = 1'000'001}); },
               errc::invalid_argument, "write_linger_us = 1000001 must be at most 1000000");
  expect_error([&] { file_tier x(odd, 4, {.path = d, .backend = file_backend{9}}); },
               errc::invalid_argument, "backend = 9 is not a file_backend");
  expect_error(
      [&] {
        file_tier x(kv_layout{1, 2, 1, 8, 0, dtype::f16}, 4, {.path = d});
      },
      errc::invalid_layout, "tokens_per_block = 0");
  // A directory nobody may write to. Root ignores permission bits, so it gets sysfs instead.
  const fs::path ro = dir.path / "read-only";
  fs::create_directory(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  const std::string unwritable = ::geteuid() == 0 ? std::string("/sys") : ro.string();
  expect_error(
      [&] { file_tier x(odd, 4, {.path = unwritable}); }, errc::io_error,
      "cannot create a temporary file in directory '" + unwritable + "': Permission denied");
  if (!file_tier::io_uring_available()) {
    expect_error([&] { file_tier x(odd, 4, {.path = d, .backend = file_backend::io_uring}); },
                 errc::unsupported, "io_uring");
  }
  // No space: a reservation far larger than any disk is refused up front.
  expect_error([&] { file_tier x(smollm2, 4000000000u, {.path = d}); }, errc::io_error,
               "cannot reserve 49152000000000 bytes");
}

namespace {
std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void put(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}
// Points the tier's descriptor at /dev/null (reads come back short, writes fail with EBADF);
// returns a duplicate of the real file to restore it with `heal`.
int break_file(file_tier& t) {
  const int saved = ::dup(t.native_handle());
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(saved >= 0);
  REQUIRE(null_fd >= 0);
  REQUIRE(::dup2(null_fd, t.native_handle()) == t.native_handle());
  ::close(null_fd);
  return saved;
}
void heal(file_tier& t, int saved) {
  REQUIRE(::dup2(saved, t.native_handle()) == t.native_handle());
  ::close(saved);
}
bool wait_for_failed(const file_tier& t, std::size_t n) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (t.failed_writes() < n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return t.failed_writes() >= n;
}
}  // namespace

TEST_CASE("file_tier: a named file's manifest refuses another layout, unknown data, lost writes") {
  temp_dir dir;
  const std::string path = (dir.path / "kv.bin").string();
  const std::string manifest = path + ".oasiskv";
  std::vector<std::byte> a(smollm2.block_bytes()), b(smollm2.block_bytes());
  std::mt19937_64 rng(11);
  fill_random(a.data(), a.size(), rng);
  {
    file_tier t(smollm2, 4, {.path = path});
    CHECK(slurp(manifest).find("state open write_through") != std::string::npos);
    t.write_block(1, a.data());
  }
  const std::string clean = slurp(manifest);
  CHECK(clean ==
        "oasiskv file_tier 1\nlayout 30 9 3 64 16 f16\nslot_bytes 12288\nslots 4\nstate clean\n");
  // Blocks of another shape are refused, and the file is left as it was.
  expect_error([&] { file_tier t(odd, 4, {.path = path}); }, errc::layout_mismatch,
               "holds blocks of layout 30x9x3x64x16 f16 (12288-byte slots); this tier's is "
               "1x2x1x8x3 bf16 (4096-byte slots)");
  CHECK(slurp(manifest) == clean);
  {
    file_tier t(smollm2, 6, {.path = path});  // more slots: the file grows, blocks stay
    t.read_block(1, b.data());
    CHECK(a == b);
  }
  // A tier that died writing through leaves every write on the device: accepted.
  put(manifest,
      "oasiskv file_tier 1\nlayout 30 9 3 64 16 f16\nslot_bytes 12288\nslots 6\n"
      "state open write_through\n");
  { file_tier t(smollm2, 6, {.path = path}); }
  // One that died writing behind may have lost writes: refused.
  put(manifest,
      "oasiskv file_tier 1\nlayout 30 9 3 64 16 f16\nslot_bytes 12288\nslots 6\n"
      "state open write_behind\n");
  expect_error([&] { file_tier t(smollm2, 6, {.path = path}); }, errc::io_error,
               "wrote behind and did not close it");
  put(manifest, "something else\n");
  expect_error([&] { file_tier t(smollm2, 6, {.path = path}); }, errc::invalid_argument,
               "is not one this version writes (first line 'something else')");
  std::filesystem::remove(manifest);
  expect_error([&] { file_tier t(smollm2, 6, {.path = path}); }, errc::invalid_argument,
               "holds data but has no manifest");
  // A tier destroyed while the device refuses a write it holds marks the file as stale.
  const std::string path2 = (dir.path / "kv2.bin").string();
  {
    file_tier t(smollm2, 4, {.path = path2, .write_behind = true});
    t.write_block(0, a.data());
    t.flush();
    const int saved = break_file(t);
    t.write_block(2, a.data());
    REQUIRE(wait_for_failed(t, 1));
    ::close(saved);
  }
  CHECK(slurp(path2 + ".oasiskv").find("state lost 1\n") != std::string::npos);
  expect_error([&] { file_tier t(smollm2, 4, {.path = path2}); }, errc::io_error,
               "could not write 1 block(s), so its content is stale");
}

TEST_CASE("file_tier: a write-behind failure surfaces at the next write, which queues nothing") {
  temp_dir dir;
  std::mt19937_64 rng(12);
  for (const file_backend backend : backends()) {
    CAPTURE(oasiskv::to_string(backend));
    file_tier t(smollm2, 8, {.path = dir.path.string(), .backend = backend, .write_behind = true});
    std::vector<std::byte> a(smollm2.block_bytes()), c(smollm2.block_bytes()),
        out(smollm2.block_bytes());
    fill_random(a.data(), a.size(), rng);
    fill_random(c.data(), c.size(), rng);
    const int saved = break_file(t);
    t.write_block(5, a.data());  // returns; the device refuses it in the background
    REQUIRE(wait_for_failed(t, 1));
    expect_error([&] { t.write_block(6, c.data()); }, errc::io_error,
                 "1 earlier write(s) failed and are held in memory (slot 5: ");
    CHECK(t.pending_writes() == 0);  // slot 6 was not queued
    t.read_block(5, out.data());     // slot 5 reads back from memory
    CHECK(out == a);
    heal(t, saved);
    t.write_block(6, c.data());  // retries slot 5 first, which now succeeds
    CHECK(t.failed_writes() == 0);
    t.flush();
    t.read_block(5, out.data());
    CHECK(out == a);
    t.read_block(6, out.data());
    CHECK(out == c);
  }
}
