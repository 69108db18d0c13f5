// pcpkv_bench/link.h: link bandwidth between this host's GPUs (`pcpkv bench-link`; bench/cuda/peer_copy_bench.cpp).
// Part of pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <vector>

namespace pcpkv::cuda {

/// Link bandwidth between this host's GPUs (`pcpkv bench-link`), with copy-engine peer copies
/// (cudaMemcpyPeerAsync) from ONE process that holds every listed GPU (call it before any rank process runs,
/// or while none does). GB/s are 1e9 bytes per second.
struct LinkBenchOptions {
  std::vector<int32_t> gpus;          // devices to use (>= 2); empty: every visible device
  int64_t bytes = int64_t{256} << 20; // per copy (>= 1 MiB, multiple of 256)
  int32_t iters = 10;                 // copies per measurement (after one warm-up)
};
struct LinkBenchResult {
  std::vector<int32_t> gpus;
  int64_t bytes = 0;
  double pair_gbps = 0;             // gpus[0] -> gpus[1], one way (median of iters)
  double pair_bidir_gbps = 0;       // gpus[0] <-> gpus[1] at once, both directions summed
  double all_pairs_recv_gbps = 0;   // every ordered pair at once: what each GPU receives (from all peers)
  double all_pairs_total_gbps = 0;  // the same, summed over GPUs
  double local_copy_gbps = 0;       // cudaMemcpyAsync device-to-device on gpus[0] (HBM), for scale
};
/// Throws pcpkv::Error when fewer than 2 GPUs are visible or two listed GPUs have no peer access.
LinkBenchResult bench_link(const LinkBenchOptions& options);

}  // namespace pcpkv::cuda
