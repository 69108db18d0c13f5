// pcpkv_bench/publish.h: `pcpkv bench`, the publication benchmark of the CUDA backend (bench/cuda/publish_bench.cpp;
// bench_exit_code in bench/bench_exit_code.cpp). Part of pcpkv_bench, not installed: engines link pcpkv alone.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cuda.h"

namespace pcpkv::cuda {

/// What `pcpkv bench` measures. Every time is a median over `iters` runs after `warmup` runs, from CUDA
/// events on one stream; inputs are rotated between runs so that L2 (not HBM) never serves them.
struct BenchOptions {
  int device_idx = 0;
  std::vector<std::string> models = {"glm-5", "deepseek-v3.2"};
  std::vector<int32_t> pcp = {2, 4, 8};
  std::vector<KvFormat> kv_formats = {KvFormat::kFp8, KvFormat::kFp8DsMla};
  std::vector<Transport> transports = {Transport::kCollect, Transport::kStaging, Transport::kDirect};
  int64_t tokens = 32768;          // one prefill request of this many tokens
  bool indexer_layer = true;       // false: an IndexShare "shared" layer (no indexer K, no top-k fill)
  int64_t topk_width = 2048;       // top-k buffer width filled with -1 (indexer layers); 0: none
  /// Which top-k rows staging / direct and the single-rank dispatch fill (pcpkv/publish/dispatch.h TopkFill; kTail:
  /// each rank's padding rows only). collect always runs kFull, as engines do.
  TopkFill topk_fill = TopkFill::kFull;
  int32_t block_size = 64;
  int iters = 20;
  int warmup = 5;
  bool graph = true;               // also capture one publication into a CUDA graph and time its replays
  /// Single-rank and per-GPU cases with `graph`: this many rank dispatches (rotating input sets) captured back to
  /// back into one graph, the replay time per call: the kernel on a busy GPU, without the host's launch path.
  int graph_calls = 16;
  std::vector<int64_t> single_rank_tokens = {4096, 32768};  // dispatch-only, PCP 1 (docs/perf.md's vLLM case)
  /// Dispatch kernels of the single-rank section ("simple", "prefetch", "warp", "warp_pf"), each with the
  /// top-k fill fused and separate, measured side by side in one run.
  std::vector<std::string> single_rank_variants = {"simple", "prefetch", "warp", "warp_pf"};
  /// The per-GPU case: rank 0's dispatch alone in a PCP per_gpu_pcp group of per_gpu_tokens tokens (one
  /// prefill request; GLM-5 and DeepSeek-V3.2 of `models`, fp8_ds_mla, indexer layer): tokens / P local rows
  /// writing P staging slots (staging) or P replicas (direct), what one GPU of the group runs before its
  /// fence. Each layer variant's dispatch kernel and fill. per_gpu_pcp 0: skipped.
  int32_t per_gpu_pcp = 8;
  int64_t per_gpu_tokens = 32768;
  /// Publication variants of the staging / direct runs, "<dispatch>:<fused|separate>:<combine rows per
  /// warp>[:pdl]" (e.g. "warp:fused:4"); each case runs every one. collect always runs its pinned baseline
  /// (the CTA "prefetch" kernel, separate top-k fill: what engines do).
  std::vector<std::string> layer_variants = {"prefetch:separate:1", "warp:separate:1", "warp:fused:1",
                                             "warp:fused:2",        "warp_pf:fused:4", "warp:fused:4"};
  /// PDL off / on (chain a: dispatch -> fence -> combine) for these token counts (one prefill request
  /// of that many tokens over pdl_pcp ranks, GLM-5, fp8_ds_mla, indexer layer), CUDA-graph replay of
  /// pdl_layers publications back to back; empty: skipped. The kernels are layer_variants.back()'s.
  std::vector<int64_t> pdl_tokens = {1, 8, 64};
  int32_t pdl_pcp = 8;
  int32_t pdl_layers = 20;
  /// The run-time replica check's cost (pcpkv/publish/replica_hash.h; a debug mode, so its own rows, never in a
  /// transport's total): after one direct publication of each (model, format) case at this PCP world (one of
  /// `pcp`; -1: the largest of them, 8 by default), every replica's written slots hashed on the GPU and compared
  /// with rank 0's. 0: skipped.
  int32_t replica_check_pcp = -1;
  double copy_gib = 2.0;           // size of the device-to-device copy that measures the copy bandwidth
  uint64_t seed = 1;
};

struct BenchStage {
  std::string name;
  double ms = 0.0;     // median over the timed runs
  int64_t bytes = 0;   // read + written (docs/perf.md byte model)
};

/// One (model, PCP, format, transport) publication.
struct BenchRun {
  std::string model;
  int32_t pcp = 0;
  KvFormat kv_format = KvFormat::kFp8DsMla;
  bool indexer_layer = true;
  int64_t tokens = 0;
  Transport transport = Transport::kDirect;
  std::string variant;      // PublishVariant name the run used (collect: its pinned baseline)
  TopkFill topk_fill = TopkFill::kFull;  // the fill it ran (collect: always kFull)
  std::vector<BenchStage> stages;
  double total_ms = 0.0;   // median of the per-run sums of the stages
  int64_t bytes = 0;       // sum over the stages
  double graph_ms = -1.0;  // median replay time of the captured publication (-1: not measured)
};

/// The fused dispatch alone on one rank (no PCP): Q norm, KV norm + RoPE + cache write, indexer LN + RoPE +
/// UE8M0 write, top-k fill; the case docs/perf.md compares with vLLM's Triton kernel.
struct BenchSingle {
  std::string model;
  KvFormat kv_format = KvFormat::kFp8DsMla;
  int64_t tokens = 0;
  std::string variant;      // dispatch kernel variant ("simple", "prefetch")
  bool fused_topk = true;   // top-k fill inside the dispatch kernel (else a separate byte fill, timed with it)
  TopkFill topk_fill = TopkFill::kFull;  // which rows it filled
  double ms = 0.0;          // median, one launch on an idle GPU (CUDA events; includes the host's launch path)
  double ms_min = 0.0;
  double graph_ms = -1.0;   // median per call of BenchOptions::graph_calls calls replayed in one CUDA graph (-1: not measured)
  int64_t bytes = 0;
};

/// Rank 0's dispatch alone in a PCP group (BenchOptions::per_gpu_pcp): one GPU's share before the fence.
struct BenchPerGpu {
  std::string model;
  int32_t pcp = 0;
  int64_t local_tokens = 0;  // rows of rank 0 (per_gpu_tokens / pcp)
  Transport transport = Transport::kDirect;
  std::string variant;       // PublishVariant name (dispatch kernel and fill; combine / pdl do not apply)
  double ms = 0.0;           // median of (top-k fill unless fused) + dispatch, one launch on an idle GPU
  double graph_ms = -1.0;    // the same, per call of BenchOptions::graph_calls calls replayed in one CUDA graph (-1: not measured)
  int64_t bytes = 0;         // read + written by rank 0's fill and dispatch (docs/perf.md byte model)
};

/// The replica check of one layer's publication (BenchOptions::replica_check_pcp): W launches of the slot-hash
/// kernel (every replica's written slots) + the compare kernel + the copy of the W diff records to the host.
struct BenchReplicaCheck {
  std::string model;
  int32_t pcp = 0;
  KvFormat kv_format = KvFormat::kFp8DsMla;
  bool indexer_layer = true;
  int64_t tokens = 0;
  int64_t slots = 0;             // written slots hashed per replica
  double ms = 0.0;               // median over the timed runs (CUDA events around the enqueue)
  int64_t cache_bytes_read = 0;  // the rows hashed: W * slots * (MLA row + 132 on indexer layers)
  int64_t bytes = 0;             // read + written: the rows, the slot list, the hashes written and compared
  bool pass = false;             // every replica's hashes equal rank 0's (after a direct publication: must hold)
  std::string detail;            // the check's detail (replica_hash_check)
};

/// One PDL off / on comparison (BenchOptions::pdl_tokens).
struct BenchPdl {
  std::string model;
  int32_t pcp = 0;
  int64_t tokens = 0;
  Transport transport = Transport::kStaging;
  std::string variant;     // kernels (PublishVariant name without the pdl part)
  int32_t layers = 0;      // publications per captured graph
  double us_off = 0.0;     // median graph replay time / layers, PDL off
  double us_on = 0.0;      // the same with PDL on
};

struct BenchReport {
  std::string device;
  int num_sms = 0;
  int64_t l2_bytes = 0;
  double copy_gbps = 0.0;        // device-to-device copy, (read + written) bytes / s / 1e9
  int64_t copy_bytes = 0;        // bytes of the copied buffer
  std::vector<std::string> kernels;  // register / shared memory / spill report of the dispatch kernels
  std::vector<BenchSingle> singles;
  std::vector<BenchPerGpu> per_gpu;
  std::vector<BenchRun> runs;
  std::vector<BenchReplicaCheck> replica_checks;
  std::vector<BenchPdl> pdl;
};

/// Runs the benchmark on device options.device_idx. progress (may be empty) receives one line per step.
/// Throws pcpkv::Error on bad options or when no device is usable.
BenchReport run_bench(const BenchOptions& options, const std::function<void(const std::string&)>& progress = {});

/// `pcpkv bench`'s exit code for `report`: 1 (a verification check failed, README's exit codes) when a
/// replica-check row failed, else 0. `why` (may be null) gets one clause per failed row, "glm-5 PCP 8 fp8_ds_mla:
/// <the check's detail>", joined by "; ". Host code in every build (bench/bench_exit_code.cpp).
int bench_exit_code(const BenchReport& report, std::string* why = nullptr);

}  // namespace pcpkv::cuda
