// pcpkv/cuda_multiproc.h: one process per rank on CUDA devices (CUDA builds only; no CUDA headers needed).
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

#include "pcpkv/multiproc.h"
#include "pcpkv/symmetric.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

/// Picks and sets this rank's device (PCPKV_DEVICE, else local_rank % visible devices, or device_idx >= 0)
/// and returns it. Throws pcpkv::Error when no device is visible.
int32_t select_rank_device(const Bootstrap& world, int32_t device_idx = -1);

/// Device symmetric memory on the current device (see the header comment): every rank maps every peer or
/// all ranks throw, naming each failing rank and its reason (e.g. "rank 1: cuMemSetAccess of rank 3's
/// buffer (GPU 3) from GPU 1 failed: CUDA_ERROR_INVALID_DEVICE (no peer access between these GPUs?)").
/// The local buffer is filled with `fill` before any peer maps it. device_ptr_table() is a device array
/// [world] of every rank's address. Teardown unmaps, frees the address ranges, releases the handles and
/// closes every descriptor (no descriptor outlives setup).
std::unique_ptr<SymmetricMemory> make_device_symmetric(Bootstrap& group, int64_t bytes, const std::string& name,
                                                       uint8_t fill = 0);

/// Test hook: make_device_symmetric on this group rank fails to map its peers with reason `why` (-1: off).
void set_device_symmetric_failure_for_test(int32_t group_rank, const std::string& why);

/// The CUDA RankPublisher (pcpkv/multiproc.h): this process's rank on its device. Caches, staging and the
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

/// NCCL all-gather for the collect transport across processes (one GPU per rank).
class NcclAllGather {
 public:
  /// Collective over group. Throws pcpkv::Error when pcpkv was built without NCCL, or when two ranks share
  /// a GPU ("collect over NCCL needs one GPU per rank: ranks 0 and 1 both use GPU 0 (...); NCCL refuses
  /// that ('Duplicate GPU detected'); the staging and direct transports, and collect with p2p all-gathers,
  /// work with several ranks per GPU"), or when NCCL fails (its message included).
  explicit NcclAllGather(Bootstrap& group);
  ~NcclAllGather();
  NcclAllGather(const NcclAllGather&) = delete;
  NcclAllGather& operator=(const NcclAllGather&) = delete;
  /// recv[r * bytes + i] = send of rank r [i], on `stream` (a cudaStream_t; graph-capturable).
  void all_gather(const void* send, void* recv, int64_t bytes, void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

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
/// all-reduce (pcpkv/allreduce.h: cuda::AllReduce over make_device_symmetric; one-shot, two-shot, fused
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

/// Free memory of the current device in bytes (cudaMemGetInfo), for leak checks.
int64_t device_free_bytes();

/// Whether pcpkv_cuda was built with NCCL.
bool have_nccl();

/// This rank's row of its group's peer-access matrix (transport "auto", pcpkv/transport_choice.h): row[b] is
/// true when rank b uses this rank's current GPU (same UUID) or a GPU this one has CUDA peer access to
/// (cudaDeviceCanAccessPeer; the peer's GPU found by its PCI bus id, false when this process cannot see it).
/// Collective over group (one all-gather).
std::vector<bool> peer_access_row(Bootstrap& group);

}  // namespace pcpkv::cuda
