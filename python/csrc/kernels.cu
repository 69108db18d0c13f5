// python/csrc/kernels.cu: reference-style CUDA kernels of the torch ops (see kernels.h). Every value goes
// through pcpkv/device/{token_math,pack,codec}.h in the canonical order of the CPU reference
// (src/cpu/dispatch.cpp, src/cpu/combine.cpp), so bytes equal the CPU reference's.
#include "kernels.h"

#include <cuda_runtime.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/device/pack.h"
#include "pcpkv/device/token_math.h"
#include "pcpkv/error.h"
#include "pcpkv/layout.h"

namespace pcpkv_torch {
namespace {

using namespace pcpkv;

constexpr int kThreads = 128;
constexpr int kMaxRowBytes = 1296;  // bf16 row + indexer part (layout.h)

#define PT_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    PCPKV_CHECK(e_ == cudaSuccess, "CUDA error {} ({}) in {}", cudaGetErrorName(e_), cudaGetErrorString(e_), #call); \
  } while (0)

unsigned grid_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__device__ int64_t mla_offset(const MlaCacheGeometry& g, int64_t slot) {
  return (slot / g.block_size) * g.block_stride + (slot % g.block_size) * g.row_stride;
}
__device__ int64_t index_data_offset(const IndexerCacheGeometry& g, int64_t slot) {
  return (slot / g.block_size) * g.block_stride + (slot % g.block_size) * kIndexHeadDim;
}
__device__ int64_t index_scale_offset(const IndexerCacheGeometry& g, int64_t slot) {
  return (slot / g.block_size) * g.block_stride + int64_t{g.block_size} * kIndexHeadDim + (slot % g.block_size) * 4;
}
__device__ int64_t target_slots(const CacheTarget& t, bool has_indexer) {
  const int64_t n = t.mla.num_blocks * t.mla.block_size;
  if (!has_indexer) return n;
  const int64_t m = t.index.num_blocks * t.index.block_size;
  return n < m ? n : m;
}

__device__ void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

/// Same as cpu_detail::write_cache_row (src/cpu/rows.h).
__device__ void write_cache_row(const CacheTarget& t, const TransportRowLayout& layout, int64_t slot,
                                const uint8_t* row) {
  copy_bytes(t.mla_base + mla_offset(t.mla, slot), row, layout.mla_bytes);
  if (layout.index_data_offset >= 0) {
    copy_bytes(t.index_base + index_data_offset(t.index, slot), row + layout.index_data_offset, kIndexHeadDim);
    copy_bytes(t.index_base + index_scale_offset(t.index, slot), row + layout.index_scale_offset, 4);
  }
}

/// Same as cpu_detail::encode_transport_row (src/cpu/rows.h).
__device__ void encode_transport_row(const float* kv_c, const float* k_pe, const float* index_k,
                                     const CacheFormat& fmt, const TransportRowLayout& layout, uint8_t* row) {
  pack::encode_mla_row(kv_c, k_pe, fmt, row);
  if (fmt.has_indexer) {
    pack::encode_index_k(index_k, row + layout.index_data_offset, row + layout.index_scale_offset);
    for (int64_t i = layout.index_scale_offset + 4; i < layout.row_bytes; ++i) row[i] = 0;
  }
}

// Canonical reductions of src/cpu/dispatch.cpp (token_math.h order).
__device__ float canonical_sumsq(const float* x, int n) {
  float leaves[64];  // n <= 512 here
  const int m = n / math::kLeaf;
  for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sumsq(x + j * math::kLeaf);
  return math::pairwise_sum(leaves, m);
}
__device__ float canonical_sum(const float* x, int n) {
  float leaves[64];
  const int m = n / math::kLeaf;
  for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sum(x + j * math::kLeaf);
  return math::pairwise_sum(leaves, m);
}
__device__ void rms_norm(float* x, int n, const float* w, float eps) {
  const float r = math::rms_inv(canonical_sumsq(x, n), n, eps);
  for (int i = 0; i < n; ++i) x[i] = math::rms_apply(x[i], r, w[i]);
}
__device__ void layer_norm128(float* x, const float* w, const float* b, float eps) {
  const float mu = math::mean_of(canonical_sum(x, 128), 128);
  for (int i = 0; i < 128; ++i) x[i] = fp32::sub(x[i], mu);
  const float r = math::rms_inv(canonical_sumsq(x, 128), 128, eps);
  for (int i = 0; i < 128; ++i) x[i] = math::ln_apply(x[i], r, w[i], b[i]);
}
__device__ void load_bf16(const uint16_t* in, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = codec::bf16_to_float(in[i]);
}

__global__ void reference_dispatch_kernel(DispatchParams p, TransportRowLayout layout, int64_t num_slots) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.num_tokens) return;
  if (p.q_c_out) {
    // Q RMSNorm without a 4096-float row: leaf sums first, then one pass that normalizes from the input.
    const int n = static_cast<int>(p.q_lora_rank);
    const uint16_t* in = p.q_c + t * p.q_c_stride;
    float leaves[512];
    for (int j = 0; j < n / math::kLeaf; ++j) {
      float x[math::kLeaf];
      load_bf16(in + j * math::kLeaf, math::kLeaf, x);
      leaves[j] = math::leaf_sumsq(x);
    }
    const float r = math::rms_inv(math::pairwise_sum(leaves, n / math::kLeaf), n, p.q_eps);
    uint16_t* out = p.q_c_out + t * p.q_lora_rank;
    for (int i = 0; i < n; ++i) out[i] = codec::float_to_bf16(math::rms_apply(codec::bf16_to_float(in[i]), r, p.q_norm_w[i]));
  }
  const bool need_kv = p.kv_c_out || p.k_pe_out || p.index_k_out || p.num_targets > 0 || p.num_row_dests > 0;
  if (!need_kv) return;
  const int64_t pos = p.positions[t];
  if (pos < 0 || pos >= p.rope_num_positions) return;  // invalid input: write nothing for this token
  float kv_c[512], k_pe[64], index_k[128];
  load_bf16(p.kv + t * p.kv_stride, 512, kv_c);
  rms_norm(kv_c, 512, p.kv_norm_w, p.kv_eps);
  const float* cs = p.rope_cos_sin + pos * kRopeDims;
  load_bf16(p.k_pe + t * p.k_pe_stride, 64, k_pe);
  math::rope64(k_pe, cs, p.mla_rope == RopeStyle::kInterleaved);
  if (p.fmt.has_indexer) {
    load_bf16(p.index_k + t * p.index_k_stride, 128, index_k);
    layer_norm128(index_k, p.index_ln_w, p.index_ln_b, p.index_eps);
    math::rope64(index_k, cs, p.index_rope == RopeStyle::kInterleaved);
    if (p.index_hadamard) math::hadamard128(index_k);
  }
  if (p.kv_c_out)
    for (int i = 0; i < 512; ++i) p.kv_c_out[t * 512 + i] = codec::float_to_bf16(kv_c[i]);
  if (p.k_pe_out)
    for (int i = 0; i < 64; ++i) p.k_pe_out[t * 64 + i] = codec::float_to_bf16(k_pe[i]);
  if (p.index_k_out)
    for (int i = 0; i < 128; ++i) p.index_k_out[t * 128 + i] = codec::float_to_bf16(index_k[i]);
  const int64_t slot = p.slot_mapping ? p.slot_mapping[t] : -1;
  const bool to_caches = p.num_targets > 0 && slot >= 0 && slot < num_slots;
  if (!to_caches && p.num_row_dests == 0) return;
  uint8_t row[kMaxRowBytes];
  encode_transport_row(kv_c, k_pe, index_k, p.fmt, layout, row);
  if (to_caches)
    for (int32_t d = 0; d < p.num_targets; ++d) write_cache_row(p.targets[d], layout, slot, row);
  for (int32_t d = 0; d < p.num_row_dests; ++d) copy_bytes(p.row_dests[d] + t * p.row_bytes, row, p.row_bytes);
}

__global__ void combine_kernel(CombineParams p, TransportRowLayout layout, int64_t num_rows) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_rows) return;
  const int64_t slot = p.slot_mapping[i];
  if (slot < 0 || slot >= target_slots(p.target, p.fmt.has_indexer)) return;
  write_cache_row(p.target, layout, slot, p.rows + i * p.row_bytes);
}

__global__ void insert_kernel(InsertParams p, TransportRowLayout layout) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.num_tokens) return;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0 || slot >= target_slots(p.target, p.fmt.has_indexer)) return;
  float kv_c[512], k_pe[64], index_k[128];
  load_bf16(p.kv_c + t * 512, 512, kv_c);
  load_bf16(p.k_pe + t * 64, 64, k_pe);
  if (p.fmt.has_indexer) load_bf16(p.index_k + t * 128, 128, index_k);
  uint8_t row[kMaxRowBytes];
  encode_transport_row(kv_c, k_pe, index_k, p.fmt, layout, row);
  write_cache_row(p.target, layout, slot, row);
}

__global__ void fence_kernel(FenceArgs a) { fence_block(a); }

}  // namespace

void launch_reference_dispatch(const DispatchParams& p, int64_t num_slots, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  reference_dispatch_kernel<<<grid_for(p.num_tokens), kThreads, 0, stream>>>(p, transport_row_layout(p.fmt),
                                                                                num_slots);
  PT_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(const CombineParams& p, cudaStream_t stream) {
  const int64_t n = int64_t{p.num_src_ranks} * p.max_local_tokens;
  if (n == 0) return;
  combine_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, transport_row_layout(p.fmt), n);
  PT_CUDA_CHECK(cudaGetLastError());
}

void launch_insert(const InsertParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  insert_kernel<<<grid_for(p.num_tokens), kThreads, 0, stream>>>(p, transport_row_layout(p.fmt));
  PT_CUDA_CHECK(cudaGetLastError());
}

void launch_fence(const FenceArgs& a, int num_blocks, cudaStream_t stream) {
  fence_kernel<<<num_blocks, 32, 0, stream>>>(a);
  PT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pcpkv_torch
