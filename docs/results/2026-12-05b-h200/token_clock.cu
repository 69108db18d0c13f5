// docs/perf.md 38: the per-token (per-item) latency profile of the warp dispatch at 4096 rows. It includes
// pcpkv's own kernel source (src/publish/cuda/dispatch_warp.cu) with PCPKV_DISPATCH_STAMP defined, so lane 0 of
// each warp stamps %globaltimer and clock64 at an item's start (0), after its first reduction (1: its inputs have
// arrived) and at its end (2). GLM-5 shapes (q_lora_rank 2048), fp8_ds_mla + indexer, R cache replicas (64-token
// blocks), no top-k fill (the bench's tail fill has no padding rows), 4 rotating input sets.
// Build (repo root): nvcc -O3 -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -DFMT_USE_CONSTEXPR=1
//   -Xcompiler=-ffp-contract=off -Iinclude -Isrc docs/results/2026-12-05b-h200/token_clock.cu -o token_clock
// Run: ./token_clock [T]  (default 4096). Built with -DNO_STAMP it prints the event times only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kMaxItems = 2 * 32768;
__device__ unsigned long long g_ns[3][kMaxItems];
__device__ long long g_clk[3][kMaxItems];

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#ifndef NO_STAMP  // -DNO_STAMP: the kernel as pcpkv builds it (event times only, no profile)
#define PCPKV_DISPATCH_STAMP(item, point)        \
  do {                                           \
    if ((threadIdx.x & 31) == 0) {               \
      g_ns[point][item] = global_ns();           \
      g_clk[point][item] = clock64();            \
    }                                            \
  } while (0)
#endif

#ifdef DISPATCH_SRC  // -DDISPATCH_SRC='"path"': another kernel source (the A/B of perf-log 40)
#include DISPATCH_SRC
#else
#include "../../../src/publish/cuda/dispatch_warp.cu"
#endif

using namespace pcpkv;
using namespace pcpkv::cuda_detail::dispatch_impl;

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

template <class T>
T* dalloc(int64_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

// Seeded bf16 values in about [-2, 2] (never zeros).
void fill_bf16(uint16_t* d, int64_t n, uint32_t seed) {
  std::vector<uint16_t> h(n);
  uint32_t s = seed;
  for (auto& v : h) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<uint16_t>(0x3c00u + (s >> 22) + ((s >> 16) & 0x8000u));  // exponent near 1, random sign
  }
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min<size_t>(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t q_rank = 2048, block = 64, sets = 4;
  int sms = 0, clock_khz = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::vector<float> w(4096, 1.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.001f * static_cast<float>(i % 997);
  float* weights = dalloc<float>(4096);
  CK(cudaMemcpy(weights, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const int64_t max_pos = T + 8;
  std::vector<float> cs(max_pos * 64);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int j = 0; j < 32; ++j) cs[p * 64 + j] = 0.9f, cs[p * 64 + 32 + j] = 0.1f;
  float* rope = dalloc<float>(max_pos * 64);
  CK(cudaMemcpy(rope, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int64_t> idx(T);
  for (int64_t t = 0; t < T; ++t) idx[t] = t;
  int64_t* slots = dalloc<int64_t>(T);
  CK(cudaMemcpy(slots, idx.data(), T * 8, cudaMemcpyHostToDevice));

  std::printf("T = %lld, %d SMs, SM clock attribute %d MHz\n\n", static_cast<long long>(T), sms, clock_khz / 1000);
  for (int reps : {1, 8}) {
    std::vector<DispatchArgs> args(sets);
    for (int k = 0; k < sets; ++k) {
      DispatchArgs& a = args[k];
      std::memset(&a, 0, sizeof(a));
      CommonArgs& c = a.c;
      c.q_lora_rank = q_rank;
      c.num_q_leaves = q_rank / 8;
      c.q_norm_w = weights;
      c.kv_norm_w = weights + 2048;
      c.index_ln_w = weights + 2560;
      c.index_ln_b = weights + 2688;
      c.rope_cos_sin = rope;
      c.q_eps = c.kv_eps = 1e-6f;
      c.index_eps = 1e-6f;
      c.k_scale = 1.0f;
      c.load_align = c.store_align = 16;
      c.has_indexer = true;
      c.index_rope_interleaved = true;
      RankArgs& r = a.r[0];
      uint16_t* q = dalloc<uint16_t>(T * q_rank);
      uint16_t* kv = dalloc<uint16_t>(T * 512);
      uint16_t* kpe = dalloc<uint16_t>(T * 64);
      uint16_t* ik = dalloc<uint16_t>(T * 128);
      fill_bf16(q, T * q_rank, 11 + k);
      fill_bf16(kv, T * 512, 21 + k);
      fill_bf16(kpe, T * 64, 31 + k);
      fill_bf16(ik, T * 128, 41 + k);
      r.q_c = q, r.kv = kv, r.k_pe = kpe, r.index_k = ik;
      r.q_c_stride = q_rank, r.kv_stride = 512, r.k_pe_stride = 64, r.index_k_stride = 128;
      r.positions = slots;
      r.slot_mapping = slots;
      r.q_c_out = dalloc<uint16_t>(T * q_rank);
      std::vector<CacheTarget> tg(reps);
      for (auto& t : tg) {
        t.mla.num_blocks = (T + block - 1) / block;
        t.mla.block_size = static_cast<int32_t>(block);
        t.mla.row_stride = 656;
        t.mla.block_stride = block * 656;
        t.mla_base = dalloc<uint8_t>(t.mla.num_blocks * t.mla.block_stride);
        t.index.num_blocks = t.mla.num_blocks;
        t.index.block_size = static_cast<int32_t>(block);
        t.index.block_stride = block * (128 + 4);
        t.index_base = dalloc<uint8_t>(t.index.num_blocks * t.index.block_stride);
      }
      CacheTarget* dt = dalloc<CacheTarget>(reps);
      CK(cudaMemcpy(dt, tg.data(), reps * sizeof(CacheTarget), cudaMemcpyHostToDevice));
      r.targets = dt;
      r.num_tokens = T;
      r.num_targets = reps;
      r.do_q = r.need_kv = true;
      a.num_ranks = 1;
      a.total_targets = reps;
      a.total_tokens = T;
    }
    for (bool split : {false, true}) {
      KernelFn fn = warp_kernel_for(KvFormat::kFp8DsMla, false, split);
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarpKernelThreads, 0));
      cudaFuncAttributes attr{};
      CK(cudaFuncGetAttributes(&attr, fn));
      const int64_t items = split ? 2 * T : T, slots_w = int64_t{per_sm} * sms * 4;
      const unsigned grid = static_cast<unsigned>(std::min<int64_t>((items + 3) / 4, int64_t{per_sm} * sms));
      cudaEvent_t b, e;
      CK(cudaEventCreate(&b));
      CK(cudaEventCreate(&e));
      std::vector<float> ms;
      for (int i = 0; i < 43; ++i) {
        CK(cudaEventRecord(b));
        fn<<<grid, kWarpKernelThreads>>>(args[i % sets]);
        CK(cudaEventRecord(e));
        CK(cudaEventSynchronize(e));
        float m = 0;
        CK(cudaEventElapsedTime(&m, b, e));
        if (i >= 3) ms.push_back(m);
      }
      CK(cudaGetLastError());
      std::sort(ms.begin(), ms.end());
#ifdef NO_STAMP
      std::printf("| %s | %d replicas | %d regs | %d CTAs/SM | grid %u | event us median %.1f (min %.1f) |\n",
                  split ? "split (KV, Q items)" : "token (warp per token)", reps, attr.numRegs, per_sm, grid,
                  ms[ms.size() / 2] * 1e3, ms[0] * 1e3);
      continue;
#endif
      std::vector<unsigned long long> ns[3];
      std::vector<long long> clk[3];
      for (int p = 0; p < 3; ++p) {
        ns[p].resize(items);
        clk[p].resize(items);
        CK(cudaMemcpyFromSymbol(ns[p].data(), g_ns, items * 8, static_cast<size_t>(p) * kMaxItems * 8));
        CK(cudaMemcpyFromSymbol(clk[p].data(), g_clk, items * 8, static_cast<size_t>(p) * kMaxItems * 8));
      }
      unsigned long long t0 = ~0ull, t1 = 0, tick = ~0ull;
      for (int64_t i = 0; i < items; ++i) t0 = std::min(t0, ns[0][i]), t1 = std::max(t1, ns[2][i]);
      for (int64_t i = 0; i + 1 < items; ++i)
        if (ns[0][i + 1] != ns[0][i]) tick = std::min<unsigned long long>(tick, ns[0][i + 1] > ns[0][i] ? ns[0][i + 1] - ns[0][i] : ns[0][i] - ns[0][i + 1]);
      const double ghz = clock_khz / 1e6;
      std::printf("### %s, %d replicas: %d regs, %d CTAs/SM (%lld warps), grid %u, %lld items; event time median %.1f us "
                  "(min %.1f); stamped launch: first start to last end %.1f us; smallest globaltimer step seen %llu ns\n\n",
                  split ? "split (KV, Q items)" : "token (warp per token)", reps, attr.numRegs, per_sm,
                  static_cast<long long>(slots_w), grid, static_cast<long long>(items), ms[ms.size() / 2] * 1e3,
                  ms[0] * 1e3, (t1 - t0) / 1e3, tick);
      std::printf("| round | items | part | start us (p10 / p50 / p90) | to point 1 us (p50 / p90) | point 1 to end us "
                  "(p50 / p90) | item us (p50 / p90) | end us (p50 / max) |\n|---|---|---|---|---|---|---|---|\n");
      const int64_t rounds = (items + slots_w - 1) / slots_w;
      for (int64_t rd = 0; rd < rounds; ++rd)
        for (int part = 0; part < (split ? 2 : 1); ++part) {
          std::vector<double> st, l1, l2, tot, en;
          for (int64_t i = rd * slots_w; i < std::min(items, (rd + 1) * slots_w); ++i) {
            if (split && (part == 0) != (i < T)) continue;
            st.push_back((ns[0][i] - t0) / 1e3);
            en.push_back((ns[2][i] - t0) / 1e3);
            // durations from clock64 (this warp's SM), at the attribute clock
            l1.push_back((clk[1][i] - clk[0][i]) / ghz / 1e3);
            l2.push_back((clk[2][i] - clk[1][i]) / ghz / 1e3);
            tot.push_back((clk[2][i] - clk[0][i]) / ghz / 1e3);
          }
          if (st.empty()) continue;
          std::printf("| %lld | %zu | %s | %.2f / %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |\n",
                      static_cast<long long>(rd), st.size(), split ? (part == 0 ? "KV" : "Q") : "token", pct(st, 0.1),
                      pct(st, 0.5), pct(st, 0.9), pct(l1, 0.5), pct(l1, 0.9), pct(l2, 0.5), pct(l2, 0.9),
                      pct(tot, 0.5), pct(tot, 0.9), pct(en, 0.5), pct(en, 1.0));
        }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
