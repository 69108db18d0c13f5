// pcpkv-test-labels: multiproc
// The all-reduce protocol (pcpkv/serving/allreduce.h) with one CPU process per rank over POSIX shared memory
// (pcpkv/ranks/symmetric.h): byte-exact against the oracle for one-shot, two-shot and the fused variant over
// consecutive calls; the capability agreement over the bootstrap; a rank that never arrives is named by
// every waiting rank (FenceTimeout), within the bound.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <vector>

#include "support/fork_ranks.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/symmetric.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {

using test::run_ranks;

struct Call {
  AllReduceAlgo algo;
  bool fused;
  int64_t n;       // elements (fused: T * hidden)
  int32_t blocks;
};

int allreduce_body(const BootstrapConfig& c) {
  auto boot = Bootstrap::connect(c);
  const int32_t W = boot->world_size(), rank = boot->rank();
  const int64_t H = 2048;
  const std::vector<Call> calls = {{AllReduceAlgo::kOneShot, false, 8 * 3000, 3}, {AllReduceAlgo::kTwoShot, false, 8 * 5001, 4},
                                   {AllReduceAlgo::kTwoShot, true, 5 * H, 2},     {AllReduceAlgo::kOneShot, true, 3 * H, 1},
                                   {AllReduceAlgo::kAuto, false, 8 * 17, 0},      {AllReduceAlgo::kTwoShot, false, 8 * 6000, 6}};
  AllReduceLayout layout;
  layout.max_elems = 8 * 6000;
  auto mem = make_host_symmetric(*boot, layout.bytes(), "allreduce workspace", 0);  // header zero on every rank
  RANK_CHECK(agree_capability(true, all_ranks_and(*boot)), "every rank can map every peer");
  const std::vector<float> norm_w = test::random_weights(H, 77);
  for (size_t k = 0; k < calls.size(); ++k) {
    const Call& call = calls[k];
    // Every rank generates every rank's input (seeded), so each can check against the oracle alone.
    std::vector<std::vector<uint16_t>> in;
    std::vector<const uint16_t*> ptrs;
    for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(1, call.n, 1000 * k + r));
    for (auto& v : in) ptrs.push_back(v.data());
    const std::vector<uint16_t> residual = test::random_bf16(1, call.n, 1000 * k + 99);
    std::vector<uint16_t> out(call.n, 0xA5A5), res_out(call.n, 0xA5A5), expect(call.n), expect_res(call.n);
    const AllReduceNorm norm{H, norm_w.data(), 1e-6f};
    if (call.fused)
      allreduce_rmsnorm_reference(ptrs, call.n / H, norm, residual.data(), expect_res.data(), expect.data());
    else
      allreduce_reference(ptrs, call.n, expect.data());
    HostAllReduceArgs a;
    a.world_size = W;
    a.rank = rank;
    for (int32_t r = 0; r < W; ++r) a.workspaces[r] = mem->ptr(r);
    a.layout = layout;
    a.algo = call.algo;
    a.num_blocks = call.blocks;
    a.num_elems = call.n;
    a.in = in[rank].data();
    a.out = out.data();
    a.fused = call.fused;
    a.norm = norm;
    a.residual_in = residual.data();
    a.residual_out = res_out.data();
    a.timeout_ms = 20000;
    host_allreduce(a);
    RANK_CHECK(out == expect, "call {}: output differs from the oracle", k);
    if (call.fused) RANK_CHECK(res_out == expect_res, "call {}: residual differs from the oracle", k);
  }
  boot->barrier();
  return 0;
}

class AllReduceProcesses : public ::testing::TestWithParam<int> {};
TEST_P(AllReduceProcesses, EqualTheOracleByteForByte) {
  const auto out = run_ranks(GetParam(), allreduce_body, 30.0, 90.0);
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}
INSTANTIATE_TEST_SUITE_P(Worlds, AllReduceProcesses, ::testing::Values(1, 2, 3, 4, 8),
                         ::testing::PrintToStringParamName());

TEST(AllReduceProcesses, MissingRankIsNamedByEveryWaiter) {
  const auto out = run_ranks(
      3,
      [](const BootstrapConfig& c) {
        auto boot = Bootstrap::connect(c);
        AllReduceLayout layout;
        layout.max_elems = 4096;
        auto mem = make_host_symmetric(*boot, layout.bytes(), "allreduce workspace", 0);
        boot->barrier();
        if (c.rank == 2) return 0;  // leaves without calling
        const std::vector<uint16_t> in = test::random_bf16(1, 4096, c.rank);
        std::vector<uint16_t> out(4096);
        HostAllReduceArgs a;
        a.world_size = 3;
        a.rank = c.rank;
        for (int32_t r = 0; r < 3; ++r) a.workspaces[r] = mem->ptr(r);
        a.layout = layout;
        a.algo = AllReduceAlgo::kOneShot;
        a.num_elems = 4096;
        a.in = in.data();
        a.out = out.data();
        a.timeout_ms = 300;
        try {
          host_allreduce(a);
        } catch (const FenceTimeout& e) {
          std::printf("timeout: %s\n", e.what());
          RANK_CHECK(e.missing_rank() == 2, "named rank {}", e.missing_rank());
          return 0;
        }
        RANK_CHECK(false, "rank {} finished although rank 2 never came", c.rank);
        return 1;
      },
      10.0, 30.0);
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(out[r].output.find("rank 2 never arrived"), std::string::npos) << out[r].output;
    EXPECT_LT(out[r].seconds, 10.0);
  }
}

TEST(AllReduceProcesses, CapabilityDisagreementMakesEveryRankFallBack) {
  const auto out = run_ranks(4, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    const bool agreed = agree_capability(c.rank != 3, all_ranks_and(*boot));
    RANK_CHECK(!agreed, "rank {} would take the symmetric path although rank 3 cannot", c.rank);
    const bool all_yes = agree_capability(true, all_ranks_and(*boot));
    RANK_CHECK(all_yes, "every rank said yes");
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

}  // namespace
}  // namespace pcpkv
