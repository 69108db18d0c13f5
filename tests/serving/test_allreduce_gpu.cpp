// pcpkv-test-labels: multiproc serial gpu
// The all-reduce on the GPU with one process per rank, N processes sharing one GPU (pcpkv/serving/allreduce.h):
// workspaces in pcpkv's device symmetric memory (pcpkv/publish/cuda_multiproc.h: CUDA VMM, FDs over the
// bootstrap), capability agreed by all ranks, byte-exact against the CPU oracle for one-shot, two-shot and
// fused calls, and a CUDA graph replayed with fresh inputs. The parent never touches CUDA (forked children
// must not inherit a CUDA context); a probe child decides whether a GPU is visible, and the test skips with
// the reason when none is.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/fork_ranks.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "support/random_bf16.h"

#if defined(PCPKV_HAVE_CUDA)
#include <cuda_runtime.h>

#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/ranks/symmetric.h"
#endif

namespace pcpkv {
namespace {

using test::run_ranks;

#if defined(PCPKV_HAVE_CUDA)

constexpr int kNoGpu = 77;

int probe_body(const BootstrapConfig&) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return kNoGpu;
  return 0;
}

struct Call {
  AllReduceAlgo algo;
  bool fused;
  int64_t n;
};

int gpu_body(const BootstrapConfig& c) {
  auto boot = Bootstrap::connect(c);
  const int32_t W = boot->world_size(), rank = boot->rank();
  cuda::select_rank_device(*boot);  // local_rank % visible devices: every rank on GPU 0 with one GPU
  const int64_t H = 6144, max_n = 8 * 20000;
  AllReduceLayout layout;
  layout.max_elems = max_n;
  auto ws = cuda::make_device_symmetric(*boot, layout.bytes(), "allreduce workspace", 0);
  RANK_CHECK(ws->world_size() == W && ws->on_device(), "symmetric memory shape");
  {
    cuda::AllReduce ar(*ws, *boot, max_n);
    RANK_CHECK(ar.uses_symmetric_memory(), "fell back: {}", ar.fallback_reason());
    cudaStream_t stream;
    RANK_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
    uint16_t *din = nullptr, *dout = nullptr, *dres = nullptr;
    float* dw = nullptr;
    RANK_CHECK(cudaMalloc(&din, max_n * 2) == cudaSuccess && cudaMalloc(&dout, max_n * 2) == cudaSuccess &&
                   cudaMalloc(&dres, max_n * 2) == cudaSuccess && cudaMalloc(&dw, H * 4) == cudaSuccess,
               "cudaMalloc buffers");
    const std::vector<float> norm_w = test::random_weights(H, 5);
    cudaMemcpy(dw, norm_w.data(), H * 4, cudaMemcpyHostToDevice);
    const std::vector<Call> calls = {{AllReduceAlgo::kOneShot, false, 8 * 1000}, {AllReduceAlgo::kTwoShot, false, max_n},
                                     {AllReduceAlgo::kTwoShot, true, 7 * H},     {AllReduceAlgo::kOneShot, true, 2 * H},
                                     {AllReduceAlgo::kAuto, false, 8 * 3}};
    cudaGraphExec_t exec = nullptr;
    for (size_t k = 0; k < calls.size() + 10; ++k) {
      // The last 10 calls replay a captured graph of the first call's shape with fresh inputs.
      const bool graph_phase = k >= calls.size();
      const Call call = graph_phase ? calls[0] : calls[k];
      std::vector<std::vector<uint16_t>> in;
      std::vector<const uint16_t*> ptrs;
      for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(1, call.n, 100 * k + r));
      for (auto& v : in) ptrs.push_back(v.data());
      const std::vector<uint16_t> residual = test::random_bf16(1, call.n, 100 * k + 50);
      std::vector<uint16_t> expect(call.n), expect_res(call.n), got(call.n), got_res(call.n);
      const AllReduceNorm host_norm{H, norm_w.data(), 1e-5f};
      if (call.fused)
        allreduce_rmsnorm_reference(ptrs, call.n / H, host_norm, residual.data(), expect_res.data(), expect.data());
      else
        allreduce_reference(ptrs, call.n, expect.data());
      cudaMemcpy(din, in[rank].data(), call.n * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(dres, residual.data(), call.n * 2, cudaMemcpyHostToDevice);
      cudaMemset(dout, 0xA5, call.n * 2);
      cuda::AllReduceOptions o;
      o.algo = call.algo;
      o.timeout_ns = 30'000'000'000;  // processes sharing one GPU take turns (time slices)
      if (graph_phase) {
        if (!exec) {
          cudaGraph_t graph;
          RANK_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
          ar.run(din, dout, call.n, stream, o);
          RANK_CHECK(cudaStreamEndCapture(stream, &graph) == cudaSuccess, "end capture");
          RANK_CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
        }
        RANK_CHECK(cudaGraphLaunch(exec, stream) == cudaSuccess, "graph launch");
      } else if (call.fused) {
        ar.run_fused(din, dres, dres, dout, call.n / H, AllReduceNorm{H, dw, 1e-5f}, stream, o);
      } else {
        ar.run(din, dout, call.n, stream, o);
      }
      RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "sync");
      ar.check();
      cudaMemcpy(got.data(), dout, call.n * 2, cudaMemcpyDeviceToHost);
      RANK_CHECK(got == expect, "call {} ({}{}): output differs from the oracle", k, to_string(call.algo),
                 call.fused ? ", fused" : "");
      if (call.fused) {
        cudaMemcpy(got_res.data(), dres, call.n * 2, cudaMemcpyDeviceToHost);
        RANK_CHECK(got_res == expect_res, "call {}: residual differs from the oracle", k);
      }
    }
    boot->barrier();  // nobody unmaps while a peer may still read
    if (exec) cudaGraphExecDestroy(exec);
    cudaFree(din);
    cudaFree(dout);
    cudaFree(dres);
    cudaFree(dw);
    cudaStreamDestroy(stream);
  }
  ws.reset();  // local teardown
  return 0;
}

class AllReduceGpuProcesses : public ::testing::TestWithParam<int> {};
TEST_P(AllReduceGpuProcesses, SharingOneGpuEqualTheOracle) {
  const auto probe = run_ranks(1, probe_body, 30.0, 60.0);
  if (probe[0].exit_code == kNoGpu) GTEST_SKIP() << "no CUDA device visible to a child process";
  ASSERT_EQ(probe[0].exit_code, 0) << test::describe(probe);
  const auto out = run_ranks(GetParam(), gpu_body, 60.0, 240.0);
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}
INSTANTIATE_TEST_SUITE_P(Worlds, AllReduceGpuProcesses, ::testing::Values(2, 4), ::testing::PrintToStringParamName());

#else

TEST(AllReduceGpuProcesses, SharingOneGpuEqualTheOracle) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace pcpkv
