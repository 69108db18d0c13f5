// CUDA DSA indexer (SPEC section 6): scores in the fixed order of pcpkv/device/consumers.h (bit-identical
// to indexer_cpu), then an exact block-wide radix select + bitonic sort for the top-k.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/error.h"
#include "pcpkv/indexer.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("indexer: {}: {}", what, cudaGetErrorString(e));
}

constexpr int kScoreThreads = 128;  // keys per score block
constexpr int kTopkThreads = 1024;

/// Slot of key position j of a request (block table row `table`).
__device__ __forceinline__ int64_t key_slot(const int32_t* table, int64_t j, int32_t bs) {
  return int64_t{table[j / bs]} * bs + j % bs;
}

/// grid (ceil(max_keys / 128), tokens of this pass); block: 128 keys of one query token.
/// smem: q of the token as fp32 [H, 128] | folded head weights [H].
__global__ void __launch_bounds__(kScoreThreads) index_scores_kernel(IndexerParams p, int64_t tok0, float c,
                                                                     float* ws) {
  extern __shared__ float smem[];
  const int64_t t = tok0 + blockIdx.y;
  const int32_t req = p.request_idx[t];
  if (req < 0) return;
  const int64_t len = p.positions[t] + 1;
  const int64_t j0 = int64_t{blockIdx.x} * kScoreThreads;
  if (j0 >= len) return;  // block-uniform: the causal triangle
  const int H = p.num_heads;
  float* qs = smem;
  float* w = smem + H * consumers::kIndexDim;
  const uint8_t* qb = p.q_fp8 + t * H * consumers::kIndexDim;
  for (int i = threadIdx.x; i < H * consumers::kIndexDim; i += kScoreThreads) qs[i] = codec::e4m3_to_float(qb[i]);
  for (int h = threadIdx.x; h < H; h += kScoreThreads)
    w[h] = consumers::index_head_weight(p.weights[t * H + h], c, p.q_scale[t * H + h]);
  __syncthreads();
  const int64_t j = j0 + threadIdx.x;
  if (j >= len) return;
  const int32_t bs = p.geometry.block_size;
  const int64_t slot = key_slot(p.block_tables + int64_t{req} * p.block_table_stride, j, bs);
  const int64_t block_base = (slot / bs) * p.geometry.block_stride;
  const uint32_t* kw =
      reinterpret_cast<const uint32_t*>(p.index_cache + block_base + (slot % bs) * consumers::kIndexDim);
  float k[consumers::kIndexDim];
#pragma unroll
  for (int i = 0; i < consumers::kIndexDim / 4; ++i) {
    const uint32_t v = kw[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) k[4 * i + e] = codec::e4m3_to_float(static_cast<uint8_t>(v >> (8 * e)));
  }
  float acc = 0.0f;
  for (int h = 0; h < H; ++h)
    acc = fp32::add(acc, fp32::mul(consumers::relu(consumers::index_logit(qs + h * consumers::kIndexDim, k)), w[h]));
  const float k_scale = *reinterpret_cast<const float*>(p.index_cache + block_base +
                                                         int64_t{bs} * consumers::kIndexDim + (slot % bs) * 4);
  const float score = fp32::mul(acc, k_scale);
  ws[(t - tok0) * p.max_keys + j] = score;
  if (p.scores) p.scores[t * p.max_keys + j] = score;
}

/// One block per query token: radix select of the k-th largest unique sort key (8 digits of 8 bits,
/// early exit once the remaining count fills a bin), gather of every key >= it, bitonic sort descending.
/// smem: room for pow2(topk) uint64 keys; a token sorts only pow2(k) of them.
__global__ void __launch_bounds__(kTopkThreads) index_topk_kernel(IndexerParams p, int64_t tok0, const float* ws) {
  extern __shared__ uint64_t buf[];
  __shared__ int hist[256];
  __shared__ uint64_t s_prefix;
  __shared__ int s_remaining, s_done, s_count;
  const int tid = threadIdx.x;
  const int64_t t = tok0 + blockIdx.x;
  int32_t* out_slots = p.topk_slots + t * p.topk;
  int32_t* out_pos = p.topk_positions ? p.topk_positions + t * p.topk : nullptr;
  const int32_t req = p.request_idx[t];
  if (req < 0) {
    for (int i = tid; i < p.topk; i += kTopkThreads) {
      out_slots[i] = -1;
      if (out_pos) out_pos[i] = -1;
    }
    return;
  }
  const int64_t len = p.positions[t] + 1;
  const int k = static_cast<int>(len < p.topk ? len : p.topk);
  const float* sc = ws + (t - tok0) * p.max_keys;
  int kp = 1;
  while (kp < k) kp <<= 1;

  uint64_t prefix = 0, mask = 0;
  if (len > k) {
    int remaining = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
      __syncthreads();
      for (int64_t j = tid; j < len; j += kTopkThreads) {
        const uint64_t key = consumers::sort_key(sc[j], j);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, sel = 0;
        for (int b = 255; b >= 0; --b) {
          if (cum + hist[b] >= remaining) {
            sel = b;
            break;
          }
          cum += hist[b];
        }
        remaining -= cum;
        s_prefix = prefix | (static_cast<uint64_t>(sel) << shift);
        s_remaining = remaining;
        s_done = hist[sel] == remaining;  // the whole bin is in: every key >= prefix is selected
      }
      __syncthreads();
      prefix = s_prefix;
      remaining = s_remaining;
      mask |= 0xffull << shift;
      const bool done = s_done;
      __syncthreads();  // s_* are rewritten next pass only after everyone has read them
      if (done) break;
    }
  }
  // Gather the k keys >= prefix (unique keys: exactly k), in any order; the sort fixes it.
  if (tid == 0) s_count = 0;
  __syncthreads();
  for (int64_t j = tid; j < len; j += kTopkThreads) {
    const uint64_t key = consumers::sort_key(sc[j], j);
    if (key >= prefix) buf[atomicAdd(&s_count, 1)] = key;
  }
  __syncthreads();
  for (int i = k + tid; i < kp; i += kTopkThreads) buf[i] = 0;  // 0 sorts last (positions < 2^31)
  __syncthreads();
  for (int size = 2; size <= kp; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < kp; i += kTopkThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = buf[i], b = buf[j];
          const bool desc = (i & size) == 0;
          if (desc ? (a < b) : (a > b)) {
            buf[i] = b;
            buf[j] = a;
          }
        }
      }
      __syncthreads();
    }
  const int32_t* table = p.block_tables + int64_t{req} * p.block_table_stride;
  for (int i = tid; i < p.topk; i += kTopkThreads) {
    int32_t slot = -1, pos = -1;
    if (i < k) {
      const int64_t j = consumers::sort_key_position(buf[i]);
      slot = static_cast<int32_t>(key_slot(table, j, p.geometry.block_size));
      pos = static_cast<int32_t>(j);
    }
    out_slots[i] = slot;
    if (out_pos) out_pos[i] = pos;
  }
}

int pow2_at_least(int x) {
  int v = 1;
  while (v < x) v <<= 1;
  return v;
}

}  // namespace

int64_t indexer_min_workspace_bytes(const IndexerParams& p) { return std::max<int64_t>(p.max_keys, 1) * 4; }

void indexer(const IndexerParams& p, void* workspace, int64_t workspace_bytes, void* stream) {
  PCPKV_CHECK(p.num_tokens >= 0, "indexer: num_tokens must be >= 0, got {}", p.num_tokens);
  PCPKV_CHECK(p.num_heads >= 1 && p.num_heads <= 128, "indexer: num_heads must be in [1, 128], got {}",
              p.num_heads);
  PCPKV_CHECK(p.topk >= 1 && p.topk <= 8192, "indexer: topk must be in [1, 8192], got {}", p.topk);
  validate_geometry(p.geometry);
  PCPKV_CHECK(p.geometry.block_stride % 4 == 0, "indexer: geometry.block_stride = {} must be a multiple of 4",
              p.geometry.block_stride);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(p.q_fp8 && p.q_scale && p.weights && p.positions && p.request_idx && p.block_tables &&
                  p.index_cache && p.topk_slots,
              "indexer: a required device pointer is null");
  PCPKV_CHECK(reinterpret_cast<uintptr_t>(p.index_cache) % 4 == 0, "indexer: index_cache must be 4-byte aligned");
  PCPKV_CHECK(p.max_keys >= 1 && p.max_keys < (int64_t{1} << 31), "indexer: max_keys must be in [1, 2^31), got {}",
              p.max_keys);
  PCPKV_CHECK(workspace && workspace_bytes >= indexer_min_workspace_bytes(p),
              "indexer: workspace_bytes = {} is below the minimum {}", workspace_bytes, indexer_min_workspace_bytes(p));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float c = index_weight_scale(p.num_heads);
  const int score_smem = p.num_heads * (consumers::kIndexDim + 1) * 4;
  const int topk_smem = pow2_at_least(p.topk) * 8;
  check_cuda(cudaFuncSetAttribute(index_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, score_smem),
             "smem attribute (scores)");
  check_cuda(cudaFuncSetAttribute(index_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, topk_smem),
             "smem attribute (top-k)");
  const int64_t per_pass = std::min<int64_t>({workspace_bytes / (p.max_keys * 4), int64_t{65535}, p.num_tokens});
  float* ws = static_cast<float*>(workspace);
  for (int64_t tok0 = 0; tok0 < p.num_tokens; tok0 += per_pass) {
    const int64_t n = std::min(per_pass, p.num_tokens - tok0);
    const dim3 grid(static_cast<unsigned>((p.max_keys + kScoreThreads - 1) / kScoreThreads), static_cast<unsigned>(n));
    index_scores_kernel<<<grid, kScoreThreads, score_smem, s>>>(p, tok0, c, ws);
    check_cuda(cudaGetLastError(), "scores launch");
    index_topk_kernel<<<static_cast<unsigned>(n), kTopkThreads, topk_smem, s>>>(p, tok0, ws);
    check_cuda(cudaGetLastError(), "top-k launch");
  }
}

}  // namespace pcpkv::cuda
