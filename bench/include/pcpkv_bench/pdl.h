// pcpkv_bench/pdl.h: PDL off / on over chains of pcpkv kernels (`pcpkv bench-serving --what pdl`;
// bench/cuda/pdl_bench.cu). Part of pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda {

/// One chain of kernels timed with PDL off and on (CUDA builds; `pcpkv bench-serving --what pdl`):
/// microseconds per chain, median of `iters` CUDA-graph replays (each replay runs the chain
/// kChainsPerGraph times back to back).
struct PdlBenchRow {
  std::string chain;         // "quant-dequant x4", "allreduce-norm > router > topk", ...
  int64_t num_tokens = 0;
  int32_t num_kernels = 0;   // kernels per chain
  double us_off = 0.0;
  double us_on = 0.0;
};
struct PdlBenchOptions {
  std::vector<int64_t> tokens = {1, 8, 64};
  int32_t iters = 50;
  int32_t warmup = 10;
  int32_t world_size = 4;    // logical ranks of the all-reduce chain
};
std::vector<PdlBenchRow> bench_pdl(const PdlBenchOptions& options);

}  // namespace pcpkv::cuda
