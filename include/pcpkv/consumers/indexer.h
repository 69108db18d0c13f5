// pcpkv/consumers/indexer.h: the DSA lightning indexer over the replicated indexer-K cache (SPEC section 6):
// per query token the score of every earlier key of its request, and the top-k of them as cache slots.
//
//   logits[n, h] = q_fp8[h] . k_fp8[n]                       (E4M3 values: exact sum rounded once to
//                                                              fp32 by default; IndexerLogit)
//   w[h]         = weights[h] * (H * 128)^-0.5 * q_scale[h]
//   score[n]     = k_scale[n] * sum_h relu(logits[n, h]) * w[h]   (a NaN score is stored as 0x7fffffff)
// Keys of query token t are the positions 0..positions[t] (inclusive, causal) of its request; key
// position j lives in slot block_tables[req][j / block_size] * block_size + j % block_size.
// top-k: k = min(topk, positions[t] + 1) keys, ordered by score descending, equal scores by position
// ascending (NaN scores rank below -inf); the row is padded with -1 to `topk` entries.
// The exact rounding order is in pcpkv/device/consumers.h; the CPU reference and the CUDA kernel follow
// it, so their scores are bit-identical and their top-k identical.
#pragma once

#include <cstdint>
#include <vector>

#include "pcpkv/core/layout.h"

namespace pcpkv {

/// How a head's logit q_fp8[h] . k_fp8[n] becomes fp32 (pcpkv/device/consumers.h has the exact rules).
/// indexer_cpu and cuda::indexer agree bit for bit under either.
enum class IndexerLogit : int32_t {
  kExact = 0,     // the exact dot product rounded once (order-free; fp64 tensor cores on the GPU). Default.
  kFp32Tree = 1,  // fp32 sums in a fixed leaf/tree order (the first CUDA-core kernel, kept for comparison)
};
const char* to_string(IndexerLogit l);

/// Pointers address host memory (CPU reference) or device memory (CUDA launcher). Contiguous tensors.
struct IndexerParams {
  int64_t num_tokens = 0;               // T query tokens
  int32_t num_heads = 0;                // H = index_n_heads, 1..128
  const uint8_t* q_fp8 = nullptr;       // [T, H, 128] E4M3 index queries (after their RoPE)
  const float* q_scale = nullptr;       // [T, H] UE8M0 scale per (token, head): a power of two
  const float* weights = nullptr;       // [T, H] fp32 weights_proj output (unscaled)
  const int64_t* positions = nullptr;   // [T] position of each query token (>= 0)
  const int32_t* request_idx = nullptr; // [T] row of block_tables; -1 = padding token (row all -1)
  const int32_t* block_tables = nullptr;// [num_requests, block_table_stride] block ids
  int32_t num_requests = 0;
  int64_t block_table_stride = 0;       // >= blocks needed by the longest request
  const uint8_t* index_cache = nullptr; // first byte of block 0 of the indexer-K cache
  IndexerCacheGeometry geometry;
  int32_t topk = 2048;                  // width of every output row, 1..8192
  int64_t max_keys = 0;                 // >= positions[t] + 1 for every real token (GPU grid + workspace)
  IndexerLogit logit = IndexerLogit::kExact;  // logit rounding rule (and, on the GPU, which score kernel)
  // ---- outputs ----
  int32_t* topk_slots = nullptr;        // [T, topk] cache slots, -1 padded
  int32_t* topk_positions = nullptr;    // optional [T, topk] key positions, -1 padded
  float* scores = nullptr;              // optional [T, max_keys]: score of key position j <= positions[t]
                                        // (entries past the token's keys are left untouched)
};

/// c = fp32(1 / sqrt(128 * H)), the constant folded into the head weights (computed in double).
float index_weight_scale(int32_t num_heads);

/// Index-query quantizer (UE8M0 per (token, head), SPEC section 3 rule): s = 2^ceil(log2(max(amax, 1e-4)
/// / 448)), bytes E4M3(x / s). q: [T, H, 128] bf16 bit patterns -> q_fp8 [T, H, 128], q_scale [T, H].
void quantize_index_queries(const uint16_t* q, int64_t num_tokens, int32_t num_heads, uint8_t* q_fp8,
                            float* q_scale);

/// The scalar fields every indexer path checks first (num_tokens, num_heads, topk, logit, geometry); throws
/// pcpkv::Error naming the field and value. validate_indexer and the CUDA entry points call it.
void validate_indexer_scalars(const IndexerParams& p);

/// Host-side validation of everything the indexer reads (host pointers): sizes, num_heads, topk, every
/// real token's request index and position, the blocks it needs (in range of the geometry, and present
/// in the table), max_keys. Throws pcpkv::Error naming the field and value, e.g.
/// "indexer: positions[3] = 70 needs 2 blocks but block_table_stride is 1".
void validate_indexer(const IndexerParams& p);

/// CPU reference (host pointers). Validates, then writes every output row.
void indexer_cpu(const IndexerParams& p);

namespace cuda {
/// Bytes of device workspace the launcher needs at least (scores of one token: max_keys fp32); more lets
/// it process more tokens per pass (tokens per pass = workspace_bytes / (max_keys * 4)).
int64_t indexer_min_workspace_bytes(const IndexerParams& p);

/// CUDA kernels (device pointers; stream is a cudaStream_t). Checks the scalar fields (throws
/// pcpkv::Error); the device-resident contents (positions, request_idx, block tables) must already be
/// valid: validate_indexer on the host copies. Scores and top-k are bit-identical to indexer_cpu.
/// p.logit picks the score kernel: kExact -> fp64 tensor cores (DMMA m16n8k16, sm_90), kFp32Tree -> the
/// CUDA-core kernel of the fixed fp32 order.
void indexer(const IndexerParams& p, void* workspace, int64_t workspace_bytes, void* stream);

/// The two halves of cuda::indexer, for benchmarks: scores of tokens [tok0, tok0 + n) into ws
/// ([n, max_keys] fp32), then the top-k of those tokens from ws. Same checks as cuda::indexer.
void indexer_scores(const IndexerParams& p, int64_t tok0, int64_t n, float* ws, void* stream);
void indexer_topk(const IndexerParams& p, int64_t tok0, int64_t n, const float* ws, void* stream);
}  // namespace cuda

}  // namespace pcpkv
