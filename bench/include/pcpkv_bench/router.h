// pcpkv_bench/router.h: the router GEMM's benchmark (`pcpkv bench-serving`; bench/cuda/router_bench.cu). Part of
// pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/serving/router.h"

namespace pcpkv::cuda {

/// One timed variant of the router GEMM at one token count (microseconds, median of `iters` timed
/// CUDA-graph replays after warm-up; `cold`: W rotates over enough copies to miss L2 on every call).
struct RouterBenchRow {
  std::string preset;
  int64_t num_tokens = 0;
  std::string variant;       // "small/e1", ..., "small2/e1", ..., "cublaslt", "auto"; a "+pdl" suffix: the
                             // graph's back-to-back calls launched with PDL (each call's W stream overlaps
                             // the previous call's tail, as the router's does after its producer)
  bool cold = true;
  double us = 0.0;
  double weight_gbps = 0.0;  // W bytes / time
};
struct RouterBenchOptions {
  std::vector<int64_t> tokens = {1, 2, 4, 8, 16, 32};
  int32_t iters = 50;        // timed replays (>= 20)
  int32_t warmup = 10;
  bool cold = true;          // also time with hot L2 when false
  bool pdl_variants = true;  // also time "small/e1+pdl" and "small2/e1+pdl"
};
/// Times every variant (both small-T kernels with each experts_per_cta, cuBLASLt, the dispatch table's
/// choice, and the PDL variants) for one
/// router config and checks the small-T logits against cuBLASLt's on the way (throws on a mismatch beyond
/// the bound). Needs a GPU.
std::vector<RouterBenchRow> bench_router_gemm(const std::string& preset, const RouterConfig& config,
                                              const RouterBenchOptions& options);

}  // namespace pcpkv::cuda
