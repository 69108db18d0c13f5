// src/publish/drivers/transport_table.h: the three transports of SPEC section 5 written once, as tables of steps shared
// by every publication driver (CPU backend, CUDA backend, the CPU and CUDA per-process publishers).
//
// A transport is an ordered list of Steps (like NCCL's table of transports, each a struct of operations): the
// operation, the stage name every driver reports, and the step's byte model (docs/perf.md section 1). A driver
// walks steps() and runs each Op with its own small function; it never switches on the transport, and it
// names and counts its stages from the table, so stage names and bytes are identical across backends.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "publish/drivers/publish_layout.h"

namespace pcpkv {

/// What a step does. The three dispatches differ in where the rows go (DispatchParams destinations).
enum class Op : uint8_t {
  kTopkFill,             // the top-k buffer [M, topk_width] filled with -1 (when not fused into the dispatch)
  kDispatchMaterialize,  // collect: bf16 kv_c / k_pe / index_k rows into this rank's collect buffers
  kDispatchStage,        // staging: transport rows into every peer's staging slot of this rank
  kDispatchDirect,       // direct: cache rows into every replica (rows with slot >= 0)
  kGather,               // collect: the all-gathers of the bf16 rows (after peers' rows are final)
  kInsert,               // collect: quantize-and-insert the gathered rows (MLA, then indexer on indexer layers)
  kFence,                // staging / direct: the publication fence
  kCombine,              // staging: this rank's staging rows into its replica
};

/// The counts a byte model needs, fixed per publication (every driver builds it with make_byte_model).
struct ByteModel {
  int64_t world = 1;             // W
  int64_t rows = 0;              // M = max_local_tokens, rows each rank processes (padding included)
  int64_t read_per_row = 0;      // dispatch reads: q_c (when materialized) + kv + k_pe + index_k + position
  int64_t q_out_bytes = 0;       // dispatch writes of q_c_out per row
  int64_t topk_row_bytes = 0;    // 4 * topk_width (0 without a top-k buffer)
  std::vector<int64_t> topk_rows;  // [W] top-k rows each rank fills
  bool topk_in_dispatch = true;  // the fill is fused into the dispatch (no kTopkFill step)
  int64_t bf16_row_bytes = 0;    // collect row: kv_c 1024 + k_pe 128 (+ index_k 256)
  int64_t mla_bytes = 0;         // MLA cache row
  int64_t index_slot_bytes = 0;  // indexer slot (0 on shared layers)
  int64_t transport_row_bytes = 0;
  int64_t written_all = 0;            // rows with slot >= 0 over all ranks
  std::vector<int64_t> written;       // [W] rows with slot >= 0 per rank
};

/// bytes(model, rank): what `rank` reads + writes in the step; a single-process driver reports the sum over ranks.
using StepBytes = int64_t (*)(const ByteModel& m, int32_t rank);

struct Step {
  Op op;
  const char* name;  // the stage name every driver reports
  StepBytes bytes;
};

/// Every step a transport can run, in order (kTopkFill first; it runs only when the fill is its own step).
std::span<const Step> transport_table(Transport t);

/// The steps one publication runs: the table without kTopkFill when the layout has no top-k buffer or the
/// driver fuses the fill into the dispatch.
std::vector<Step> steps(Transport t, const PublishLayout& l, bool fuse_topk);

/// Whether one of `steps` runs `op` (what a driver allocates for).
bool uses(const std::vector<Step>& steps, Op op);

/// The byte model of setup / layout; fuse_topk as given to steps().
ByteModel make_byte_model(const PublishSetup& s, const PublishLayout& l, bool fuse_topk);

/// Bytes of a step over all ranks (single-process drivers).
int64_t step_bytes_all_ranks(const Step& step, const ByteModel& m);

/// Stage names of steps(t, l, fuse_topk), in order.
std::vector<std::string> stage_names(Transport t, const PublishLayout& l, bool fuse_topk);

}  // namespace pcpkv
