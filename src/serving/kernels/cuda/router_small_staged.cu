// src/serving/kernels/cuda/router_small_staged.cu: the staged small-T router kernel (RouterSmallKernel::kStaged,
// "small2"; pcpkv/serving/router.h, SPEC section 7).
//
// Why a second kernel: the row-loop kernel (v1) prefetches W into registers but loads x inside its FMA loop,
// and the compiler keeps each of those loads behind the previous vector's FMAs: one dependent L2 round trip
// per 16-byte vector of a thread (6 for GLM-5, 7 for DeepSeek-V3.2), on top of the HBM round trip for W.
// At T = 1 that chain, not HBM bandwidth, set its 3.3 us (W alone is 0.74 us at 4.2 TB/s).
// Here every load of a pass is issued before the first FMA, as 16-byte cp.async into shared memory, so a
// pass costs one HBM round trip (W and x overlap) with no register limit on the bytes in flight:
//   * W with .cg (L2 only: read once per call, keep it out of L1), issued BEFORE the PDL wait: W is a
//     weight, not the previous kernel's output, so under PDL its HBM read overlaps the producer's tail;
//   * x with .ca after the PDL wait (the CTAs on one SM read the same x rows: L1 can serve the second).
// Each thread reads back only the slots it filled itself, so cp.async.wait_all is the only wait (no CTA
// barrier before the FMAs). FMA chains, butterfly and warp sum are v1's, in v1's order: bit-identical logits.
//
// Shared memory per CTA: slot s of thread i at stage[s * 128 + i] (16 B; consecutive threads hit consecutive
// banks); slots [0, kE*kL*nU) hold W (expert e, half h, vector u at (e*kL + h)*nU + u), then kT*nU slots of
// x (token t, vector u at kE*kL*nU + t*nU + u). nU = vectors per thread and pass: all of them (one pass)
// when they fit, e.g. GLM-5 T=1 e1: 2 * 6 * 2 KiB = 24 KiB; T=8 e2: 10 * 6 * 2 KiB = 120 KiB.
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "core/cuda/check.h"
#include "serving/kernels/cuda/router_small.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda::router_detail {
namespace {

constexpr int kBlock = kRouterSmallBlock;

__device__ __forceinline__ void cp_async_cg16(uint32_t smem_addr, const void* gptr) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr), "l"(gptr) : "memory");
}
__device__ __forceinline__ void cp_async_ca16(uint32_t smem_addr, const void* gptr) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_addr), "l"(gptr) : "memory");
}
/// Waits for this thread's cp.async copies; they are then visible to this thread.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

template <int kT, int kE, bool kWf32>
__global__ void __launch_bounds__(kBlock) router_staged_kernel(SmallArgs a, int32_t n_u) {
  constexpr int kL = kWf32 ? 2 : 1;  // 16-byte loads per 8 weights
  extern __shared__ uint4 stage[];
  const int tid = threadIdx.x;
  const int e0 = blockIdx.x * kE;
  const int num_vec = a.hidden / 8;
  const size_t w_row_bytes = static_cast<size_t>(a.hidden) * (kWf32 ? 4 : 2);
  const char* w_base = static_cast<const char*>(a.w) + static_cast<size_t>(e0) * w_row_bytes;
  const uint32_t stage_addr = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  const int x_slot0 = kE * kL * n_u;

  float acc[kE][kT];
#pragma unroll
  for (int e = 0; e < kE; ++e)
#pragma unroll
    for (int t = 0; t < kT; ++t) acc[e][t] = 0.0f;

  const int per_pass = kBlock * n_u;
  for (int base = 0; base < num_vec; base += per_pass) {
    // 1. W of the pass: every load in flight at once.
    for (int u = 0; u < n_u; ++u) {
      const int v = base + u * kBlock + tid;
      if (v < num_vec) {
#pragma unroll
        for (int e = 0; e < kE; ++e)
#pragma unroll
          for (int h = 0; h < kL; ++h)
            cp_async_cg16(stage_addr + static_cast<uint32_t>(((e * kL + h) * n_u + u) * kBlock + tid) * 16u,
                          w_base + e * w_row_bytes + static_cast<size_t>(v) * 16 * kL + h * 16);
      }
    }
    if (base == 0) {
      pdl::wait();  // x is the previous kernel's output; logits may still be read by it (WAR)
      pdl::launch_dependents();
    }
    // 2. x of the pass, behind the W loads in the same memory pipeline.
    for (int u = 0; u < n_u; ++u) {
      const int v = base + u * kBlock + tid;
      if (v < num_vec) {
#pragma unroll
        for (int t = 0; t < kT; ++t)
          if (t < a.num_tokens)
            cp_async_ca16(stage_addr + static_cast<uint32_t>((x_slot0 + t * n_u + u) * kBlock + tid) * 16u,
                          a.x + t * a.x_stride + static_cast<int64_t>(v) * 8);
      }
    }
    cp_async_wait_all();
    // 3. FMAs from shared memory, v1's order: vector ascending, then token, expert, element.
    for (int u = 0; u < n_u; ++u) {
      const int v = base + u * kBlock + tid;
      if (v < num_vec) {
        uint4 wv[kE][kL];
#pragma unroll
        for (int e = 0; e < kE; ++e)
#pragma unroll
          for (int h = 0; h < kL; ++h) wv[e][h] = stage[((e * kL + h) * n_u + u) * kBlock + tid];
        float wf[kE][8];
        small_weights_to_float<kE, kWf32>(wv, wf);
#pragma unroll
        for (int t = 0; t < kT; ++t) {
          if (t < a.num_tokens) {
            float xf[8];
            bf16x8_to_float(stage[(x_slot0 + t * n_u + u) * kBlock + tid], xf);
#pragma unroll
            for (int e = 0; e < kE; ++e)
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[e][t] = fp32::fma(xf[j], wf[e][j], acc[e][t]);
          }
        }
      }
    }
    // The next pass refills this thread's own slots: its reads above completed (their values fed the FMAs).
  }
  if (num_vec == 0) {  // cannot happen (hidden >= 8 is validated); never write before the wait
    pdl::wait();
    pdl::launch_dependents();
  }
  small_reduce_store<kT, kE>(acc, a, e0);
}

using StagedKernel = void (*)(SmallArgs, int32_t);

template <int kT, int kE>
StagedKernel pick_w(RouterWeightDtype d) {
  return d == RouterWeightDtype::kBf16 ? router_staged_kernel<kT, kE, false> : router_staged_kernel<kT, kE, true>;
}

template <int kT>
StagedKernel pick_e(int32_t experts_per_cta, RouterWeightDtype d) {
  switch (experts_per_cta) {
    case 1: return pick_w<kT, 1>(d);
    case 2: return pick_w<kT, 2>(d);
    case 4: return pick_w<kT, 4>(d);
    case 8: return pick_w<kT, 8>(d);
    default: return nullptr;
  }
}

StagedKernel pick(int32_t bucket, int32_t experts_per_cta, RouterWeightDtype d) {
  switch (bucket) {
    case 1: return pick_e<1>(experts_per_cta, d);
    case 2: return pick_e<2>(experts_per_cta, d);
    case 4: return pick_e<4>(experts_per_cta, d);
    case 8: return pick_e<8>(experts_per_cta, d);
    default: return nullptr;
  }
}

/// Raises a kernel's dynamic shared memory limit once per (kernel, device): the attribute is per device.
void allow_smem(StagedKernel k, int64_t max_smem_bytes) {
  static std::mutex mu;
  static std::set<std::pair<StagedKernel, int>> done;
  int device = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({k, device})) return;
  // The dynamic limit is what the CTA may opt into minus the kernel's own static shared memory, as the
  // compiler laid it out (not our estimate of it).
  cudaFuncAttributes attr{};
  PCPKV_CUDA_CHECK(cudaFuncGetAttributes(&attr, k));
  PCPKV_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(max_smem_bytes - static_cast<int64_t>(attr.sharedSizeBytes))));
  done.insert({k, device});
}

}  // namespace

int64_t router_staged_smem_bytes(int32_t bucket, int32_t experts_per_cta, RouterWeightDtype w_dtype,
                                 int32_t vectors_per_pass) {
  const int64_t slots = int64_t{experts_per_cta} * (w_dtype == RouterWeightDtype::kFp32 ? 2 : 1) + bucket;
  return slots * vectors_per_pass * kBlock * 16;
}

void launch_router_staged(const SmallArgs& a, int32_t bucket, int32_t experts_per_cta, RouterWeightDtype w_dtype,
                          int64_t max_smem_bytes, bool pdl_on, cudaStream_t stream) {
  const StagedKernel k = pick(bucket, experts_per_cta, w_dtype);
  PCPKV_CHECK(k != nullptr,
              "router: the staged kernel (small2) is built for token buckets 1, 2, 4, 8 and experts_per_cta 1, 2, "
              "4, 8; got bucket {} (num_tokens {}), experts_per_cta {}",
              bucket, a.num_tokens, experts_per_cta);
  PCPKV_CHECK(a.n_experts % experts_per_cta == 0, "router: experts_per_cta = {} does not divide n_experts = {}",
              experts_per_cta, a.n_experts);
  const int32_t num_vec = a.hidden / 8;
  int32_t n_u = (num_vec + kBlock - 1) / kBlock;  // one pass when it fits
  // Static shared memory of the epilogue comes on top of the dynamic part.
  const int64_t static_bytes = int64_t{experts_per_cta} * bucket * (kBlock / 32) * 4;
  while (n_u > 1 && router_staged_smem_bytes(bucket, experts_per_cta, w_dtype, n_u) + static_bytes > max_smem_bytes)
    n_u = (n_u + 1) / 2;
  const int64_t smem = router_staged_smem_bytes(bucket, experts_per_cta, w_dtype, n_u);
  PCPKV_CHECK(smem + static_bytes <= max_smem_bytes,
              "router: the staged kernel needs {} bytes of shared memory per CTA for bucket {}, experts_per_cta {}; "
              "the device allows {}",
              smem + static_bytes, bucket, experts_per_cta, max_smem_bytes);
  // Static + dynamic above the default 48 KB needs the opt-in; raising it once per kernel is cheap.
  allow_smem(k, max_smem_bytes);
  PCPKV_CUDA_CHECK(pdl::launch(k, dim3(static_cast<unsigned>(a.n_experts / experts_per_cta)), dim3(kBlock),
                               static_cast<size_t>(smem), stream, pdl_on, a, n_u));
}

}  // namespace pcpkv::cuda::router_detail
