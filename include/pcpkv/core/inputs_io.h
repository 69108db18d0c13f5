// pcpkv/core/inputs_io.h: the safetensors files `pcpkv run` reads (--inputs) and writes (--save, written by
// save_run in pcpkv/publish/save_run.h).
//
// Tensor names (every file; load_inputs in inputs.h reads them):
//   q_c        BF16 [N, q_lora_rank]   q_a_proj output, global token order
//   kv         BF16 [N, 512]           kv_a_proj_with_mqa output, first 512
//   k_pe       BF16 [N, 64]            kv_a_proj_with_mqa output, last 64
//   index_k    BF16 [N, 128]           indexer wk output (indexer layers)
//   positions  I64  [N]                must equal the plan's global positions
//   q_norm_w   BF16|F32 [q_lora_rank]; kv_norm_w BF16|F32 [512]; index_ln_w, index_ln_b BF16|F32 [128]
// Optional, describing the batch (read by read_inputs_batch; written by save_run):
//   requests      I64 [R, 3]   per request: kind (0 prefill, 1 decode), num_new_tokens, context_len
//   slot_mapping  I64 [N]      global slot of each new token (in [0, num_slots), not in the null block)
//   block_tables  I32 [R, max_blocks_per_request], -1 padded; slot = table[pos / B] * B + pos % B, so
//                              the two must agree when both are present
// Written by save_run only (outputs, for other tools to check):
//   gathered_slot_mapping  I64 [pcp_world, max_local_tokens]
//   mla_cache              U8  [num_blocks, block_size, row_stride] (row_stride = the row's bytes when
//                              dense; [num_blocks, block_stride] when blocks are padded)
//   index_cache            U8  [num_blocks, block_stride] (vLLM's [num_blocks, block_size * 132] when dense)
// plus __metadata__ with the geometry (block_size, strides, kv_format, ds_mla_scale, k_scale, ...).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"

namespace pcpkv {

/// What an inputs file says about its batch, read before the plan is built.
struct InputsBatch {
  int64_t num_tokens = 0;  // rows of 'kv' (N)
  bool has_index_k = false;
  std::vector<RequestSpec> requests;  // empty when the file has no 'requests' tensor
  std::vector<int64_t> slot_mapping;  // empty when the file has no 'slot_mapping' tensor; else [N]
  std::vector<std::vector<int32_t>> block_tables;  // empty when the file has no 'block_tables' tensor; else
                                                   // its rows as stored ([R][max_blocks], -1 padded)
  int64_t saved_block_size = 0;  // the `block_size` of the file's metadata (a `pcpkv run --save` file), else 0
  std::string saved_kv_format;   // the `kv_format` of the file's metadata, else ""
  std::string saved_ds_mla_scale;  // its `ds_mla_scale`, `k_scale` and `has_indexer` ("true"/"false"), else ""
  std::string saved_k_scale;
  std::string saved_has_indexer;
  /// One line per tensor pcpkv does not read (unknown names, with the known name it is closest to:
  /// "tensor 'slot_maping' is not read (not a tensor pcpkv knows; did you mean 'slot_mapping'?)").
  std::vector<std::string> notes;
};

/// Every tensor name an inputs file may hold (read_inputs_batch, load_inputs), and those a saved file adds.
const std::vector<std::string>& inputs_tensor_names();

/// Reads the header and the optional 'requests' / 'slot_mapping' / 'block_tables' tensors of an inputs file. Throws
/// pcpkv::Error on a malformed file or a bad requests row ("requests[1]: kind = 7, expected 0 or 1").
InputsBatch read_inputs_batch(const std::string& path);

/// Replaces the plan's slots with `slots` ([num_global_tokens], global order, each >= 0), as an
/// engine's captured slot mapping: checks every entry first (in range [0, num_slots), not in the null
/// block, no duplicates; pcpkv::Error "slot_mapping[17] = 9000 is out of range [0, 8192)"), and that the
/// mapping is paged (SPEC 4: slot = block_id * block_size + position % block_size, one cache block per
/// logical block of a request; pcpkv::Error naming the token otherwise). Then rewrites global_slots, each
/// rank's slot_mapping (decode copies on ranks > 0 stay -1), the gathered mapping, and the block tables so
/// that they produce these slots (blocks holding only context keep the plan's id when no new token
/// claimed it, else take the lowest free one). The plan is unchanged when it throws.
void apply_slot_mapping(PcpPlan& plan, const std::vector<int64_t>& slots, const std::string& origin);

/// Replaces the plan's block tables with `tables` ([num_requests][>= blocks the request needs], entries
/// past a request's need -1, as save_run writes them) and derives every slot from them
/// (table[position / block_size] * block_size + position % block_size). Checks first: row count, row
/// length, ids in [first usable block, num_blocks), no id twice; pcpkv::Error
/// "block_tables[1][3] = 0 is out of range [1, 40)". The plan is unchanged when it throws.
void apply_block_tables(PcpPlan& plan, const std::vector<std::vector<int32_t>>& tables, const std::string& origin);

}  // namespace pcpkv
