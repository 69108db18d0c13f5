// docs/perf.md section 36: does the direct dispatch's byte pattern move faster when the Q stream and the
// KV / replica stream are split (two kernels, or two warp roles in one kernel), or when the inputs are one
// fused row per token (the layout of vLLM's fused_qkv_a_proj output)? No math: values are bit mixes.
// Standalone: nvcc -O3 -arch=sm_90 -std=c++17 split_probe.cu -o split_probe && ./split_probe [T]
// T: tokens (default 32768; docs/perf.md 38 ran 4096, the per-GPU size). Grids as the dispatch sizes them:
// min(ceil(work items / 4), CTAs per SM x SMs). Below 16384 tokens 4 sets of every buffer rotate, so that a set is
// not in the 60 MB L2 when its launch comes (the bench rotates its input sets too).
// Each case is timed (a) one launch between two events on an idle GPU and (b) 10 launches back to back in a CUDA
// graph, per launch. Floor = bytes / the same run's device-to-device copy bandwidth (read + written).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

constexpr int kMaxRep = 8, kBlock = 64, kRow = 656, kIdxRow = 128;
constexpr int64_t kMlaBlockStride = int64_t{kBlock} * kRow, kIdxBlockStride = int64_t{kBlock} * (kIdxRow + 4);
constexpr int64_t kFusedRow = 4096 + 1024 + 128;  // bytes: q_c | kv_c | k_pe of one token

struct Args {
  const uint8_t *q, *kv, *kpe;  // row strides below (bytes)
  int64_t q_stride, kv_stride, kpe_stride;
  const uint4* idx;
  uint4* q_out;
  uint8_t* mla[kMaxRep];
  uint8_t* index[kMaxRep];
  const int64_t *slot, *pos;
  int replicas;
  int64_t tokens;
};

__device__ __forceinline__ void do_q(const Args& a, int64_t t, int lane) {
  uint4 q[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) q[v] = __ldcs(reinterpret_cast<const uint4*>(a.q + t * a.q_stride) + 32 * v + lane);
#pragma unroll
  for (int v = 0; v < 8; ++v) __stcs(a.q_out + t * 256 + 32 * v + lane, make_uint4(q[v].y, q[v].x, q[v].w, q[v].z));
}

__device__ __forceinline__ void do_kv(const Args& a, int64_t t, int lane) {
  const uint4* kvr = reinterpret_cast<const uint4*>(a.kv + t * a.kv_stride);
  const uint4 k0 = __ldcs(kvr + lane), k1 = __ldcs(kvr + 32 + lane);
  uint4 x = make_uint4(0, 0, 0, 0);
  if (lane < 8)
    x = __ldcs(reinterpret_cast<const uint4*>(a.kpe + t * a.kpe_stride) + lane);
  else if (lane >= 16)
    x = __ldcs(a.idx + t * 16 + lane - 16);
  const int64_t slot = __ldg(a.slot + t);
  const int64_t pos = __ldg(a.pos + t);
  x.x ^= static_cast<uint32_t>(pos);
  const uint2 wa = make_uint2(k0.x ^ k0.z, k0.y ^ k0.w), wb = make_uint2(k1.x ^ k1.z, k1.y ^ k1.w);
  const int64_t blk = slot / kBlock, off = slot % kBlock;
  for (int d = 0; d < a.replicas; ++d) {
    uint8_t* row = a.mla[d] + blk * kMlaBlockStride + off * kRow;
    *reinterpret_cast<uint2*>(row + 8 * lane) = wa;
    *reinterpret_cast<uint2*>(row + 256 + 8 * lane) = wb;
    if (lane == 0) *reinterpret_cast<uint4*>(row + 512) = k0;
    if (lane < 8) *reinterpret_cast<uint4*>(row + 528 + 16 * lane) = x;
    if (lane >= 16) {
      uint8_t* block = a.index[d] + blk * kIdxBlockStride;
      *reinterpret_cast<uint2*>(block + off * kIdxRow + 8 * (lane - 16)) = make_uint2(x.x ^ x.z, x.y ^ x.w);
      if (lane == 16) *reinterpret_cast<uint32_t*>(block + kBlock * kIdxRow + off * 4) = x.x;
    }
  }
}

// Part: 0 = Q and KV in one warp per token (today's dispatch), 1 = Q only, 2 = KV only,
// 3 = warp roles in one kernel (warps 0..kQWarps-1 of a CTA walk the tokens for Q, the others for KV),
// 4 = as 0, but each CTA takes one contiguous range of tokens (its warps interleave inside it), so a cache block's
// rows in every replica are written by one SM close together in time, not by warps spread over the whole GPU.
// 5 = items: each token's KV part (items [0, T)) and Q part (items [T, 2T)) as one list of 2T items for all warps;
// 6 = items interleaved: item 2t is token t's Q part, 2t + 1 its KV part.
template <int kPart, int kCtas, int kQWarps = 2>
__global__ void __launch_bounds__(128, kCtas) pattern(const __grid_constant__ Args a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t kTokens = a.tokens;
  if constexpr (kPart == 5 || kPart == 6) {
    const int64_t stride = int64_t{gridDim.x} * 4;
    for (int64_t i = int64_t{blockIdx.x} * 4 + warp; i < 2 * kTokens; i += stride) {
      const bool kv = kPart == 5 ? i < kTokens : (i & 1) != 0;
      const int64_t t = kPart == 5 ? (kv ? i : i - kTokens) : i >> 1;
      if (kv)
        do_kv(a, t, lane);
      else
        do_q(a, t, lane);
    }
  } else if constexpr (kPart == 3) {
    const bool q_role = warp < kQWarps;
    const int per = q_role ? kQWarps : 4 - kQWarps;
    const int w = q_role ? warp : warp - kQWarps;
    const int64_t stride = int64_t{gridDim.x} * per;
    for (int64_t t = int64_t{blockIdx.x} * per + w; t < kTokens; t += stride)
      if (q_role)
        do_q(a, t, lane);
      else
        do_kv(a, t, lane);
  } else {
    int64_t first = int64_t{blockIdx.x} * 4 + warp, end = kTokens, stride = int64_t{gridDim.x} * 4;
    if constexpr (kPart == 4) {
      const int64_t chunk = (kTokens + gridDim.x - 1) / gridDim.x;
      first = int64_t{blockIdx.x} * chunk + warp;
      end = min(int64_t{kTokens}, int64_t{blockIdx.x + 1} * chunk);
      stride = 4;
    }
    for (int64_t t = first; t < end; t += stride) {
      if constexpr (kPart == 0 || kPart == 4) {
        // loads of both parts issued before either part's stores, as the dispatch does
        uint4 q[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) q[v] = __ldcs(reinterpret_cast<const uint4*>(a.q + t * a.q_stride) + 32 * v + lane);
        do_kv(a, t, lane);
#pragma unroll
        for (int v = 0; v < 8; ++v)
          __stcs(a.q_out + t * 256 + 32 * v + lane, make_uint4(q[v].y, q[v].x, q[v].w, q[v].z));
      } else if constexpr (kPart == 1) {
        do_q(a, t, lane);
      } else {
        do_kv(a, t, lane);
      }
    }
  }
}

__global__ void copy_kernel(const uint4* __restrict__ s, uint4* __restrict__ d, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    __stcs(d + i, __ldcs(s + i));
}

// Median ms of `runs` timed calls of `run` (after 3 untimed ones), each between two events on `st`.
float median_ms(const std::function<void()>& run, cudaStream_t st, int runs) {
  cudaEvent_t b, e;
  CK(cudaEventCreate(&b));
  CK(cudaEventCreate(&e));
  std::vector<float> ms;
  for (int i = 0; i < runs + 3; ++i) {
    CK(cudaEventRecord(b, st));
    run();
    CK(cudaEventRecord(e, st));
    CK(cudaEventSynchronize(e));
    float m = 0;
    CK(cudaEventElapsedTime(&m, b, e));
    if (i >= 3) ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// One launch on an idle GPU: the launch itself included.
float single_ms(const std::function<void(cudaStream_t, int)>& launch, cudaStream_t st) {
  int i = 0;
  return median_ms([&] { launch(st, i++); }, st, 20);
}

// 10 launches back to back in one CUDA graph, per launch: no launch gaps.
// launch(st, i): the i-th launch (it picks buffer set i % sets).
float graph_ms(const std::function<void(cudaStream_t, int)>& launch, cudaStream_t st) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 10; ++i) launch(st, i);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  return median_ms([&] { CK(cudaGraphLaunch(ge, st)); }, st, 10) / 10;
}

int main(int argc, char** argv) {
  const int64_t kTokens = argc > 1 ? std::atoll(argv[1]) : 32768;
  if (kTokens < 1 || kTokens % kBlock != 0) {
    std::printf("T = %lld must be a positive multiple of %d\n", static_cast<long long>(kTokens), kBlock);
    return 1;
  }
  const int64_t kBlocks = kTokens / kBlock;
  const int sets = kTokens < 16384 ? 4 : 1;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::vector<int64_t> slots(kTokens), pos(kTokens);
  for (int64_t t = 0; t < kTokens; ++t) slots[t] = t, pos[t] = t;
  // separate inputs (the bench's layout) and one fused row per token (an engine's fused_qkv_a_proj output)
  std::vector<Args> sep(sets), fus(sets);
  for (int k = 0; k < sets; ++k) {
    uint8_t *q, *kv, *kpe, *fused;
    uint4 *idx, *qo;
    CK(cudaMalloc(&q, kTokens * 4096));
    CK(cudaMalloc(&kv, kTokens * 1024));
    CK(cudaMalloc(&kpe, kTokens * 128));
    CK(cudaMalloc(&fused, kTokens * kFusedRow));
    CK(cudaMalloc(&idx, kTokens * 256));
    CK(cudaMalloc(&qo, kTokens * 4096));
    CK(cudaMemset(q, 0x3c, kTokens * 4096));
    CK(cudaMemset(kv, 0x3d, kTokens * 1024));
    CK(cudaMemset(kpe, 0x3e, kTokens * 128));
    CK(cudaMemset(fused, 0x3b, kTokens * kFusedRow));
    CK(cudaMemset(idx, 0x3f, kTokens * 256));
    Args a{};
    for (int d = 0; d < kMaxRep; ++d) {
      CK(cudaMalloc(&a.mla[d], kBlocks * kBlock * kRow));
      CK(cudaMalloc(&a.index[d], kBlocks * kBlock * (kIdxRow + 4)));
    }
    int64_t *slot, *posd;
    CK(cudaMalloc(&slot, kTokens * 8));
    CK(cudaMalloc(&posd, kTokens * 8));
    CK(cudaMemcpy(slot, slots.data(), kTokens * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(posd, pos.data(), kTokens * 8, cudaMemcpyHostToDevice));
    a.idx = idx, a.q_out = qo, a.slot = slot, a.pos = posd, a.tokens = kTokens;
    sep[k] = a, fus[k] = a;
    sep[k].q = q, sep[k].kv = kv, sep[k].kpe = kpe, sep[k].q_stride = 4096, sep[k].kv_stride = 1024;
    sep[k].kpe_stride = 128;
    fus[k].q = fused, fus[k].kv = fused + 4096, fus[k].kpe = fused + 5120;
    fus[k].q_stride = fus[k].kv_stride = fus[k].kpe_stride = kFusedRow;
  }
  // the dispatch's grid: min(ceil(items / 4 warps), resident CTAs)
  auto grid = [&](int64_t items, int ctas) { return static_cast<unsigned>(std::min<int64_t>((items + 3) / 4, sms * ctas)); };
  const int64_t T = kTokens;

  const int64_t copy_bytes = int64_t{1} << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, copy_bytes));
  CK(cudaMalloc(&dst, copy_bytes));
  CK(cudaMemset(src, 1, copy_bytes));
  const float copy =
      single_ms([&](cudaStream_t s, int) { cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, s); }, st);
  const double gbs = 2.0 * copy_bytes / (copy * 1e-3) / 1e9;
  std::printf("T = %lld tokens, %d buffer set(s); copy bandwidth %.0f GB/s (cudaMemcpy, 1 GiB read + 1 GiB written)\n\n",
              static_cast<long long>(T), sets, gbs);
  std::printf(
      "| case | replicas | MB | one launch us | graph us per launch | floor us | one / floor | graph / floor |\n"
      "|---|---|---|---|---|---|---|---|\n");
  using Launch = std::function<void(cudaStream_t, const Args&)>;
  auto row = [&](const char* name, int reps, double mb, const Launch& f, bool fused_rows = false) {
    const std::vector<Args>& set = fused_rows ? fus : sep;
    auto each = [&](cudaStream_t s, int i) { f(s, set[i % sets]); };
    const float sg = single_ms(each, st), g = graph_ms(each, st);
    CK(cudaGetLastError());
    const double floor_us = mb / (gbs * 1e-3);  // MB / (GB/s) -> us
    std::printf("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", name, reps, mb, sg * 1e3, g * 1e3, floor_us,
                sg * 1e3 / floor_us, g * 1e3 / floor_us);
    std::fflush(stdout);
  };
  const int64_t cn = T * 256;  // the q rows as uint4s
  row("copy kernel (q rows' bytes)", 0, 2.0 * T * 4096 / 1e6, [&](cudaStream_t s, const Args& a) {
    copy_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(a.q), a.q_out, cn);
  });
  const double q_mb = 2.0 * T * 4096 / 1e6;
  for (int reps : {1, 8}) {
    for (int k = 0; k < sets; ++k) sep[k].replicas = fus[k].replicas = reps;
    const double kv_mb = T * (1024 + 128 + 256 + 16 + reps * (656.0 + 132)) / 1e6;
    row("Q only, 6 CTAs", reps, q_mb, [&](cudaStream_t s, const Args& a) { pattern<1, 6><<<grid(T, 6), 128, 0, s>>>(a); });
    row("Q only, 8 CTAs", reps, q_mb, [&](cudaStream_t s, const Args& a) { pattern<1, 8><<<grid(T, 8), 128, 0, s>>>(a); });
    row("KV only, 8 CTAs", reps, kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<2, 8><<<grid(T, 8), 128, 0, s>>>(a); });
    row("fused warp per token, 6 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<0, 6><<<grid(T, 6), 128, 0, s>>>(a); });
    row("fused warp per token, 8 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<0, 8><<<grid(T, 8), 128, 0, s>>>(a); });
    row("fused, one input row per token", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<0, 6><<<grid(T, 6), 128, 0, s>>>(a); }, true);
    row("fused, contiguous token range per CTA", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<4, 6><<<grid(T, 6), 128, 0, s>>>(a); });
    row("KV only, 6 CTAs", reps, kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<2, 6><<<grid(T, 6), 128, 0, s>>>(a); });
    row("split: Q kernel then KV kernel", reps, q_mb + kv_mb, [&](cudaStream_t s, const Args& a) {
      pattern<1, 8><<<grid(T, 8), 128, 0, s>>>(a);
      pattern<2, 8><<<grid(T, 8), 128, 0, s>>>(a);
    });
    row("roles 2 Q : 2 KV warps, 6 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<3, 6, 2><<<grid(T, 6), 128, 0, s>>>(a); });
    row("roles 1 Q : 3 KV warps, 6 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<3, 6, 1><<<grid(T, 6), 128, 0, s>>>(a); });
    row("roles 1 Q : 3 KV warps, 8 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<3, 8, 1><<<grid(T, 8), 128, 0, s>>>(a); });
    row("items KV then Q (2T), 6 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<5, 6><<<grid(2 * T, 6), 128, 0, s>>>(a); });
    row("items KV then Q (2T), 8 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<5, 8><<<grid(2 * T, 8), 128, 0, s>>>(a); });
    row("items Q, KV interleaved (2T), 8 CTAs", reps, q_mb + kv_mb,
        [&](cudaStream_t s, const Args& a) { pattern<6, 8><<<grid(2 * T, 8), 128, 0, s>>>(a); });
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
