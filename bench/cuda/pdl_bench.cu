// bench/cuda/pdl_bench.cu: the PDL on/off benchmark of `pcpkv bench-serving` (pcpkv/core/pdl.h).
//
// Chains of pcpkv kernels, each captured kChainsPerGraph times back to back into one CUDA graph, with every
// launch PDL-enabled or not; time per chain = median replay time / kChainsPerGraph. Chains:
//   "quant>dequant x4"             FP8 per-token-group quantization and its consumer, 4 layers (8 kernels),
//                                  DeepSeek-V3.2 hidden 7168 (chain b)
//   "allreduce+norm>router>topk"   the MoE entry of a GLM-5 decode step: fused all-reduce + residual +
//                                  RMSNorm over W logical ranks, router GEMM (dispatch), grouped top-k
// (Chain a, dispatch > fence > combine, needs the publication kernels to launch through pdl::launch.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/check.h"
#include "bench/cuda/graph_timer.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/serving/router.h"
#include "pcpkv_bench/pdl.h"

namespace pcpkv::cuda {
namespace {

constexpr int kChainsPerGraph = 10;

using cuda::graph_median_us_per_call;

std::vector<uint16_t> filler(int64_t n, uint32_t seed, float scale) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float f = (static_cast<float>(s >> 8) / 16777216.0f * 2.0f - 1.0f) * scale;
    v[i] = codec::float_to_bf16(f == 0.0f ? scale * 1e-3f : f);
  }
  return v;
}

struct Arena {
  std::vector<void*> ptrs;
  template <typename T>
  T* alloc(int64_t n, const std::vector<T>* init = nullptr) {
    void* p = nullptr;
    PCPKV_CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    if (init) PCPKV_CUDA_CHECK(cudaMemcpy(p, init->data(), init->size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(p);
  }
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
};

/// Median microseconds per chain of `enqueue(stream, pdl)` captured kChainsPerGraph times.
double time_chain(const std::function<void(cudaStream_t, bool)>& enqueue, bool pdl, const PdlBenchOptions& o,
                  cudaStream_t stream) {
  enqueue(stream, pdl);  // eager once: cuBLASLt picks its algorithm outside the capture
  PCPKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  return graph_median_us_per_call([&](cudaStream_t st, int64_t) { enqueue(st, pdl); }, kChainsPerGraph, o.warmup,
                                  o.iters, stream);
}

}  // namespace

std::vector<PdlBenchRow> bench_pdl(const PdlBenchOptions& o) {
  PCPKV_CHECK(o.iters >= 20, "bench: iters = {} must be >= 20", o.iters);
  PCPKV_CHECK(o.world_size >= 1 && o.world_size <= kAllReduceMaxRanks, "bench: world_size = {} is outside [1, {}]",
              o.world_size, kAllReduceMaxRanks);
  cudaStream_t stream = nullptr;
  PCPKV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<PdlBenchRow> rows;

  for (const int64_t T : o.tokens) {
    PCPKV_CHECK(T >= 1, "bench: token count {} must be >= 1", T);
    // ---- chain b: FP8 quant > dequant, 4 layers ----
    {
      constexpr int kLayers = 4;
      const int64_t H = 7168;
      Arena a;
      const std::vector<uint16_t> hx = filler(T * H, 1, 1.0f);
      uint16_t* x = a.alloc<uint16_t>(T * H, &hx);
      std::vector<uint16_t*> y(kLayers);
      std::vector<uint8_t*> q(kLayers);
      std::vector<float*> s(kLayers);
      for (int l = 0; l < kLayers; ++l) {
        y[l] = a.alloc<uint16_t>(T * H);
        q[l] = a.alloc<uint8_t>(T * H);
        s[l] = a.alloc<float>(T * H / kFp8QuantGroup);
      }
      auto enqueue = [&](cudaStream_t st, bool pdl) {
        for (int l = 0; l < kLayers; ++l) {
          Fp8GroupQuantParams p;
          p.num_tokens = T;
          p.hidden = H;
          p.x = l == 0 ? x : y[l - 1];
          p.x_stride = H;
          p.q = q[l];
          p.scales = s[l];
          p.format = Fp8ScaleFormat::kUe8m0;
          fp8_group_quant(p, st, pdl);
          fp8_group_dequant(p, y[l], st, pdl);
        }
      };
      PdlBenchRow r;
      r.chain = "quant>dequant x4";
      r.num_tokens = T;
      r.num_kernels = 2 * kLayers;
      r.us_off = time_chain(enqueue, false, o, stream);
      r.us_on = time_chain(enqueue, true, o, stream);
      rows.push_back(r);
    }
    // ---- the MoE entry: all-reduce + norm > router > top-k (GLM-5) ----
    {
      const RouterConfig rc = router_config(preset("glm-5"));
      const int64_t H = rc.hidden_size;
      const int32_t W = o.world_size;
      Arena a;
      LogicalAllReduce ar(W, T * H);
      std::vector<uint16_t*> in(W), res(W), y(W);
      for (int32_t r = 0; r < W; ++r) {
        const std::vector<uint16_t> h = filler(T * H, 10 + r, 1.0f);
        in[r] = a.alloc<uint16_t>(T * H, &h);
        res[r] = a.alloc<uint16_t>(T * H, &h);
        y[r] = a.alloc<uint16_t>(T * H);
      }
      const std::vector<float> nw(static_cast<size_t>(H), 1.0f);
      float* dnw = a.alloc<float>(H, &nw);
      const std::vector<uint16_t> hw = filler(rc.n_experts * H, 3, 0.02f);
      uint16_t* w = a.alloc<uint16_t>(rc.n_experts * H, &hw);
      float* logits = a.alloc<float>(T * rc.n_experts);
      int32_t* ids = a.alloc<int32_t>(T * rc.top_k);
      float* weights = a.alloc<float>(T * rc.top_k);
      RouterGemm gemm(H, rc.n_experts, RouterWeightDtype::kBf16);
      auto enqueue = [&](cudaStream_t st, bool pdl) {
        AllReduceOptions ao;
        ao.pdl = pdl;
        ar.run_fused(in.data(), res.data(), res.data(), y.data(), T, AllReduceNorm{H, dnw, 1e-5f}, st, ao);
        RouterGemmOptions ro;
        ro.pdl = pdl;
        gemm.run(y[0], H, w, logits, T, st, ro);
        grouped_topk(logits, T, nullptr, rc, ids, weights, st, pdl);
      };
      PdlBenchRow r;
      r.chain = fmt::format("allreduce+norm(W={})>router>topk", W);
      r.num_tokens = T;
      r.num_kernels = 3;
      r.us_off = time_chain(enqueue, false, o, stream);
      r.us_on = time_chain(enqueue, true, o, stream);
      ar.check();
      rows.push_back(r);
    }
  }
  cudaStreamDestroy(stream);
  return rows;
}

}  // namespace pcpkv::cuda
