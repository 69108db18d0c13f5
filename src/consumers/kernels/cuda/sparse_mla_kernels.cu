// CUDA sparse MLA attention (SPEC section 6), the kSimt kernel and the entry point (kMma lives in
// sparse_mla_mma.cu): fp32 CUDA-core math, online softmax over tiles of 32
// selected slots. One block per (token, group of 16 heads); the arithmetic order depends only on that
// token's query and index row, so results are bit-reproducible across batches, grids and PCP layouts.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/sparse_mla.h"
#include "consumers/kernels/cuda/sparse_mla_mma.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("sparse_mla: {}: {}", what, cudaGetErrorString(e));
}

constexpr int kThreads = 256;
constexpr int kHeads = 16;        // heads per block
constexpr int kKeys = 32;         // selected slots per tile (= warp size: one lane per key)
constexpr int kQk = consumers::kMlaQkDim;
constexpr int kV = consumers::kMlaVDim;
constexpr int kKStride = kQk + 1; // padded row: lanes reading different rows hit different banks
constexpr int kChunks = kQk / 8;  // decode chunks per row

struct Smem {
  float q[kHeads][kQk];           // (heads, 576) queries as fp32 (bf16 exact)
  float k[kKeys][kKStride];       // (keys, 576) decoded rows of the tile
  float p[kKeys][kHeads];         // (keys, heads) scores, then softmax numerators
  float m[kHeads], l[kHeads], alpha[kHeads];
  int32_t slot[kKeys];
};

__global__ void __launch_bounds__(kThreads) sparse_mla_kernel(SparseMlaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int H = p.num_heads;
  const int nh = H - h0 < kHeads ? H - h0 : kHeads;
  const int64_t num_slots = p.geometry.num_blocks * p.geometry.block_size;
  const int32_t bs = p.geometry.block_size;

  for (int i = tid; i < kHeads * kQk; i += kThreads) {
    const int g = i / kQk, d = i % kQk;
    sm.q[g][d] = g < nh ? codec::bf16_to_float(p.q[((t * H) + h0 + g) * kQk + d]) : 0.0f;
  }
  if (tid < kHeads) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.0f;
  }
  float acc[kHeads][2];  // (heads, dims tid and tid + 256)
#pragma unroll
  for (int g = 0; g < kHeads; ++g) acc[g][0] = acc[g][1] = 0.0f;

  const int32_t* idx_row = p.indices + t * p.topk;
  bool seen = false;  // any valid slot (block-uniform): decides "no key" (zeros, -inf) at the end
  for (int tile0 = 0; tile0 < p.topk; tile0 += kKeys) {
    int valid = 0;
    if (tid < kKeys) {
      int32_t s = tile0 + tid < p.topk ? idx_row[tile0 + tid] : -1;
      if (s < -1 || s >= num_slots) s = -1;  // out of range: skipped like -1 (validate on the host)
      sm.slot[tid] = s;
      valid = s >= 0;
    }
    if (!__syncthreads_or(valid)) continue;  // also publishes sm.slot
    seen = true;

    // Decode the tile's rows (8 elements per task).
    for (int task = tid; task < kKeys * kChunks; task += kThreads) {
      const int j = task / kChunks, c = task % kChunks;
      const int32_t s = sm.slot[j];
      float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (s >= 0) {
        const uint8_t* row = p.mla_cache + (int64_t{s} / bs) * p.geometry.block_stride + (int64_t{s} % bs) * p.geometry.row_stride;
        consumers::mla_decode_chunk(row, p.fmt.kv_format, p.fmt.k_scale, c, v, p.scales_as_bf16);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sm.k[j][8 * c + e] = v[e];
    }
    __syncthreads();

    // Scores: lane = key, warp w = heads w and w + 8.
    {
      const float* kr = sm.k[lane];
      float s0 = 0.0f, s1 = 0.0f;
      for (int d = 0; d < kQk; ++d) {
        const float kv = kr[d];
        s0 = fp32::fma(sm.q[warp][d], kv, s0);
        s1 = fp32::fma(sm.q[warp + 8][d], kv, s1);
      }
      const bool ok = sm.slot[lane] >= 0;
      sm.p[lane][warp] = ok ? fp32::mul(s0, p.softmax_scale) : -INFINITY;
      sm.p[lane][warp + 8] = ok ? fp32::mul(s1, p.softmax_scale) : -INFINITY;
    }
    __syncthreads();

    // Online softmax update per head (warp w: heads w and w + 8; lane = key).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = warp + 8 * r;
      const float s = sm.p[lane][g];
      float tmax = s;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
      const float m_old = sm.m[g];
      const float m_new = fmaxf(m_old, tmax);
      float e = 0.0f, alpha = 1.0f;
      if (m_new != -INFINITY) {
        alpha = m_old == -INFINITY ? 0.0f : expf(fp32::sub(m_old, m_new));
        e = s == -INFINITY ? 0.0f : expf(fp32::sub(s, m_new));
      }
      float sum = e;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) sum = fp32::add(sum, __shfl_xor_sync(0xffffffffu, sum, off));
      sm.p[lane][g] = e;
      __syncwarp();
      if (lane == 0) {
        sm.l[g] = fp32::add(fp32::mul(sm.l[g], alpha), sum);
        sm.m[g] = m_new;
        sm.alpha[g] = alpha;
      }
    }
    __syncthreads();

    // out[g][d] = out * alpha + sum_j p[j][g] * k[j][d], keys in tile order.
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      acc[g][0] = fp32::mul(acc[g][0], sm.alpha[g]);
      acc[g][1] = fp32::mul(acc[g][1], sm.alpha[g]);
    }
    for (int j = 0; j < kKeys; ++j) {
      const float v0 = sm.k[j][tid], v1 = sm.k[j][tid + kThreads];
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float pj = sm.p[j][g];
        acc[g][0] = fp32::fma(pj, v0, acc[g][0]);
        acc[g][1] = fp32::fma(pj, v1, acc[g][1]);
      }
    }
    __syncthreads();  // the next tile overwrites k, p and slot
  }

#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    if (g >= nh) break;
    const int64_t th = t * H + h0 + g;
    const float l = sm.l[g];
    float* out = p.out + th * kV;
    if (seen) {
      out[tid] = fp32::div(acc[g][0], l);
      out[tid + kThreads] = fp32::div(acc[g][1], l);
      if (tid == 0) p.lse[th] = fp32::add(sm.m[g], logf(l));
    } else {  // no valid slot
      out[tid] = 0.0f;
      out[tid + kThreads] = 0.0f;
      if (tid == 0) p.lse[th] = -INFINITY;
    }
  }
}

}  // namespace

void sparse_mla(const SparseMlaParams& p, void* stream, SparseMlaKernel kernel) {
  PCPKV_CHECK(p.num_tokens >= 0 && p.num_tokens < (int64_t{1} << 31),
              "sparse_mla: num_tokens must be in [0, 2^31), got {}", p.num_tokens);
  PCPKV_CHECK(p.num_heads >= 1, "sparse_mla: num_heads must be >= 1, got {}", p.num_heads);
  PCPKV_CHECK(p.topk >= 1, "sparse_mla: topk must be >= 1, got {}", p.topk);
  validate_sparse_mla_scales(p);
  validate_geometry(p.geometry, p.fmt.kv_format);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(p.q && p.mla_cache && p.indices && p.out && p.lse, "sparse_mla: a required device pointer is null");
  PCPKV_CHECK(kernel == SparseMlaKernel::kMma || kernel == SparseMlaKernel::kSimt,
              "sparse_mla: kernel must be kMma or kSimt, got {}", static_cast<int>(kernel));
  if (kernel == SparseMlaKernel::kMma) {
    detail::sparse_mla_mma(p, static_cast<cudaStream_t>(stream));
    return;
  }
  static_assert(kV == 2 * kThreads, "each thread owns two output dims");
  const int smem = static_cast<int>(sizeof(Smem));
  check_cuda(cudaFuncSetAttribute(sparse_mla_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "smem attribute");
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>((p.num_heads + kHeads - 1) / kHeads));
  sparse_mla_kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "launch");
}

}  // namespace pcpkv::cuda
