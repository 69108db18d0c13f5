// src/serving/drivers/router_dispatch.cpp: THE dispatch table of the router GEMM (pcpkv/serving/router.h), small-T
// kernel versus cuBLASLt. One table for every preset and both weight dtypes: the kernel is bound by reading W once (3
// MB for GLM-5, 3.5 MB for DeepSeek-V3.2), so the crossover depends on the token count, not the preset.
//
// MEASURED: NVIDIA H200 (one GPU, CUDA 13.0, sm_90), 2026-11-29, `pcpkv bench-serving` (defaults: presets
// glm-5 and deepseek-v3.2, cold L2, median of 50 CUDA-graph replays); microseconds per call,
// glm-5 / deepseek-v3.2 (docs/perf.md has the whole table):
//   T    small/e1 (v1)   small2 best (v2)      cuBLASLt      fastest
//   1    3.33 / 3.64     3.11 / 3.33 (e2)      6.26 / 6.40   small2/e2
//   2    4.17 / 4.52     3.77 / 4.10 (e1)      6.28 / 6.41   small2/e1
//   4    6.03 / 6.43     4.88 / 5.49 (e1)      6.29 / 6.43   small2/e1
//   8    9.58 / 10.37    7.68 / 8.63           6.33 / 6.46   cublaslt
//   16   9.96 / 11.03    -                     6.48 / 6.62   cublaslt
//   32   24.31 / 26.11   -                     6.50 / 6.69   cublaslt
// Rows: the bench's "suggested dispatch" of that run.
#include <climits>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/serving/router.h"

namespace pcpkv {

const std::vector<RouterDispatchEntry>& router_dispatch_table() {
  static const std::vector<RouterDispatchEntry> table = {
      {1, RouterPath::kSmallT, 2, RouterSmallKernel::kStaged},             // T = 1: staged, 2 experts per CTA
      {4, RouterPath::kSmallT, 1, RouterSmallKernel::kStaged},             // T = 2..4 (T = 3 runs bucket 4)
      {INT32_MAX, RouterPath::kCublasLt, 0, RouterSmallKernel::kRowLoop},  // T >= 5: x re-reads dominate
  };
  return table;
}

RouterDispatchEntry router_dispatch(int64_t num_tokens) {
  PCPKV_CHECK(num_tokens >= 1, "router: num_tokens = {} must be >= 1 to dispatch", num_tokens);
  for (const RouterDispatchEntry& e : router_dispatch_table())
    if (num_tokens <= e.max_tokens) return e;
  return router_dispatch_table().back();
}

int32_t router_token_bucket(int64_t num_tokens) {
  PCPKV_CHECK(num_tokens >= 1 && num_tokens <= kRouterSmallMaxTokens,
              "router: num_tokens = {} is outside the small-T kernel's range [1, {}]", num_tokens,
              kRouterSmallMaxTokens);
  int32_t b = 1;
  while (b < num_tokens) b *= 2;
  return b;
}

}  // namespace pcpkv
