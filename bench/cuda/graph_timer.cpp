// Graph-replay timing shared by the benches (graph_timer.h).
#include "bench/cuda/graph_timer.h"

#include <algorithm>

#include "core/cuda/check.h"
#include "pcpkv/core/error.h"

namespace pcpkv::cuda {

double median_of(std::vector<double> v) {
  PCPKV_CHECK(!v.empty(), "bench: median of no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double graph_median_us_per_call(const std::function<void(cudaStream_t, int64_t)>& enqueue, int64_t calls,
                                int warmup, int iters, cudaStream_t stream) {
  PCPKV_CHECK(calls >= 1 && iters >= 1 && warmup >= 0, "bench: calls = {}, iters = {}, warmup = {} out of range",
              calls, iters, warmup);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  auto cleanup = [&] {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (ev0) cudaEventDestroy(ev0);
    if (ev1) cudaEventDestroy(ev1);
  };
  try {
    PCPKV_CUDA_CHECK(cudaEventCreate(&ev0));
    PCPKV_CUDA_CHECK(cudaEventCreate(&ev1));
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int64_t k = 0; k < calls; ++k) enqueue(stream, k);
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    PCPKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < warmup; ++i) PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    std::vector<double> us;
    us.reserve(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      PCPKV_CUDA_CHECK(cudaEventRecord(ev0, stream));
      PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      PCPKV_CUDA_CHECK(cudaEventRecord(ev1, stream));
      PCPKV_CUDA_CHECK(cudaEventSynchronize(ev1));
      float ms = 0;
      PCPKV_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      us.push_back(static_cast<double>(ms) * 1000.0 / static_cast<double>(calls));
    }
    cleanup();
    return median_of(std::move(us));
  } catch (...) {
    cleanup();
    throw;
  }
}

}  // namespace pcpkv::cuda
