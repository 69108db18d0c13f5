// The collect path's all-gather between logical ranks that share one GPU (a device copy; NCCL takes this
// role across GPUs), and the top-k -1 fill.
#include <algorithm>
#include <cstring>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "pcpkv/publish/kernels.h"

namespace pcpkv::cuda {
namespace {

constexpr int kMaxGroup = 8;  // sources / destinations per launch (larger worlds take several launches)
constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

struct GatherArgs {
  const uint4* src[kMaxGroup];
  uint4* dst[kMaxGroup];
  int32_t num_src, num_dst;
  int32_t first_src;  // rank index of src[0]: its rows land at dst + first_src * chunks
  int64_t chunks;     // 16-byte chunks per rank
};
static_assert(sizeof(GatherArgs) <= 4096, "kernel parameters must fit the classic 4 KB limit");

// blockIdx.y = dst * num_src + src; the x dimension strides over the chunks of that pair.
__global__ void __launch_bounds__(kThreads) all_gather_kernel(const __grid_constant__ GatherArgs a) {
  const int pair = blockIdx.y;
  const int d = pair / a.num_src, s = pair % a.num_src;
  const uint4* src = a.src[s];
  uint4* dst = a.dst[d] + int64_t{a.first_src + s} * a.chunks;
  const int64_t step = int64_t{gridDim.x} * kThreads * kUnroll;
  for (int64_t base = int64_t{blockIdx.x} * kThreads * kUnroll + threadIdx.x; base < a.chunks; base += step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t{k} * kThreads;
      if (i < a.chunks) v[k] = __ldg(src + i);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t{k} * kThreads;
      if (i < a.chunks) dst[i] = v[k];
    }
  }
}

}  // namespace

void launch_all_gather(const std::vector<const void*>& src, const std::vector<void*>& dst, int64_t bytes_per_rank,
                       cudaStream_t stream) {
  const int world = static_cast<int>(src.size());
  PCPKV_CHECK(world >= 1, "all-gather: world = {} must be >= 1", world);
  PCPKV_CHECK(dst.size() == src.size(), "all-gather: {} destinations for {} sources", dst.size(), src.size());
  PCPKV_CHECK(bytes_per_rank >= 0 && bytes_per_rank % 16 == 0, "all-gather: bytes_per_rank = {} must be a multiple of 16",
              bytes_per_rank);
  for (int r = 0; r < world; ++r)
    PCPKV_CHECK(reinterpret_cast<uint64_t>(src[r]) % 16 == 0 && reinterpret_cast<uint64_t>(dst[r]) % 16 == 0,
                "all-gather: rank {}: buffers must be 16-byte aligned", r);
  if (bytes_per_rank == 0) return;
  for (int s0 = 0; s0 < world; s0 += kMaxGroup)
    for (int d0 = 0; d0 < world; d0 += kMaxGroup) {
      GatherArgs a;
      std::memset(&a, 0, sizeof(a));
      a.num_src = std::min(kMaxGroup, world - s0);
      a.num_dst = std::min(kMaxGroup, world - d0);
      a.first_src = s0;
      a.chunks = bytes_per_rank / 16;
      for (int k = 0; k < a.num_src; ++k) a.src[k] = static_cast<const uint4*>(src[s0 + k]);
      for (int k = 0; k < a.num_dst; ++k) a.dst[k] = static_cast<uint4*>(dst[d0 + k]);
      const int pairs = a.num_src * a.num_dst;
      const int64_t per_pair_blocks = (a.chunks + kThreads * kUnroll - 1) / (kThreads * kUnroll);
      const int64_t budget = std::max<int64_t>(1, int64_t{num_sms()} * 8 / pairs);
      const dim3 grid(static_cast<unsigned>(std::min(per_pair_blocks, budget)), static_cast<unsigned>(pairs));
      all_gather_kernel<<<grid, kThreads, 0, stream>>>(a);
      PCPKV_CUDA_CHECK_LAUNCH();
    }
}

void launch_fill_minus_one(int32_t* p, int64_t count, cudaStream_t stream) {
  PCPKV_CHECK(count >= 0, "topk fill: count = {} must be >= 0", count);
  if (count == 0) return;
  // -1 as int32 is 0xFFFFFFFF: a byte fill writes exactly that.
  PCPKV_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, static_cast<size_t>(count) * sizeof(int32_t), stream));
}

}  // namespace pcpkv::cuda
