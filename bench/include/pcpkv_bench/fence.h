// pcpkv_bench/fence.h: fence latency across rank processes (`pcpkv bench-fence`): the host fence
// (bench/host_fence_bench.cpp) and the CUDA fence kernel (bench/cuda/multiproc_publish_bench.cpp). Part of
// pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pcpkv {

class Bootstrap;

/// Fence latency benchmark (`pcpkv bench-fence`): every rank of `group` runs `layers` fences back to back
/// (barrier index = layer % num_barriers, as micro-batches alternate), `iters` times after `warmup`.
struct FenceBenchOptions {
  int32_t layers = 61;
  int32_t iters = 50;
  int32_t warmup = 5;
  int32_t num_barriers = 2;
  int64_t timeout_ms = 30000;
  bool graph = true;            // CUDA: also time a captured graph of `layers` fences, replayed `iters` times
  int32_t device_idx = -1;      // CUDA: -1 = round-robin
  /// CUDA: wall-time budget of the whole measurement (seconds, 0: none). A probe of a few fences measures
  /// the cost of one (the slowest rank's, agreed by all); iterations (at least 3) and, when even that is
  /// too slow, layers per iteration are scaled down to fit. Processes sharing a GPU without MPS time-slice
  /// and a fence then costs milliseconds: this keeps 2/4/8 processes on one GPU bounded.
  double time_budget_s = 20.0;
};
struct FenceBenchResult {
  std::string device;
  std::vector<double> per_layer_us;  // this rank's samples: microseconds per fence (per layer)
  double median_us = 0, p10_us = 0, p90_us = 0;
  std::vector<double> graph_per_layer_us;  // CUDA graph replays: replay time / layers
  double graph_median_us = 0;
  uint64_t final_epoch = 0;          // epoch of barrier 0 at the end (checks that every call advanced it)
  int32_t layers_run = 0, iters_run = 0, warmup_run = 0;  // what ran (after the time budget), 0: as asked
  int32_t max_ranks_per_gpu = 1;     // CUDA: most ranks of the group on one GPU (> 1: time-slicing)
};
/// Host fence over POSIX shared memory (the CPU backend's fence across processes). Collective.
FenceBenchResult bench_host_fence(Bootstrap& group, const FenceBenchOptions& options);
/// Median / percentile of samples (sorted copy); 0 for an empty vector.
double percentile(std::vector<double> samples, double q);

}  // namespace pcpkv

namespace pcpkv::cuda {

/// Fence latency with one process per rank (pcpkv bench-fence --backend cuda): per-layer times from CUDA
/// events around `layers` back-to-back fence kernels, and from replays of a captured graph of them.
FenceBenchResult bench_fence(Bootstrap& group, const FenceBenchOptions& options);

}  // namespace pcpkv::cuda
