// pcpkv/serving/allreduce.h: all-reduce of bf16 over symmetric memory (SPEC section 7), for the tensor-parallel
// reductions around the attention of a decode step.
//
// Math (identical bytes on the CPU and the GPU, whatever the algorithm or the number of blocks):
//   out[i] = bf16( (((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{W-1}[i]) )   fp32 adds in rank order, one rounding
// Fused variant, per row t of [num_tokens, hidden] (= an all-reduce followed by vLLM's fused_add_rms_norm):
//   residual_out[t, k] = bf16( out[t, k] + residual_in[t, k] )          (out as above, bf16)
//   y[t, k]            = bf16( (r_k * inv) * w[k] ),  r = residual_out as fp32,
//                        inv = 1 / sqrt(sumsq(r) / hidden + eps)         (pcpkv/device/token_math.h order)
// residual_in must be the same on every rank (it is the replicated residual stream of tensor parallelism).
//
// Algorithms:
//   one-shot  copy the input into this rank's workspace, barrier, every rank reads all W peers and reduces
//             everything (W x the bytes read, 1 barrier): lowest latency for small messages;
//   two-shot  copy in, barrier, rank r reduces segment r (reduce-scatter) into its workspace, barrier, every
//             rank gathers the other segments from their owners (all-gather): 2 x the bytes, 2 barriers.
//             The fused variant splits by rows, so each row's norm is computed once, by its owner.
// Barriers are per block: in call e (a per-rank call counter), block b of rank r publishes e into slot
// [b][barrier][e & 1][r] of every peer's signal pad with a system-scope release and polls its own slots
// [b][barrier][e & 1][*] with acquire loads until they hold e (SPEC section 5's fence, per block). The
// epoch lives in device memory and advances on the device (the last block of a call to finish writes e),
// so a captured CUDA graph replays correctly. The data region is double-buffered by e's parity: a rank
// can be at most one call ahead of any peer (it cannot finish call e+1 before every peer has started e+1,
// i.e. finished e), whatever the number of blocks of each call. A bounded wait records the first missing
// peer in the workspace's error word instead of hanging; check() turns it into pcpkv::FenceTimeout. After
// a timeout the workspaces must be re-created (epochs are out of step).
//
// Host header: no CUDA headers (streams are CUstream_st*, NCCL communicators ncclComm*).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/device/config.h"

struct CUstream_st;
struct ncclComm;

namespace pcpkv {

class Bootstrap;
class SymmetricMemory;

constexpr int kAllReduceMaxRanks = 8;
constexpr int kAllReduceMaxBlocks = 64;        // blocks per rank and launch (signal pad size)
constexpr int kAllReduceThreads = 256;         // threads per block on the GPU
constexpr int64_t kAllReduceChunkVectors = 256;  // 16-byte vectors per chunk (one per GPU thread)
constexpr int64_t kAllReduceMaxHidden = 8192;  // fused variant: row length limit (4 vectors per thread)

enum class AllReduceAlgo : uint8_t { kAuto, kOneShot, kTwoShot };
const char* to_string(AllReduceAlgo a);
AllReduceAlgo parse_allreduce_algo(const std::string& s);  // "auto" | "oneshot" | "twoshot"

/// The size threshold between one-shot and two-shot, kept in ONE place (src/serving/drivers/allreduce_dispatch.cpp;
/// measured with `pcpkv bench-serving --what allreduce`, W logical ranks on one H200). `bytes` per rank
/// (the whole message, bf16), world_size in [1, kAllReduceMaxRanks]; throws pcpkv::Error outside those.
/// The two-argument form is the plain all-reduce; `fused` selects the residual-add + RMSNorm variant's
/// threshold (its one-shot normalizes every row on every rank, so it turns over earlier).
AllReduceAlgo choose_allreduce_algo(int64_t bytes, int32_t world_size);
AllReduceAlgo choose_allreduce_algo(int64_t bytes, int32_t world_size, bool fused);

/// Byte layout of one rank's workspace (every rank's has the same layout; all of it in symmetric memory):
///   [0, signal_bytes)   u32 signal pad [kAllReduceMaxBlocks][2 barriers][2 parities][kAllReduceMaxRanks]
///   epoch               u32: calls this rank has completed (local)
///   arrivals            u32: blocks of the current call that have finished (local; the last resets it)
///   error word          u32: 0, or 1 + the first peer a bounded wait gave up on (local)
///   data                bf16 [2 parities][max_elems]: the copied-in input; two-shot: the reduced segment
///   aux                 bf16 [2 parities][max_elems]: fused two-shot: the new residual of owned rows
/// The header (signals, epochs, error word) must be zero on every rank before the first call.
struct AllReduceLayout {
  int64_t max_elems = 0;  // bf16 elements per rank and call

  static constexpr int64_t kSignalBytes = int64_t{kAllReduceMaxBlocks} * 2 * 2 * kAllReduceMaxRanks * 4;
  static constexpr int64_t kEpochOffset = kSignalBytes;
  static constexpr int64_t kArrivalOffset = kSignalBytes + 4;
  static constexpr int64_t kErrorOffset = kSignalBytes + 8;
  static constexpr int64_t kHeaderBytes = 16384;  // >= kErrorOffset + 4, keeps data 16 KiB aligned
  PCPKV_HD int64_t half_bytes() const { return ((max_elems * 2 + 255) / 256) * 256; }
  PCPKV_HD int64_t data_offset(uint32_t parity) const { return kHeaderBytes + int64_t{parity} * half_bytes(); }
  PCPKV_HD int64_t aux_offset(uint32_t parity) const { return kHeaderBytes + (2 + int64_t{parity}) * half_bytes(); }
  PCPKV_HD int64_t bytes() const { return kHeaderBytes + 4 * half_bytes(); }
  /// Byte offset of signal slot [block][barrier][parity][src_rank].
  PCPKV_HD static int64_t signal_offset(int block, int barrier, uint32_t parity, int src_rank) {
    return ((((int64_t{block} * 2 + barrier) * 2 + parity) * kAllReduceMaxRanks) + src_rank) * 4;
  }
};
static_assert(AllReduceLayout::kErrorOffset + 4 <= AllReduceLayout::kHeaderBytes, "header overflows");

/// Work split shared by the CPU and GPU implementations. Items are 16-byte vectors (plain) or rows
/// (fused); the item range is cut into `num_segments` segments (1 for one-shot, W for two-shot:
/// segment q = [q*S, min((q+1)*S, num_items)), S = ceil(num_items / W)), each segment into chunks of
/// items_per_chunk items, and chunk c of a segment belongs to block c % num_blocks.
struct AllReducePartition {
  int64_t num_items = 0;
  int64_t items_per_chunk = 1;
  int32_t num_segments = 1;
  int32_t num_blocks = 1;
  PCPKV_HD int64_t segment_size() const { return (num_items + num_segments - 1) / num_segments; }
  PCPKV_HD int64_t segment_begin(int32_t q) const {
    const int64_t b = q * segment_size();
    return b < num_items ? b : num_items;
  }
  PCPKV_HD int64_t segment_end(int32_t q) const { return segment_begin(q + 1); }
  /// Chunks of segment q, and the item range of its chunk c.
  PCPKV_HD int64_t num_chunks(int32_t q) const {
    return (segment_end(q) - segment_begin(q) + items_per_chunk - 1) / items_per_chunk;
  }
};

/// Blocks per rank for a call: enough chunks per block to amortize its barriers, at most max_blocks.
int32_t allreduce_num_blocks(const AllReducePartition& p, int32_t max_blocks);

// ---- CPU: the oracle and the protocol -------------------------------------------------------------

/// The oracle of the plain all-reduce: inputs[W] host pointers to [n] bf16; out [n] bf16.
void allreduce_reference(const std::vector<const uint16_t*>& inputs, int64_t n, uint16_t* out);

/// Fused residual-add + RMSNorm parameters (the rows of a call are [num_tokens, hidden]).
struct AllReduceNorm {
  int64_t hidden = 0;                 // multiple of 8, <= kAllReduceMaxHidden
  const float* weight = nullptr;      // [hidden] fp32 (bf16 checkpoint values convert exactly)
  float eps = 1e-6f;
};
/// The oracle of the fused variant: inputs[W] -> [num_tokens, hidden]; residual_in, residual_out, y:
/// [num_tokens, hidden] bf16 (residual_out may alias residual_in).
void allreduce_rmsnorm_reference(const std::vector<const uint16_t*>& inputs, int64_t num_tokens,
                                 const AllReduceNorm& norm, const uint16_t* residual_in, uint16_t* residual_out,
                                 uint16_t* y);

/// One rank's call of the protocol on the CPU (ranks are threads of one process, or processes over
/// POSIX shared memory: pcpkv/ranks/symmetric.h). Same barriers, epochs, parities and work split as the GPU.
struct HostAllReduceArgs {
  int32_t world_size = 1;
  int32_t rank = 0;
  uint8_t* workspaces[kAllReduceMaxRanks] = {};  // every rank's workspace, this process's addresses
  AllReduceLayout layout;
  AllReduceAlgo algo = AllReduceAlgo::kAuto;
  int32_t num_blocks = 0;         // 0: allreduce_num_blocks(.., 4); must be equal on every rank
  int64_t num_elems = 0;          // plain: [n] bf16; fused: num_tokens * hidden
  const uint16_t* in = nullptr;
  uint16_t* out = nullptr;        // plain: the reduced values; fused: y
  bool fused = false;
  AllReduceNorm norm;
  const uint16_t* residual_in = nullptr;
  uint16_t* residual_out = nullptr;
  int64_t timeout_ms = 10000;     // bound of each wait; then pcpkv::FenceTimeout naming the missing rank
};
/// Validates (before any write), runs, and throws pcpkv::FenceTimeout when a peer never arrives.
void host_allreduce(const HostAllReduceArgs& args);

/// Throws pcpkv::Error naming the field: world size, rank, n % 8, n > max_elems, hidden, null pointers.
void validate_allreduce(int32_t world_size, int32_t rank, const AllReduceLayout& layout, int64_t num_elems,
                        bool fused, const AllReduceNorm& norm);

// ---- capability agreement -------------------------------------------------------------------------

/// A collective AND over every rank of the group (e.g. a Bootstrap all-gather). Must be called by all.
using AllRanksAnd = std::function<bool(bool local_ok)>;
/// The AND over a Bootstrap group (all_gather of one byte per rank).
AllRanksAnd all_ranks_and(Bootstrap& group);
/// The symmetric-memory path is used only when every rank can use it: returns all_ranks(local_ok).
/// Every rank gets the same answer, so all take the same path (never a mix that would deadlock).
bool agree_capability(bool local_ok, const AllRanksAnd& all_ranks);

}  // namespace pcpkv

// ---- CUDA ----------------------------------------------------------------------------------------
namespace pcpkv::cuda {

struct AllReduceOptions {
  AllReduceAlgo algo = AllReduceAlgo::kAuto;
  int32_t num_blocks = 0;      // per rank; 0 = allreduce_num_blocks(...)
  bool pdl = false;            // programmatic stream serialization (pcpkv/core/pdl.h)
  int64_t timeout_ns = 10'000'000'000;  // bound of each wait (processes sharing one GPU time-slice: be generous)
};

/// W logical ranks on one GPU in one process (tests, benchmarks): owns W workspaces (cudaMalloc, header
/// zeroed) and runs every rank in ONE launch (grid.y = rank), so that all blocks are co-resident.
class LogicalAllReduce {
 public:
  /// Throws pcpkv::Error for world_size outside [1, 8], max_elems < 8, or no device.
  LogicalAllReduce(int32_t world_size, int64_t max_elems);
  ~LogicalAllReduce();
  LogicalAllReduce(const LogicalAllReduce&) = delete;
  LogicalAllReduce& operator=(const LogicalAllReduce&) = delete;

  int32_t world_size() const;
  const AllReduceLayout& layout() const;
  /// Device address of rank r's workspace.
  uint8_t* workspace(int32_t r) const;
  /// Largest blocks per rank that keep all W x blocks co-resident on this device.
  int32_t max_blocks() const;

  /// in[r], out[r]: rank r's [n] bf16 device buffers. Asynchronous; graph-capturable.
  void run(const uint16_t* const* in, uint16_t* const* out, int64_t n, CUstream_st* stream,
           const AllReduceOptions& options = {});
  /// Fused: in[r] [num_tokens, hidden]; residual_in[r] -> residual_out[r] (may alias), y[r].
  void run_fused(const uint16_t* const* in, const uint16_t* const* residual_in, uint16_t* const* residual_out,
                 uint16_t* const* y, int64_t num_tokens, const AllReduceNorm& norm, CUstream_st* stream,
                 const AllReduceOptions& options = {});
  /// Synchronizes the device, reads every rank's error word; throws pcpkv::FenceTimeout naming the first
  /// rank's missing peer.
  void check();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One process of a group (one rank per process; several processes may share a GPU).
class AllReduce {
 public:
  /// workspaces[r]: this process's device address of rank r's workspace (symmetric memory: CUDA VMM/IPC
  /// mappings), each layout.bytes() long. Collective: every rank constructs with the same world size and
  /// max_elems. Checks locally that every workspace is mapped and reachable (same device or P2P), zeroes
  /// its own header, then agrees with all ranks through `all_ranks`; if any rank cannot, every rank uses
  /// `nccl` (ncclAllReduce, bf16 sum: NCCL's own rounding order, not byte-identical) and throws when none
  /// was given (or NCCL was not built). Throws pcpkv::Error naming the reason.
  AllReduce(int32_t rank, const std::vector<uint8_t*>& workspaces, int64_t max_elems, const AllRanksAnd& all_ranks,
            ncclComm* nccl = nullptr);
  /// The same over pcpkv's device symmetric memory (pcpkv/publish/cuda_multiproc.h: make_device_symmetric(group,
  /// AllReduceLayout{max_elems}.bytes(), ...)) and its group's bootstrap for the agreement. Throws when the
  /// buffers are host memory or smaller than the layout.
  AllReduce(const SymmetricMemory& workspaces, Bootstrap& group, int64_t max_elems, ncclComm* nccl = nullptr);
  ~AllReduce();
  AllReduce(const AllReduce&) = delete;
  AllReduce& operator=(const AllReduce&) = delete;

  bool uses_symmetric_memory() const;
  /// Why the symmetric path was not taken (empty when it was).
  const std::string& fallback_reason() const;
  const AllReduceLayout& layout() const;

  void run(const uint16_t* in, uint16_t* out, int64_t n, CUstream_st* stream, const AllReduceOptions& options = {});
  void run_fused(const uint16_t* in, const uint16_t* residual_in, uint16_t* residual_out, uint16_t* y,
                 int64_t num_tokens, const AllReduceNorm& norm, CUstream_st* stream,
                 const AllReduceOptions& options = {});
  void check();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Local capability of this process: every workspace non-null, world <= 8, and each peer's memory on this
/// device or on a device this one can access (cudaDeviceCanAccessPeer). *why says what failed.
bool allreduce_local_capability(const std::vector<uint8_t*>& workspaces, std::string* why);

}  // namespace pcpkv::cuda
