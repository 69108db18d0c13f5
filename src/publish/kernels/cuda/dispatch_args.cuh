// src/publish/kernels/cuda/dispatch_args.cuh: what both dispatch kernels (dispatch.cu: a CTA per token;
// dispatch_warp.cu: a warp per token) share: the kernel parameter block built by launch_dispatch, and the per-leaf RoPE
// and Hadamard helpers in token_math.h's rounding order. Internal to pcpkv_cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "publish/kernels/cuda/kernel_util.cuh"
#include "pcpkv/publish/dispatch.h"
#include "pcpkv/core/layout.h"

namespace pcpkv::cuda::dispatch_impl {

constexpr int kMaxRanks = 8;
constexpr int kMaxTargets = 64;  // per launch, all ranks together
constexpr int kMaxDests = 64;

/// What the kernel needs of a CacheTarget, with the power-of-two block sizes as shifts and masks.
struct TargetLite {
  uint8_t* mla_base;
  int64_t row_stride;
  int64_t block_stride;
  uint8_t* index_base;
  int64_t index_block_stride;
  int64_t index_scale_base;  // block_size * 128: where the scales of a block start
  int32_t block_shift;
  int32_t block_mask;
  int32_t index_block_shift;
  int32_t index_block_mask;
};

struct RankArgs {
  const uint16_t* q_c;
  const uint16_t* kv;
  const uint16_t* k_pe;
  const uint16_t* index_k;
  int64_t q_c_stride, kv_stride, k_pe_stride, index_k_stride;
  const int64_t* positions;
  const int64_t* slot_mapping;  // may be null when nothing is written to caches
  const int64_t* indexer_slot_mapping;  // the indexer rows' slots; null: slot_mapping's (no load then)
  uint16_t* q_c_out;
  uint16_t* kv_c_out;
  uint16_t* k_pe_out;
  uint16_t* index_k_out;
  int32_t* topk_fill;           // null: no fill (none, or no buffer)
  int64_t topk_first_row;       // rows [topk_first_row, num_tokens) are filled (pcpkv/publish/dispatch.h topk_fill_first_row)
  const CacheTarget* targets;   // device table
  uint8_t* const* row_dests;    // device table
  int64_t token_begin;          // first work index of this rank in the launch
  int64_t num_tokens;
  int32_t num_targets, target_base;
  int32_t num_row_dests, dest_base;
  bool do_q;                    // Q RMSNorm (q_c_out set)
  bool need_kv;                 // anything of kv / k_pe / index_k is produced
};

struct CommonArgs {
  int32_t q_lora_rank;
  int32_t num_q_leaves;
  const float* q_norm_w;
  const float* kv_norm_w;
  const float* index_ln_w;
  const float* index_ln_b;
  const float* rope_cos_sin;
  float q_eps, kv_eps, index_eps;
  float k_scale;
  int64_t topk_width;
  int64_t row_bytes;
  int32_t index_data_offset;
  int32_t index_scale_offset;
  int32_t load_align;    // alignment of every input row
  int32_t store_align;   // alignment of every cache row / transport row / output row
  bool topk_vec;         // topk rows 16-byte aligned: int4 stores
  bool mla_rope_interleaved;
  bool index_rope_interleaved;
  bool hadamard;
  bool has_indexer;
  bool pow2;             // fp8_ds_mla scale rule
};

struct DispatchArgs {
  CommonArgs c;
  int32_t num_ranks;
  int32_t total_targets;
  int32_t total_dests;
  int64_t total_tokens;
  RankArgs r[kMaxRanks];
};

/// Copies the device tables of every hosted rank (cache targets, row destinations) into shared memory, once
/// per CTA of a persistent grid: `num_threads` threads cooperate; the caller synchronizes afterwards. The tables
/// are host-written before the launch (never by a kernel), so this may run before the PDL wait.
__device__ __forceinline__ void load_tables_to_smem(const DispatchArgs& a, TargetLite* s_targets, uint8_t** s_dests,
                                                    int num_threads) {
  for (int i = threadIdx.x; i < a.total_targets; i += num_threads) {
    int r = 0;
    while (r + 1 < a.num_ranks && i >= a.r[r + 1].target_base) ++r;
    const CacheTarget ct = a.r[r].targets[i - a.r[r].target_base];
    TargetLite tl;
    tl.mla_base = ct.mla_base;
    tl.row_stride = ct.mla.row_stride;
    tl.block_stride = ct.mla.block_stride;
    tl.block_shift = __ffs(ct.mla.block_size) - 1;
    tl.block_mask = ct.mla.block_size - 1;
    tl.index_base = ct.index_base;
    tl.index_block_stride = ct.index.block_stride;
    tl.index_scale_base = int64_t{ct.index.block_size} * kIndexHeadDim;
    tl.index_block_shift = ct.index.block_size > 0 ? __ffs(ct.index.block_size) - 1 : 0;
    tl.index_block_mask = ct.index.block_size > 0 ? ct.index.block_size - 1 : 0;
    s_targets[i] = tl;
  }
  for (int i = threadIdx.x; i < a.total_dests; i += num_threads) {
    int r = 0;
    while (r + 1 < a.num_ranks && i >= a.r[r + 1].dest_base) ++r;
    s_dests[i] = a.r[r].row_dests[i - a.r[r].dest_base];
  }
}

static_assert(sizeof(DispatchArgs) <= 4096, "kernel parameters must fit the classic 4 KB limit");

__device__ __forceinline__ int find_rank(const DispatchArgs& a, int64_t g) {
  int r = 0;
#pragma unroll 1
  while (r + 1 < a.num_ranks && g >= a.r[r + 1].token_begin) ++r;
  return r;
}

/// cos/sin of the 8 dims of rope leaf `leaf` (elements 8*leaf .. 8*leaf+7 of a 64-dim rope section):
/// interleaved pairs use angles 4*leaf .. 4*leaf+3 (c[0..4), s[0..4)); NeoX uses angles 8*(leaf&3)+k.
__device__ __forceinline__ void load_rope(const float* cs, int leaf, bool interleaved, float (&c)[8], float (&s)[8]) {
  if (interleaved) {
    const float4 c4 = __ldg(reinterpret_cast<const float4*>(cs + 4 * leaf));
    const float4 s4 = __ldg(reinterpret_cast<const float4*>(cs + 32 + 4 * leaf));
    c[0] = c4.x; c[1] = c4.y; c[2] = c4.z; c[3] = c4.w;
    s[0] = s4.x; s[1] = s4.y; s[2] = s4.z; s[3] = s4.w;
    c[4] = c[5] = c[6] = c[7] = s[4] = s[5] = s[6] = s[7] = 0.0f;
  } else {
    const int base = 8 * (leaf & 3);
    const float4 c0 = __ldg(reinterpret_cast<const float4*>(cs + base));
    const float4 c1 = __ldg(reinterpret_cast<const float4*>(cs + base + 4));
    const float4 s0 = __ldg(reinterpret_cast<const float4*>(cs + 32 + base));
    const float4 s1 = __ldg(reinterpret_cast<const float4*>(cs + 32 + base + 4));
    c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
    s[0] = s0.x; s[1] = s0.y; s[2] = s0.z; s[3] = s0.w; s[4] = s1.x; s[5] = s1.y; s[6] = s1.z; s[7] = s1.w;
  }
}

/// RoPE of one leaf (token_math.h rope64, each pair's products rounded, then the sum). NeoX pairs (i, i+32)
/// live in lanes 4 apart: every lane of `mask` must call this (the exchange is a shuffle); only lanes with
/// apply = true change x.
__device__ __forceinline__ void rope_leaf(float (&x)[8], int leaf, bool interleaved, const float (&c)[8],
                                          const float (&s)[8], unsigned mask, bool apply) {
  if (interleaved) {
    if (!apply) return;
#pragma unroll
    for (int m = 0; m < 4; ++m) math::rope_pair(x[2 * m], x[2 * m + 1], c[m], s[m]);
  } else {
    float partner[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) partner[k] = __shfl_xor_sync(mask, x[k], 4);
    if (!apply) return;
    if ((leaf & 4) == 0) {  // first half: r0 = x0*c - x1*s
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = fp32::sub(fp32::mul(x[k], c[k]), fp32::mul(partner[k], s[k]));
    } else {                // second half: r1 = x1*c + x0*s
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = fp32::add(fp32::mul(x[k], c[k]), fp32::mul(partner[k], s[k]));
    }
  }
}

/// token_math.h hadamard128 over 16 lanes x 8 values: stages h = 1, 2, 4 in-thread, 8..64 across lanes.
/// lane16: this lane's leaf (0..15); mask: the 16 lanes holding the leaves (0xffff or 0xffff0000).
__device__ __forceinline__ void hadamard_leaf(float (&x)[8], int lane16, unsigned mask) {
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if ((k & h) == 0) {
        const float a = x[k], b = x[k + h];
        x[k] = fp32::add(a, b);
        x[k + h] = fp32::sub(a, b);
      }
  }
#pragma unroll
  for (int lh = 1; lh < 16; lh <<= 1) {
    const bool lower = (lane16 & lh) == 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float other = __shfl_xor_sync(mask, x[k], lh);
      x[k] = lower ? fp32::add(x[k], other) : fp32::sub(other, x[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = fp32::mul(x[k], math::kHadamard128Scale);
}

/// The indexer-K LayerNorm's mean and sum of squared deviations (SPEC 2.4, token_math.h order) over the 16
/// lanes of `mask`, one leaf each, of the row x (kRescaled: x * 2^-72); x is not changed.
template <bool kRescaled>
__device__ __forceinline__ float index_ln_stats(const float (&x)[8], unsigned mask, float& mu) {
  float v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = kRescaled ? fp32::mul(x[k], math::kRescale) : x[k];
  mu = math::mean_of(lanes_sum<16>(math::leaf_sum(v), mask), static_cast<int>(kIndexHeadDim));
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = fp32::sub(v[k], mu);
  return lanes_sum<16>(math::leaf_sumsq(v), mask);
}

/// The overflow guard's cold half for the indexer-K LayerNorm: the stats of this lane's leaf times 2^-72,
/// reloaded from the row (`src`: the leaf's 8 bf16, `align`: its alignment; the bits the hot path read).
/// Not inlined, and reloading instead of reading the hot path's registers, so the ordinary path keeps its
/// registers and code (docs/perf.md section 12). Every lane of `mask` calls it. Returns (mean, sumsq).
__device__ __noinline__ inline float2 rescaled_index_ln_stats(const uint16_t* src, int align, unsigned mask) {
  float x[8];
  unpack_bf16x8(load16_ro(src, align), x);
  float mu;
  const float var = index_ln_stats<true>(x, mask, mu);
  return make_float2(mu, var);
}

/// How index_ln_center handles a row whose LayerNorm sums are not finite (the overflow guard, token_math.h).
enum class LnGuard {
  kFlag,      // no guard: the ordinary result, and `nonfinite` set (the CTA kernel's hot pass; it redoes the
              // CTA's tokens with kInline afterwards, dispatch.cu)
  kInline,    // rescaled stats computed inline from x (the CTA kernel's cold pass)
  kColdCall,  // rescaled stats from the cold call rescaled_index_ln_stats (the warp kernel: no spills)
};

/// Indexer-K LayerNorm centring: x = the leaf of `raw` minus the row mean; returns r = 1 / sqrt(var + eps)
/// (every lane of `mask` the same). `src` / `align`: where `raw` was loaded from (for the guard's reload).
/// Overflow guard (token_math.h): a row whose sums are not finite is centred from x * 2^-72 with
/// eps * 2^-144 when that is finite (a lane-uniform branch), per kGuard above. `nonfinite` (kFlag only) is
/// ORed with whether this row's sums were not finite.
template <LnGuard kGuard>
__device__ __forceinline__ float index_ln_center(const uint4& raw, const uint16_t* src, int align, float (&x)[8],
                                                 unsigned mask, float eps, bool& nonfinite) {
  unpack_bf16x8(raw, x);
  float mu;
  float var = index_ln_stats<false>(x, mask, mu);
  if constexpr (kGuard == LnGuard::kFlag) {
    nonfinite |= !math::finite(var);
  } else if (!math::finite(var)) {
    float2 big;
    if constexpr (kGuard == LnGuard::kColdCall) {
      big = rescaled_index_ln_stats(src, align, mask);
    } else {
      big.y = index_ln_stats<true>(x, mask, big.x);
    }
    if (math::use_rescaled(var, big.y)) {
      var = big.y, mu = big.x, eps = math::rescaled_eps(eps);
      math::rescale_leaf(x);
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = fp32::sub(x[k], mu);
  return math::rms_inv(var, static_cast<int>(kIndexHeadDim), eps);
}

__device__ __forceinline__ uint8_t* mla_row(const TargetLite& tl, int64_t slot) {
  return tl.mla_base + (slot >> tl.block_shift) * tl.block_stride + (slot & tl.block_mask) * tl.row_stride;
}

using KernelFn = void (*)(DispatchArgs);

/// dispatch_warp.cu: one warp per token, kWarpKernelThreads threads per CTA, for 16-byte-aligned layouts and
/// q_lora_rank <= 8 * kWarpKernelMaxQLeaves (launch_dispatch falls back to the CTA kernel otherwise).
/// l2_prefetch: also bulk-prefetch the warp's next token into L2 (variant warp_pf). split: each token's KV and Q
/// parts are two work items of the persistent grid (the instance for few tokens per warp, docs/perf.md 38;
/// l2_prefetch is ignored then).
constexpr int kWarpKernelThreads = 128;
constexpr int kWarpKernelTokensPerCta = kWarpKernelThreads / 32;
constexpr int kWarpKernelMaxQLeaves = 256;
KernelFn warp_kernel_for(KvFormat f, bool l2_prefetch, bool split = false);

}  // namespace pcpkv::cuda::dispatch_impl
