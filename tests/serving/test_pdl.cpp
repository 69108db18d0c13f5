// pcpkv-test-labels: cuda
// PDL chains (pcpkv/core/pdl.h, SPEC section 7): the same chains of pcpkv kernels launched with and without
// programmatic stream serialization, captured into CUDA graphs whose intermediates are poisoned before
// every replay, give identical bytes, equal to the CPU references. A dependent kernel that read before its
// griddepcontrol.wait would see the poison. Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/serving/router.h"
#include "support/gpu.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {


template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) throw Error("cudaMalloc failed");
  return p;
}
template <typename T>
std::vector<T> dev_get(const T* p, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

// PCPKV_PDL follows the one rule of the switches (read_env_switch): a value other than 1, 0 or empty is refused,
// naming the variable and the value, not taken for off. It needs the switch undecided: ctest runs it in its own
// process (gtest_discover_tests), and it comes first in this file for a run of the whole binary. A refused value
// leaves the switch undecided. Needs no GPU.
TEST(Pdl, SwitchRefusesOddValuesOfTheVariable) {
  for (const char* odd : {"yes", "true", "2"}) {
    ::setenv("PCPKV_PDL", odd, 1);
    try {
      (void)pdl::enabled();
      ADD_FAILURE() << "PCPKV_PDL='" << odd << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("PCPKV_PDL: must be 1 (on) or 0 / empty / unset (off), got '") +
                                           odd + "'"),
                std::string::npos)
          << e.what();
    }
  }
  ::setenv("PCPKV_PDL", "1", 1);
  EXPECT_TRUE(pdl::enabled());
  ::unsetenv("PCPKV_PDL");
  EXPECT_TRUE(pdl::enabled()) << "decided once per process";
  pdl::set_enabled(false);
}

TEST(Pdl, SwitchDefaultsOffAndCanBeSet) {
  const bool initial = pdl::enabled();
  pdl::set_enabled(true);
  EXPECT_TRUE(pdl::enabled());
  pdl::set_enabled(false);
  EXPECT_FALSE(pdl::enabled());
  pdl::set_enabled(initial);
}

/// Chain b: x -> [quant -> dequant] x kLayers, then the router GEMM and top-k on the last output.
/// Every intermediate is poisoned inside the graph before the chain runs.
struct QuantChain {
  static constexpr int kLayers = 3;
  int64_t T, H;
  RouterConfig rc;
  uint16_t* x;
  std::vector<uint16_t*> y;   // [kLayers]
  std::vector<uint8_t*> q;    // [kLayers]
  std::vector<float*> s;      // [kLayers]
  uint16_t* w;
  float* logits;
  int32_t* ids;
  float* weights;
  RouterSmallKernel small_kernel = RouterSmallKernel::kAuto;  // kAuto: the dispatch; else small-T, 1 expert/CTA
  QuantChain(int64_t T_, const RouterConfig& c) : T(T_), H(c.hidden_size), rc(c) {
    x = dev_alloc<uint16_t>(T * H);
    for (int l = 0; l < kLayers; ++l) {
      y.push_back(dev_alloc<uint16_t>(T * H));
      q.push_back(dev_alloc<uint8_t>(T * H));
      s.push_back(dev_alloc<float>(T * H / kFp8QuantGroup));
    }
    w = dev_alloc<uint16_t>(c.n_experts * H);
    logits = dev_alloc<float>(T * c.n_experts);
    ids = dev_alloc<int32_t>(T * c.top_k);
    weights = dev_alloc<float>(T * c.top_k);
  }
  ~QuantChain() {
    cudaFree(x);
    for (int l = 0; l < kLayers; ++l) {
      cudaFree(y[l]);
      cudaFree(q[l]);
      cudaFree(s[l]);
    }
    cudaFree(w);
    cudaFree(logits);
    cudaFree(ids);
    cudaFree(weights);
  }
  Fp8GroupQuantParams params(int l) const {
    Fp8GroupQuantParams p;
    p.num_tokens = T;
    p.hidden = H;
    p.x = l == 0 ? x : y[l - 1];
    p.x_stride = H;
    p.q = q[l];
    p.scales = s[l];
    p.format = Fp8ScaleFormat::kUe8m0;
    return p;
  }
  void enqueue(cudaStream_t stream, cuda::RouterGemm& gemm, bool pdl) {
    for (int l = 0; l < kLayers; ++l) {
      cudaMemsetAsync(q[l], 0xA5, T * H, stream);
      cudaMemsetAsync(y[l], 0xA5, T * H * 2, stream);
    }
    cudaMemsetAsync(logits, 0xA5, T * rc.n_experts * 4, stream);
    for (int l = 0; l < kLayers; ++l) {
      cuda::fp8_group_quant(params(l), stream, pdl);
      cuda::fp8_group_dequant(params(l), y[l], stream, pdl);
    }
    cuda::RouterGemmOptions o;
    o.pdl = pdl;
    if (small_kernel != RouterSmallKernel::kAuto) {
      o.path = RouterPath::kSmallT;
      o.experts_per_cta = 1;
      o.small_kernel = small_kernel;
    }
    gemm.run(y[kLayers - 1], H, w, logits, T, stream, o);
    cuda::grouped_topk(logits, T, nullptr, rc, ids, weights, stream, pdl);
  }
};

TEST(Pdl, QuantChainIsByteIdenticalWithAndWithoutPdl) {
  REQUIRE_GPU();
  const RouterConfig rc = router_config(preset("deepseek-v3.2"));
  for (const int64_t T : {1, 8, 64}) {
    SCOPED_TRACE(::testing::Message() << "T " << T);
    const std::vector<uint16_t> hx = test::random_bf16(T, rc.hidden_size, 40 + T);
    const std::vector<uint16_t> hw = test::random_bf16(rc.n_experts, rc.hidden_size, 41, 0, 0.02);
    // CPU reference of the quant chain.
    std::vector<uint16_t> cur = hx, next(hx.size());
    std::vector<uint8_t> hq(hx.size());
    std::vector<float> hs(hx.size() / kFp8QuantGroup);
    for (int l = 0; l < QuantChain::kLayers; ++l) {
      Fp8GroupQuantParams p;
      p.num_tokens = T;
      p.hidden = rc.hidden_size;
      p.x = cur.data();
      p.x_stride = rc.hidden_size;
      p.q = hq.data();
      p.scales = hs.data();
      p.format = Fp8ScaleFormat::kUe8m0;
      fp8_group_quant_reference(p);
      fp8_group_dequant_reference(p, next.data());
      cur = next;
    }
    std::vector<RouterSmallKernel> kernels = {RouterSmallKernel::kAuto};
    if (T <= kRouterStagedMaxTokens) {
      kernels.push_back(RouterSmallKernel::kRowLoop);
      kernels.push_back(RouterSmallKernel::kStaged);
    }
    for (const RouterSmallKernel kernel : kernels) {
      SCOPED_TRACE(::testing::Message() << "router " << to_string(kernel));
      std::vector<std::vector<uint8_t>> results;  // [pdl off, pdl on]: y, logits, ids, weights as bytes
      for (const bool pdl : {false, true}) {
        QuantChain chain(T, rc);
        chain.small_kernel = kernel;
        CUDA_OK(cudaMemcpy(chain.x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(chain.w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
        cuda::RouterGemm gemm(rc.hidden_size, rc.n_experts, RouterWeightDtype::kBf16);
        cudaStream_t stream;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        chain.enqueue(stream, gemm, pdl);  // eager once (also picks the cuBLASLt algorithm)
        CUDA_OK(cudaStreamSynchronize(stream));
        cudaGraph_t graph;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        chain.enqueue(stream, gemm, pdl);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        for (int k = 0; k < 20; ++k) CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        const auto y = dev_get(chain.y[QuantChain::kLayers - 1], hx.size());
        EXPECT_EQ(y, cur) << (pdl ? "pdl on" : "pdl off");
        const auto logits = dev_get(chain.logits, T * rc.n_experts);
        const auto ids = dev_get(chain.ids, T * rc.top_k);
        const auto weights = dev_get(chain.weights, T * rc.top_k);
        std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(logits.data()),
                                   reinterpret_cast<const uint8_t*>(logits.data() + logits.size()));
        bytes.insert(bytes.end(), reinterpret_cast<const uint8_t*>(ids.data()),
                     reinterpret_cast<const uint8_t*>(ids.data() + ids.size()));
        bytes.insert(bytes.end(), reinterpret_cast<const uint8_t*>(weights.data()),
                     reinterpret_cast<const uint8_t*>(weights.data() + weights.size()));
        results.push_back(bytes);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      }
      EXPECT_EQ(results[0], results[1]) << "PDL changed the bytes";
    }
  }
}

TEST(Pdl, AllReduceThenRouterChain) {
  REQUIRE_GPU();
  const RouterConfig rc = router_config(preset("glm-5"));
  const int32_t W = 4;
  const int64_t T = 8, H = rc.hidden_size;
  std::vector<std::vector<uint16_t>> in;
  std::vector<const uint16_t*> in_ptrs;
  for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(T, H, 70 + r));
  for (auto& v : in) in_ptrs.push_back(v.data());
  const std::vector<uint16_t> residual = test::random_bf16(T, H, 80);
  const std::vector<float> nw = test::random_weights(H, 81);
  std::vector<uint16_t> res_ref(T * H), y_ref(T * H);
  allreduce_rmsnorm_reference(in_ptrs, T, AllReduceNorm{H, nw.data(), 1e-5f}, residual.data(), res_ref.data(), y_ref.data());
  const std::vector<uint16_t> hw = test::random_bf16(rc.n_experts, H, 82, 0, 0.02);

  // The small-T kernels explicitly (T = 8 dispatches to cuBLASLt): each must wait before reading y.
  for (const RouterSmallKernel kernel :
       {RouterSmallKernel::kAuto, RouterSmallKernel::kRowLoop, RouterSmallKernel::kStaged}) {
    SCOPED_TRACE(::testing::Message() << "router " << to_string(kernel));
    std::vector<std::vector<uint8_t>> results;
    for (const bool pdl : {false, true}) {
      cuda::LogicalAllReduce ar(W, T * H);
      std::vector<uint16_t*> din(W), dres(W), dy(W);
      for (int32_t r = 0; r < W; ++r) {
        din[r] = dev_alloc<uint16_t>(T * H);
        dres[r] = dev_alloc<uint16_t>(T * H);
        dy[r] = dev_alloc<uint16_t>(T * H);
        CUDA_OK(cudaMemcpy(din[r], in[r].data(), T * H * 2, cudaMemcpyHostToDevice));
      }
      uint16_t* dres_src = dev_alloc<uint16_t>(T * H);  // graph nodes copy device to device (no pageable memory)
      CUDA_OK(cudaMemcpy(dres_src, residual.data(), T * H * 2, cudaMemcpyHostToDevice));
      float* dnw = dev_alloc<float>(H);
      uint16_t* dw = dev_alloc<uint16_t>(hw.size());
      float* logits = dev_alloc<float>(T * rc.n_experts);
      int32_t* ids = dev_alloc<int32_t>(T * rc.top_k);
      float* weights = dev_alloc<float>(T * rc.top_k);
      CUDA_OK(cudaMemcpy(dnw, nw.data(), H * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
      cuda::RouterGemm gemm(H, rc.n_experts, RouterWeightDtype::kBf16);
      cudaStream_t stream;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      auto enqueue = [&] {
        for (int32_t r = 0; r < W; ++r) {
          cudaMemcpyAsync(dres[r], dres_src, T * H * 2, cudaMemcpyDeviceToDevice, stream);
          cudaMemsetAsync(dy[r], 0xA5, T * H * 2, stream);
        }
        cudaMemsetAsync(logits, 0xA5, T * rc.n_experts * 4, stream);
        cuda::AllReduceOptions o;
        o.pdl = pdl;
        ar.run_fused(din.data(), dres.data(), dres.data(), dy.data(), T, AllReduceNorm{H, dnw, 1e-5f}, stream, o);
        cuda::RouterGemmOptions ro;
        ro.pdl = pdl;
        if (kernel != RouterSmallKernel::kAuto) {
          ro.path = RouterPath::kSmallT;
          ro.experts_per_cta = 1;
          ro.small_kernel = kernel;
        }
        gemm.run(dy[0], H, dw, logits, T, stream, ro);
        cuda::grouped_topk(logits, T, nullptr, rc, ids, weights, stream, pdl);
      };
      enqueue();
      CUDA_OK(cudaStreamSynchronize(stream));
      cudaGraph_t graph;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      enqueue();
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int k = 0; k < 20; ++k) CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      ar.check();
      for (int32_t r = 0; r < W; ++r) {
        EXPECT_EQ(dev_get(dy[r], T * H), y_ref) << "rank " << r << (pdl ? " pdl" : "");
        EXPECT_EQ(dev_get(dres[r], T * H), res_ref) << "rank " << r << (pdl ? " pdl" : "");
      }
      const auto lg = dev_get(logits, T * rc.n_experts);
      const auto id = dev_get(ids, T * rc.top_k);
      std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(lg.data()),
                                 reinterpret_cast<const uint8_t*>(lg.data() + lg.size()));
      bytes.insert(bytes.end(), reinterpret_cast<const uint8_t*>(id.data()), reinterpret_cast<const uint8_t*>(id.data() + id.size()));
      results.push_back(bytes);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
      for (int32_t r = 0; r < W; ++r) {
        cudaFree(din[r]);
        cudaFree(dres[r]);
        cudaFree(dy[r]);
      }
      cudaFree(dres_src);
      cudaFree(dnw);
      cudaFree(dw);
      cudaFree(logits);
      cudaFree(ids);
      cudaFree(weights);
    }
    EXPECT_EQ(results[0], results[1]) << "PDL changed the bytes";
  }
}

}  // namespace
}  // namespace pcpkv
