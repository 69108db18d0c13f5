// docs/perf.md section 35: the byte pattern of the GLM-5 PCP 8 direct dispatch with no math in it.
// Standalone probe (not part of the build): nvcc -O3 -arch=sm_90 -std=c++17 write_pattern_probe.cu -o probe
// One warp per token on a persistent grid (6 CTAs of 4 warps per SM, as the warp dispatch; also 8 and 12, the
// last with spills), each token reads q_c (2048 bf16), kv (512), k_pe (64) and index_k (128) with 16-byte loads,
// and writes q_c_out (4 KB) and, in each of 0-8 replicas, the fp8_ds_mla row (512 B kv_c, 16 B scales, 128 B
// k_pe at a 656 B row stride, 64 rows per block) and the indexer row (128 B data, 4 B scale, in a 64-row block),
// with the store widths of the dispatch.
// The values are bit mixes of the loads (no norm, no quantization): whatever time is left is the memory system's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));        \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

constexpr int kTokens = 32768, kReplicas = 8, kBlock = 64, kRow = 656, kIdxRow = 128;
constexpr int64_t kBlocks = kTokens / kBlock;
constexpr int64_t kMlaBlockStride = int64_t{kBlock} * kRow, kIdxBlockStride = int64_t{kBlock} * (kIdxRow + 4);

struct Args {
  const uint4 *q, *kv, *kpe, *idx;
  uint4* q_out;
  uint8_t* mla[kReplicas];
  uint8_t* index[kReplicas];
  const int64_t* slot;
  int replicas;
};

template <bool kWideKv, int kCtasPerSm>
__global__ void __launch_bounds__(128, kCtasPerSm) pattern(const __grid_constant__ Args a) {
  const int lane = threadIdx.x & 31;
  const int64_t stride = int64_t{gridDim.x} * 4;
  for (int64_t t = int64_t{blockIdx.x} * 4 + (threadIdx.x >> 5); t < kTokens; t += stride) {
    uint4 q[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) q[v] = __ldcs(a.q + t * 256 + 32 * v + lane);
    const uint4 k0 = __ldcs(a.kv + t * 64 + lane), k1 = __ldcs(a.kv + t * 64 + 32 + lane);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (lane < 8) x = __ldcs(a.kpe + t * 8 + lane);
    else if (lane >= 16) x = __ldcs(a.idx + t * 16 + lane - 16);
    const int64_t slot = __ldg(a.slot + t);
#pragma unroll
    for (int v = 0; v < 8; ++v) __stcs(a.q_out + t * 256 + 32 * v + lane, make_uint4(q[v].y, q[v].x, q[v].w, q[v].z));
    // kv_c as fp8 would be 8 bytes per leaf: fold each 16-byte load to 8 bytes.
    const uint2 wa = make_uint2(k0.x ^ k0.z, k0.y ^ k0.w), wb = make_uint2(k1.x ^ k1.z, k1.y ^ k1.w);
    const int64_t blk = slot / kBlock, off = slot % kBlock;
    for (int d = 0; d < a.replicas; ++d) {
      uint8_t* row = a.mla[d] + blk * kMlaBlockStride + off * kRow;
      if constexpr (kWideKv) {
        // 16 bytes per lane: even lanes write leaves 2i, 2i+1 of the first half, odd lanes of the second.
        const uint2 pa = make_uint2(__shfl_xor_sync(~0u, wa.x, 1), __shfl_xor_sync(~0u, wa.y, 1));
        const uint2 pb = make_uint2(__shfl_xor_sync(~0u, wb.x, 1), __shfl_xor_sync(~0u, wb.y, 1));
        const bool odd = lane & 1;
        const uint4 w = odd ? make_uint4(pb.x, pb.y, wb.x, wb.y) : make_uint4(wa.x, wa.y, pa.x, pa.y);
        *reinterpret_cast<uint4*>(row + (odd ? 256 + 8 * (lane - 1) : 8 * lane)) = w;
      } else {
        *reinterpret_cast<uint2*>(row + 8 * lane) = wa;
        *reinterpret_cast<uint2*>(row + 256 + 8 * lane) = wb;
      }
      if (lane == 0) *reinterpret_cast<uint4*>(row + 512) = k0;
      if (lane < 8) *reinterpret_cast<uint4*>(row + 528 + 16 * lane) = x;
      if (lane >= 16) {
        uint8_t* block = a.index[d] + blk * kIdxBlockStride;
        *reinterpret_cast<uint2*>(block + off * kIdxRow + 8 * (lane - 16)) = make_uint2(x.x ^ x.z, x.y ^ x.w);
        if (lane == 16) *reinterpret_cast<uint32_t*>(block + kBlock * kIdxRow + off * 4) = x.x;
      }
    }
  }
}

template <typename K>
float time_it(K launch, int iters) {
  cudaEvent_t b, e;
  cudaEventCreate(&b);
  cudaEventCreate(&e);
  std::vector<float> ms;
  for (int i = 0; i < iters + 3; ++i) {
    cudaEventRecord(b);
    launch();
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float m = 0;
    cudaEventElapsedTime(&m, b, e);
    if (i >= 3) ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  const bool shuffled = argc > 1;  // any argument: blocks of the slot mapping in a shuffled order
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Args a{};
  uint4 *q, *kv, *kpe, *idx, *qo;
  CK(cudaMalloc(&q, int64_t{kTokens} * 4096));
  CK(cudaMalloc(&kv, int64_t{kTokens} * 1024));
  CK(cudaMalloc(&kpe, int64_t{kTokens} * 128));
  CK(cudaMalloc(&idx, int64_t{kTokens} * 256));
  CK(cudaMalloc(&qo, int64_t{kTokens} * 4096));
  CK(cudaMemset(q, 0x3c, int64_t{kTokens} * 4096));
  CK(cudaMemset(kv, 0x3d, int64_t{kTokens} * 1024));
  CK(cudaMemset(kpe, 0x3e, int64_t{kTokens} * 128));
  CK(cudaMemset(idx, 0x3f, int64_t{kTokens} * 256));
  for (int d = 0; d < kReplicas; ++d) {
    CK(cudaMalloc(&a.mla[d], kBlocks * kMlaBlockStride));
    CK(cudaMalloc(&a.index[d], kBlocks * kIdxBlockStride));
  }
  std::vector<int64_t> slots(kTokens);
  std::vector<int64_t> order(kBlocks);
  for (int64_t b = 0; b < kBlocks; ++b) order[b] = b;
  if (shuffled) {
    uint64_t s = 88172645463325252ull;
    for (int64_t b = kBlocks - 1; b > 0; --b) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      std::swap(order[b], order[static_cast<int64_t>(s % static_cast<uint64_t>(b + 1))]);
    }
  }
  for (int t = 0; t < kTokens; ++t) slots[t] = order[t / kBlock] * kBlock + t % kBlock;
  int64_t* slot;
  CK(cudaMalloc(&slot, kTokens * 8));
  CK(cudaMemcpy(slot, slots.data(), kTokens * 8, cudaMemcpyHostToDevice));
  a.q = q, a.kv = kv, a.kpe = kpe, a.idx = idx, a.q_out = qo, a.slot = slot;

  // Copy bandwidth of this run: read + write of 2 GiB.
  const int64_t copy_bytes = int64_t{1} << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, copy_bytes));
  CK(cudaMalloc(&dst, copy_bytes));
  CK(cudaMemset(src, 1, copy_bytes));
  const float copy_ms = time_it([&] { cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice); }, 20);
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  std::printf("slot mapping: %s blocks; copy bandwidth %.0f GB/s\n", shuffled ? "shuffled" : "ordered", copy_gbs);
  std::printf("| replicas | kv_c stores | CTAs per SM | us | MB | floor us | time / floor |\n"
              "|---|---|---|---|---|---|---|\n");
  for (int reps : {0, 1, 2, 4, 8}) {
    a.replicas = reps;
    const double mb = (double{kTokens} * (5504 + 4096 + reps * (656 + 132))) / 1e6;
    for (int mode = 0; mode < 4; ++mode) {
      // 6 CTAs per SM as the warp dispatch (8 B and 16 B kv_c stores), then 8 and 12 (more tokens in flight).
      const int ctas = mode < 2 ? 6 : (mode == 2 ? 8 : 12);
      const bool wide = mode == 1;
      const float ms = time_it(
          [&] {
            if (mode == 0) pattern<false, 6><<<6 * sms, 128>>>(a);
            else if (mode == 1) pattern<true, 6><<<6 * sms, 128>>>(a);
            else if (mode == 2) pattern<false, 8><<<8 * sms, 128>>>(a);
            else pattern<false, 12><<<12 * sms, 128>>>(a);
          },
          20);
      CK(cudaGetLastError());
      const double floor_us = mb * 1e6 / (copy_gbs * 1e9) * 1e6;
      std::printf("| %d | %s | %d | %.1f | %.1f | %.1f | %.2f |\n", reps, wide ? "16 B" : "8 B", ctas, ms * 1e3, mb,
                  floor_us, ms * 1e3 / floor_us);
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
