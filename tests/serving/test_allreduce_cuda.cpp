// pcpkv-test-labels: cuda
// The all-reduce on the GPU (pcpkv/serving/allreduce.h, SPEC section 7) against the CPU oracle, byte for byte:
// W logical ranks in one launch over world sizes, algorithms, block counts and consecutive calls; the
// fused residual-add + RMSNorm; CUDA-graph capture replayed 100 times with fresh inputs; the per-process
// class driven as two ranks on two streams; a missing rank ends in FenceTimeout. Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/core/error.h"
#include "support/gpu.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {


/// Per-rank device buffers [W][n] bf16, poisoned.
struct RankBuffers {
  std::vector<uint16_t*> p;
  int64_t n = 0;
  RankBuffers(int32_t world, int64_t count) : p(world, nullptr), n(count) {
    for (auto& b : p) {
      if (cudaMalloc(&b, std::max<int64_t>(count, 8) * 2) != cudaSuccess) throw Error("cudaMalloc failed");
      cudaMemset(b, 0xA5, std::max<int64_t>(count, 8) * 2);
    }
  }
  ~RankBuffers() {
    for (auto* b : p) cudaFree(b);
  }
  void put(int32_t r, const std::vector<uint16_t>& h) { cudaMemcpy(p[r], h.data(), h.size() * 2, cudaMemcpyHostToDevice); }
  std::vector<uint16_t> get(int32_t r) const {
    std::vector<uint16_t> h(n);
    cudaMemcpy(h.data(), p[r], n * 2, cudaMemcpyDeviceToHost);
    return h;
  }
  const uint16_t* const* in() const { return p.data(); }
  uint16_t* const* out() { return p.data(); }
};

std::vector<std::vector<uint16_t>> inputs(int32_t world, int64_t n, uint64_t seed) {
  std::vector<std::vector<uint16_t>> v;
  for (int32_t r = 0; r < world; ++r) v.push_back(test::random_bf16(1, n, seed + r));
  return v;
}
std::vector<uint16_t> oracle(const std::vector<std::vector<uint16_t>>& in, int64_t n) {
  std::vector<const uint16_t*> ptrs;
  for (auto& v : in) ptrs.push_back(v.data());
  std::vector<uint16_t> out(n);
  allreduce_reference(ptrs, n, out.data());
  return out;
}

TEST(AllReduceCuda, LogicalRanksEqualOracle) {
  REQUIRE_GPU();
  struct Case {
    int32_t world;
    AllReduceAlgo algo;
    int32_t blocks;
    int64_t n;
  };
  const std::vector<Case> cases = {
      {1, AllReduceAlgo::kOneShot, 0, 4096},         {2, AllReduceAlgo::kOneShot, 1, 8 * 1000},
      {2, AllReduceAlgo::kTwoShot, 3, 8 * 4097},     {3, AllReduceAlgo::kTwoShot, 2, 8 * 777},
      {4, AllReduceAlgo::kOneShot, 0, 1 << 20},      {4, AllReduceAlgo::kTwoShot, 0, 1 << 21},
      {8, AllReduceAlgo::kOneShot, 5, 8 * 513},      {8, AllReduceAlgo::kTwoShot, 0, 8 * 5},
      {8, AllReduceAlgo::kTwoShot, 0, 3 << 20},      {5, AllReduceAlgo::kAuto, 0, 8 * 40000},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "W " << c.world << " " << to_string(c.algo) << " blocks " << c.blocks << " n "
                                      << c.n);
    cuda::LogicalAllReduce ar(c.world, c.n);
    const auto in = inputs(c.world, c.n, 10 + c.world);
    RankBuffers din(c.world, c.n), dout(c.world, c.n);
    for (int32_t r = 0; r < c.world; ++r) din.put(r, in[r]);
    cuda::AllReduceOptions o;
    o.algo = c.algo;
    o.num_blocks = c.blocks;
    o.timeout_ns = 2'000'000'000;
    ar.run(din.in(), dout.out(), c.n, nullptr, o);
    ar.check();
    const auto expect = oracle(in, c.n);
    for (int32_t r = 0; r < c.world; ++r) ASSERT_EQ(dout.get(r), expect) << "rank " << r;
  }
}

TEST(AllReduceCuda, ConsecutiveCallsChangingSizeBlocksAndAlgo) {
  REQUIRE_GPU();
  const int32_t W = 4;
  const int64_t max_n = 8 * 30000;
  cuda::LogicalAllReduce ar(W, max_n);
  RankBuffers din(W, max_n), dout(W, max_n);
  const std::vector<std::pair<int64_t, int32_t>> calls = {{max_n, 12}, {8 * 100, 1}, {8 * 29999, 3}, {8 * 7, 2},
                                                          {max_n, 0},  {8, 1},       {8 * 15000, 9}};
  for (size_t k = 0; k < calls.size(); ++k) {
    const auto [n, blocks] = calls[k];
    const auto in = inputs(W, n, 100 * k);
    for (int32_t r = 0; r < W; ++r) din.put(r, in[r]);
    cuda::AllReduceOptions o;
    o.algo = k % 2 ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
    o.num_blocks = std::min(blocks, ar.max_blocks());
    ar.run(din.in(), dout.out(), n, nullptr, o);
    ar.check();
    const auto expect = oracle(in, n);
    for (int32_t r = 0; r < W; ++r) {
      auto got = dout.get(r);
      got.resize(n);
      ASSERT_EQ(got, expect) << "call " << k << " rank " << r;
    }
  }
}

struct FusedSetup {
  int32_t world;
  int64_t T, H;
  std::vector<std::vector<uint16_t>> in;
  std::vector<uint16_t> residual;
  std::vector<float> w;
  std::vector<uint16_t> expect_res, expect_y;
  FusedSetup(int32_t world_, int64_t T_, int64_t H_, uint64_t seed) : world(world_), T(T_), H(H_) {
    for (int32_t r = 0; r < world; ++r) in.push_back(test::random_bf16(T, H, seed + r));
    residual = test::random_bf16(T, H, seed + 50);
    w = test::random_weights(H, seed + 51);
    expect_res.resize(T * H);
    expect_y.resize(T * H);
    std::vector<const uint16_t*> ptrs;
    for (auto& v : in) ptrs.push_back(v.data());
    allreduce_rmsnorm_reference(ptrs, T, AllReduceNorm{H, w.data(), 1e-5f}, residual.data(), expect_res.data(),
                                expect_y.data());
  }
};

TEST(AllReduceCuda, FusedResidualRmsNormEqualsOracle) {
  REQUIRE_GPU();
  for (const int32_t W : {2, 4, 8}) {
    for (const int64_t H : {6144, 7168, 1024}) {
      for (const AllReduceAlgo algo : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        for (const bool alias : {false, true}) {
          const int64_t T = 13;
          SCOPED_TRACE(::testing::Message() << "W " << W << " H " << H << " " << to_string(algo) << (alias ? " alias" : ""));
          FusedSetup s(W, T, H, 7 * W + H);
          cuda::LogicalAllReduce ar(W, T * H);
          RankBuffers din(W, T * H), dres(W, T * H), dres_out(W, T * H), dy(W, T * H);
          float* dw = nullptr;
          CUDA_OK(cudaMalloc(&dw, H * 4));
          CUDA_OK(cudaMemcpy(dw, s.w.data(), H * 4, cudaMemcpyHostToDevice));
          for (int32_t r = 0; r < W; ++r) {
            din.put(r, s.in[r]);
            dres.put(r, s.residual);
          }
          cuda::AllReduceOptions o;
          o.algo = algo;
          ar.run_fused(din.in(), dres.in(), alias ? dres.out() : dres_out.out(), dy.out(), T, AllReduceNorm{H, dw, 1e-5f},
                       nullptr, o);
          ar.check();
          for (int32_t r = 0; r < W; ++r) {
            ASSERT_EQ(dy.get(r), s.expect_y) << "rank " << r;
            ASSERT_EQ((alias ? dres : dres_out).get(r), s.expect_res) << "rank " << r;
          }
          cudaFree(dw);
        }
      }
    }
  }
}

TEST(AllReduceCuda, GraphReplayAdvancesEpochsOnDevice) {
  REQUIRE_GPU();
  const int32_t W = 4;
  const int64_t n = 8 * 4096, T = 3, H = 6144;
  cuda::LogicalAllReduce ar(W, std::max(n, T * H));
  RankBuffers din(W, n), dout(W, n), fin(W, T * H), fres(W, T * H), fy(W, T * H);
  FusedSetup s(W, T, H, 900);
  float* dw = nullptr;
  CUDA_OK(cudaMalloc(&dw, H * 4));
  CUDA_OK(cudaMemcpy(dw, s.w.data(), H * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda::AllReduceOptions two;
  two.algo = AllReduceAlgo::kTwoShot;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ar.run(din.in(), dout.out(), n, stream);  // one-shot (auto at 64 KB)
  ar.run_fused(fin.in(), fres.in(), fres.out(), fy.out(), T, AllReduceNorm{H, dw, 1e-5f}, stream, two);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const int kReplays = 100;
  for (int k = 0; k < kReplays; ++k) {
    const bool verify = k % 20 == 0 || k == kReplays - 1;
    const auto in = inputs(W, n, 5000 + k);
    for (int32_t r = 0; r < W; ++r) {
      CUDA_OK(cudaMemcpyAsync(din.p[r], in[r].data(), n * 2, cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaMemcpyAsync(fin.p[r], s.in[r].data(), T * H * 2, cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaMemcpyAsync(fres.p[r], s.residual.data(), T * H * 2, cudaMemcpyHostToDevice, stream));
    }
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (!verify) continue;
    ar.check();
    const auto expect = oracle(in, n);
    for (int32_t r = 0; r < W; ++r) {
      ASSERT_EQ(dout.get(r), expect) << "replay " << k << " rank " << r;
      ASSERT_EQ(fy.get(r), s.expect_y) << "replay " << k << " rank " << r;
      ASSERT_EQ(fres.get(r), s.expect_res) << "replay " << k << " rank " << r;
    }
  }
  for (int32_t r = 0; r < W; ++r) {
    uint32_t epoch = 0;
    CUDA_OK(cudaMemcpy(&epoch, ar.workspace(r) + AllReduceLayout::kEpochOffset, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(epoch, 2u * kReplays) << "rank " << r;  // two calls per replay, counted on the device
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(dw);
}

/// Two "processes" in one: two AllReduce objects (ranks 0 and 1) over two device workspaces, each on its
/// own stream; the agreement function is local (both say yes).
TEST(AllReduceCuda, PerProcessClassOnTwoStreamsAndMissingPeer) {
  REQUIRE_GPU();
  const int64_t n = 8 * 10000;
  AllReduceLayout layout;
  layout.max_elems = n;
  std::vector<uint8_t*> ws(2, nullptr);
  for (auto& w : ws) CUDA_OK(cudaMalloc(&w, layout.bytes()));
  const AllRanksAnd local_and = [](bool ok) { return ok; };
  {
    cuda::AllReduce r0(0, ws, n, local_and), r1(1, ws, n, local_and);
    EXPECT_TRUE(r0.uses_symmetric_memory());
    cudaStream_t s0, s1;
    CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    const auto in = inputs(2, n, 31);
    RankBuffers din(2, n), dout(2, n);
    din.put(0, in[0]);
    din.put(1, in[1]);
    for (const AllReduceAlgo algo : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot, AllReduceAlgo::kOneShot}) {
      cuda::AllReduceOptions o;
      o.algo = algo;
      o.num_blocks = 8;
      r0.run(din.p[0], dout.p[0], n, s0, o);
      r1.run(din.p[1], dout.p[1], n, s1, o);
      CUDA_OK(cudaStreamSynchronize(s0));
      CUDA_OK(cudaStreamSynchronize(s1));
      r0.check();
      r1.check();
      const auto expect = oracle(in, n);
      EXPECT_EQ(dout.get(0), expect);
      EXPECT_EQ(dout.get(1), expect);
    }
    // Rank 1 does not come: rank 0's bounded wait records it, check() throws naming rank 1.
    cuda::AllReduceOptions quick;
    quick.timeout_ns = 50'000'000;
    quick.num_blocks = 2;
    r0.run(din.p[0], dout.p[0], n, s0, quick);
    try {
      r0.check();
      ADD_FAILURE() << "no timeout";
    } catch (const FenceTimeout& e) {
      EXPECT_EQ(e.missing_rank(), 1) << e.what();
    }
    cudaStreamDestroy(s0);
    cudaStreamDestroy(s1);
  }
  // Capability: a null peer workspace is refused locally; the agreement makes every rank fall back.
  std::string why;
  EXPECT_FALSE(cuda::allreduce_local_capability({ws[0], nullptr}, &why));
  EXPECT_NE(why.find("rank 1"), std::string::npos) << why;
  EXPECT_TRUE(cuda::allreduce_local_capability(ws, &why)) << why;
  const AllRanksAnd someone_says_no = [](bool) { return false; };
  EXPECT_THROW(cuda::AllReduce(0, ws, n, someone_says_no, nullptr), Error);  // no NCCL communicator given
  for (auto* w : ws) cudaFree(w);
}

}  // namespace
}  // namespace pcpkv
