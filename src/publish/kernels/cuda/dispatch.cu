// The fused dispatch kernel (SPEC section 2, 3): Q RMSNorm, KV RMSNorm, k_pe RoPE, indexer LayerNorm +
// RoPE (+ Hadamard), quantization into the cache format, cache writes into every target ("direct") and/or
// transport rows into every row destination ("staging"), materialized bf16 outputs ("collect"), and the
// top-k -1 fill. Bytes equal dispatch_reference's (pcpkv/publish/cpu.h) exactly.
//
// This file: the CTA-per-token kernels (variants simple, prefetch) and the host launcher of every variant;
// the warp-per-token kernel (variant warp) is in dispatch_warp.cu, the shared parameter block and RoPE /
// Hadamard helpers in dispatch_args.cuh.
//
// Work split. A persistent grid of 128-thread CTAs walks the tokens of up to 8 ranks (one launch serves
// all logical ranks of a GPU). Per token:
//   all 128 threads   2 q_c leaves (8 bf16 = one 16-byte load each) per thread, 4 when q_lora_rank > 2048
//   threads 0..63     kv leaf t (kv_c tile t / 16 for fp8_ds_mla)
//   warp 2, lanes 0..7   k_pe leaf
//   warp 3, lanes 0..15  index_k leaf
// Every load of a token is issued before its first reduction; the "prefetch" variant also issues the next
// token's loads before processing the current one. Sums follow token_math.h's canonical order: leaf sums
// in-thread, shfl_xor butterflies across lanes, then warps pairwise through shared memory.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/cuda/check.h"
#include "publish/kernels/cuda/dispatch_args.cuh"
#include "publish/kernels/cuda/kernel_util.cuh"
#include "publish/contract/dispatch_variant.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/validate.h"
#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda {
namespace {

using namespace dispatch_impl;

constexpr int kThreads = 128;  // 4 warps per token: see the work split above

template <int QL>
struct TokenRegs {
  uint4 q[QL];
  uint4 x;       // kv leaf (threads 0..63), k_pe leaf (warp 2), index_k leaf (warp 3)
  int64_t slot;  // threads 0..127; warp 3 (the indexer row) holds the indexer slot
  int64_t pos;   // warps 2, 3
};

// kAligned: every input row, output row and cache row is 16-byte aligned (the normal case); the generic
// instances pick access widths at run time (smaller, slower code for unusual layouts).
template <int QL, bool kAligned>
__device__ __forceinline__ void load_token(const DispatchArgs& a, int64_t g, TokenRegs<QL>& v) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const RankArgs& ra = a.r[find_rank(a, g)];
  const int64_t t = g - ra.token_begin;
  const int la = kAligned ? 16 : a.c.load_align;
#pragma unroll
  for (int l = 0; l < QL; ++l) {
    const int leaf = QL * tid + l;
    v.q[l] = make_uint4(0, 0, 0, 0);
    if (ra.do_q && leaf < a.c.num_q_leaves) v.q[l] = load16_ro(ra.q_c + t * ra.q_c_stride + 8 * leaf, la);
  }
  v.x = make_uint4(0, 0, 0, 0);
  v.slot = -1;
  v.pos = 0;
  if (!ra.need_kv) return;
  if (tid < 64) {
    v.x = load16_ro(ra.kv + t * ra.kv_stride + 8 * tid, la);
  } else if (warp == 2 && lane < 8) {
    v.x = load16_ro(ra.k_pe + t * ra.k_pe_stride + 8 * lane, la);
  } else if (warp == 3 && lane < 16 && a.c.has_indexer) {
    v.x = load16_ro(ra.index_k + t * ra.index_k_stride + 8 * lane, la);
  }
  if (tid < 128) {
    // Warp 3 writes only the indexer row: its slot comes from the indexer mapping when there is one.
    const int64_t* sm = warp == 3 && ra.indexer_slot_mapping != nullptr ? ra.indexer_slot_mapping : ra.slot_mapping;
    if (sm != nullptr) v.slot = __ldg(sm + t);
  }
  if (warp == 2 || warp == 3) v.pos = __ldg(ra.positions + t);
}

// This thread's share of the Q and KV sums of squares (token_math.h order): Q per warp into red[0..3] (all
// 128 threads), KV per warp into red[4..5] (threads 0..63). kRescaled: of the rows x * 2^-72 (overflow guard).
template <int QL, bool kRescaled>
__device__ __forceinline__ void sumsq_parts(const TokenRegs<QL>& v, bool do_q, bool do_kv, float* red) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (do_q) {
    float leaf_part[QL];
#pragma unroll
    for (int l = 0; l < QL; ++l) {
      float qx[8];
      unpack_bf16x8(v.q[l], qx);
      leaf_part[l] = kRescaled ? math::leaf_sumsq_rescaled(qx) : math::leaf_sumsq(qx);
    }
    // The thread's QL consecutive leaves pairwise (QL is a power of two), then the lanes.
#pragma unroll
    for (int h = 1; h < QL; h <<= 1)
#pragma unroll
      for (int l = 0; l + h < QL; l += 2 * h) leaf_part[l] = fp32::add(leaf_part[l], leaf_part[l + h]);
    const float part = lanes_sum<32>(leaf_part[0], 0xffffffffu);
    if (lane == 0) red[warp] = part;
  }
  if (do_kv && tid < 64) {
    float kx[8];
    unpack_bf16x8(v.x, kx);
    const float p = lanes_sum<32>(kRescaled ? math::leaf_sumsq_rescaled(kx) : math::leaf_sumsq(kx), 0xffffffffu);
    if (lane == 0) red[4 + warp] = p;
  }
}

// One token. kGuard = false (the hot pass): the ordinary reductions only; a thread that sees one of its sums
// not finite sets *s_cold where it tests the sum (such a row is published as the code before the guard did:
// r = 0, zeros). A flag in shared memory, not a register carried through the token loop: that register spilled
// in the simple kernel. kGuard = true (the cold pass, which the kernel runs over all of a CTA's tokens only when
// *s_cold is set): the overflow guard inline (token_math.h; SPEC 2.1, 2.2, 2.4), rewriting every byte of the
// token (identical bytes for ordinary rows), no top-k fill (the hot pass did it). Why two passes: any guard code
// on the hot path of this kernel, inline or as a call, cost 9-13% of its time (registers of the prefetched next
// token; docs/perf.md sections 12b and 32).
template <KvFormat F, int QL, bool kAligned, bool kGuard>
__device__ __forceinline__ void process_token(const DispatchArgs& a, int64_t g, const TokenRegs<QL>& v,
                                              const TargetLite* s_targets, uint8_t* const* s_dests,
                                              float (*s_red)[6], float* s_big, int* s_cold, int parity) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const CommonArgs& c = a.c;
  const RankArgs& ra = a.r[find_rank(a, g)];
  const int64_t t = g - ra.token_begin;
  const int sa = kAligned ? 16 : c.store_align;

  // Top-k fill first: plain stores that need nothing else.
  if (!kGuard && ra.topk_fill != nullptr && t >= ra.topk_first_row) {
    int32_t* row = ra.topk_fill + t * c.topk_width;
    if (c.topk_vec) {
      for (int64_t i = 4 * tid; i < c.topk_width; i += 4 * kThreads)
        *reinterpret_cast<int4*>(row + i) = make_int4(-1, -1, -1, -1);
    } else {
      for (int64_t i = tid; i < c.topk_width; i += kThreads) row[i] = -1;
    }
  }

  // ---- Q and KV sums of squares: leaves in-thread, lanes by butterfly, warps through shared memory ----
  float* red = s_red[parity];  // double-buffered by iteration parity: one barrier per token suffices
  // Only the raw 16-byte vectors stay live across the barrier (registers decide occupancy); the values are
  // unpacked again after it.
  sumsq_parts<QL, false>(v, ra.do_q, ra.need_kv, red);
  __syncthreads();
  // The hot pass reads each total where it uses it, by the threads that use it (Q: all, KV: 0..63), as the
  // code before the guard did, and only notes whether it is finite. The cold pass reads both up front: its
  // overflow guard needs every thread to hold the same sums, so the branch (and its barrier) is CTA-uniform.
  // s_big is read only between this barrier and the next token's first one.
  float q_total = 0.0f, kv_total = 0.0f;
  bool q_big = false, kv_big = false, nonfinite = false;
  if constexpr (kGuard) {
    if (ra.do_q) q_total = fp32::add(fp32::add(red[0], red[1]), fp32::add(red[2], red[3]));
    if (ra.need_kv) kv_total = fp32::add(red[4], red[5]);
    if (!math::finite(q_total) || !math::finite(kv_total)) {
      const bool redo_q = !math::finite(q_total), redo_kv = !math::finite(kv_total);
      sumsq_parts<QL, true>(v, redo_q, redo_kv, s_big);
      __syncthreads();
      if (redo_q) {
        const float t2 = fp32::add(fp32::add(s_big[0], s_big[1]), fp32::add(s_big[2], s_big[3]));
        q_big = math::use_rescaled(q_total, t2);
        if (q_big) q_total = t2;
      }
      if (redo_kv) {
        const float t2 = fp32::add(s_big[4], s_big[5]);
        kv_big = math::use_rescaled(kv_total, t2);
        if (kv_big) kv_total = t2;
      }
    }
  }

  // ---- Q output ----
  if (ra.do_q) {
    if constexpr (!kGuard) {
      q_total = fp32::add(fp32::add(red[0], red[1]), fp32::add(red[2], red[3]));
      if (!math::finite(q_total)) *s_cold = 1;
    }
    const float r = math::rms_inv(q_total, c.q_lora_rank, q_big ? math::rescaled_eps(c.q_eps) : c.q_eps);
#pragma unroll
    for (int l = 0; l < QL; ++l) {
      const int leaf = QL * tid + l;
      if (leaf < c.num_q_leaves) {
        float qx[8];
        unpack_bf16x8(v.q[l], qx);
        if (q_big) math::rescale_leaf(qx);
        const float4 w0 = __ldg(reinterpret_cast<const float4*>(c.q_norm_w + 8 * leaf));
        const float4 w1 = __ldg(reinterpret_cast<const float4*>(c.q_norm_w + 8 * leaf + 4));
        const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = math::rms_apply(qx[k], r, w[k]);
        uint32_t packed[4];
        pack_bf16x8(y, packed);
        store_bytes<16>(reinterpret_cast<uint8_t*>(ra.q_c_out + t * c.q_lora_rank + 8 * leaf), packed, sa);
      }
    }
  }
  if (!ra.need_kv) return;

  // ---- KV: RMSNorm, encode the kv_c part of the MLA row ----
  if (tid < 64) {
    if constexpr (!kGuard) {
      kv_total = fp32::add(red[4], red[5]);
      if (!math::finite(kv_total)) *s_cold = 1;
    }
    const float r = math::rms_inv(kv_total, static_cast<int>(kKvLoraRank), kv_big ? math::rescaled_eps(c.kv_eps) : c.kv_eps);
    float kx[8];
    unpack_bf16x8(v.x, kx);
    if (kv_big) math::rescale_leaf(kx);
    const float4 w0 = __ldg(reinterpret_cast<const float4*>(c.kv_norm_w + 8 * tid));
    const float4 w1 = __ldg(reinterpret_cast<const float4*>(c.kv_norm_w + 8 * tid + 4));
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = math::rms_apply(kx[k], r, w[k]);
    if (ra.kv_c_out != nullptr) {
      uint32_t packed[4];
      pack_bf16x8(y, packed);
      store_bytes<16>(reinterpret_cast<uint8_t*>(ra.kv_c_out + t * kKvLoraRank + 8 * tid), packed, sa);
    }
    uint32_t words[4];
    uint32_t scale_bits = 0;
    if constexpr (F == KvFormat::kBf16) {
      pack_bf16x8(y, words);
    } else if constexpr (F == KvFormat::kFp8) {
      divide_by_scale(y, c.k_scale);
      uint32_t w2[2];
      pack_e4m3x8(y, w2);
      words[0] = w2[0];
      words[1] = w2[1];
    } else {
      // 16 consecutive threads hold one 128-element tile (tile = tid / 16).
      const float amax = lanes_max<16>(amax8(y), 0xffffffffu);
      const float s = codec::ds_mla_tile_scale(amax, c.pow2);
      scale_bits = __float_as_uint(s);
      divide_by_scale(y, s);
      uint32_t w2[2];
      pack_e4m3x8(y, w2);
      words[0] = w2[0];
      words[1] = w2[1];
    }
    constexpr int kChunk = F == KvFormat::kBf16 ? 16 : 8;
    const bool scale_writer = F == KvFormat::kFp8DsMla && (tid & 15) == 0;
    const int scale_off = static_cast<int>(kDsMlaScaleOffset) + 4 * (tid >> 4);
    if (v.slot >= 0)
      for (int d = 0; d < ra.num_targets; ++d) {
        uint8_t* row = mla_row(s_targets[ra.target_base + d], v.slot);
        store_bytes<kChunk>(row + kChunk * tid, words, sa);
        if (scale_writer) store_bytes<4>(row + scale_off, &scale_bits, sa);
      }
    for (int d = 0; d < ra.num_row_dests; ++d) {
      uint8_t* row = s_dests[ra.dest_base + d] + t * c.row_bytes;
      store_bytes<kChunk>(row + kChunk * tid, words, sa);
      if (scale_writer) store_bytes<4>(row + scale_off, &scale_bits, sa);
    }
  } else if (warp == 2) {
    // ---- k_pe: RoPE, then bf16 (bf16, fp8_ds_mla) or e4m3 / k_scale (fp8) ----
    if (lane < 8) {
      float rc[8], rs[8];
      load_rope(c.rope_cos_sin + v.pos * kRopeDims, lane, c.mla_rope_interleaved, rc, rs);
      float x[8];
      unpack_bf16x8(v.x, x);
      rope_leaf(x, lane, c.mla_rope_interleaved, rc, rs, 0xffu, true);
      if (ra.k_pe_out != nullptr) {
        uint32_t packed[4];
        pack_bf16x8(x, packed);
        store_bytes<16>(reinterpret_cast<uint8_t*>(ra.k_pe_out + t * kRopeDims + 8 * lane), packed, sa);
      }
      uint32_t words[4];
      if constexpr (F == KvFormat::kFp8) {
        divide_by_scale(x, c.k_scale);
        uint32_t w2[2];
        pack_e4m3x8(x, w2);
        words[0] = w2[0];
        words[1] = w2[1];
      } else {
        pack_bf16x8(x, words);
      }
      constexpr int kChunk = F == KvFormat::kFp8 ? 8 : 16;
      constexpr int kBase = F == KvFormat::kBf16 ? 1024 : (F == KvFormat::kFp8 ? 512 : static_cast<int>(kDsMlaKpeOffset));
      if (v.slot >= 0)
        for (int d = 0; d < ra.num_targets; ++d)
          store_bytes<kChunk>(mla_row(s_targets[ra.target_base + d], v.slot) + kBase + kChunk * lane, words, sa);
      for (int d = 0; d < ra.num_row_dests; ++d)
        store_bytes<kChunk>(s_dests[ra.dest_base + d] + t * c.row_bytes + kBase + kChunk * lane, words, sa);
    }
  } else if (warp == 3 && c.has_indexer) {
    // ---- indexer K: LayerNorm, RoPE on dims [0, 64), optional Hadamard, UE8M0 quantization ----
    if (lane < 16) {
      // The rope loads go first: their latency overlaps the LayerNorm.
      float rc[8] = {}, rs[8] = {};
      if (lane < 8) load_rope(c.rope_cos_sin + v.pos * kRopeDims, lane, c.index_rope_interleaved, rc, rs);
      float x[8];
      const float r = index_ln_center<kGuard ? LnGuard::kInline : LnGuard::kFlag>(
          v.x, ra.index_k + t * ra.index_k_stride + 8 * lane, kAligned ? 16 : c.load_align, x, 0xffffu, c.index_eps,
          nonfinite);
      if (!kGuard && nonfinite) *s_cold = 1;
      const float4 w0 = __ldg(reinterpret_cast<const float4*>(c.index_ln_w + 8 * lane));
      const float4 w1 = __ldg(reinterpret_cast<const float4*>(c.index_ln_w + 8 * lane + 4));
      const float4 b0 = __ldg(reinterpret_cast<const float4*>(c.index_ln_b + 8 * lane));
      const float4 b1 = __ldg(reinterpret_cast<const float4*>(c.index_ln_b + 8 * lane + 4));
      const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = math::ln_apply(x[k], r, w[k], b[k]);
      rope_leaf(x, lane, c.index_rope_interleaved, rc, rs, 0xffffu, lane < 8);
      if (c.hadamard) hadamard_leaf(x, lane, 0xffffu);
      if (ra.index_k_out != nullptr) {
        uint32_t packed[4];
        pack_bf16x8(x, packed);
        store_bytes<16>(reinterpret_cast<uint8_t*>(ra.index_k_out + t * kIndexHeadDim + 8 * lane), packed, sa);
      }
      const float s = codec::indexer_scale(lanes_max<16>(amax8(x), 0xffffu));
      divide_by_scale(x, s);
      uint32_t words[2];
      pack_e4m3x8(x, words);
      const uint32_t scale_row[4] = {__float_as_uint(s), 0u, 0u, 0u};  // scale + the 12 zero pad bytes
      if (v.slot >= 0)
        for (int d = 0; d < ra.num_targets; ++d) {
          const TargetLite& tl = s_targets[ra.target_base + d];
          const int64_t blk = v.slot >> tl.index_block_shift, off = v.slot & tl.index_block_mask;
          uint8_t* block = tl.index_base + blk * tl.index_block_stride;
          store_bytes<8>(block + off * kIndexHeadDim + 8 * lane, words, sa);
          if (lane == 0) store_bytes<4>(block + tl.index_scale_base + off * 4, scale_row, sa);
        }
      for (int d = 0; d < ra.num_row_dests; ++d) {
        uint8_t* row = s_dests[ra.dest_base + d] + t * c.row_bytes;
        store_bytes<8>(row + c.index_data_offset + 8 * lane, words, sa);
        if (lane == 0) store_bytes<16>(row + c.index_scale_offset, scale_row, sa);
      }
    }
  }
}

// The cold pass (see process_token) over all of this CTA's tokens.
template <KvFormat F, int QL, bool kAligned>
__device__ __forceinline__ void cold_pass(const DispatchArgs& a, const TargetLite* s_targets, uint8_t* const* s_dests,
                                          float (*s_red)[6], float* s_big, int* s_cold) {
  int parity = 0;
  for (int64_t g = blockIdx.x; g < a.total_tokens; g += gridDim.x, parity ^= 1) {
    TokenRegs<QL> cur;
    load_token<QL, kAligned>(a, g, cur);
    process_token<F, QL, kAligned, true>(a, g, cur, s_targets, s_dests, s_red, s_big, s_cold, parity);
  }
}

// The same, not inlined. Inlined after the token loop of the two-leaf instances, the cold pass costs that loop
// registers (ptxas re-reads threadIdx there ~15 more times); as a call, only what is live at the call site is
// saved, and its spills stay in the call. The four-leaf instances do better with it inline (docs/perf.md 32).
template <KvFormat F, int QL, bool kAligned>
__device__ __noinline__ void cold_pass_call(const DispatchArgs& a, const TargetLite* s_targets,
                                            uint8_t* const* s_dests, float (*s_red)[6], float* s_big, int* s_cold) {
  cold_pass<F, QL, kAligned>(a, s_targets, s_dests, s_red, s_big, s_cold);
}

template <KvFormat F, int QL, bool kPrefetch, bool kAligned>
__global__ void __launch_bounds__(kThreads, kPrefetch ? 7 : 8) dispatch_kernel(const __grid_constant__ DispatchArgs a) {
  __shared__ TargetLite s_targets[kMaxTargets];
  __shared__ uint8_t* s_dests[kMaxDests];
  __shared__ float s_red[2][6];
  __shared__ float s_big[6];  // the overflow guard's rescaled sums (rare)
  __shared__ int s_cold;      // set when the hot pass met a non-finite sum: run the cold pass
  if (threadIdx.x == 0) s_cold = 0;
  // Device tables -> shared memory once per CTA (the grid is persistent).
  load_tables_to_smem(a, s_targets, s_dests, kThreads);
  __syncthreads();
  // PDL (pcpkv/core/pdl.h): the tables above are host-written; everything below may touch the previous kernel's data.
  pdl::wait();
  pdl::launch_dependents();

  const int64_t stride = gridDim.x;
  if (blockIdx.x >= a.total_tokens) return;
  if constexpr (kPrefetch) {
    TokenRegs<QL> cur;
    load_token<QL, kAligned>(a, blockIdx.x, cur);
    int parity = 0;
    for (int64_t g = blockIdx.x; g < a.total_tokens; g += stride, parity ^= 1) {
      TokenRegs<QL> nxt;
      if (g + stride < a.total_tokens) load_token<QL, kAligned>(a, g + stride, nxt);
      process_token<F, QL, kAligned, false>(a, g, cur, s_targets, s_dests, s_red, s_big, &s_cold, parity);
      cur = nxt;
    }
  } else {
    int parity = 0;
    for (int64_t g = blockIdx.x; g < a.total_tokens; g += stride, parity ^= 1) {
      TokenRegs<QL> cur;
      load_token<QL, kAligned>(a, g, cur);
      process_token<F, QL, kAligned, false>(a, g, cur, s_targets, s_dests, s_red, s_big, &s_cold, parity);
    }
  }
  // The cold pass (see process_token): only a CTA that met a row with a non-finite sum (an overflow, or a NaN /
  // inf input) takes it; it rewrites all its tokens, the same threads writing the same bytes in program order,
  // so the guarded bytes are the last ones written. The barrier also ends the hot pass's use of s_red.
  __syncthreads();
  if (s_cold != 0) {
    if constexpr (QL == 2)
      cold_pass_call<F, QL, kAligned>(a, s_targets, s_dests, s_red, s_big, &s_cold);
    else
      cold_pass<F, QL, kAligned>(a, s_targets, s_dests, s_red, s_big, &s_cold);
  }
}

// Instances: per format, aligned {2 leaves simple, 2 leaves prefetch, 4 leaves simple} and generic-alignment
// {2 leaves, 4 leaves} (simple). Four leaves with prefetch would spill.
template <KvFormat F>
KernelFn pick_q(int ql, bool prefetch, bool aligned) {
  if (!aligned) return ql == 2 ? dispatch_kernel<F, 2, false, false> : dispatch_kernel<F, 4, false, false>;
  if (ql == 4) return dispatch_kernel<F, 4, false, true>;
  return prefetch ? dispatch_kernel<F, 2, true, true> : dispatch_kernel<F, 2, false, true>;
}

KernelFn pick_kernel(KvFormat f, int ql, bool prefetch, bool aligned) {
  switch (f) {
    case KvFormat::kBf16: return pick_q<KvFormat::kBf16>(ql, prefetch, aligned);
    case KvFormat::kFp8: return pick_q<KvFormat::kFp8>(ql, prefetch, aligned);
    case KvFormat::kFp8DsMla: break;
  }
  return pick_q<KvFormat::kFp8DsMla>(ql, prefetch, aligned);
}

/// Persistent grid size: resident CTAs per SM (occupancy API) times SMs, cached per kernel and device.
int resident_ctas(KernelFn fn) {
  static std::mutex mu;
  static std::unordered_map<uint64_t, int> cache;
  int device = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t key = (reinterpret_cast<uint64_t>(fn) << 8) ^ static_cast<uint64_t>(device);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int per_sm = 0, sms = 0;
  PCPKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0));
  PCPKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int n = std::max(1, per_sm) * std::max(1, sms);
  cache.emplace(key, n);
  return n;
}

// The variant kAuto runs. Change it only after `pcpkv bench --variants ...` measured the candidates on the
// device (docs/perf.md section 4). Measured 2026-11-29 on one H200 (`pcpkv bench`, defaults): warp is the
// fastest single-rank dispatch at 32768 tokens (179.8 us vs prefetch 198.5, separate top-k fill) and the
// fastest layer variant (warp:separate:1) for staging and direct in 22 of 24 (model, P, kv) cases.
constexpr DispatchVariant kDefaultVariant = DispatchVariant::kWarp;

// kWarp runs the split instance (a token's KV and Q parts as two items) while the one-warp-per-token grid would
// give each warp at most this many tokens: on an H100 the split was 3% faster at 4096 rows and 0.5-8% slower from
// 8192 up (docs/perf-log.md 38); its byte tests against the CPU oracle passed on the GPU.
constexpr int64_t kSplitMaxTokensPerWarp = 2;

// kAuto: PCPKV_DISPATCH_VARIANT when set (an unknown value throws pcpkv::Error), else kDefaultVariant.
DispatchVariant resolve_variant(DispatchVariant v) {
  if (v != DispatchVariant::kAuto) return v;
  return dispatch_variant_from_env(read_env(kEnvDispatchVariant)).value_or(kDefaultVariant);
}

// Fields that must agree between jobs sharing one launch.
bool same_common(const DispatchParams& a, const DispatchParams& b) {
  return a.q_lora_rank == b.q_lora_rank && a.q_norm_w == b.q_norm_w && a.kv_norm_w == b.kv_norm_w &&
         a.index_ln_w == b.index_ln_w && a.index_ln_b == b.index_ln_b && a.rope_cos_sin == b.rope_cos_sin &&
         a.q_eps == b.q_eps && a.kv_eps == b.kv_eps && a.index_eps == b.index_eps && a.mla_rope == b.mla_rope &&
         a.index_rope == b.index_rope && a.index_hadamard == b.index_hadamard &&
         a.fmt.kv_format == b.fmt.kv_format && a.fmt.ds_mla_scale == b.fmt.ds_mla_scale &&
         a.fmt.k_scale == b.fmt.k_scale && a.fmt.has_indexer == b.fmt.has_indexer &&
         a.topk_width == b.topk_width && a.row_bytes == b.row_bytes;
}

uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// v: a resolved variant (never kAuto; launch_dispatch resolves it).
void launch_group(const DispatchJob* jobs, int n, cudaStream_t stream, DispatchVariant v, bool pdl) {
  const DispatchParams& p0 = jobs[0].params;
  DispatchArgs a;
  std::memset(&a, 0, sizeof(a));
  CommonArgs& c = a.c;
  const bool any_q = std::any_of(jobs, jobs + n, [](const DispatchJob& j) { return j.params.q_c_out != nullptr; });
  c.q_lora_rank = static_cast<int32_t>(any_q ? p0.q_lora_rank : 0);
  c.num_q_leaves = c.q_lora_rank / 8;
  c.q_norm_w = p0.q_norm_w;
  c.kv_norm_w = p0.kv_norm_w;
  c.index_ln_w = p0.index_ln_w;
  c.index_ln_b = p0.index_ln_b;
  c.rope_cos_sin = p0.rope_cos_sin;
  c.q_eps = p0.q_eps;
  c.kv_eps = p0.kv_eps;
  c.index_eps = p0.index_eps;
  c.k_scale = p0.fmt.k_scale;
  c.topk_width = p0.topk_width;
  c.row_bytes = p0.row_bytes;
  const TransportRowLayout layout = transport_row_layout(p0.fmt);
  c.index_data_offset = static_cast<int32_t>(layout.index_data_offset);
  c.index_scale_offset = static_cast<int32_t>(layout.index_scale_offset);
  c.mla_rope_interleaved = p0.mla_rope == RopeStyle::kInterleaved;
  c.index_rope_interleaved = p0.index_rope == RopeStyle::kInterleaved;
  c.hadamard = p0.index_hadamard;
  c.has_indexer = p0.fmt.has_indexer;
  c.pow2 = p0.fmt.ds_mla_scale == DsMlaScale::kPow2;

  // Alignment: the OR of every address and stride has the alignment of the least aligned one.
  uint64_t load_bits = 0, store_bits = 0, topk_bits = 0;
  PCPKV_CHECK(addr(p0.rope_cos_sin) % 16 == 0, "dispatch: rope_cos_sin must be 16-byte aligned");
  for (const float* w : {p0.q_norm_w, p0.kv_norm_w, p0.index_ln_w, p0.index_ln_b})
    PCPKV_CHECK(addr(w) % 16 == 0, "dispatch: norm weights must be 16-byte aligned (got {:#x})", addr(w));
  int64_t begin = 0;
  int32_t target_base = 0, dest_base = 0;
  for (int i = 0; i < n; ++i) {
    const DispatchParams& p = jobs[i].params;
    RankArgs& r = a.r[i];
    r.q_c = p.q_c;
    r.kv = p.kv;
    r.k_pe = p.k_pe;
    r.index_k = p.index_k;
    r.q_c_stride = p.q_c_stride;
    r.kv_stride = p.kv_stride;
    r.k_pe_stride = p.k_pe_stride;
    r.index_k_stride = p.index_k_stride;
    r.positions = p.positions;
    r.slot_mapping = p.slot_mapping;
    r.indexer_slot_mapping = p.indexer_slot_mapping;
    r.q_c_out = p.q_c_out;
    r.kv_c_out = p.kv_c_out;
    r.k_pe_out = p.k_pe_out;
    r.index_k_out = p.index_k_out;
    r.topk_first_row = topk_fill_first_row(p.topk_fill_mode, p.topk_indexer_rows, p.num_tokens);
    r.topk_fill = r.topk_first_row < p.num_tokens ? p.topk_fill : nullptr;
    r.targets = p.targets;
    r.row_dests = p.row_dests;
    r.token_begin = begin;
    r.num_tokens = p.num_tokens;
    r.num_targets = p.num_targets;
    r.target_base = target_base;
    r.num_row_dests = p.num_row_dests;
    r.dest_base = dest_base;
    r.do_q = p.q_c_out != nullptr;
    r.need_kv = p.kv_c_out || p.k_pe_out || p.index_k_out || p.num_targets > 0 || p.num_row_dests > 0;
    begin += p.num_tokens;
    target_base += p.num_targets;
    dest_base += p.num_row_dests;

    load_bits |= addr(p.kv) | static_cast<uint64_t>(p.kv_stride * 2) | addr(p.k_pe) |
                 static_cast<uint64_t>(p.k_pe_stride * 2);
    if (p.q_c_out) load_bits |= addr(p.q_c) | static_cast<uint64_t>(p.q_c_stride * 2);
    if (p.index_k) load_bits |= addr(p.index_k) | static_cast<uint64_t>(p.index_k_stride * 2);
    store_bits |= addr(p.q_c_out) | addr(p.kv_c_out) | addr(p.k_pe_out) | addr(p.index_k_out);
    if (p.q_c_out) store_bits |= static_cast<uint64_t>(p.q_lora_rank * 2);
    for (const CacheTarget& t : jobs[i].host_targets) {
      store_bits |= addr(t.mla_base) | static_cast<uint64_t>(t.mla.row_stride) |
                    static_cast<uint64_t>(t.mla.block_stride);
      if (p.fmt.has_indexer) store_bits |= addr(t.index_base) | static_cast<uint64_t>(t.index.block_stride);
    }
    for (uint8_t* d : jobs[i].host_row_dests) store_bits |= addr(d) | static_cast<uint64_t>(p.row_bytes);
    if (r.topk_fill) topk_bits |= addr(p.topk_fill) | static_cast<uint64_t>(p.topk_width * 4);
  }
  a.num_ranks = n;
  a.total_targets = target_base;
  a.total_dests = dest_base;
  a.total_tokens = begin;
  // Inputs are bf16: at least 2-byte aligned (validated by the caller's types).
  c.load_align = std::max(2, align_of(load_bits));
  c.store_align = align_of(store_bits);
  c.topk_vec = align_of(topk_bits) >= 16;
  if (a.total_tokens == 0) return;

  const int ql = c.num_q_leaves > 2 * kThreads ? 4 : 2;  // leaves per thread
  const bool aligned = c.load_align == 16 && c.store_align == 16;
  KernelFn fn = nullptr;
  int64_t grid = 0;
  const bool warp = v == DispatchVariant::kWarp || v == DispatchVariant::kWarpPrefetch ||
                    v == DispatchVariant::kWarpToken || v == DispatchVariant::kWarpSplit;
  if (warp && aligned && c.num_q_leaves <= kWarpKernelMaxQLeaves) {
    static_assert(kWarpKernelThreads == kThreads, "resident_ctas() assumes one block size");
    bool split = v == DispatchVariant::kWarpSplit;
    if (v == DispatchVariant::kWarp)
      split = a.total_tokens <= kSplitMaxTokensPerWarp * kWarpKernelTokensPerCta *
                                    int64_t{resident_ctas(warp_kernel_for(p0.fmt.kv_format, false, false))};
    fn = warp_kernel_for(p0.fmt.kv_format, v == DispatchVariant::kWarpPrefetch, split);
    const int64_t items = split ? 2 * a.total_tokens : a.total_tokens;
    grid = std::min<int64_t>((items + kWarpKernelTokensPerCta - 1) / kWarpKernelTokensPerCta, resident_ctas(fn));
  } else {  // the CTA kernel: simple / prefetch, and what the warp kernel does not serve
    fn = pick_kernel(p0.fmt.kv_format, ql, v == DispatchVariant::kPrefetch, aligned);
    grid = std::min<int64_t>(a.total_tokens, resident_ctas(fn));
  }
  if (pdl) {
    PCPKV_CUDA_CHECK(pdl::launch(fn, dim3(static_cast<unsigned>(grid)), dim3(kThreads), 0, stream, true, a));
  } else {
    fn<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(a);
  }
  PCPKV_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_dispatch(const DispatchJob* jobs, int num_jobs, cudaStream_t stream, DispatchVariant variant, bool pdl) {
  PCPKV_CHECK(num_jobs >= 0, "dispatch: num_jobs = {} must be >= 0", num_jobs);
  // Validate every job before enqueuing anything (host copies of the device tables stand in for them).
  for (int i = 0; i < num_jobs; ++i) {
    const DispatchJob& j = jobs[i];
    PCPKV_CHECK(static_cast<int64_t>(j.host_targets.size()) == j.params.num_targets,
                "dispatch: job {}: host_targets has {} entries but num_targets = {}", i, j.host_targets.size(),
                j.params.num_targets);
    PCPKV_CHECK(static_cast<int64_t>(j.host_row_dests.size()) == j.params.num_row_dests,
                "dispatch: job {}: host_row_dests has {} entries but num_row_dests = {}", i,
                j.host_row_dests.size(), j.params.num_row_dests);
    PCPKV_CHECK(j.params.num_targets <= kMaxTargets && j.params.num_row_dests <= kMaxDests,
                "dispatch: job {}: {} targets / {} row destinations; the CUDA kernel serves at most {} each", i,
                j.params.num_targets, j.params.num_row_dests, kMaxTargets);
    DispatchParams hp = j.params;
    hp.targets = j.host_targets.empty() ? nullptr : j.host_targets.data();
    hp.row_dests = j.host_row_dests.empty() ? nullptr : j.host_row_dests.data();
    validate_dispatch_shape(hp);
    if (hp.num_targets > 0 || hp.num_row_dests > 0 || hp.kv_c_out || hp.k_pe_out || hp.index_k_out)
      PCPKV_CHECK(hp.num_tokens == 0 || hp.slot_mapping != nullptr || hp.num_targets == 0,
                  "dispatch: job {}: slot_mapping is null", i);
  }
  // kAuto resolved once, before anything is enqueued: a bad PCPKV_DISPATCH_VARIANT throws here.
  const DispatchVariant v = resolve_variant(variant);
  // Group consecutive jobs that can share a launch.
  int first = 0;
  while (first < num_jobs) {
    int last = first + 1, targets = jobs[first].params.num_targets, dests = jobs[first].params.num_row_dests;
    while (last < num_jobs && last - first < kMaxRanks && same_common(jobs[first].params, jobs[last].params) &&
           targets + jobs[last].params.num_targets <= kMaxTargets &&
           dests + jobs[last].params.num_row_dests <= kMaxDests) {
      targets += jobs[last].params.num_targets;
      dests += jobs[last].params.num_row_dests;
      ++last;
    }
    launch_group(jobs + first, last - first, stream, v, pdl);
    first = last;
  }
}

std::vector<std::string> dispatch_kernel_resources() {
  std::vector<std::string> out;
  const KvFormat formats[] = {KvFormat::kBf16, KvFormat::kFp8, KvFormat::kFp8DsMla};
  const struct {
    int ql;
    bool prefetch, aligned;
  } instances[] = {{2, false, true}, {2, true, true}, {4, false, true}, {2, false, false}, {4, false, false}};
  for (KvFormat f : formats)
    for (const auto& in : instances) {
      KernelFn fn = pick_kernel(f, in.ql, in.prefetch, in.aligned);
      cudaFuncAttributes attr{};
      PCPKV_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
      int per_sm = 0;
      PCPKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0));
      out.push_back(fmt::format("dispatch<{}, q_leaves={}, {}, {}>: {} regs, {} B static smem, {} B local (spill), "
                                "{} CTAs/SM of {} threads",
                                to_string(f), in.ql, in.prefetch ? "prefetch" : "simple",
                                in.aligned ? "aligned" : "any alignment", attr.numRegs, attr.sharedSizeBytes,
                                attr.localSizeBytes, per_sm, kThreads));
    }
  for (KvFormat f : formats)
    for (int k = 0; k < 3; ++k) {
      const bool pf = k == 1, split = k == 2;
      KernelFn fn = warp_kernel_for(f, pf, split);
      cudaFuncAttributes attr{};
      PCPKV_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
      int per_sm = 0;
      PCPKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarpKernelThreads, 0));
      out.push_back(fmt::format("dispatch<{}, {}, aligned>: {} regs, {} B static smem, {} B local (spill), "
                                "{} CTAs/SM of {} threads = {} tokens in flight per SM",
                                to_string(f),
                                split ? "KV and Q parts as items (warp_split; warp at few tokens per warp)"
                                      : (pf ? "warp per token + L2 prefetch (warp_pf)" : "warp per token (warp_token)"),
                                attr.numRegs, attr.sharedSizeBytes, attr.localSizeBytes, per_sm, kWarpKernelThreads,
                                per_sm * kWarpKernelTokensPerCta));
    }
  return out;
}

}  // namespace pcpkv::cuda
