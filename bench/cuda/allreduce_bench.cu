// bench/cuda/allreduce_bench.cu: all-reduce latency by size for W logical ranks on one GPU (pcpkv/serving/allreduce.h),
// for `pcpkv bench-serving`. One GPU's HBM stands in for the peers' memory, so this measures the kernel's
// and the barriers' cost, not NVLink (the multi-GPU comparison against NCCL belongs to the multi-GPU issue).
// Each variant is checked against the CPU oracle once, then a graph of kCallsPerGraph calls is replayed
// `iters` times; time per call = median replay / kCallsPerGraph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda/check.h"
#include "bench/cuda/graph_timer.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv_bench/allreduce.h"

namespace pcpkv::cuda {
namespace {

constexpr int kCallsPerGraph = 20;

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
std::vector<uint16_t> bench_bf16(int64_t n, uint64_t seed) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(mix(seed * 1000003u + i) >> 40) / 16777216.0f * 2.0f - 1.0f;
    v[i] = codec::float_to_bf16(f == 0.0f ? 1e-3f : f);
  }
  return v;
}
using cuda::graph_median_us_per_call;

}  // namespace

std::vector<AllReduceBenchRow> bench_allreduce(const AllReduceBenchOptions& o) {
  PCPKV_CHECK(o.iters >= 20, "bench: iters = {} must be >= 20", o.iters);
  PCPKV_CHECK(!o.bytes.empty() && !o.world_sizes.empty(), "bench: no sizes or world sizes");
  PCPKV_CHECK(o.hidden > 0 && o.hidden % 8 == 0 && o.hidden <= kAllReduceMaxHidden, "bench: hidden = {} is unusable",
              o.hidden);
  for (const int64_t b : o.bytes) PCPKV_CHECK(b >= 16 && b % 16 == 0, "bench: size {} must be a multiple of 16 bytes", b);
  const int64_t max_elems = *std::max_element(o.bytes.begin(), o.bytes.end()) / 2;
  const int64_t H = o.hidden;
  std::vector<float> norm_w(static_cast<size_t>(H));
  for (int64_t k = 0; k < H; ++k) norm_w[k] = 0.75f + static_cast<float>(k % 7) * 0.0625f;
  float* dw = nullptr;
  PCPKV_CUDA_CHECK(cudaMalloc(&dw, H * 4));
  PCPKV_CUDA_CHECK(cudaMemcpy(dw, norm_w.data(), H * 4, cudaMemcpyHostToDevice));
  const AllReduceNorm norm{H, dw, 1e-5f};
  cudaStream_t stream = nullptr;
  PCPKV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<AllReduceBenchRow> rows;

  for (const int32_t W : o.world_sizes) {
    LogicalAllReduce ar(W, max_elems);
    std::vector<std::vector<uint16_t>> h_in;
    std::vector<uint16_t*> in(W), out(W), res(W), y(W);
    const std::vector<uint16_t> h_res = bench_bf16(max_elems, 999);
    for (int32_t r = 0; r < W; ++r) {
      h_in.push_back(bench_bf16(max_elems, 100 + r));
      for (uint16_t** p : {&in[r], &out[r], &res[r], &y[r]}) PCPKV_CUDA_CHECK(cudaMalloc(p, max_elems * 2));
      PCPKV_CUDA_CHECK(cudaMemcpy(in[r], h_in[r].data(), max_elems * 2, cudaMemcpyHostToDevice));
    }
    for (const int64_t bytes : o.bytes) {
      const int64_t n = bytes / 2;
      struct Variant {
        std::string name;
        AllReduceAlgo algo;
        bool fused;
      };
      std::vector<Variant> variants = {{"oneshot", AllReduceAlgo::kOneShot, false},
                                       {"twoshot", AllReduceAlgo::kTwoShot, false},
                                       {"auto", AllReduceAlgo::kAuto, false}};
      if (n % H == 0) {
        variants.push_back({"fused-oneshot", AllReduceAlgo::kOneShot, true});
        variants.push_back({"fused-twoshot", AllReduceAlgo::kTwoShot, true});
        variants.push_back({"fused-auto", AllReduceAlgo::kAuto, true});
      }
      for (const Variant& v : variants) {
        AllReduceOptions opt;
        opt.algo = v.algo;
        const int64_t T = n / H;
        auto call = [&] {
          if (v.fused)
            ar.run_fused(in.data(), res.data(), res.data(), y.data(), T, norm, stream, opt);
          else
            ar.run(in.data(), out.data(), n, stream, opt);
        };
        // Correctness once against the oracle (fused: residual reset first).
        for (int32_t r = 0; r < W; ++r)
          PCPKV_CUDA_CHECK(cudaMemcpy(res[r], h_res.data(), n * 2, cudaMemcpyHostToDevice));
        call();
        ar.check();
        std::vector<const uint16_t*> ptrs;
        for (auto& h : h_in) ptrs.push_back(h.data());
        std::vector<uint16_t> expect(n), expect_res(n), got(n);
        if (v.fused)
          allreduce_rmsnorm_reference(ptrs, T, AllReduceNorm{H, norm_w.data(), 1e-5f}, h_res.data(), expect_res.data(),
                                      expect.data());
        else
          allreduce_reference(ptrs, n, expect.data());
        for (int32_t r = 0; r < W; ++r) {
          PCPKV_CUDA_CHECK(cudaMemcpy(got.data(), v.fused ? y[r] : out[r], n * 2, cudaMemcpyDeviceToHost));
          PCPKV_CHECK(got == expect, "bench: all-reduce {} W={} {} B: rank {} differs from the CPU oracle", v.name, W,
                      bytes, r);
        }
        const double us_per_call =
            graph_median_us_per_call([&](cudaStream_t, int64_t) { call(); }, kCallsPerGraph, o.warmup, o.iters, stream);
        ar.check();
        AllReduceBenchRow row;
        row.world_size = W;
        row.bytes = bytes;
        row.variant = v.name;
        AllReducePartition part;
        const AllReduceAlgo algo = v.algo == AllReduceAlgo::kAuto ? choose_allreduce_algo(bytes, W, v.fused) : v.algo;
        part.num_items = v.fused ? T : n / 8;
        part.items_per_chunk = v.fused ? 1 : kAllReduceChunkVectors;
        part.num_segments = algo == AllReduceAlgo::kTwoShot ? W : 1;
        row.num_blocks = allreduce_num_blocks(part, ar.max_blocks());
        row.us = us_per_call;
        row.algbw_gbps = static_cast<double>(bytes) / (row.us * 1e3);
        rows.push_back(row);
      }
    }
    for (int32_t r = 0; r < W; ++r)
      for (uint16_t* p : {in[r], out[r], res[r], y[r]}) cudaFree(p);
  }
  cudaStreamDestroy(stream);
  cudaFree(dw);
  return rows;
}

}  // namespace pcpkv::cuda
