// pcpkv_bench/allreduce.h: the all-reduce's benchmarks: W logical ranks on one GPU (`pcpkv bench-serving`;
// bench/cuda/allreduce_bench.cu) and one process per rank against NCCL (`pcpkv launch -- bench-allreduce`;
// bench/cuda/multiproc_allreduce_bench.cpp). Part of pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/serving/allreduce.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

struct AllReduceBenchRow {
  int32_t world_size = 0;
  int64_t bytes = 0;           // per rank
  std::string variant;         // "oneshot", "twoshot", "fused-oneshot", "fused-twoshot", "auto"
  int32_t num_blocks = 0;
  double us = 0.0;             // median per call (graph replay)
  double algbw_gbps = 0.0;     // bytes / time
};
struct AllReduceBenchOptions {
  std::vector<int32_t> world_sizes = {2, 4, 8};
  std::vector<int64_t> bytes = {4096, 16384, 65536, 262144, 1048576, 4194304, 16777216};
  int64_t hidden = 6144;       // fused rows
  int32_t iters = 50;
  int32_t warmup = 10;
};
/// W logical ranks on one GPU: latency by size for each algorithm; checks the bytes against the CPU oracle
/// once per (world, size, variant) before timing (throws on a mismatch).
std::vector<AllReduceBenchRow> bench_allreduce(const AllReduceBenchOptions& options);

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
