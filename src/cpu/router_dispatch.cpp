// src/cpu/router_dispatch.cpp: THE dispatch table of the router GEMM (pcpkv/router.h), small-T kernel
// versus cuBLASLt. One table for every preset and both weight dtypes: the kernel is bound by reading W once
// (3 MB for GLM-5, 3.5 MB for DeepSeek-V3.2), so the crossover depends on the token count, not the preset.
//
// PROVISIONAL: these rows are an estimate, not yet measured. Replace them with the fastest variant per
// token count printed by `pcpkv bench-serving --what router` on the H200 (its "suggested dispatch" table),
// and record the date and the command here and in docs/perf.md.
#include <climits>
#include <vector>

#include "pcpkv/error.h"
#include "pcpkv/router.h"

namespace pcpkv {

const std::vector<RouterDispatchEntry>& router_dispatch_table() {
  static const std::vector<RouterDispatchEntry> table = {
      {2, RouterPath::kSmallT, 1},         // T = 1, 2: one CTA per expert, most memory parallelism
      {8, RouterPath::kSmallT, 2},         // T <= 8: two experts per CTA halve the x re-reads from L2
      {16, RouterPath::kSmallT, 4},
      {INT32_MAX, RouterPath::kCublasLt, 0},  // tensor cores once x re-reads dominate
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
