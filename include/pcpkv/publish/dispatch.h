// pcpkv/publish/dispatch.h: the kernel contracts of the publication pipeline (SPEC sections 2, 3, 5).
//
// One parameter struct per job, shared by the CPU reference (src/publish/cpu) and the CUDA kernels (src/publish/cuda):
//   DispatchParams  fused per-token math, materialize and/or write cache rows / transport rows
//   CombineParams   staging rows (rank-major) -> local paged caches
//   InsertParams    collect path: gathered bf16 kv_c / k_pe / index_k -> local paged caches
// Pointers address the backend's memory (host for the CPU backend, device for CUDA). bf16 tensors are
// uint16_t bit patterns. Strides are in elements unless the name ends in _bytes. No CUDA types here.
#pragma once

#include <cstdint>
#include <string>

#include "pcpkv/core/layout.h"

namespace pcpkv {

enum class RopeStyle : uint8_t { kInterleaved, kNeox };

/// One cache replica's destination: base pointers and geometry (format comes from CacheFormat).
struct CacheTarget {
  uint8_t* mla_base = nullptr;          // first byte of block 0 of the MLA cache
  MlaCacheGeometry mla;
  uint8_t* index_base = nullptr;        // first byte of block 0 of the indexer-K cache (indexer layers)
  IndexerCacheGeometry index;
};

/// Which entries of the top-k buffer [T, topk_width] the dispatch sets to -1 (docs/spec.md section 2.1).
/// pcpkv's indexer top-k (pcpkv/consumers/indexer.h) writes every entry of every row it processes, its -1 tail and
/// padding tokens (request_idx -1) included; so after the dispatch and that indexer over rows
/// [0, topk_indexer_rows) of the same buffer (indexer topk == topk_width), kTail gives the same bytes as kFull.
enum class TopkFill : uint8_t {
  kFull = 0,  // every row (what engines do; the default)
  kTail = 1,  // only the rows the indexer never visits: t >= topk_indexer_rows (the padding past the step's tokens)
  kNone = 2,  // nothing (the caller's indexer writes every row)
};
const char* to_string(TopkFill f);  // "full" | "tail" | "none"
/// "full" | "tail" | "none" -> TopkFill; throws pcpkv::Error naming `what` (e.g. "--topk-fill") and the value.
TopkFill parse_topk_fill(const std::string& s, const std::string& what);
/// First row the dispatch fills: rows [topk_fill_first_row, T) get -1 in all topk_width entries, rows before it
/// are not touched (kFull: 0, kTail: indexer_rows, kNone: T). The one rule every dispatch path follows.
inline int64_t topk_fill_first_row(TopkFill mode, int64_t indexer_rows, int64_t num_tokens) {
  return mode == TopkFill::kFull ? 0 : mode == TopkFill::kTail ? indexer_rows : num_tokens;
}

/// Fused dispatch over num_tokens local tokens (SPEC section 2). Modes combine freely:
///  * materialize: each non-null *_out pointer receives that tensor (bf16);
///  * cache write: num_targets > 0 -> every token with slot_mapping[t] >= 0 writes its MLA row (and
///    indexer slot) into each of targets[0..num_targets) ("direct" when num_targets = PCP world); with an
///    indexer_slot_mapping, its indexer row goes to slot indexer_slot_mapping[t] (>= 0) of the indexer cache instead,
///    and each mapping's -1 skips its own cache only (docs/spec.md section 4.2);
///  * transport rows: num_row_dests > 0 -> token t's packed row (TransportRowLayout) is stored at
///    row_dests[d] + t * row_bytes for every d (the "staging" publish into every peer's slot), for every
///    t < num_tokens, padding included (a padded row's bytes are unspecified; its slot is -1).
/// A layer without an indexer passes index_k = nullptr and fmt.has_indexer = false.
struct DispatchParams {
  int64_t num_tokens = 0;                 // T
  int64_t q_lora_rank = 0;                // multiple of 8, <= 4096
  // ---- inputs ----
  const uint16_t* q_c = nullptr;          // [T, q_lora_rank] bf16, row stride q_c_stride; null: no Q norm
  int64_t q_c_stride = 0;
  const uint16_t* kv = nullptr;           // [T, 512] bf16, row stride kv_stride
  int64_t kv_stride = 512;
  const uint16_t* k_pe = nullptr;         // [T, 64] bf16, row stride k_pe_stride
  int64_t k_pe_stride = 64;
  const uint16_t* index_k = nullptr;      // [T, 128] bf16, row stride index_k_stride; null: no indexer
  int64_t index_k_stride = 128;
  const int64_t* positions = nullptr;     // [T] rope positions, each in [0, rope_num_positions)
  const float* q_norm_w = nullptr;        // [q_lora_rank]
  const float* kv_norm_w = nullptr;       // [512]
  const float* index_ln_w = nullptr;      // [128]
  const float* index_ln_b = nullptr;      // [128]
  const float* rope_cos_sin = nullptr;    // [rope_num_positions, 64]: cos 32 | sin 32
  int64_t rope_num_positions = 0;
  float q_eps = 1e-6f;
  float kv_eps = 1e-6f;
  float index_eps = 1e-6f;
  RopeStyle mla_rope = RopeStyle::kInterleaved;
  RopeStyle index_rope = RopeStyle::kNeox;
  bool index_hadamard = false;
  CacheFormat fmt;
  // ---- materialized outputs (null: not produced) ----
  uint16_t* q_c_out = nullptr;            // [T, q_lora_rank] bf16, contiguous
  uint16_t* kv_c_out = nullptr;           // [T, 512] bf16 normalized kv_c
  uint16_t* k_pe_out = nullptr;           // [T, 64] bf16 roped k_pe
  uint16_t* index_k_out = nullptr;        // [T, 128] bf16 normalized + roped indexer K
  int32_t* topk_fill = nullptr;           // [T, topk_width] int32: rows topk_fill_first_row(..).. T-1 := -1
  int64_t topk_width = 0;                 //   (indexer layers); >= 1 when topk_fill is set
  TopkFill topk_fill_mode = TopkFill::kFull;  // which rows (TopkFill); full unless the indexer writes the rest
  int64_t topk_indexer_rows = 0;          // kTail: rows [0, n) the indexer top-k writes (its num_tokens: the
                                          //   step's real tokens); in [0, T]. 0 = fill every row (= kFull)
  // ---- cache writes ----
  const int64_t* slot_mapping = nullptr;  // [T], -1 = no cache row
  const int64_t* indexer_slot_mapping = nullptr;  // [T] indexer-cache slots (indexer layers), -1 = no indexer row;
                                                //   null: slot_mapping addresses both caches (the default)
  const CacheTarget* targets = nullptr;   // [num_targets] (a device table on the GPU)
  int32_t num_targets = 0;
  // ---- transport rows ----
  uint8_t* const* row_dests = nullptr;    // [num_row_dests] (a device table on the GPU)
  int32_t num_row_dests = 0;
  int64_t row_bytes = 0;                  // transport_row_layout(fmt).row_bytes
};

/// Staging rows -> local caches. rows: [num_src_ranks][max_local_tokens][row_bytes] (one ubatch of one
/// double-buffer half); slot_mapping: the gathered mapping [num_src_ranks * max_local_tokens];
/// indexer_slot_mapping: the gathered indexer mapping (same shape), null: slot_mapping addresses both caches.
struct CombineParams {
  const uint8_t* rows = nullptr;
  int32_t num_src_ranks = 0;
  int64_t max_local_tokens = 0;
  int64_t row_bytes = 0;
  const int64_t* slot_mapping = nullptr;
  const int64_t* indexer_slot_mapping = nullptr;
  CacheFormat fmt;
  CacheTarget target;
};

/// Collect path: quantize-and-insert gathered bf16 rows. All inputs [num_tokens, ...] bf16, contiguous.
struct InsertParams {
  int64_t num_tokens = 0;
  const uint16_t* kv_c = nullptr;         // [num_tokens, 512]
  const uint16_t* k_pe = nullptr;         // [num_tokens, 64]
  const uint16_t* index_k = nullptr;      // [num_tokens, 128]; null when !fmt.has_indexer
  const int64_t* slot_mapping = nullptr;  // [num_tokens]
  const int64_t* indexer_slot_mapping = nullptr;  // [num_tokens] indexer slots; null: slot_mapping (the default)
  CacheFormat fmt;
  CacheTarget target;
};

}  // namespace pcpkv
