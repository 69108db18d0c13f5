// CUDA LSE merge of partial attention outputs (SPEC section 6). One warp per row; every lane computes
// the row's m and L identically, then the lanes split the head dims; shards are summed in index order.
#include <cuda_runtime.h>

#include <cstdint>

#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/lse_merge.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("lse_merge: {}: {}", what, cudaGetErrorString(e));
}

constexpr int kWarpsPerBlock = 8;

/// NaN and +inf count as -inf (an empty or broken shard contributes nothing).
__device__ __forceinline__ float usable(float l) { return (isnan(l) || l == INFINITY) ? -INFINITY : l; }

__global__ void __launch_bounds__(32 * kWarpsPerBlock) lse_merge_kernel(LseMergeParams p) {
  const int64_t r = int64_t{blockIdx.x} * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= p.num_rows) return;
  float m = -INFINITY;
  for (int n = 0; n < p.num_shards; ++n) m = fmaxf(m, usable(p.lses[n * p.num_rows + r]));
  float* out = p.out + r * p.head_dim;
  if (m == -INFINITY) {
    for (int d = lane; d < p.head_dim; d += 32) out[d] = 0.0f;
    if (lane == 0) p.lse[r] = -INFINITY;
    return;
  }
  float sum = 0.0f;
  for (int n = 0; n < p.num_shards; ++n) {
    const float l = usable(p.lses[n * p.num_rows + r]);
    if (l != -INFINITY) sum = fp32::add(sum, expf(fp32::sub(l, m)));
  }
  const float L = fp32::add(logf(sum), m);
  for (int d = lane; d < p.head_dim; d += 32) {
    float acc = 0.0f;
    for (int n = 0; n < p.num_shards; ++n) {
      const float l = usable(p.lses[n * p.num_rows + r]);
      if (l == -INFINITY) continue;  // not read: an empty shard's output may hold anything
      acc = fp32::fma(expf(fp32::sub(l, L)), p.outs[(n * p.num_rows + r) * p.head_dim + d], acc);
    }
    out[d] = acc;
  }
  if (lane == 0) p.lse[r] = L;
}

}  // namespace

void lse_merge(const LseMergeParams& p, void* stream) {
  validate_lse_merge(p);
  if (p.num_rows == 0) return;
  const int64_t blocks = (p.num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  PCPKV_CHECK(blocks < (int64_t{1} << 31), "lse_merge: num_rows = {} is too large", p.num_rows);
  lse_merge_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "launch");
}

}  // namespace pcpkv::cuda
