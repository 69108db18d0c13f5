// pcpkv/publish/kernels.h: host launchers of the publication kernels (defined in pcpkv_cuda; the backend, the
// rank publishers, the bench, the tests and python/csrc call them). Every launcher validates its parameters
// on the host with the same checks as the CPU reference (pcpkv/publish/validate.h) and throws pcpkv::Error before
// enqueuing anything; the kernels themselves trust their inputs. All launches are asynchronous on `stream`
// and capturable into graphs.
// Host header: no CUDA headers. Pointers in the parameter structs are device pointers; streams are
// cudaStream_t (= CUstream_st*), forward-declared here like pcpkv/serving/router.h does, so a caller passes
// its cudaStream_t unchanged. Launchers live in pcpkv::cuda, like every product's (the host API is pcpkv::).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/publish/dispatch.h"

struct CUstream_st;

namespace pcpkv::cuda {

// ---- dispatch (SPEC section 2) ------------------------------------------------------------------------
/// One rank's dispatch: the public contract (device pointers; params.targets and params.row_dests point
/// to device tables) plus host copies of those two tables, used to validate and to pick store widths.
struct DispatchJob {
  DispatchParams params;
  std::vector<CacheTarget> host_targets;   // [params.num_targets], equal to the device table
  std::vector<uint8_t*> host_row_dests;    // [params.num_row_dests], equal to the device table
};

enum class DispatchVariant : uint8_t {
  kAuto,      // the default (currently kWarp; PCPKV_DISPATCH_VARIANT=simple|prefetch|warp|warp_pf|warp_token|warp_split
              // overrides, any other non-empty value is refused)
  kSimple,    // persistent CTAs of 4 warps, one token per CTA iteration, loads at the top of each iteration
  kPrefetch,  // same, but the next token's inputs are loaded before the current token is processed
  kWarp,      // persistent warps, no CTA barrier (dispatch_warp.cu): kWarpSplit at few tokens per warp
              // (dispatch.cu's kSplitMaxTokensPerWarp; 0 for now, docs/perf.md 38), else kWarpToken; layouts that
              // are not 16-byte aligned and q_lora_rank > 2048 run the simple kernel instead
  kWarpPrefetch,  // kWarpToken + a bulk L2 prefetch of each warp's next token ("warp_pf")
  kWarpToken,     // one token per warp at every size ("warp_token": kWarp before issue 34)
  kWarpSplit,     // each token's KV part and Q part as two items of the warps at every size ("warp_split")
};
/// Names of the variants; unlike the launchers these two are defined in pcpkv_core
/// (src/publish/contract/dispatch_variant.cpp), so CPU builds have them too.
const char* to_string(DispatchVariant v);
/// "auto" | "simple" | "prefetch" | "warp" | "warp_pf" | "warp_token" | "warp_split"; throws pcpkv::Error otherwise.
DispatchVariant parse_dispatch_variant(const std::string& s);

/// Enqueues the fused dispatch of every job (one kernel launch for up to 8 jobs that share weights, rope
/// table and format; more launches otherwise). Throws pcpkv::Error on a bad parameter, or (variant kAuto) on a
/// PCPKV_DISPATCH_VARIANT that names no variant; nothing is enqueued then.
/// pdl: launch with programmatic stream serialization (pcpkv/core/pdl.h); the kernel waits for the previous
/// kernel before it reads or writes anything but the device tables of targets / row destinations, which
/// must not be written by the preceding kernel.
void launch_dispatch(const DispatchJob* jobs, int num_jobs, CUstream_st* stream,
                     DispatchVariant variant = DispatchVariant::kAuto, bool pdl = false);

/// Registers, shared memory and spills of the dispatch kernel instances (from cudaFuncGetAttributes), one
/// line each, for the bench report.
std::vector<std::string> dispatch_kernel_resources();

// ---- combine (staging -> local caches) -----------------------------------------------------------------
/// What rows_per_warp = 0 means. Change it only after `pcpkv bench --layer-variants ...` measured it.
constexpr int kDefaultCombineRowsPerWarp = 1;
/// Enqueues the combine of every job (one launch for up to 8). Throws pcpkv::Error on a bad parameter, or when a
/// job's caches overlap its inputs or another job's caches or inputs (validate_combine_jobs of
/// pcpkv/publish/validate.h).
/// rows_per_warp: 1 (one warp per row, the slot read before the row), 2 or 4 (a warp reads the slots and
/// rows of that many rows at once, then stores), 0 = kDefaultCombineRowsPerWarp. pdl: see launch_dispatch.
void launch_combine(const CombineParams* jobs, int num_jobs, CUstream_st* stream, int rows_per_warp = 0,
                    bool pdl = false);

// ---- collect: quantize-and-insert --------------------------------------------------------------------------
/// Both throw pcpkv::Error on a bad parameter, or when a job's caches overlap its inputs or another job's caches or
/// inputs (validate_insert_jobs of pcpkv/publish/validate.h); nothing is enqueued then.
/// MLA cache rows of every job (kv_c, k_pe); the indexer part is ignored here.
void launch_insert_mla(const InsertParams* jobs, int num_jobs, CUstream_st* stream);
/// Indexer-K slots of every job (jobs whose fmt.has_indexer is false are skipped).
void launch_insert_indexer(const InsertParams* jobs, int num_jobs, CUstream_st* stream);

// ---- collect: all-gather between logical ranks of one GPU -------------------------------------------------
/// dst[p][r * bytes_per_rank + i] = src[r][i] for every destination p and source r, i.e. the all-gather of
/// one tensor (one launch per 8 x 8 block of ranks). Device pointers, 16-byte aligned; bytes_per_rank % 16 == 0.
void launch_all_gather(const std::vector<const void*>& src, const std::vector<void*>& dst, int64_t bytes_per_rank,
                       CUstream_st* stream);

// ---- top-k buffer fill ------------------------------------------------------------------------------------
/// Fills count int32 with -1 (a 0xFF byte fill at copy-engine speed).
void launch_fill_minus_one(int32_t* p, int64_t count, CUstream_st* stream);

// ---- the run-time replica check (docs/spec.md section 5.2; oracles: pcpkv/publish/replica_hash.h) -----------
/// hashes[i] = the replica hash of slot slots[i] of `target` (its MLA row and, when fmt.has_indexer, its indexer data
/// and scale), i < num_slots: slot_hashes_reference on the GPU, equal bit for bit. Device pointers: target's bases,
/// slots [num_slots] int64 (each in [0, target.mla.num_slots()): the launcher cannot read them, so pass slots the
/// host checked, e.g. written_slots of a validated plan), hashes [num_slots] uint64. Reads only the hashed bytes.
/// Throws pcpkv::Error on a bad format or target (validate_cache_target) or null pointers (nothing enqueued).
void launch_slot_hashes(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, int64_t num_slots,
                        uint64_t* hashes, CUstream_st* stream);
/// The indexer cache at its own slots (docs/spec.md 4.2, 5.2): hashes[i] = entry i's hash, its MLA row at slots[i]
/// and its indexer data and scale at index_slots[i] of target.index (either -1: that part absent), with the weights
/// of launch_slot_hashes (so index_slots == slots gives its hashes): the 6-pointer slot_hashes_reference on the GPU,
/// equal bit for bit. Device pointers; index_slots [num_slots] int64, each -1 or in [0, target.index.num_slots())
/// and slots each -1 or in [0, target.mla.num_slots()) (host-checked: validate_hash_slots with allow_skip). Reads
/// no padding of a padded indexer block stride. Throws pcpkv::Error as launch_slot_hashes, or on a null index_slots.
void launch_slot_hashes_own_index(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                                  const int64_t* index_slots, int64_t num_slots, uint64_t* hashes,
                                  CUstream_st* stream);

/// One rank's hashes against rank 0's (launch_compare_replica_hashes): entries that differ, and the index of the
/// first (UINT64_MAX: none). compare_replica_hashes_reference's ReplicaHashDiff, in device-atomic types.
struct DeviceHashDiff {
  unsigned long long num_diff;
  unsigned long long first;
};
/// diffs[q] for q < world: how hashes[q * num_slots + i] differs from hashes[i] over i < num_slots (diffs[0] stays
/// empty). Device pointers: hashes [world][num_slots] uint64, diffs [world]; the launcher initializes diffs.
/// Throws pcpkv::Error when world < 1, num_slots < 0 or a pointer is null.
void launch_compare_replica_hashes(const uint64_t* hashes, int32_t world, int64_t num_slots, DeviceHashDiff* diffs,
                                   CUstream_st* stream);

// ---- fence (SPEC section 5) -----------------------------------------------------------------------------
/// Launches the fence kernel with num_blocks blocks (block b acts as rank args.first_rank + b). pdl: launch
/// with programmatic stream serialization; the kernel waits for the previous kernel before it signals.
void launch_fence(const FenceArgs& args, int num_blocks, CUstream_st* stream, bool pdl = false);

/// Throws pcpkv::FenceTimeout when *error (host view of the host-mapped FenceError) reports a timeout.
/// Call after synchronizing the stream that ran the fence.
void throw_if_fence_timeout(const FenceError& error, double timeout_ms);

}  // namespace pcpkv::cuda
