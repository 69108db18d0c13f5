// Fence latency between rank processes on CUDA devices (cuda::bench_fence in pcpkv/publish/cuda_multiproc.h):
// `layers` fence kernels back to back per iteration, timed with events (per layer = span / layers), then the
// same sequence captured once into a CUDA graph and replayed `iters` times (each replay timed). The device
// epochs must have advanced once per fence, replays included; a mismatch throws.
//
// Time budget: processes that share a GPU without MPS time-slice it, and a spinning fence kernel then waits
// for its peers' time slices (milliseconds per fence; 4 and 8 processes did not finish 61 x 50 fences in
// 40 s). A probe of a few fences measures the slowest rank's cost per fence; iterations (and, if needed,
// layers per iteration) are scaled down so that the whole measurement fits options.time_budget_s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include <fmt/format.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "publish/drivers/cuda/multiproc_fence.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/core/error.h"
#include "pcpkv_bench/fence.h"

namespace pcpkv::cuda {

FenceBenchResult bench_fence(Bootstrap& group, const FenceBenchOptions& o) {
  using namespace cuda;
  PCPKV_CHECK(o.layers >= 1 && o.iters >= 1 && o.warmup >= 0 && o.num_barriers >= 1,
              "bench-fence: layers {}, iters {}, warmup {}, barriers {}: layers, iters and barriers must be >= 1",
              o.layers, o.iters, o.warmup, o.num_barriers);
  const int32_t device = select_rank_device(group, o.device_idx);
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  PCPKV_CHECK(o.time_budget_s >= 0, "bench-fence: time budget {} s must be >= 0", o.time_budget_s);
  FenceBenchResult res;
  res.device = fmt::format("{}; {} processes, rank 0 on device {}", prop.name, group.world_size(), device);
  // How many ranks share each GPU (by UUID: indices differ with CUDA_VISIBLE_DEVICES).
  {
    char uuid[16];
    std::memcpy(uuid, prop.uuid.bytes, 16);
    std::vector<char> all(16 * static_cast<size_t>(group.world_size()));
    group.all_gather(uuid, 16, all.data());
    std::map<std::string, int32_t> per_gpu;
    for (int32_t r = 0; r < group.world_size(); ++r)
      res.max_ranks_per_gpu = std::max(res.max_ranks_per_gpu, ++per_gpu[std::string(&all[16 * r], 16)]);
  }
  RankFence fence(group, o.num_barriers, o.timeout_ms, {});
  Stream stream;
  Event begin, end;
  std::vector<int64_t> calls(static_cast<size_t>(o.num_barriers), 0);
  int32_t layers = o.layers;
  auto enqueue_layers = [&](int32_t n) {
    for (int32_t layer = 0; layer < n; ++layer) {
      fence.enqueue(layer % o.num_barriers, stream.get());
      ++calls[static_cast<size_t>(layer % o.num_barriers)];
    }
  };
  int32_t warmup = o.warmup, iters = o.iters;
  if (o.time_budget_s > 0) {
    // Probe: a few fences (a warm-up of sorts), timed on the host; every rank adopts the slowest rank's cost.
    const int32_t probe = std::min(o.layers, 2 * o.num_barriers + 2);
    enqueue_layers(probe);  // untimed: module loading and first-launch costs
    fence.wait(stream.get(), "bench-fence (probe warm-up)");
    const auto t0 = std::chrono::steady_clock::now();
    enqueue_layers(probe);
    fence.wait(stream.get(), "bench-fence (probe)");
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / probe;
    std::vector<double> all(static_cast<size_t>(group.world_size()));
    group.all_gather(&mine, sizeof(mine), all.data());
    const double per_fence_s = *std::max_element(all.begin(), all.end());
    // Eager and graph phases share the budget; each needs >= 3 timed iterations (+ its warm-up).
    const double phase_s = o.time_budget_s / (o.graph ? 2.0 : 1.0);
    const int32_t min_iters = std::min(3, o.iters);
    const double fit_layers = phase_s / (per_fence_s * (min_iters + std::min(o.warmup, 1)));
    if (fit_layers < o.layers)
      layers = std::max(std::min(o.layers, 2 * o.num_barriers), static_cast<int32_t>(std::floor(fit_layers)));
    const int64_t fit_iters = static_cast<int64_t>(std::floor(phase_s / (per_fence_s * layers)));
    if (fit_iters < o.warmup + o.iters) {
      warmup = static_cast<int32_t>(std::min<int64_t>(o.warmup, std::max<int64_t>(fit_iters / 5, 1)));
      iters = static_cast<int32_t>(std::clamp<int64_t>(fit_iters - warmup, min_iters, o.iters));
    }
  }
  res.layers_run = layers;
  res.warmup_run = warmup;
  res.iters_run = iters;
  for (int32_t it = 0; it < warmup + iters; ++it) {
    PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), stream.get()));
    enqueue_layers(layers);
    PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), stream.get()));
    fence.wait(stream.get(), "bench-fence");
    if (it >= warmup) res.per_layer_us.push_back(1000.0 * elapsed_ms(begin, end) / layers);
  }
  if (o.graph) {
    cudaGraph_t graph = nullptr;
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    const std::vector<int64_t> before = calls;
    enqueue_layers(layers);
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PCPKV_CUDA_CHECK(inst);
    const int32_t replays = warmup + iters;
    for (int32_t b = 0; b < o.num_barriers; ++b) {
      const int64_t per = calls[static_cast<size_t>(b)] - before[static_cast<size_t>(b)];
      fence.note_replayed(b, per * (replays - 1));
      calls[static_cast<size_t>(b)] += per * (replays - 1);
    }
    for (int32_t it = 0; it < replays; ++it) {
      PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), stream.get()));
      PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
      PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), stream.get()));
      fence.wait(stream.get(), "bench-fence (graph)");
      if (it >= warmup) res.graph_per_layer_us.push_back(1000.0 * elapsed_ms(begin, end) / layers);
    }
    cudaGraphExecDestroy(exec);
  }
  const std::vector<uint64_t> epochs = fence.epochs();
  for (int32_t b = 0; b < o.num_barriers; ++b)
    PCPKV_CHECK(epochs[static_cast<size_t>(b)] == static_cast<uint64_t>(calls[static_cast<size_t>(b)]),
                "bench-fence: barrier {} epoch is {} on the device, but {} fences ran (graph replays must advance it)",
                b, epochs[static_cast<size_t>(b)], calls[static_cast<size_t>(b)]);
  res.final_epoch = epochs[0];
  res.median_us = percentile(res.per_layer_us, 0.5);
  res.p10_us = percentile(res.per_layer_us, 0.1);
  res.p90_us = percentile(res.per_layer_us, 0.9);
  res.graph_median_us = percentile(res.graph_per_layer_us, 0.5);
  group.barrier();  // nobody frees a pad a peer still signals
  return res;
}

}  // namespace pcpkv::cuda
