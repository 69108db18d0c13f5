// bench/cuda/graph_timer.h: the benches' one way to time small kernels: capture a batch of calls into a CUDA
// graph (no launch gaps), replay it, and take the median over timed replays (CUDA events).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace pcpkv::cuda {

/// Median of v (v non-empty; the mean of the two middle values for an even count).
double median_of(std::vector<double> v);

/// Captures enqueue(stream, k) for k = 0..calls-1 into one graph, replays it `warmup` times untimed, then
/// `iters` times between events; returns the median microseconds per call (replay time / calls).
/// Throws pcpkv::Error on a CUDA error; the graph is destroyed either way.
double graph_median_us_per_call(const std::function<void(cudaStream_t, int64_t)>& enqueue, int64_t calls,
                                int warmup, int iters, cudaStream_t stream);

}  // namespace pcpkv::cuda
