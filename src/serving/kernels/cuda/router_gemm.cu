// src/serving/kernels/cuda/router_gemm.cu: the router GEMM (pcpkv/serving/router.h, SPEC section 7): host side, and the
// row-loop small-T kernel (v1, "small"; the staged kernel "small2" is in router_small_staged.cu).
//
// Small T (1..32): a CUDA-core kernel bound by reading W once. CTA = 128 threads owning kE experts;
// thread i covers 16-byte vectors i, i+128, ... of the hidden dim, so each thread streams its W vectors
// (ld.global.nc, no L1 allocation: read once) and re-reads x from L2. All W loads of a pass are issued
// before the PDL wait: W is a weight, not the previous kernel's output, so with PDL its HBM read overlaps
// the producer's tail. fp32 accumulation: one FMA chain per thread (ascending k), warp butterfly, pairwise
// over the 4 warps; deterministic, and the depth is what router_logit_bound_factor(kSmallT) counts.
// (Its x loads stay behind the previous vector's FMAs: one L2 round trip per vector; v2 removes that.)
// Larger T: cuBLASLt (bf16 x bf16 -> fp32, fp32 compute; fp32 weights: fp32 GEMM on an fp32 copy of x).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "core/cuda/check.h"
#include "serving/kernels/cuda/router_small.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/serving/router.h"

#define RG_LT_CHECK(call)                                                                     \
  do {                                                                                        \
    const cublasStatus_t rg_st_ = (call);                                                     \
    PCPKV_CHECK(rg_st_ == CUBLAS_STATUS_SUCCESS, "router: {} failed: cuBLAS status {}", #call, \
                static_cast<int>(rg_st_));                                                    \
  } while (0)

namespace pcpkv::cuda {
namespace {

using router_detail::bf16x8_to_float;
using router_detail::SmallArgs;

constexpr int kBlock = router_detail::kRouterSmallBlock;
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

/// 16-byte streaming load of weights: read once per call, so keep it out of L1. volatile keeps the
/// weight loads ahead of the PDL wait.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

/// 16-byte loads per 8 weights, and how many passes of 8 vectors each thread keeps in flight: enough
/// bytes in flight per SM to cover HBM latency without spilling the W registers.
template <bool kWf32>
constexpr int kWLoads = kWf32 ? 2 : 1;
/// (With many tokens the compiler hoists every x load of a pass too: fewer vectors per pass then.)
template <int kT, int kE, bool kWf32>
constexpr int unroll() {
  int u = 8 / (kE * kWLoads<kWf32>);
  if (kT >= 16 && u > 4) u = 4;
  return u < 2 ? 2 : u;
}

template <int kT, int kE, bool kWf32>
__global__ void __launch_bounds__(kBlock) router_small_kernel(SmallArgs a) {
  constexpr int kU = unroll<kT, kE, kWf32>();
  constexpr int kL = kWLoads<kWf32>;
  const int tid = threadIdx.x;
  const int e0 = blockIdx.x * kE;
  const int num_vec = a.hidden / 8;
  const size_t w_row_bytes = static_cast<size_t>(a.hidden) * (kWf32 ? 4 : 2);
  const char* w_base = static_cast<const char*>(a.w) + static_cast<size_t>(e0) * w_row_bytes;

  float acc[kE][kT];
#pragma unroll
  for (int e = 0; e < kE; ++e)
#pragma unroll
    for (int t = 0; t < kT; ++t) acc[e][t] = 0.0f;

  bool waited = false;
  for (int base = 0; base < num_vec; base += kBlock * kU) {
    uint4 wv[kE][kU][kL];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = base + u * kBlock + tid;
#pragma unroll
      for (int e = 0; e < kE; ++e)
#pragma unroll
        for (int h = 0; h < kL; ++h)
          wv[e][u][h] = v < num_vec ? ld_stream(w_base + e * w_row_bytes + static_cast<size_t>(v) * 16 * kL + h * 16)
                                    : make_uint4(0, 0, 0, 0);
    }
    if (!waited) {
      pdl::wait();  // x is the previous kernel's output
      pdl::launch_dependents();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = base + u * kBlock + tid;
      if (v < num_vec) {
        float wf[kE][8];
#pragma unroll
        for (int e = 0; e < kE; ++e) {
          if constexpr (kWf32) {
            const uint32_t* p0 = reinterpret_cast<const uint32_t*>(&wv[e][u][0]);
            const uint32_t* p1 = reinterpret_cast<const uint32_t*>(&wv[e][u][1]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              wf[e][j] = __uint_as_float(p0[j]);
              wf[e][4 + j] = __uint_as_float(p1[j]);
            }
          } else {
            bf16x8_to_float(wv[e][u][0], wf[e]);
          }
        }
#pragma unroll
        for (int t = 0; t < kT; ++t) {
          if (t < a.num_tokens) {
            // A plain load, not ld.global.nc: under PDL the producer of x was still writing while this
            // kernel was alive, which breaks .nc's read-only-for-the-kernel's-lifetime contract.
            const uint4 xv = reinterpret_cast<const uint4*>(a.x + t * a.x_stride)[v];
            float xf[8];
            bf16x8_to_float(xv, xf);
#pragma unroll
            for (int e = 0; e < kE; ++e)
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[e][t] = fp32::fma(xf[j], wf[e][j], acc[e][t]);
          }
        }
      }
    }
  }
  if (!waited) {  // hidden == 0 cannot happen (validated), but never skip the wait before writing
    pdl::wait();
    pdl::launch_dependents();
  }

  router_detail::small_reduce_store<kT, kE>(acc, a, e0);
}

/// bf16 -> fp32 copy of x for the fp32-weight cuBLASLt path (exact).
__global__ void bf16_to_f32_kernel(const uint16_t* x, int64_t x_stride, float* y, int64_t num_tokens,
                                   int64_t hidden) {
  pdl::wait();
  pdl::launch_dependents();
  const int64_t n = num_tokens * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / hidden, k = i % hidden;
    y[i] = __uint_as_float(static_cast<uint32_t>(x[t * x_stride + k]) << 16);
  }
}

using SmallKernel = void (*)(SmallArgs);

template <int kT, int kE>
SmallKernel pick_w(RouterWeightDtype d) {
  return d == RouterWeightDtype::kBf16 ? router_small_kernel<kT, kE, false> : router_small_kernel<kT, kE, true>;
}

// Accumulator budget: kE * kT <= 64 registers (beyond that the kernel spills; cuBLASLt is the answer).
template <int kT>
SmallKernel pick_e(int experts_per_cta, RouterWeightDtype d) {
  switch (experts_per_cta) {
    case 1: return pick_w<kT, 1>(d);
    case 2: return pick_w<kT, 2>(d);
    case 4:
      if constexpr (4 * kT <= 64) return pick_w<kT, 4>(d);
      break;
    case 8:
      if constexpr (8 * kT <= 64) return pick_w<kT, 8>(d);
      break;
    default: break;
  }
  return nullptr;
}

SmallKernel pick_small_kernel(int32_t bucket, int experts_per_cta, RouterWeightDtype d) {
  switch (bucket) {
    case 1: return pick_e<1>(experts_per_cta, d);
    case 2: return pick_e<2>(experts_per_cta, d);
    case 4: return pick_e<4>(experts_per_cta, d);
    case 8: return pick_e<8>(experts_per_cta, d);
    case 16: return pick_e<16>(experts_per_cta, d);
    case 32: return pick_e<32>(experts_per_cta, d);
    default: return nullptr;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// ---- RouterGemm ----------------------------------------------------------------------------------

struct RouterGemm::Impl {
  int64_t hidden = 0;
  int64_t n_experts = 0;
  RouterWeightDtype w_dtype = RouterWeightDtype::kBf16;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  float* x_f32 = nullptr;          // fp32 copy of x (fp32-weight cuBLASLt path)
  int64_t x_f32_tokens = 0;
  int64_t max_smem_optin = 0;      // shared memory a CTA may opt into (staged kernel)

  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<std::pair<int64_t, int64_t>, Plan> plans;  // (num_tokens, x_stride)

  ~Impl() {
    for (auto& [key, p] : plans) {
      if (p.op) cublasLtMatmulDescDestroy(p.op);
      if (p.a) cublasLtMatrixLayoutDestroy(p.a);
      if (p.b) cublasLtMatrixLayoutDestroy(p.b);
      if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    }
    if (lt) cublasLtDestroy(lt);
    if (workspace) cudaFree(workspace);
    if (x_f32) cudaFree(x_f32);
  }

  const Plan& plan(int64_t num_tokens, int64_t x_stride) {
    const auto key = std::make_pair(num_tokens, x_stride);
    if (auto it = plans.find(key); it != plans.end()) return it->second;
    const bool f32 = w_dtype == RouterWeightDtype::kFp32;
    const cudaDataType_t ab = f32 ? CUDA_R_32F : CUDA_R_16BF;
    Plan p;
    // Column-major view: D[E, T] = op(A)[E, hidden] . B[hidden, T] with A = W stored [hidden, E] (ld hidden),
    // op(A) = A^T; B = x stored [hidden, T] (ld x_stride); D = logits [E, T] (ld E) = row-major [T, E].
    RG_LT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    RG_LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    RG_LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    RG_LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, hidden, n_experts, hidden));
    RG_LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, hidden, num_tokens, f32 ? hidden : x_stride));
    RG_LT_CHECK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_32F, n_experts, num_tokens, n_experts));
    cublasLtMatmulPreference_t pref = nullptr;
    RG_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    RG_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result{};
    int num_results = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.d, p.d, pref, 1, &result, &num_results);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || num_results == 0) {
      cublasLtMatmulDescDestroy(p.op);
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.d);
      PCPKV_FAIL("router: cuBLASLt has no algorithm for {} x {} x {} ({} weights), status {}", num_tokens, n_experts,
                 hidden, to_string(w_dtype), static_cast<int>(st));
    }
    p.algo = result.algo;
    return plans.emplace(key, p).first->second;
  }
};

RouterGemm::RouterGemm(int64_t hidden, int64_t n_experts, RouterWeightDtype w_dtype) : impl_(new Impl) {
  PCPKV_CHECK(hidden > 0 && hidden % 8 == 0 && hidden <= (int64_t{1} << 24),
              "router: hidden = {} must be a positive multiple of 8", hidden);
  PCPKV_CHECK(n_experts >= 1 && n_experts <= 512, "router: n_experts = {} is outside [1, 512]", n_experts);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  PCPKV_CHECK(err == cudaSuccess && count > 0, "router: no CUDA device ({})",
              err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
  impl_->hidden = hidden;
  impl_->n_experts = n_experts;
  impl_->w_dtype = w_dtype;
  int device = 0, smem_optin = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  PCPKV_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  impl_->max_smem_optin = smem_optin;
  RG_LT_CHECK(cublasLtCreate(&impl_->lt));
  PCPKV_CUDA_CHECK(cudaMalloc(&impl_->workspace, kWorkspaceBytes));
}

RouterGemm::~RouterGemm() = default;

int64_t RouterGemm::hidden() const { return impl_->hidden; }
int64_t RouterGemm::n_experts() const { return impl_->n_experts; }
RouterWeightDtype RouterGemm::w_dtype() const { return impl_->w_dtype; }

void RouterGemm::run(const uint16_t* x, int64_t x_stride, const void* w, float* logits, int64_t num_tokens,
                     CUstream_st* stream, const RouterGemmOptions& options) {
  Impl& m = *impl_;
  PCPKV_CHECK(num_tokens >= 0 && num_tokens <= (int64_t{1} << 30), "router: num_tokens = {} is out of range",
              num_tokens);
  if (num_tokens == 0) return;
  PCPKV_CHECK(x_stride >= m.hidden && x_stride % 8 == 0,
              "router: x_stride = {} must be >= hidden = {} and a multiple of 8 (16-byte rows)", x_stride, m.hidden);
  PCPKV_CHECK(x != nullptr && w != nullptr && logits != nullptr, "router: null x, w or logits pointer");
  PCPKV_CHECK(aligned16(x) && aligned16(w), "router: x and w must be 16-byte aligned");

  RouterPath path = options.path;
  int experts_per_cta = options.experts_per_cta;
  RouterSmallKernel small_kernel = options.small_kernel;
  if (path == RouterPath::kAuto) {
    const RouterDispatchEntry e = router_dispatch(num_tokens);
    path = e.path;
    if (experts_per_cta == 0) experts_per_cta = e.experts_per_cta;
    if (small_kernel == RouterSmallKernel::kAuto) small_kernel = e.kernel;
  }
  if (path == RouterPath::kSmallT && num_tokens > kRouterSmallMaxTokens) path = RouterPath::kCublasLt;

  if (path == RouterPath::kSmallT) {
    const RouterDispatchEntry row = router_dispatch(num_tokens);
    if (experts_per_cta == 0) experts_per_cta = row.path == RouterPath::kSmallT ? row.experts_per_cta : 1;
    if (small_kernel == RouterSmallKernel::kAuto)
      small_kernel = row.path == RouterPath::kSmallT ? row.kernel : RouterSmallKernel::kRowLoop;
    const int32_t bucket = router_token_bucket(num_tokens);
    PCPKV_CHECK(m.n_experts % experts_per_cta == 0, "router: experts_per_cta = {} does not divide n_experts = {}",
                experts_per_cta, m.n_experts);
    SmallArgs a{x, x_stride, w, logits, static_cast<int32_t>(num_tokens), static_cast<int32_t>(m.hidden),
                static_cast<int32_t>(m.n_experts)};
    if (small_kernel == RouterSmallKernel::kStaged) {
      router_detail::launch_router_staged(a, bucket, experts_per_cta, m.w_dtype, m.max_smem_optin, options.pdl,
                                          stream);
      return;
    }
    const SmallKernel k = pick_small_kernel(bucket, experts_per_cta, m.w_dtype);
    PCPKV_CHECK(k != nullptr,
                "router: experts_per_cta = {} with {} tokens (bucket {}) is not built (1, 2, 4, 8 with "
                "experts_per_cta x bucket <= 64)",
                experts_per_cta, num_tokens, bucket);
    PCPKV_CUDA_CHECK(pdl::launch(k, dim3(static_cast<unsigned>(m.n_experts / experts_per_cta)), dim3(kBlock), 0,
                              stream, options.pdl, a));
    return;
  }

  // cuBLASLt
  const bool f32 = m.w_dtype == RouterWeightDtype::kFp32;
  const void* b_ptr = x;
  if (f32) {
    if (m.x_f32_tokens < num_tokens) {
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      PCPKV_CUDA_CHECK(cudaStreamIsCapturing(stream, &cs));
      PCPKV_CHECK(cs == cudaStreamCaptureStatusNone,
                  "router: the fp32-weight cuBLASLt path must run once with {} tokens before graph capture "
                  "(it allocates its fp32 copy of x)",
                  num_tokens);
      if (m.x_f32) PCPKV_CUDA_CHECK(cudaFree(m.x_f32));
      m.x_f32 = nullptr;
      PCPKV_CUDA_CHECK(cudaMalloc(&m.x_f32, static_cast<size_t>(num_tokens * m.hidden) * sizeof(float)));
      m.x_f32_tokens = num_tokens;
    }
    const int64_t n = num_tokens * m.hidden;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 1024));
    PCPKV_CUDA_CHECK(pdl::launch(bf16_to_f32_kernel, dim3(blocks), dim3(256), 0, stream, options.pdl, x, x_stride,
                              m.x_f32, num_tokens, m.hidden));
    b_ptr = m.x_f32;
  }
  const Impl::Plan& p = m.plan(num_tokens, x_stride);
  const float alpha = 1.0f, beta = 0.0f;
  RG_LT_CHECK(cublasLtMatmul(m.lt, p.op, &alpha, w, p.a, b_ptr, p.b, &beta, logits, p.d, logits, p.d, &p.algo,
                             m.workspace, kWorkspaceBytes, stream));
}

}  // namespace pcpkv::cuda
