// pcpkv-test-labels: cuda
// The SPEC section 5 fence kernel for ranks that share a GPU (src/publish/drivers/cuda/local_fence.h over
// pcpkv/device/fence_kernel.h): epochs advance per call and per barrier index, ranks arriving from separate
// launches on separate streams meet, and a rank that never arrives ends the wait with pcpkv::FenceTimeout
// naming it (an error word in host-mapped memory), not a hang. Skips with the reason when no GPU is visible.
#include <cuda_runtime_api.h>

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "publish/drivers/cuda/local_fence.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/core/error.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

using cuda::LocalFence;
using cuda::Stream;

TEST(GpuFence, EpochsAdvancePerCallAndPerBarrier) {
  REQUIRE_GPU();
  for (int32_t W : {1, 2, 3, 8}) {
    LocalFence f(W, 2, 5000.0);
    Stream s;
    for (int i = 0; i < 7; ++i) f.enqueue(0, s.get());
    for (int i = 0; i < 3; ++i) f.enqueue(1, s.get());
    s.sync();
    f.check();
    const std::vector<uint64_t> e = f.epochs();
    ASSERT_EQ(e.size(), static_cast<size_t>(2 * W));
    for (int32_t r = 0; r < W; ++r) {
      EXPECT_EQ(e[static_cast<size_t>(2 * r)], 7u) << "W " << W << " rank " << r << " barrier 0";
      EXPECT_EQ(e[static_cast<size_t>(2 * r + 1)], 3u) << "W " << W << " rank " << r << " barrier 1";
    }
  }
}

TEST(GpuFence, RanksFromSeparateLaunchesOnSeparateStreamsMeet) {
  REQUIRE_GPU();
  LocalFence f(4, 1, 5000.0);
  Stream a, b;
  for (int i = 0; i < 20; ++i) {
    f.enqueue_ranks(0, 0, 2, a.get());  // ranks 0, 1
    f.enqueue_ranks(0, 2, 2, b.get());  // ranks 2, 3: must run concurrently with the launch on `a`
  }
  a.sync();
  b.sync();
  f.check();
  for (uint64_t e : f.epochs()) EXPECT_EQ(e, 20u);
}

TEST(GpuFence, MissingRankTimesOutAndIsNamed) {
  REQUIRE_GPU();
  const double timeout_ms = 50.0;
  LocalFence f(4, 1, timeout_ms);
  Stream s;
  const auto start = std::chrono::steady_clock::now();
  f.enqueue_ranks(0, 0, 3, s.get());  // rank 3 never arrives
  s.sync();
  const double waited = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, timeout_ms + 5000.0) << "the bounded wait must end";
  try {
    f.check();
    FAIL() << "expected pcpkv::FenceTimeout";
  } catch (const FenceTimeout& e) {
    EXPECT_EQ(e.missing_rank(), 3);
    EXPECT_NE(std::string(e.what()).find("rank 3 never arrived"), std::string::npos) << e.what();
  }
  // After a reset the fence works again.
  f.reset();
  f.enqueue(0, s.get());
  s.sync();
  EXPECT_NO_THROW(f.check());
  for (uint64_t e : f.epochs()) EXPECT_EQ(e, 1u);
}

TEST(GpuFence, BadArgumentsThrow) {
  REQUIRE_GPU();
  EXPECT_THROW(LocalFence(0, 1, 10.0), Error);
  EXPECT_THROW(LocalFence(2, 0, 10.0), Error);
  LocalFence f(2, 1, 10.0);
  Stream s;
  EXPECT_THROW(f.enqueue(1, s.get()), Error);           // barrier out of range
  EXPECT_THROW(f.enqueue_ranks(0, 1, 2, s.get()), Error);  // ranks past the world
}

}  // namespace
}  // namespace pcpkv
