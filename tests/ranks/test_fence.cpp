// pcpkv-test-labels: unit
// The host fence (pcpkv/ranks/fence.h, SPEC section 5): visibility across many epochs, parity-slot reuse,
// more ranks than cores, processes sharing memory, and a bounded wait that names the missing rank.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

using test::error_of;

using Clock = std::chrono::steady_clock;

struct Pads {
  std::vector<std::vector<uint64_t>> storage;
  std::vector<uint64_t*> ptrs;
  Pads(int32_t world, int32_t num_barriers) {
    for (int32_t r = 0; r < world; ++r) {
      storage.emplace_back(static_cast<size_t>(fence_pad_elems(num_barriers, world)), 0xdeadull);
      zero_fence_pad(storage.back().data(), num_barriers, world);
      ptrs.push_back(storage.back().data());
    }
  }
};

// Each rank writes its cell of a double-buffered board (plain stores), fences, then reads every cell (plain
// loads). A missing release/acquire or a lost epoch shows up as a stale value. Two barrier indices alternate.
void board_test(int32_t world, int iterations) {
  constexpr int32_t kBarriers = 2;
  Pads pads(world, kBarriers);
  std::vector<int64_t> board(static_cast<size_t>(2 * world), -1);
  std::vector<int64_t> errors(static_cast<size_t>(world), 0);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      HostFence fence(r, world, kBarriers, pads.ptrs);
      for (int it = 0; it < iterations; ++it) {
        board[static_cast<size_t>((it & 1) * world + r)] = it;
        fence.arrive_and_wait(it % kBarriers, 20000);
        for (int32_t p = 0; p < world; ++p)
          if (board[static_cast<size_t>((it & 1) * world + p)] != it) ++errors[static_cast<size_t>(r)];
      }
      EXPECT_EQ(fence.epoch(0) + fence.epoch(1), static_cast<uint64_t>(iterations));
    });
  }
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], 0) << "rank " << r << " saw stale cells";
}

TEST(Fence, ManyEpochsBetweenThreads) { board_test(4, 3000); }

TEST(Fence, EightRanksOnFewCores) {
  const auto t0 = Clock::now();
  board_test(8, 400);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0) << "back-off must not starve ranks";
}

TEST(Fence, SingleRankReturnsImmediately) {
  Pads pads(1, 1);
  HostFence fence(0, 1, 1, pads.ptrs);
  for (int i = 0; i < 5; ++i) fence.arrive_and_wait(0, 10);
  EXPECT_EQ(fence.epoch(0), 5u);
}

TEST(Fence, ParitySlotsHoldTheLatestEpochs) {
  // After epochs 1..5 at barrier 1, parity 1 slots hold 5 and parity 0 slots hold 4, in every pad.
  constexpr int32_t W = 3;
  Pads pads(W, 2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      HostFence fence(r, W, 2, pads.ptrs);
      for (int i = 0; i < 5; ++i) fence.arrive_and_wait(1, 20000);
    });
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < W; ++r)
    for (int32_t src = 0; src < W; ++src) {
      const auto& pad = pads.storage[static_cast<size_t>(r)];
      EXPECT_EQ(pad[static_cast<size_t>((1 * 2 + 1) * W + src)], 5u);
      EXPECT_EQ(pad[static_cast<size_t>((1 * 2 + 0) * W + src)], 4u);
      EXPECT_EQ(pad[static_cast<size_t>((0 * 2 + 1) * W + src)], 0u) << "barrier 0 untouched";
    }
}

TEST(Fence, RankThatNeverArrivesTimesOutNamingIt) {
  // Epoch 1 completes with all three ranks; then rank 2 stops and ranks 0, 1 wait for epoch 2.
  constexpr int32_t W = 3;
  constexpr int64_t kTimeoutMs = 200;
  Pads pads(W, 1);
  std::vector<int> missing(2, -100);
  std::vector<std::string> messages(2);
  std::vector<double> waited_ms(2, 0.0);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      HostFence fence(r, W, 1, pads.ptrs);
      fence.arrive_and_wait(0, 20000);
      if (r == 2) return;  // never arrives again
      const auto t0 = Clock::now();
      try {
        fence.arrive_and_wait(0, kTimeoutMs);
      } catch (const FenceTimeout& e) {
        missing[static_cast<size_t>(r)] = e.missing_rank();
        messages[static_cast<size_t>(r)] = e.what();
      }
      waited_ms[static_cast<size_t>(r)] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    });
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(missing[static_cast<size_t>(r)], 2) << messages[static_cast<size_t>(r)];
    EXPECT_NE(messages[static_cast<size_t>(r)].find("rank 2 never arrived"), std::string::npos)
        << messages[static_cast<size_t>(r)];
    EXPECT_NE(messages[static_cast<size_t>(r)].find("epoch 2"), std::string::npos) << messages[static_cast<size_t>(r)];
    EXPECT_GE(waited_ms[static_cast<size_t>(r)], kTimeoutMs);
    EXPECT_LT(waited_ms[static_cast<size_t>(r)], kTimeoutMs + 2000) << "the wait is bounded";
  }
}

TEST(Fence, ProcessesSharingMemory) {
  // Two processes, pads and board in one MAP_SHARED mapping: the same protocol as between threads.
  constexpr int32_t W = 2;
  constexpr int kIterations = 2000;
  const int64_t pad_elems = fence_pad_elems(1, W);
  const size_t bytes = static_cast<size_t>(W * pad_elems + 2 * W) * sizeof(uint64_t);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* words = static_cast<uint64_t*>(mem);
  std::vector<uint64_t*> pads = {words, words + pad_elems};
  for (uint64_t* p : pads) zero_fence_pad(p, 1, W);
  auto* board = reinterpret_cast<int64_t*>(words + W * pad_elems);
  auto run = [&](int32_t rank) -> int64_t {
    HostFence fence(rank, W, 1, pads);
    int64_t errors = 0;
    for (int it = 0; it < kIterations; ++it) {
      board[(it & 1) * W + rank] = it;
      fence.arrive_and_wait(0, 20000);
      for (int32_t p = 0; p < W; ++p) errors += board[(it & 1) * W + p] != it;
    }
    return errors;
  };
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 3;
    try {
      code = run(1) == 0 ? 0 : 1;
    } catch (...) {
      code = 2;
    }
    _exit(code);
  }
  const int64_t errors = run(0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child: 1 = stale cells, 2 = exception";
  EXPECT_EQ(errors, 0);
  munmap(mem, bytes);
}

TEST(Fence, BadSetupThrows) {
  Pads pads(2, 1);
  EXPECT_NE(error_of([&] { HostFence(2, 2, 1, pads.ptrs); }).find("rank = 2 is out of range [0, 2)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { HostFence(0, 3, 1, pads.ptrs); }).find("2 pads for world = 3"), std::string::npos);
  EXPECT_NE(error_of([&] { HostFence(0, 2, 0, pads.ptrs); }).find("num_barriers = 0"), std::string::npos);
  std::vector<uint64_t*> misaligned = {pads.ptrs[0], reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(pads.ptrs[1]) + 4)};
  EXPECT_NE(error_of([&] { HostFence(0, 2, 1, misaligned); }).find("pads[1]"), std::string::npos);
  HostFence ok(0, 2, 1, pads.ptrs);
  EXPECT_NE(error_of([&] { ok.arrive_and_wait(1, 10); }).find("barrier_idx = 1 is out of range"), std::string::npos);
}

}  // namespace
}  // namespace pcpkv
