// pcpkv/publish/cuda_multiproc.h: the per-process CUDA publication driver and the multi-process benchmarks
// (CUDA builds only; no CUDA headers needed). Devices and symmetric device memory: pcpkv/ranks/cuda.h.
//
// Processes must fork before they touch CUDA; `pcpkv launch` starts fresh processes, so any rank may. Each
// rank uses device PCPKV_DEVICE, or local_rank % visible devices (round-robin: several ranks may share one
// GPU). Symmetric device memory is allocated with the CUDA VMM API (cuMemCreate, exported as a POSIX file
// descriptor, passed over the bootstrap socket with SCM_RIGHTS, imported and cuMemMap'd by every rank) and
// works between processes on one GPU and between GPUs with peer access. NVLink multicast is never used.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/multiproc.h"
#include "pcpkv/ranks/cuda.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

/// The CUDA RankPublisher (pcpkv/publish/multiproc.h): this process's rank on its device. Caches, staging and the
/// fence pads live in device symmetric memory; the fence is the SPEC section 5 kernel with this rank's
/// device-resident epochs and a host-mapped error word (a timeout becomes pcpkv::FenceTimeout naming the
/// missing rank; a peer process that dies is noticed by the host while it waits, and named at once).
/// collect: the three all-gathers go through NCCL when every rank has its own GPU, else (and with
/// options.collect_via == "p2p") as peer reads of symmetric memory after a fence.
std::unique_ptr<RankPublisher> make_rank_publisher(Bootstrap& group, const PublishSetup& setup,
                                                   const RankPublishOptions& options);

/// Fence latency with one process per rank (pcpkv bench-fence --backend cuda): per-layer times from CUDA
/// events around `layers` back-to-back fence kernels, and from replays of a captured graph of them.
FenceBenchResult bench_fence(Bootstrap& group, const FenceBenchOptions& options);


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

/// The all-reduce across rank processes (`pcpkv launch --nproc N -- bench-allreduce`): pcpkv's symmetric-memory
/// all-reduce (pcpkv/serving/allreduce.h: cuda::AllReduce over make_device_symmetric; one-shot, two-shot, fused
/// residual-add + RMSNorm with each) against ncclAllReduce (bf16 sum) on the same ranks, per message size.
/// Every call is timed inside a CUDA graph of `calls` back-to-back calls (one eager call before each replay
/// absorbs the ranks' start skew); per rank the median over `repeats` replays, then the max over ranks.
struct AllReduceSweepOptions {
  std::vector<int64_t> bytes;         // message sizes (bf16 bytes per rank); empty: 8 KiB .. 64 MiB, x2 steps
  int64_t hidden = 6144;              // fused rows [bytes / (2 hidden), hidden] (GLM-5's hidden size)
  int32_t repeats = 7;
  bool check = true;                  // compare every symmetric variant with the CPU oracle, byte for byte
  uint64_t seed = 7;
  int64_t timeout_ns = 10'000'000'000;
};
struct AllReduceSweepRow {
  int64_t bytes = 0;                  // message bytes per rank (fused: whole rows)
  std::string variant;                // "nccl", "oneshot", "twoshot", "fused-oneshot", "fused-twoshot"
  double us = 0;                      // max over ranks of each rank's median per call
  std::vector<double> rank_us;        // [world] each rank's median
  int64_t mismatches = -1;            // elements that differ from the CPU oracle (-1: not checked); NCCL
                                      // rounds in its own order, so its count is reported, not required to be 0
};
struct AllReduceSweepResult {
  int32_t world_size = 0;
  std::string device;
  bool symmetric = false;             // false: the symmetric path was refused (fallback_reason) and only NCCL ran
  std::string fallback_reason;
  std::vector<AllReduceSweepRow> rows;
};
/// Collective over group (one process per rank, one GPU each, NCCL required). A symmetric variant whose
/// bytes differ from the oracle shows as mismatches > 0 (the caller fails). Throws pcpkv::Error when NCCL is
/// missing, two ranks share a GPU, or a call times out.
AllReduceSweepResult bench_allreduce_sweep(Bootstrap& group, const AllReduceSweepOptions& options);

}  // namespace pcpkv::cuda
