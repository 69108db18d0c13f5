// src/serving/kernels/cuda/router_small.h: internal interface between the router GEMM's host side (router_gemm.cu) and
// its small-T kernels (router_gemm.cu: the row-loop kernel, v1; router_small_staged.cu: the staged kernel, v2). Both
// kernels: CTA = kRouterSmallBlock threads owning experts_per_cta consecutive experts; thread i covers the 16-byte
// vectors i, i + 128, ... of the hidden dim with one fp32 FMA chain per (expert, token), then a warp butterfly and a
// pairwise sum over the 4 warps (router_logit_bound_factor(kSmallT) counts that depth).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pcpkv/serving/router.h"

namespace pcpkv::cuda::router_detail {

constexpr int kRouterSmallBlock = 128;

struct SmallArgs {
  const uint16_t* x;     // [T, hidden] bf16, row stride x_stride
  int64_t x_stride;
  const void* w;         // [E, hidden] bf16 or fp32
  float* logits;         // [T, E]
  int32_t num_tokens;
  int32_t hidden;
  int32_t n_experts;
};

/// Shared memory of the staged kernel per CTA: (experts_per_cta * (fp32 W ? 2 : 1) + bucket) slots of
/// 16 bytes per thread and vector of a pass, vectors_per_pass vectors per thread.
int64_t router_staged_smem_bytes(int32_t bucket, int32_t experts_per_cta, RouterWeightDtype w_dtype,
                                 int32_t vectors_per_pass);

/// Launches the staged kernel (RouterSmallKernel::kStaged) for the token bucket (1, 2, 4, 8) and
/// experts_per_cta (1, 2, 4, 8) on `stream`: grid n_experts / experts_per_cta. Picks the vectors per thread
/// and pass (all of a thread's vectors in one pass when they fit in max_smem_bytes). Throws pcpkv::Error
/// for a bucket or experts_per_cta that is not built, or when even one vector per pass does not fit.
void launch_router_staged(const SmallArgs& args, int32_t bucket, int32_t experts_per_cta, RouterWeightDtype w_dtype,
                          int64_t max_smem_bytes, bool pdl, cudaStream_t stream);

}  // namespace pcpkv::cuda::router_detail

#if defined(__CUDACC__)
#include "pcpkv/device/fp32.h"

namespace pcpkv::cuda::router_detail {

/// 8 bf16 (one 16-byte vector, little-endian) to fp32, exact.
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);             // element 2i: the low half
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

/// acc[e][t] += x[t, v*8 .. v*8+8) . w[e, v*8 .. v*8+8), FMAs in ascending element order (the chain order
/// both kernels share). wv[e][h]: expert e's 16-byte vector(s) (h = 1 for fp32 weights); xv: the token's.
template <int kE, bool kWf32>
__device__ __forceinline__ void small_weights_to_float(const uint4 (&wv)[kE][kWf32 ? 2 : 1], float (&wf)[kE][8]) {
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    if constexpr (kWf32) {
      wf[e][0] = __uint_as_float(wv[e][0].x);
      wf[e][1] = __uint_as_float(wv[e][0].y);
      wf[e][2] = __uint_as_float(wv[e][0].z);
      wf[e][3] = __uint_as_float(wv[e][0].w);
      wf[e][4] = __uint_as_float(wv[e][1].x);
      wf[e][5] = __uint_as_float(wv[e][1].y);
      wf[e][6] = __uint_as_float(wv[e][1].z);
      wf[e][7] = __uint_as_float(wv[e][1].w);
    } else {
      bf16x8_to_float(wv[e][0], wf[e]);
    }
  }
}

/// The epilogue both kernels share: warp butterfly (offsets 16..1), pairwise over the 4 warps, store
/// logits[t, e0 + e] for t < num_tokens. Needs every thread of the CTA (one __syncthreads).
template <int kT, int kE>
__device__ __forceinline__ void small_reduce_store(float (&acc)[kE][kT], const SmallArgs& a, int e0) {
  constexpr int kWarps = kRouterSmallBlock / 32;
  __shared__ float red[kE * kT][kWarps];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int e = 0; e < kE; ++e)
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      if (t < a.num_tokens) {
        float s = acc[e][t];
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) s = fp32::add(s, __shfl_xor_sync(0xffffffffu, s, off));
        if (lane == 0) red[e * kT + t][warp] = s;
      }
    }
  __syncthreads();
  for (int i = tid; i < kE * kT; i += kRouterSmallBlock) {
    const int e = i / kT, t = i % kT;
    if (t < a.num_tokens)
      a.logits[static_cast<int64_t>(t) * a.n_experts + e0 + e] =
          fp32::add(fp32::add(red[i][0], red[i][1]), fp32::add(red[i][2], red[i][3]));
  }
}

}  // namespace pcpkv::cuda::router_detail
#endif  // __CUDACC__
