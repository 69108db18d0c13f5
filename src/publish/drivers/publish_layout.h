// src/publish/drivers/publish_layout.h: what a per-process publication driver (CPU or CUDA) lays out and checks,
// shared so that both lay out caches exactly as the single-process backends do (byte-comparable replicas).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/dispatch.h"

namespace pcpkv {

/// Byte layout of one process's symmetric buffers for a PublishSetup.
///  caches:  [mla allocation][pad to 256][indexer allocation], each allocation
///           [guard][base_offset][cache][guard] like PublishResult's, filled with kGuardByte per run;
///  staging: StagingGeometry (rows from every rank of the group);
///  collect: this rank's materialized bf16 rows [kv_c M*512 | k_pe M*64 | index_k M*128] (uint16).
struct PublishLayout {
  MlaCacheGeometry mla;
  IndexerCacheGeometry index;
  int64_t head = 0;                 // guard_bytes + base_offset: offset of block 0 in each allocation
  int64_t mla_alloc_bytes = 0;
  int64_t index_alloc_bytes = 0;
  int64_t index_region_offset = 0;  // of the indexer allocation within the caches buffer
  int64_t caches_bytes = 0;
  StagingGeometry staging;
  TransportRowLayout row;
  int64_t collect_kv_offset = 0, collect_kpe_offset = 0, collect_index_offset = 0, collect_bytes = 0;
  bool fill_topk = false;
  int64_t max_position = 0;         // largest global position (rope table rows = max_position + 1)
};

/// Throws pcpkv::Error naming the field (the same checks as the single-process backends).
void validate_publish_setup(const PublishSetup& s);
void validate_publish_inputs(const PublishSetup& s, const GlobalInputs& in, Transport transport);
PublishLayout make_publish_layout(const PublishSetup& s);

/// Per-rank input pointers (backend memory) for base_dispatch_params.
struct DispatchInputs {
  const uint16_t* q_c = nullptr;
  const uint16_t* kv = nullptr;
  const uint16_t* k_pe = nullptr;
  const uint16_t* index_k = nullptr;
  const int64_t* positions = nullptr;
  const float* q_norm_w = nullptr;
  const float* kv_norm_w = nullptr;
  const float* index_ln_w = nullptr;
  const float* index_ln_b = nullptr;
  const float* rope_cos_sin = nullptr;
  int64_t rope_num_positions = 0;
  uint16_t* q_c_out = nullptr;
  int32_t* topk = nullptr;
  int64_t topk_indexer_rows = 0;  // the rank's num_local_tokens (setup.topk_fill_mode = kTail)
};
/// DispatchParams for M = max_local_tokens rows with the model's eps and rope styles, no transport set.
DispatchParams base_dispatch_params(const PublishSetup& s, const PublishLayout& l, const DispatchInputs& in);

/// First row of rank r's top-k buffer that the publication fills (rows [first, max_local_tokens) get -1):
/// topk_fill_first_row of setup.topk_fill_mode with the rank's num_local_tokens as the indexer's rows.
int64_t topk_first_row(const PublishSetup& s, int32_t rank);

/// "rank 2 (global rank 6, pid 4711)" for messages.
std::string describe_rank(int32_t pcp_rank, const std::vector<int32_t>& global_ranks, const std::vector<int64_t>& pids);

}  // namespace pcpkv
