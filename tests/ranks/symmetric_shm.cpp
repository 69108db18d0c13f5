// pcpkv-test-labels: multiproc
// Host symmetric memory (POSIX shm) with N forked processes: every rank reads and writes every peer's
// buffer, the setup is all-or-nothing, and teardown leaks no descriptor or mapping.
#include <gtest/gtest.h>

#include <dirent.h>

#include <cstring>

#include "support/fork_ranks.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {
namespace {

using test::run_ranks;

// Counts /dev/shm entries this process created (they must be unlinked at once).
int count_dev_shm_entries(pid_t pid) {
  int n = 0;
  const std::string prefix = fmt::format("pcpkv-{}-", pid);
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) ++n;
    ::closedir(d);
  }
  return n;
}

int readwrite_body(const BootstrapConfig& c) {
  auto boot = Bootstrap::connect(c);
  const int w = boot->world_size();
  const int64_t bytes = 3 * 4096 + 100;  // not a page multiple
  auto mem = make_host_symmetric(*boot, bytes, "test buffer", 0xA5);
  RANK_CHECK(mem->world_size() == w && mem->rank() == c.rank && mem->bytes() == bytes, "shape");
  RANK_CHECK(!mem->on_device() && mem->device_ptr_table() == nullptr, "host");
  RANK_CHECK(count_dev_shm_entries(::getpid()) == 0, "/dev/shm entry left behind");
  // Every byte starts as the fill value.
  for (int r = 0; r < w; ++r)
    for (int64_t i = 0; i < bytes; ++i) RANK_CHECK(mem->ptr(r)[i] == 0xA5, "fill of rank {} at {}", r, i);
  boot->barrier();
  // Rank q writes its id into slice q of every peer's buffer (a "direct" publish), then everyone checks.
  const int64_t slice = bytes / w;
  for (int r = 0; r < w; ++r) std::memset(mem->ptr(r) + c.rank * slice, 0x10 + c.rank, slice);
  boot->barrier();
  for (int q = 0; q < w; ++q)
    for (int64_t i = 0; i < slice; ++i)
      RANK_CHECK(mem->local()[q * slice + i] == 0x10 + q, "slice of rank {} at {}", q, i);
  for (int64_t i = w * slice; i < bytes; ++i) RANK_CHECK(mem->local()[i] == 0xA5, "tail byte {} touched", i);
  boot->barrier();
  return 0;
}

class ShmWorld : public ::testing::TestWithParam<int> {};
TEST_P(ShmWorld, EveryRankMapsEveryPeer) {
  const auto out = run_ranks(GetParam(), readwrite_body);
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}
INSTANTIATE_TEST_SUITE_P(Worlds, ShmWorld, ::testing::Values(1, 2, 4, 8), ::testing::PrintToStringParamName());

TEST(Shm, TeardownLeaksNoDescriptorOrMapping) {
  const auto out = run_ranks(4, [](const BootstrapConfig& c) {
    const ResourceCounts before = count_process_resources();
    {
      auto boot = Bootstrap::connect(c);
      for (int round = 0; round < 3; ++round) {
        auto a = make_host_symmetric(*boot, 1 << 20, "a");
        auto b = make_host_symmetric(*boot, 12345, "b");
        const ResourceCounts during = count_process_resources();
        RANK_CHECK(during.shm_mappings == before.shm_mappings + 2 * c.world_size, "mappings during: {}",
                   during.shm_mappings);
        // Descriptors: only the bootstrap's sockets, none per buffer.
        RANK_CHECK(during.open_fds <= before.open_fds + (c.rank == 0 ? c.world_size : 1), "fds during: {} vs {}",
                   during.open_fds, before.open_fds);
        boot->barrier();
      }
    }
    const ResourceCounts after = count_process_resources();
    RANK_CHECK(after.open_fds == before.open_fds, "fds {} -> {}", before.open_fds, after.open_fds);
    RANK_CHECK(after.shm_mappings == before.shm_mappings, "mappings {} -> {}", before.shm_mappings, after.shm_mappings);
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

TEST(Shm, SetupIsAllOrNothing) {
  // Rank 2 cannot map its peers: every rank throws a message naming rank 2 and the reason, and no rank
  // keeps a mapping or a descriptor.
  const auto out = run_ranks(4, [](const BootstrapConfig& c) {
    const ResourceCounts before = count_process_resources();
    auto boot = Bootstrap::connect(c);
    const ResourceCounts connected = count_process_resources();
    set_host_symmetric_failure_for_test(2, "mmap of rank 0's buffer failed: Cannot allocate memory (injected)");
    try {
      auto mem = make_host_symmetric(*boot, 1 << 16, "staging");
      RANK_CHECK(false, "setup succeeded on rank {}", c.rank);
    } catch (const Error& e) {
      const std::string msg = e.what();
      RANK_CHECK(msg.find("symmetric memory 'staging'") != std::string::npos, "{}", msg);
      RANK_CHECK(msg.find("rank 2: mmap of rank 0's buffer failed: Cannot allocate memory") != std::string::npos, "{}",
                 msg);
      std::printf("caught: %s\n", msg.c_str());
    }
    const ResourceCounts after = count_process_resources();
    RANK_CHECK(after.open_fds == connected.open_fds && after.shm_mappings == before.shm_mappings,
               "leak after a failed setup: fds {} -> {}, mappings {} -> {}", connected.open_fds, after.open_fds,
               before.shm_mappings, after.shm_mappings);
    // The job goes on: a later setup works.
    set_host_symmetric_failure_for_test(-1, "");
    auto mem = make_host_symmetric(*boot, 4096, "retry");
    boot->barrier();
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

TEST(Shm, SizeMismatchFailsEveryRank) {
  const auto out = run_ranks(3, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    auto mem = make_host_symmetric(*boot, c.rank == 1 ? 8192 : 4096, "caches");
    return 0;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find("rank 1 asks for 8192 bytes, rank 0 for 4096"), std::string::npos) << out[r].output;
  }
}

TEST(Shm, MoreThanSharedMemoryHoldsFailsEveryRankCleanly) {
  // 2 x 4 TB (mappable: under the 128 TB address space): the fill of a buffer past /dev/shm's free space ended the
  // process through the OOM killer (SIGKILL) instead of an error; now every rank refuses it before creating anything.
  const auto out = run_ranks(2, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    auto mem = make_host_symmetric(*boot, int64_t{1} << 42, "caches");
    return 0;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find("2 rank(s) x 4398046511104 bytes need 8796 GB of shared memory, more than "
                                 "the "),
              std::string::npos)
        << out[r].output;
    EXPECT_NE(out[r].output.find("GB free in /dev/shm"), std::string::npos) << out[r].output;
  }
}

}  // namespace
}  // namespace pcpkv
