// src/serving/kernels/cuda/router_topk.cu: grouped top-k routing on the device (pcpkv/serving/router.h, SPEC section
// 7).
//
// One warp per token; lane l holds experts l, l+32, ... (kPerLane of them) in registers. Group scores go
// through shared memory (lane g scans group g). Every selection is a warp arg-max under one total order
// (larger score first, then lower index), so the result does not depend on the shuffle order.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/serving/router.h"

namespace pcpkv::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 512;

struct TopkArgs {
  const float* logits;  // [T, E]
  const float* bias;    // [E] or null
  int32_t* ids;         // [T, top_k]
  float* weights;       // [T, top_k]
  int64_t num_tokens;
  int32_t n_experts;
  int32_t top_k;
  int32_t n_group;
  int32_t topk_group;
  float scale;
  bool norm;
  bool logits_bf16;
};

/// (value, index) arg-max across the warp: larger value wins, then lower index. `extra` travels along.
__device__ __forceinline__ void warp_argmax(float& v, int& idx, float& extra) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    const float oe = __shfl_xor_sync(0xffffffffu, extra, off);
    if (ov > v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
      extra = oe;
    }
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) grouped_topk_kernel(TopkArgs a) {
  pdl::wait();
  pdl::launch_dependents();
  __shared__ float biased_smem[kWarpsPerBlock][kMaxExperts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + warp;
  if (t >= a.num_tokens) return;  // whole warp leaves; only __syncwarp below
  const float* row = a.logits + t * a.n_experts;
  const float kNegInf = -INFINITY;

  float s[kPerLane], b[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e < a.n_experts) {
      float l = row[e];
      if (a.logits_bf16) l = codec::bf16_to_float(codec::float_to_bf16(l));
      s[j] = fp32::div(1.0f, fp32::add(1.0f, expf(-l)));
      b[j] = fp32::add(s[j], a.bias != nullptr ? a.bias[e] : 0.0f);
    } else {
      s[j] = 0.0f;
      b[j] = kNegInf;
    }
  }

  const int group_size = a.n_experts / a.n_group;
  if (a.n_group > 1) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < a.n_experts) biased_smem[warp][e] = b[j];
    }
    __syncwarp();
    float gscore = kNegInf;
    if (lane < a.n_group) {
      float top1 = kNegInf, top2 = kNegInf;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        const float v = biased_smem[warp][e];
        if (v > top1) {
          top2 = top1;
          top1 = v;
        } else if (v > top2) {
          top2 = v;
        }
      }
      gscore = fp32::add(top1, top2);
    }
    uint32_t kept = 0;
    for (int i = 0; i < a.topk_group; ++i) {
      float v = (kept >> lane) & 1u ? kNegInf : gscore;
      int idx = lane < a.n_group && !((kept >> lane) & 1u) ? lane : 1 << 30;
      float unused = 0.0f;
      warp_argmax(v, idx, unused);
      kept |= 1u << idx;
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < a.n_experts && !((kept >> (e / group_size)) & 1u)) b[j] = kNegInf;
    }
  }

  float sum = 0.0f;
  int my_id = 0;
  float my_s = 0.0f;
  for (int i = 0; i < a.top_k; ++i) {
    float v = kNegInf;
    int idx = 1 << 30;
    float sv = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < a.n_experts && (b[j] > v || (b[j] == v && e < idx))) {
        v = b[j];
        idx = e;
        sv = s[j];
      }
    }
    warp_argmax(v, idx, sv);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j == idx) b[j] = kNegInf;  // taken
    sum = fp32::add(sum, sv);
    if (lane == i) {
      my_id = idx;
      my_s = sv;
    }
  }
  if (lane < a.top_k) {
    const float denom = a.norm ? fp32::add(sum, 1e-20f) : 1.0f;
    a.ids[t * a.top_k + lane] = my_id;
    a.weights[t * a.top_k + lane] = fp32::mul(fp32::div(my_s, denom), a.scale);
  }
}

}  // namespace

void grouped_topk(const float* logits, int64_t num_tokens, const float* bias, const RouterConfig& c, int32_t* ids,
                  float* weights, CUstream_st* stream, bool pdl) {
  validate_router_config(c);
  PCPKV_CHECK(num_tokens >= 0, "router: num_tokens = {} must be >= 0", num_tokens);
  if (num_tokens == 0) return;
  PCPKV_CHECK(logits != nullptr && ids != nullptr && weights != nullptr,
              "router: null logits, ids or weights pointer");
  TopkArgs a{logits,
             bias,
             ids,
             weights,
             num_tokens,
             static_cast<int32_t>(c.n_experts),
             static_cast<int32_t>(c.top_k),
             static_cast<int32_t>(c.n_group),
             static_cast<int32_t>(c.topk_group),
             static_cast<float>(c.routed_scaling_factor),
             c.norm_topk_prob,
             c.logits_bf16};
  const dim3 grid(static_cast<unsigned>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(kWarpsPerBlock * 32);
  const int per_lane = static_cast<int>((c.n_experts + 31) / 32);
  if (per_lane <= 2)
    PCPKV_CUDA_CHECK(pdl::launch(grouped_topk_kernel<2>, grid, block, 0, stream, pdl, a));
  else if (per_lane <= 4)
    PCPKV_CUDA_CHECK(pdl::launch(grouped_topk_kernel<4>, grid, block, 0, stream, pdl, a));
  else if (per_lane <= 8)
    PCPKV_CUDA_CHECK(pdl::launch(grouped_topk_kernel<8>, grid, block, 0, stream, pdl, a));
  else
    PCPKV_CUDA_CHECK(pdl::launch(grouped_topk_kernel<16>, grid, block, 0, stream, pdl, a));
}

}  // namespace pcpkv::cuda
