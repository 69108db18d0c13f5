// The "warp" variant of the fused dispatch (SPEC sections 2, 3): one warp per token, no CTA barrier, the
// same bytes as dispatch.cu's CTA-per-token kernel and dispatch_reference (the same math helpers in the same
// rounding order; only the lane mapping differs). docs/perf.md section 3 explains why it should be faster.
//
// Work split, per token, inside one warp (lane l):
//   q_c      leaves 32 v + l, v = 0..7 (8 x 16-byte loads: each warp instruction reads 512 contiguous bytes);
//            q_lora_rank <= 2048 (the CTA kernel serves larger ranks)
//   kv       leaves l and l + 32 (fp8_ds_mla tiles l / 16 and 2 + l / 16)
//   k_pe     lanes 0..7, leaf l
//   index_k  lanes 16..31, leaf l - 16
//   top-k    16-byte streaming stores of -1, issued right after the loads (they need nothing)
// Reductions (token_math.h's canonical order): a lane's leaf sums, then across lanes. The 8 Q partials of a
// lane are reduced by a butterfly reduce-scatter (offsets 1, 2, 4 halve the values a lane holds, 8 and 16
// finish the 32-lane sums), which adds exactly the canonical pairs of every 32-leaf group, then the group
// tree ((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7)) by three more butterflies: 12 shuffles instead of 40.
// A persistent grid walks the tokens of up to 8 ranks; warps never wait for each other, so a SM keeps
// 24 tokens (~130 KB of loads) in flight instead of 8. The warp_pf instance also asks the copy engine for an
// L2 prefetch of the warp's next token (cp.async.bulk.prefetch.L2: one instruction per input row, no
// registers), so that token's loads hit L2 and DRAM sees more requests in flight.
// The norm weights (q_norm_w, kv_norm_w, the indexer's LayerNorm weight and bias: up to 11 KB of fp32) are
// copied into shared memory once per persistent CTA: every token reads all of them, and from L1 they cost
// ~100 global loads per token and compete with the rows for L1 (measured 3-5% faster, docs/perf.md 4d).
#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <unordered_map>

#include "core/cuda/check.h"
#include "publish/kernels/cuda/dispatch_args.cuh"
#include "publish/kernels/cuda/kernel_util.cuh"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda::dispatch_impl {
namespace {

constexpr int kWarps = 4;  // per CTA; the CTA shares only the target / destination tables
constexpr int kWarpThreads = 32 * kWarps;
constexpr int kMinBlocks = 6;  // 24 warps (tokens) per SM: caps registers at 80 (no spills; 7 spills)
constexpr int kSplitMinBlocks = 8;  // the split kernel (Q and KV parts as items): 32 warps per SM, 64 registers
constexpr int kQLeaves = 8;    // q_c leaves per lane: q_lora_rank <= 32 * 8 * 8 = 2048

// The CTA's copy of the norm weights (fp32): q_norm_w [q_lora_rank <= 2048], kv_norm_w [512], then the
// indexer's LayerNorm weight and bias [128] each.
constexpr int kWQ = 0, kWKv = 8 * 32 * kQLeaves, kWLnW = kWKv + 512, kWLnB = kWLnW + 128, kWFloats = kWLnB + 128;

/// Canonical total of 8 groups: p[v] is this lane's leaf sum of leaf 32 v + lane (group v = 32 lanes).
/// Reduce-scatter: at offset 1 a lane keeps 4 of its 8 values (the upper half when lane bit 0 is set) and
/// adds its partner's copy of them, at offset 2 it keeps 2, at offset 4 one; offsets 8 and 16 finish the
/// group sum. Each add is one of the canonical pairs of its group (both lanes of a pair hold the same
/// value index). The lane then holds group v = 4 b0 + 2 b1 + b2 (b = lane bits), and the group tree pairs
/// v bit 0 (lane bit 2), then v bit 1 (lane bit 1), then v bit 2 (lane bit 0). Every lane returns the total.
__device__ __forceinline__ float warp_total8(const float (&p)[8], int lane) {
  constexpr unsigned kFull = 0xffffffffu;
  const bool u0 = lane & 1, u1 = lane & 2, u2 = lane & 4;
  float h4[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = u0 ? p[i] : p[i + 4];
    const float keep = u0 ? p[i + 4] : p[i];
    h4[i] = fp32::add(keep, __shfl_xor_sync(kFull, send, 1));
  }
  float h2[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = u1 ? h4[i] : h4[i + 2];
    const float keep = u1 ? h4[i + 2] : h4[i];
    h2[i] = fp32::add(keep, __shfl_xor_sync(kFull, send, 2));
  }
  float g = fp32::add(u2 ? h2[1] : h2[0], __shfl_xor_sync(kFull, u2 ? h2[0] : h2[1], 4));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 8));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 16));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 4));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 2));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 1));
  return g;
}

/// Canonical total of 2 groups (p[0]: leaf lane, p[1]: leaf lane + 32): the same scheme, 6 shuffles.
__device__ __forceinline__ float warp_total2(const float (&p)[2], int lane) {
  constexpr unsigned kFull = 0xffffffffu;
  const bool u0 = lane & 1;
  float g = fp32::add(u0 ? p[1] : p[0], __shfl_xor_sync(kFull, u0 ? p[0] : p[1], 1));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 2));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 4));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 8));
  g = fp32::add(g, __shfl_xor_sync(kFull, g, 16));
  return fp32::add(g, __shfl_xor_sync(kFull, g, 1));
}

/// The overflow guard's Q total (token_math.h): the canonical sum of squares of the rescaled leaves
/// 32 v + lane of the q_c row (leaves past num_q_leaves add 0), in warp_total8's order. It reloads the row
/// (L1 / L2 hits: the token was just read) instead of reusing the kernel's registers: a rare path that reads
/// those registers again made ptxas spill the whole kernel (~300 B per thread). Every lane returns the total.
__device__ __noinline__ float rescaled_q_total(const uint16_t* row, int num_q_leaves, int lane) {
  float part[kQLeaves];
#pragma unroll
  for (int v = 0; v < kQLeaves; ++v) {
    const int leaf = 32 * v + lane;
    float qx[8] = {};
    if (leaf < num_q_leaves) unpack_bf16x8(*reinterpret_cast<const uint4*>(row + 8 * leaf), qx);
    part[v] = math::leaf_sumsq_rescaled(qx);
  }
  return warp_total8(part, lane);
}

/// The overflow guard's KV total (token_math.h): the canonical sum of squares of the rescaled leaves lane and
/// lane + 32 of the kv row, in warp_total2's order, reloaded like rescaled_q_total (the ordinary path keeps
/// its registers and code: docs/perf.md section 12). Every lane returns the total.
__device__ __noinline__ float rescaled_kv_total(const uint16_t* row, int lane) {
  float a[8], b[8];
  unpack_bf16x8(*reinterpret_cast<const uint4*>(row + 8 * lane), a);
  unpack_bf16x8(*reinterpret_cast<const uint4*>(row + 8 * (lane + 32)), b);
  const float part[2] = {math::leaf_sumsq_rescaled(a), math::leaf_sumsq_rescaled(b)};
  return warp_total2(part, lane);
}

/// Bulk prefetch of [p, p + bytes) into L2 (sm_90 copy engine; p and bytes multiples of 16). A hint: no
/// data reaches registers, nothing is written.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

/// The input rows of token g (lane 0 issues them: the addresses are warp-uniform, and the instruction takes
/// uniform operands).
__device__ __forceinline__ void prefetch_token(const DispatchArgs& a, int64_t g, int lane) {
  if (lane != 0 || g >= a.total_tokens) return;
  const RankArgs& ra = a.r[find_rank(a, g)];
  const int64_t t = g - ra.token_begin;
  if (ra.do_q) prefetch_l2(ra.q_c + t * ra.q_c_stride, static_cast<uint32_t>(a.c.q_lora_rank) * 2);
  if (!ra.need_kv) return;
  prefetch_l2(ra.kv + t * ra.kv_stride, kKvLoraRank * 2);
  prefetch_l2(ra.k_pe + t * ra.k_pe_stride, kRopeDims * 2);
  if (a.c.has_indexer) prefetch_l2(ra.index_k + t * ra.index_k_stride, kIndexHeadDim * 2);
}

/// Prefetch of the 128-byte line at p into L1 (a hint: nothing reaches registers).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

/// 8 weights from the CTA's shared-memory copy (w 16-byte aligned).
__device__ __forceinline__ void load_w8(const float* w, float (&out)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(w);
  const float4 b = *reinterpret_cast<const float4*>(w + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void store16(void* p, const uint32_t* w) { stg16(p, w[0], w[1], w[2], w[3]); }
__device__ __forceinline__ void store8(void* p, const uint32_t* w) { stg8(p, w[0], w[1]); }
/// Streaming store (evict-first): outputs this kernel never reads back.
__device__ __forceinline__ void store16_cs(void* p, const uint32_t* w) { stg16_cs(p, w[0], w[1], w[2], w[3]); }

/// kv_c: RMSNorm of leaves lane / lane + 32, the bf16 copy, and the encoded kv_c part of the MLA row
/// (ya / yb are the normalized values; words are the bytes of each leaf in the row, scale_bits the fp8_ds_mla
/// tile scales of lane 0: tiles 0..3). kv_row: where raw was loaded from (the overflow guard reloads it).
template <KvFormat F>
__device__ __forceinline__ void encode_kv(const CommonArgs& c, const float* kv_w, const uint4 (&raw)[2],
                                          const uint16_t* kv_row, int lane, uint32_t (&wa)[4],
                                          uint32_t (&wb)[4], uint32_t (&scales)[4], float (&ya)[8], float (&yb)[8]) {
  unpack_bf16x8(raw[0], ya);
  unpack_bf16x8(raw[1], yb);
  const float part[2] = {math::leaf_sumsq(ya), math::leaf_sumsq(yb)};
  float total = warp_total2(part, lane);
  float eps = c.kv_eps;
  if (!math::finite(total)) {  // overflow guard (token_math.h; SPEC 2.2), warp-uniform
    const float t2 = rescaled_kv_total(kv_row, lane);
    if (math::use_rescaled(total, t2)) {
      total = t2;
      eps = math::rescaled_eps(eps);
      math::rescale_leaf(ya);
      math::rescale_leaf(yb);
    }
  }
  const float r = math::rms_inv(total, static_cast<int>(kKvLoraRank), eps);
  float w[8];
  load_w8(kv_w + 8 * lane, w);
#pragma unroll
  for (int k = 0; k < 8; ++k) ya[k] = math::rms_apply(ya[k], r, w[k]);
  load_w8(kv_w + 8 * (lane + 32), w);
#pragma unroll
  for (int k = 0; k < 8; ++k) yb[k] = math::rms_apply(yb[k], r, w[k]);
  if constexpr (F == KvFormat::kBf16) {
    pack_bf16x8(ya, wa);
    pack_bf16x8(yb, wb);
  } else if constexpr (F == KvFormat::kFp8) {
    float qa[8], qb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) qa[k] = ya[k], qb[k] = yb[k];
    divide_by_scale(qa, c.k_scale);
    divide_by_scale(qb, c.k_scale);
    uint32_t a2[2], b2[2];
    pack_e4m3x8(qa, a2);
    pack_e4m3x8(qb, b2);
    wa[0] = a2[0]; wa[1] = a2[1];
    wb[0] = b2[0]; wb[1] = b2[1];
  } else {
    // Lanes 0..15 / 16..31 hold tiles 0 / 1 (leaf lane) and 2 / 3 (leaf lane + 32).
    const float sa = codec::ds_mla_tile_scale(lanes_max<16>(amax8(ya), 0xffffffffu), c.pow2);
    const float sb = codec::ds_mla_tile_scale(lanes_max<16>(amax8(yb), 0xffffffffu), c.pow2);
    float qa[8], qb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) qa[k] = ya[k], qb[k] = yb[k];
    divide_by_scale(qa, sa);
    divide_by_scale(qb, sb);
    uint32_t a2[2], b2[2];
    pack_e4m3x8(qa, a2);
    pack_e4m3x8(qb, b2);
    wa[0] = a2[0]; wa[1] = a2[1];
    wb[0] = b2[0]; wb[1] = b2[1];
    const float s1 = __shfl_xor_sync(0xffffffffu, sa, 16), s3 = __shfl_xor_sync(0xffffffffu, sb, 16);
    scales[0] = __float_as_uint(sa);
    scales[1] = __float_as_uint(s1);
    scales[2] = __float_as_uint(sb);
    scales[3] = __float_as_uint(s3);
  }
}

/// Writes the kv_c part of an MLA row (cache row or transport row) at `row`.
template <KvFormat F>
__device__ __forceinline__ void store_kv(uint8_t* row, int lane, const uint32_t (&wa)[4], const uint32_t (&wb)[4],
                                         const uint32_t (&scales)[4]) {
  if constexpr (F == KvFormat::kBf16) {
    store16(row + 16 * lane, wa);
    store16(row + 16 * (lane + 32), wb);
  } else {
    store8(row + 8 * lane, wa);
    store8(row + 8 * (lane + 32), wb);
    if constexpr (F == KvFormat::kFp8DsMla)
      if (lane == 0) store16(row + kDsMlaScaleOffset, scales);
  }
}

/// The norm weights -> s_w (layout above). A null weight pointer means no rank of this launch needs that norm.
/// When every pointer is 16-byte aligned, each thread issues all its 16-byte loads (at most 6) before any store:
/// one memory round trip per CTA instead of one per weight (the scalar loops took 3-4, serialized, on the way to
/// the CTA's first token; docs/perf.md section 19).
__device__ __forceinline__ void load_weights_to_smem(const CommonArgs& c, float* s_w) {
  const float* const ln_w = c.has_indexer ? c.index_ln_w : nullptr;
  const float* const ln_b = c.has_indexer && ln_w != nullptr ? c.index_ln_b : nullptr;
  const float* const lnw = ln_b != nullptr ? ln_w : nullptr;  // the LayerNorm needs both
  const uint64_t bits = reinterpret_cast<uint64_t>(c.q_norm_w) | reinterpret_cast<uint64_t>(c.kv_norm_w) |
                        reinterpret_cast<uint64_t>(lnw) | reinterpret_cast<uint64_t>(ln_b);
  if ((bits & 15u) == 0u) {
    constexpr int kVecs = kWFloats / 4, kPerThread = (kVecs + kWarpThreads - 1) / kWarpThreads;
    float4 v[kPerThread];
    const float* src[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int o = 4 * (static_cast<int>(threadIdx.x) + j * kWarpThreads);  // float offset in s_w
      const float* p = nullptr;
      if (o < kWKv) p = c.q_norm_w != nullptr && o < c.q_lora_rank ? c.q_norm_w + o : nullptr;
      else if (o < kWLnW) p = c.kv_norm_w != nullptr ? c.kv_norm_w + (o - kWKv) : nullptr;
      else if (o < kWLnB) p = lnw != nullptr ? lnw + (o - kWLnW) : nullptr;
      else if (o < kWFloats) p = ln_b != nullptr ? ln_b + (o - kWLnB) : nullptr;
      src[j] = p;
      if (p != nullptr) v[j] = __ldg(reinterpret_cast<const float4*>(p));
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      if (src[j] != nullptr) *reinterpret_cast<float4*>(s_w + 4 * (threadIdx.x + j * kWarpThreads)) = v[j];
    return;
  }
  if (c.q_norm_w != nullptr)
    for (int i = threadIdx.x; i < c.q_lora_rank; i += kWarpThreads) s_w[kWQ + i] = c.q_norm_w[i];
  if (c.kv_norm_w != nullptr)
    for (int i = threadIdx.x; i < static_cast<int>(kKvLoraRank); i += kWarpThreads) s_w[kWKv + i] = c.kv_norm_w[i];
  if (ln_b != nullptr)
    for (int i = threadIdx.x; i < static_cast<int>(kIndexHeadDim); i += kWarpThreads) {
      s_w[kWLnW + i] = ln_w[i];
      s_w[kWLnB + i] = ln_b[i];
    }
}

// Per-item timestamps for the latency profile of docs/perf.md 38 (results/2026-12-05b-h200/token_clock.cu defines
// it before including this file); compiled to nothing in pcpkv. point: 0 start, 1 inputs reduced, 2 done.
#ifndef PCPKV_DISPATCH_STAMP
#define PCPKV_DISPATCH_STAMP(item, point) ((void)(item), (void)(point))
#endif

/// The q_c row of local token t: leaves 32 v + lane (zeros past num_q_leaves or without Q).
__device__ __forceinline__ void load_q(const CommonArgs& c, const RankArgs& ra, int64_t t, int lane,
                                       uint4 (&q)[kQLeaves]) {
#pragma unroll
  for (int v = 0; v < kQLeaves; ++v) {
    const int leaf = 32 * v + lane;
    q[v] = make_uint4(0, 0, 0, 0);
    if (ra.do_q && leaf < c.num_q_leaves) q[v] = __ldcs(reinterpret_cast<const uint4*>(ra.q_c + t * ra.q_c_stride + 8 * leaf));
  }
}

/// The KV inputs of local token t (kv leaves lane / lane + 32, the k_pe or index_k leaf, slot, position), and
/// its RoPE row into L1. Untouched when the rank needs no KV part.
__device__ __forceinline__ void load_kv(const CommonArgs& c, const RankArgs& ra, int64_t t, int lane, uint4 (&kv)[2],
                                        uint4& x, int64_t& slot, int64_t& pos) {
  if (!ra.need_kv) return;
  const uint16_t* kv_row = ra.kv + t * ra.kv_stride;
  kv[0] = __ldcs(reinterpret_cast<const uint4*>(kv_row + 8 * lane));
  kv[1] = __ldcs(reinterpret_cast<const uint4*>(kv_row + 8 * (lane + 32)));
  if (lane < 8)
    x = __ldcs(reinterpret_cast<const uint4*>(ra.k_pe + t * ra.k_pe_stride + 8 * lane));
  else if (lane >= 16 && c.has_indexer)
    x = __ldcs(reinterpret_cast<const uint4*>(ra.index_k + t * ra.index_k_stride + 8 * (lane - 16)));
  if (ra.slot_mapping != nullptr) slot = __ldg(ra.slot_mapping + t);
  pos = __ldg(ra.positions + t);
  // The token's RoPE row (64 fp32 = 2 lines) into L1 now: k_pe and indexer lanes read it only after the kv_c
  // part, and that dependent load's latency was the second largest stall of the kernel (ncu source counters,
  // docs/perf.md section 17). A hint: no register, no byte written.
  if (lane < 2) prefetch_l1(c.rope_cos_sin + pos * kRopeDims + 32 * lane);
}

/// Top-k fill of local token t: stores that need nothing, issued while the loads are in flight.
__device__ __forceinline__ void fill_topk(const CommonArgs& c, const RankArgs& ra, int64_t t, int lane) {
  if (ra.topk_fill == nullptr || t < ra.topk_first_row) return;
  int32_t* row = ra.topk_fill + t * c.topk_width;
  if (c.topk_vec) {
#pragma unroll 4
    for (int64_t i = 4 * lane; i < c.topk_width; i += 4 * 32) stg16_cs(row + i, ~0u, ~0u, ~0u, ~0u);
  } else {
    for (int64_t i = lane; i < c.topk_width; i += 32) stg4(row + i, ~0u);
  }
}

/// Q RMSNorm of local token t from its loaded leaves, and the q_c_out row.
__device__ __forceinline__ void q_part(const CommonArgs& c, const RankArgs& ra, int64_t t, int lane, const float* s_w,
                                       const uint4 (&q)[kQLeaves], int64_t item) {
  float part[kQLeaves];
#pragma unroll
  for (int v = 0; v < kQLeaves; ++v) {
    float qx[8];
    unpack_bf16x8(q[v], qx);
    part[v] = math::leaf_sumsq(qx);  // zero leaves (past num_q_leaves) add +0: the canonical padding
  }
  float total = warp_total8(part, lane);
  PCPKV_DISPATCH_STAMP(item, 1);
  bool big = false;
  if (!math::finite(total)) {  // overflow guard (token_math.h; SPEC 2.1), warp-uniform
    const float t2 = rescaled_q_total(ra.q_c + t * ra.q_c_stride, c.num_q_leaves, lane);
    big = math::use_rescaled(total, t2);
    if (big) total = t2;
  }
  const float r = math::rms_inv(total, c.q_lora_rank, big ? math::rescaled_eps(c.q_eps) : c.q_eps);
  uint16_t* out = ra.q_c_out + t * c.q_lora_rank;
#pragma unroll
  for (int v = 0; v < kQLeaves; ++v) {
    const int leaf = 32 * v + lane;
    if (leaf < c.num_q_leaves) {
      float qx[8], w[8];
      unpack_bf16x8(q[v], qx);
      if (big) math::rescale_leaf(qx);
      load_w8(s_w + kWQ + 8 * leaf, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) qx[k] = math::rms_apply(qx[k], r, w[k]);
      uint32_t packed[4];
      pack_bf16x8(qx, packed);
      store16_cs(out + 8 * leaf, packed);
    }
  }
}

/// The KV part of local token t (the rank needs it): kv_c, k_pe and the indexer row into every target and
/// transport row. stamp_item: the item whose point 1 the profile stamps here (-1: none).
template <KvFormat F>
__device__ __forceinline__ void kv_part(const CommonArgs& c, const RankArgs& ra, int64_t t, int lane, const float* s_w,
                                        const TargetLite* s_targets, uint8_t* const* s_dests, const uint4 (&kv)[2],
                                        const uint4& x, int64_t slot, int64_t pos, int64_t stamp_item) {
  // ---- kv_c ----
  {
    uint32_t wa[4], wb[4], scales[4] = {0u, 0u, 0u, 0u};
    float ya[8], yb[8];
    encode_kv<F>(c, s_w + kWKv, kv, ra.kv + t * ra.kv_stride, lane, wa, wb, scales, ya, yb);
    if (stamp_item >= 0) PCPKV_DISPATCH_STAMP(stamp_item, 1);
    if (ra.kv_c_out != nullptr) {
      uint32_t p[4];
      uint16_t* out = ra.kv_c_out + t * kKvLoraRank;
      pack_bf16x8(ya, p);
      store16(out + 8 * lane, p);
      pack_bf16x8(yb, p);
      store16((out + 8 * (lane + 32)), p);
    }
    if (slot >= 0)
      for (int d = 0; d < ra.num_targets; ++d) store_kv<F>(mla_row(s_targets[ra.target_base + d], slot), lane, wa, wb, scales);
    for (int d = 0; d < ra.num_row_dests; ++d) store_kv<F>(s_dests[ra.dest_base + d] + t * c.row_bytes, lane, wa, wb, scales);
  }

  if (lane < 8) {
    // ---- k_pe: RoPE, then bf16 (bf16, fp8_ds_mla) or e4m3 / k_scale (fp8) ----
    float rc[8], rs[8];
    load_rope(c.rope_cos_sin + pos * kRopeDims, lane, c.mla_rope_interleaved, rc, rs);
    float xf[8];
    unpack_bf16x8(x, xf);
    rope_leaf(xf, lane, c.mla_rope_interleaved, rc, rs, 0xffu, true);
    if (ra.k_pe_out != nullptr) {
      uint32_t p[4];
      pack_bf16x8(xf, p);
      store16((ra.k_pe_out + t * kRopeDims + 8 * lane), p);
    }
    uint32_t words[4];
    if constexpr (F == KvFormat::kFp8) {
      divide_by_scale(xf, c.k_scale);
      uint32_t w2[2];
      pack_e4m3x8(xf, w2);
      words[0] = w2[0];
      words[1] = w2[1];
    } else {
      pack_bf16x8(xf, words);
    }
    constexpr int kBase = F == KvFormat::kBf16 ? 1024 : (F == KvFormat::kFp8 ? 512 : static_cast<int>(kDsMlaKpeOffset));
    auto put = [&](uint8_t* row) {
      if constexpr (F == KvFormat::kFp8) store8(row + kBase + 8 * lane, words);
      else store16(row + kBase + 16 * lane, words);
    };
    if (slot >= 0)
      for (int d = 0; d < ra.num_targets; ++d) put(mla_row(s_targets[ra.target_base + d], slot));
    for (int d = 0; d < ra.num_row_dests; ++d) put(s_dests[ra.dest_base + d] + t * c.row_bytes);
  } else if (lane >= 16 && c.has_indexer) {
    // ---- indexer K: LayerNorm, RoPE on dims [0, 64), optional Hadamard, UE8M0 quantization ----
    constexpr unsigned kHalf = 0xffff0000u;
    const int leaf = lane - 16;
    // The indexer row's slot: its own mapping's entry (loaded here, so the default form, null, keeps its
    // registers and loads), else the token's slot.
    const int64_t index_slot = ra.indexer_slot_mapping != nullptr ? __ldg(ra.indexer_slot_mapping + t) : slot;
    float rc[8] = {}, rs[8] = {};
    if (leaf < 8) load_rope(c.rope_cos_sin + pos * kRopeDims, leaf, c.index_rope_interleaved, rc, rs);
    float xf[8];
    bool unused = false;  // kColdCall guards the row itself
    const float r = index_ln_center<LnGuard::kColdCall>(x, ra.index_k + t * ra.index_k_stride + 8 * leaf, 16, xf,
                                                        kHalf, c.index_eps, unused);
    float w[8], b[8];
    load_w8(s_w + kWLnW + 8 * leaf, w);
    load_w8(s_w + kWLnB + 8 * leaf, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) xf[k] = math::ln_apply(xf[k], r, w[k], b[k]);
    rope_leaf(xf, leaf, c.index_rope_interleaved, rc, rs, kHalf, leaf < 8);
    if (c.hadamard) hadamard_leaf(xf, leaf, kHalf);
    if (ra.index_k_out != nullptr) {
      uint32_t p[4];
      pack_bf16x8(xf, p);
      store16((ra.index_k_out + t * kIndexHeadDim + 8 * leaf), p);
    }
    const float s = codec::indexer_scale(lanes_max<16>(amax8(xf), kHalf));
    divide_by_scale(xf, s);
    uint32_t words[2];
    pack_e4m3x8(xf, words);
    const uint32_t scale_row[4] = {__float_as_uint(s), 0u, 0u, 0u};  // scale + the 12 zero pad bytes
    if (index_slot >= 0)
      for (int d = 0; d < ra.num_targets; ++d) {
        const TargetLite& tl = s_targets[ra.target_base + d];
        uint8_t* block = tl.index_base + (index_slot >> tl.index_block_shift) * tl.index_block_stride;
        const int64_t off = index_slot & tl.index_block_mask;
        store8(block + off * kIndexHeadDim + 8 * leaf, words);
        if (leaf == 0) stg4(block + tl.index_scale_base + off * 4, scale_row[0]);
      }
    for (int d = 0; d < ra.num_row_dests; ++d) {
      uint8_t* row = s_dests[ra.dest_base + d] + t * c.row_bytes;
      store8(row + c.index_data_offset + 8 * leaf, words);
      if (leaf == 0) store16(row + c.index_scale_offset, scale_row);
    }
  }
}

// kSplit (few tokens per warp): each token is two items, its KV part (items [0, T)) and its Q part (items
// [T, 2T)), walked by the persistent grid as one list: twice the work units for the same warps, so at 4096 tokens
// the last round is not 928 whole tokens on a GPU of 3168 warps, and the long KV chains (reductions, encode,
// RoPE, 8 replicas' stores) start first while the Q rows (pure streaming) fill the end. Same math per part, so
// the same bytes. Without Q's 32 registers of loads live across the KV part, 8 CTAs fit per SM (docs/perf.md 38).
template <KvFormat F, bool kL2Prefetch, bool kSplit>
__global__ void __launch_bounds__(kWarpThreads, kSplit ? kSplitMinBlocks : kMinBlocks)
    dispatch_warp_kernel(const __grid_constant__ DispatchArgs a) {
  __shared__ TargetLite s_targets[kMaxTargets];
  __shared__ uint8_t* s_dests[kMaxDests];
  __shared__ __align__(16) float s_w[kWFloats];
  // Device tables -> shared memory once per CTA (the grid is persistent). The tables are set up by the host
  // before the launch (never written by a kernel), so this may run before the PDL wait.
  load_tables_to_smem(a, s_targets, s_dests, kWarpThreads);
  // PDL (pcpkv/core/pdl.h): everything below reads inputs or writes buffers the previous kernel may touch (the
  // norm weights too: an engine may produce them on the same stream).
  pdl::wait();
  pdl::launch_dependents();

  const CommonArgs& c = a.c;
  load_weights_to_smem(c, s_w);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t stride = int64_t{gridDim.x} * kWarps;
  if constexpr (kSplit) {
    const int64_t items = 2 * a.total_tokens;
    for (int64_t i = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5); i < items; i += stride) {
      const bool kv_item = i < a.total_tokens;
      const int64_t g = kv_item ? i : i - a.total_tokens;
      const RankArgs& ra = a.r[find_rank(a, g)];
      const int64_t t = g - ra.token_begin;
      PCPKV_DISPATCH_STAMP(i, 0);
      if (kv_item) {
        uint4 kv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        uint4 x = make_uint4(0, 0, 0, 0);
        int64_t slot = -1, pos = 0;
        load_kv(c, ra, t, lane, kv, x, slot, pos);
        fill_topk(c, ra, t, lane);
        if (ra.need_kv) kv_part<F>(c, ra, t, lane, s_w, s_targets, s_dests, kv, x, slot, pos, i);
      } else if (ra.do_q) {
        uint4 q[kQLeaves];
        load_q(c, ra, t, lane, q);
        q_part(c, ra, t, lane, s_w, q, i);
      }
      PCPKV_DISPATCH_STAMP(i, 2);
    }
  } else {
    for (int64_t g = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5); g < a.total_tokens; g += stride) {
      const RankArgs& ra = a.r[find_rank(a, g)];
      const int64_t t = g - ra.token_begin;
      PCPKV_DISPATCH_STAMP(g, 0);
      if constexpr (kL2Prefetch) prefetch_token(a, g + stride, lane);
      // every load of the token first, then the top-k fill's stores while they are in flight
      uint4 q[kQLeaves];
      load_q(c, ra, t, lane, q);
      uint4 kv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      uint4 x = make_uint4(0, 0, 0, 0);  // k_pe leaf (lanes 0..7) or index_k leaf (lanes 16..31)
      int64_t slot = -1, pos = 0;
      load_kv(c, ra, t, lane, kv, x, slot, pos);
      fill_topk(c, ra, t, lane);
      if (ra.do_q) q_part(c, ra, t, lane, s_w, q, g);
      if (ra.need_kv) kv_part<F>(c, ra, t, lane, s_w, s_targets, s_dests, kv, x, slot, pos, -1);
      PCPKV_DISPATCH_STAMP(g, 2);
    }
  }
}

template <bool kL2Prefetch, bool kSplit>
KernelFn warp_kernel_of(KvFormat f) {
  switch (f) {
    case KvFormat::kBf16: return dispatch_warp_kernel<KvFormat::kBf16, kL2Prefetch, kSplit>;
    case KvFormat::kFp8: return dispatch_warp_kernel<KvFormat::kFp8, kL2Prefetch, kSplit>;
    case KvFormat::kFp8DsMla: break;
  }
  return dispatch_warp_kernel<KvFormat::kFp8DsMla, kL2Prefetch, kSplit>;
}

}  // namespace

KernelFn warp_kernel_for(KvFormat f, bool l2_prefetch, bool split) {
  if (split) return warp_kernel_of<false, true>(f);  // no next token of the same warp to prefetch
  return l2_prefetch ? warp_kernel_of<true, false>(f) : warp_kernel_of<false, false>(f);
}

}  // namespace pcpkv::cuda::dispatch_impl
