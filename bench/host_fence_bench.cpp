// Host fence latency across processes (see bench_host_fence in pcpkv/publish/multiproc.h).
#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/ranks/symmetric.h"
#include "pcpkv_bench/fence.h"

namespace pcpkv {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

FenceBenchResult bench_host_fence(Bootstrap& group, const FenceBenchOptions& o) {
  PCPKV_CHECK(o.layers >= 1 && o.iters >= 1 && o.warmup >= 0 && o.num_barriers >= 1,
              "bench-fence: layers {}, iters {}, warmup {}, barriers {}: layers, iters and barriers must be >= 1",
              o.layers, o.iters, o.warmup, o.num_barriers);
  const int32_t W = group.world_size();
  auto pads_mem = make_host_symmetric(group, fence_pad_bytes(o.num_barriers, W), "fence pads", 0);
  std::vector<uint64_t*> pads;
  for (int32_t r = 0; r < W; ++r) pads.push_back(reinterpret_cast<uint64_t*>(pads_mem->ptr(r)));
  HostFence fence(group.rank(), W, o.num_barriers, pads);
  group.barrier();
  FenceBenchResult res;
  res.device = fmt::format("CPU, {} processes", W);
  using Clock = std::chrono::steady_clock;
  for (int32_t it = 0; it < o.warmup + o.iters; ++it) {
    for (int32_t layer = 0; layer < o.layers; ++layer) {
      const auto t0 = Clock::now();
      fence_wait_watching_peers(fence, layer % o.num_barriers, o.timeout_ms, group.pids(), "bench-fence");
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (it >= o.warmup) res.per_layer_us.push_back(us);
    }
  }
  res.median_us = percentile(res.per_layer_us, 0.5);
  res.p10_us = percentile(res.per_layer_us, 0.1);
  res.p90_us = percentile(res.per_layer_us, 0.9);
  res.final_epoch = fence.epoch(0);
  group.barrier();  // nobody unmaps a pad a peer still signals
  return res;
}

}  // namespace pcpkv
