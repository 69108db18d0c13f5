// Fence latency between rank processes on CUDA devices (cuda::bench_fence in pcpkv/cuda_multiproc.h):
// `layers` fence kernels back to back per iteration, timed with events (per layer = span / layers), then the
// same sequence captured once into a CUDA graph and replayed `iters` times (each replay timed). The device
// epochs must have advanced once per fence, replays included; a mismatch throws.
#include <fmt/format.h>

#include "cuda/buffers.h"
#include "cuda/check.h"
#include "cuda/multiproc_fence.h"
#include "pcpkv/bootstrap.h"
#include "pcpkv/cuda_multiproc.h"
#include "pcpkv/error.h"

namespace pcpkv::cuda {

FenceBenchResult bench_fence(Bootstrap& group, const FenceBenchOptions& o) {
  using namespace cuda_detail;
  PCPKV_CHECK(o.layers >= 1 && o.iters >= 1 && o.warmup >= 0 && o.num_barriers >= 1,
              "bench-fence: layers {}, iters {}, warmup {}, barriers {}: layers, iters and barriers must be >= 1",
              o.layers, o.iters, o.warmup, o.num_barriers);
  const int32_t device = select_rank_device(group, o.device_idx);
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  FenceBenchResult res;
  res.device = fmt::format("{}; {} processes, rank 0 on device {}", prop.name, group.world_size(), device);
  RankFence fence(group, o.num_barriers, o.timeout_ms, {});
  Stream stream;
  Event begin, end;
  std::vector<int64_t> calls(static_cast<size_t>(o.num_barriers), 0);
  auto enqueue_layers = [&] {
    for (int32_t layer = 0; layer < o.layers; ++layer) {
      fence.enqueue(layer % o.num_barriers, stream.get());
      ++calls[static_cast<size_t>(layer % o.num_barriers)];
    }
  };
  for (int32_t it = 0; it < o.warmup + o.iters; ++it) {
    PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), stream.get()));
    enqueue_layers();
    PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), stream.get()));
    fence.wait(stream.get(), "bench-fence");
    if (it >= o.warmup) res.per_layer_us.push_back(1000.0 * elapsed_ms(begin, end) / o.layers);
  }
  if (o.graph) {
    cudaGraph_t graph = nullptr;
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    const std::vector<int64_t> before = calls;
    enqueue_layers();
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PCPKV_CUDA_CHECK(inst);
    const int32_t replays = o.warmup + o.iters;
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
      if (it >= o.warmup) res.graph_per_layer_us.push_back(1000.0 * elapsed_ms(begin, end) / o.layers);
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
