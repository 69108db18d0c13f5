// bench/cuda/router_bench.cu: the router GEMM benchmark of `pcpkv bench-serving` (pcpkv/serving/router.h).
//
// Every variant (both small-T kernels with each experts-per-CTA, cuBLASLt bf16 -> fp32, the dispatch
// table's choice) is captured into a CUDA graph of `copies` back-to-back calls and replayed; the time per
// call is the median replay time over `iters` replays (CUDA events) divided by `copies`. The "+pdl"
// variants capture the same calls with PDL on: call k+1 streams its W while call k finishes, which is what
// the router gains behind its real producer (the all-reduce + norm); cuBLASLt has no such variant here.
// Correctness before timing: every variant's logits within the path's bound of the fp64 oracle, and every
// small-T variant's logits bit-identical to the first one's (both kernels share one FMA order).
// Cold: each call of the graph reads a different copy of W, with enough copies (3x the L2 size) that every
// call misses L2, as in a decode step where the other layers' weights have evicted this one's. Hot: one
// copy, L2-resident.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda/check.h"
#include "bench/cuda/graph_timer.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/serving/router.h"
#include "pcpkv_bench/router.h"

namespace pcpkv::cuda {
namespace {

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// Uniform in [-scale, scale) with a few outlier channels (x20) so that sums are not benign.
std::vector<uint16_t> bench_bf16(int64_t rows, int64_t cols, uint64_t seed, float scale, bool outliers) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    float f = (static_cast<float>(mix(seed * 1000003u + i) >> 40) / 16777216.0f * 2.0f - 1.0f) * scale;
    if (outliers && (i % cols) % 997 == 13) f *= 20.0f;
    if (f == 0.0f) f = scale * 1e-3f;
    v[i] = codec::float_to_bf16(f);
  }
  return v;
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) { PCPKV_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

using cuda::graph_median_us_per_call;

// Floors of a small-T router call, timed the same way (graph of back-to-back calls, cold W): what any kernel
// costs per call (launch and drain inside a graph), and what a kernel that only reads W once costs.
__global__ void empty_kernel() {}

/// Reads n16 16-byte words of w, issuing every load of a thread before using any (kUnroll per thread and
/// pass: 6 cover GLM-5's W with 256 x 128 threads), and writes their XOR only if n16 < 0 (never), so the
/// loads are kept and nothing is written.
constexpr int kReadUnroll = 8;
__global__ void __launch_bounds__(128) read_w_kernel(const uint4* w, int64_t n16, uint32_t* sink) {
  const int64_t threads = int64_t{gridDim.x} * blockDim.x;
  uint32_t acc = 0;
  for (int64_t base = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; base < n16; base += threads * kReadUnroll) {
    uint4 v[kReadUnroll];
#pragma unroll
    for (int k = 0; k < kReadUnroll; ++k) {
      const int64_t i = base + k * threads;
      v[k] = i < n16 ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kReadUnroll; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (n16 < 0) *sink = acc;
}

}  // namespace

std::vector<RouterBenchRow> bench_router_gemm(const std::string& preset, const RouterConfig& c,
                                              const RouterBenchOptions& o) {
  validate_router_config(c);
  PCPKV_CHECK(o.iters >= 20, "bench: iters = {} must be >= 20", o.iters);
  PCPKV_CHECK(o.warmup >= 1, "bench: warmup = {} must be >= 1", o.warmup);
  PCPKV_CHECK(!o.tokens.empty(), "bench: no token counts");
  const int64_t H = c.hidden_size, E = c.n_experts;
  const int64_t max_t = *std::max_element(o.tokens.begin(), o.tokens.end());
  PCPKV_CHECK(*std::min_element(o.tokens.begin(), o.tokens.end()) >= 1, "bench: token counts must be >= 1");
  int device = 0, l2_bytes = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  PCPKV_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const int64_t w_bytes = E * H * 2;
  const int64_t copies = std::max<int64_t>(8, (3 * int64_t{l2_bytes} + w_bytes - 1) / w_bytes);

  const std::vector<uint16_t> hx = bench_bf16(max_t, H, 1, 1.0f, true);
  const std::vector<uint16_t> hw = bench_bf16(E, H, 2, 0.02f, false);
  DevBuf<uint16_t> x(hx.size()), w(static_cast<size_t>(copies) * hw.size());
  DevBuf<float> logits(static_cast<size_t>(max_t * E));
  PCPKV_CUDA_CHECK(cudaMemcpy(x.p, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  for (int64_t k = 0; k < copies; ++k)
    PCPKV_CUDA_CHECK(cudaMemcpy(w.p + k * hw.size(), hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));

  // The fp64 oracle once, for the correctness check of each variant.
  std::vector<double> exact(static_cast<size_t>(max_t * E)), abs_sum(exact.size());
  router_logits_reference(hx.data(), H, hw.data(), RouterWeightDtype::kBf16, max_t, H, E, exact.data(), abs_sum.data());

  RouterGemm gemm(H, E, RouterWeightDtype::kBf16);
  cudaStream_t stream = nullptr;
  PCPKV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  struct Variant {
    std::string name;
    RouterGemmOptions opt;
  };
  const auto small = [](int e, RouterSmallKernel k, bool pdl) {
    RouterGemmOptions opt;
    opt.path = RouterPath::kSmallT;
    opt.experts_per_cta = e;
    opt.small_kernel = k;
    opt.pdl = pdl;
    return opt;
  };
  std::vector<RouterBenchRow> rows;
  {
    // The floors (num_tokens 0): an empty kernel, and one that reads W (a different copy per call) with as
    // many CTAs of 128 threads as the staged kernel uses at T = 1 (one expert per CTA).
    const int64_t n16 = w_bytes / 16;
    DevBuf<uint32_t> sink(1);
    const double empty_us = graph_median_us_per_call(
        [&](cudaStream_t st, int64_t) { empty_kernel<<<static_cast<unsigned>(E), 128, 0, st>>>(); }, copies,
        o.warmup, o.iters, stream);
    const double read_us = graph_median_us_per_call(
        [&](cudaStream_t st, int64_t k) {
          read_w_kernel<<<static_cast<unsigned>(E), 128, 0, st>>>(reinterpret_cast<const uint4*>(w.p + k * hw.size()),
                                                                 n16, sink.p);
        },
        copies, o.warmup, o.iters, stream);
    for (const auto& [name, us] : {std::pair<const char*, double>{"floor/empty-kernel", empty_us},
                                   std::pair<const char*, double>{"floor/read-W", read_us}}) {
      RouterBenchRow r;
      r.preset = preset;
      r.num_tokens = 0;
      r.variant = name;
      r.cold = true;
      r.us = us;
      r.weight_gbps = static_cast<double>(w_bytes) / (us * 1e3);
      rows.push_back(r);
    }
  }
  for (const int64_t T : o.tokens) {
    std::vector<Variant> variants;
    if (T <= kRouterSmallMaxTokens) {
      for (const int e : {1, 2, 4, 8})
        if (E % e == 0 && e * router_token_bucket(T) <= 64)
          variants.push_back({fmt::format("small/e{}", e), small(e, RouterSmallKernel::kRowLoop, false)});
      if (T <= kRouterStagedMaxTokens)
        for (const int e : {1, 2, 4, 8})
          if (E % e == 0) variants.push_back({fmt::format("small2/e{}", e), small(e, RouterSmallKernel::kStaged, false)});
      if (o.pdl_variants) {
        variants.push_back({"small/e1+pdl", small(1, RouterSmallKernel::kRowLoop, true)});
        if (T <= kRouterStagedMaxTokens)
          variants.push_back({"small2/e1+pdl", small(1, RouterSmallKernel::kStaged, true)});
      }
    }
    RouterGemmOptions lt;
    lt.path = RouterPath::kCublasLt;
    variants.push_back({"cublaslt", lt});
    variants.push_back({"auto", RouterGemmOptions{}});
    std::vector<float> first_small;  // logits of the first small-T variant of this T
    for (const Variant& v : variants) {
      // Correctness first (and cuBLASLt's algorithm choice, outside the capture).
      PCPKV_CUDA_CHECK(cudaMemsetAsync(logits.p, 0xA5, T * E * 4, stream));
      gemm.run(x.p, H, w.p, logits.p, T, stream, v.opt);
      PCPKV_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<float> got(static_cast<size_t>(T * E));
      PCPKV_CUDA_CHECK(cudaMemcpy(got.data(), logits.p, got.size() * 4, cudaMemcpyDeviceToHost));
      RouterPath used = v.opt.path == RouterPath::kAuto ? router_dispatch(T).path : v.opt.path;
      if (used == RouterPath::kSmallT && T > kRouterSmallMaxTokens) used = RouterPath::kCublasLt;
      const double factor = router_logit_bound_factor(used, H);
      for (size_t i = 0; i < got.size(); ++i) {
        const double bound = factor * std::ldexp(abs_sum[i], -24) + 1e-12 * abs_sum[i] + 1e-30;
        PCPKV_CHECK(std::fabs(got[i] - exact[i]) <= bound,
                    "bench: {} {} T={}: logit {} = {} differs from the fp64 oracle {} by more than the bound {}", preset,
                    v.name, T, i, got[i], exact[i], bound);
      }
      if (used == RouterPath::kSmallT) {
        if (first_small.empty()) {
          first_small = got;
        } else {
          for (size_t i = 0; i < got.size(); ++i)
            PCPKV_CHECK(std::memcmp(&got[i], &first_small[i], 4) == 0,
                        "bench: {} {} T={}: logit {} = {} is not bit-identical to the first small-T variant's {}",
                        preset, v.name, T, i, got[i], first_small[i]);
        }
      }
      for (const bool cold : {true, false}) {
        if (!cold && o.cold) continue;
        const int64_t n_calls = copies;
        const double us_per_call = graph_median_us_per_call(
            [&](cudaStream_t st, int64_t k) {
              gemm.run(x.p, H, w.p + (cold ? k : 0) * hw.size(), logits.p, T, st, v.opt);
            },
            n_calls, o.warmup, o.iters, stream);
        RouterBenchRow r;
        r.preset = preset;
        r.num_tokens = T;
        r.variant = v.name;
        r.cold = cold;
        r.us = us_per_call;
        r.weight_gbps = static_cast<double>(w_bytes) / (r.us * 1e3);
        rows.push_back(r);
      }
    }
  }
  cudaStreamDestroy(stream);
  return rows;
}

}  // namespace pcpkv::cuda
