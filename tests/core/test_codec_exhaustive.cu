// pcpkv-test-labels: cuda
// The hardware conversions the kernels use (pcpkv/device/codec_hw.h: cvt.rn.satfinite.e4m3x2.f32 and
// cvt.rn.bf16x2.f32) against the software oracle of pcpkv/device/codec.h, for every one of the 2^32 float
// bit patterns, in both lanes of each x2 instruction (lane 0 sees pattern u, lane 1 sees u ^ kLaneMix, so
// each lane covers all 2^32 patterns too). The GPU computes the hardware bytes chunk by chunk; host threads
// compare them with codec.h computed on the host. Any difference fails the test with the first patterns.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/cuda.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/codec_hw.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {


constexpr uint32_t kLaneMix = 0x9E3779B9u;
constexpr int64_t kChunk = int64_t{1} << 26;  // patterns per GPU round trip

__global__ void hw_convert(uint32_t base, uint16_t* e4m3x2, uint32_t* bf16x2) {
  const int64_t n = kChunk;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t u = base + static_cast<uint32_t>(i);
    const float lo = __uint_as_float(u), hi = __uint_as_float(u ^ kLaneMix);
    e4m3x2[i] = codec::hw_float2_to_e4m3x2(lo, hi);
    bf16x2[i] = codec::hw_float2_to_bf16x2(lo, hi);
  }
}

// Did the device code use the hardware instructions at all? (sm_89+ only; the test is meaningless otherwise.)
__global__ void uses_hw(int* flag) { *flag = PCPKV_HW_CODEC; }

struct Mismatch {
  uint32_t pattern;
  std::string what;
};

TEST(CodecExhaustive, HardwareConversionsEqualCodecForEveryFloat) {
  REQUIRE_GPU();
  int* flag = nullptr;
  int hw = 0;
  CUDA_OK(cudaMalloc(&flag, sizeof(int)));
  uses_hw<<<1, 1>>>(flag);
  CUDA_OK(cudaMemcpy(&hw, flag, sizeof(int), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(flag));
  if (!hw) GTEST_SKIP() << "this device build uses the software codec (compute capability < 8.9 or PCPKV_SOFTWARE_CODEC)";

  uint16_t* d_e4 = nullptr;
  uint32_t* d_bf = nullptr;
  CUDA_OK(cudaMalloc(&d_e4, kChunk * sizeof(uint16_t)));
  CUDA_OK(cudaMalloc(&d_bf, kChunk * sizeof(uint32_t)));
  uint16_t* h_e4 = nullptr;
  uint32_t* h_bf = nullptr;
  CUDA_OK(cudaMallocHost(&h_e4, kChunk * sizeof(uint16_t)));
  CUDA_OK(cudaMallocHost(&h_bf, kChunk * sizeof(uint32_t)));

  const int num_threads = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> num_bad{0};
  std::vector<std::vector<Mismatch>> first(static_cast<size_t>(num_threads));
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kChunk) {
    hw_convert<<<1024, 256>>>(static_cast<uint32_t>(base), d_e4, d_bf);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(h_e4, d_e4, kChunk * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h_bf, d_bf, kChunk * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    std::vector<std::thread> pool;
    for (int t = 0; t < num_threads; ++t)
      pool.emplace_back([&, t] {
        const int64_t begin = kChunk * t / num_threads, end = kChunk * (t + 1) / num_threads;
        int64_t bad = 0;
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t u = static_cast<uint32_t>(base + static_cast<uint64_t>(i));
          const float lo = fp32::from_bits(u), hi = fp32::from_bits(u ^ kLaneMix);
          const uint16_t e_want = static_cast<uint16_t>(codec::float_to_e4m3(lo) | (codec::float_to_e4m3(hi) << 8));
          const uint32_t b_want = codec::float_to_bf16(lo) | (static_cast<uint32_t>(codec::float_to_bf16(hi)) << 16);
          if (h_e4[i] != e_want || h_bf[i] != b_want) {
            ++bad;
            auto& f = first[static_cast<size_t>(t)];
            if (f.size() < 4)
              f.push_back({u, fmt::format("float {:#010x}/{:#010x}: e4m3x2 hw {:#06x} codec {:#06x}, bf16x2 hw "
                                          "{:#010x} codec {:#010x}",
                                          u, u ^ kLaneMix, h_e4[i], e_want, h_bf[i], b_want)});
          }
        }
        num_bad += bad;
      });
    for (auto& th : pool) th.join();
  }
  std::string report;
  for (const auto& f : first)
    for (const Mismatch& m : f) report += "\n  " + m.what;
  EXPECT_EQ(num_bad.load(), 0) << num_bad.load() << " of 2^32 patterns differ; first ones:" << report;
  cudaFree(d_e4);
  cudaFree(d_bf);
  cudaFreeHost(h_e4);
  cudaFreeHost(h_bf);
}

// The single-value forms and the 4-byte packing agree with the x2 forms (lane order: x[0] first in memory).
__global__ void packing(const float* x, uint32_t* out) {
  out[0] = codec::hw_float4_to_e4m3x4(x[0], x[1], x[2], x[3]);
  out[1] = codec::hw_float_to_e4m3(x[0]) | (codec::hw_float_to_e4m3(x[1]) << 8) |
           (codec::hw_float_to_e4m3(x[2]) << 16) | (static_cast<uint32_t>(codec::hw_float_to_e4m3(x[3])) << 24);
  out[2] = codec::hw_float2_to_bf16x2(x[0], x[1]);
  out[3] = codec::hw_float_to_bf16(x[0]) | (static_cast<uint32_t>(codec::hw_float_to_bf16(x[1])) << 16);
}

TEST(CodecExhaustive, PackingOrderIsLittleEndian) {
  REQUIRE_GPU();
  const float h_x[4] = {1.0f, -2.5f, 448.0f, 0.013671875f};
  float* d_x = nullptr;
  uint32_t* d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_x, sizeof(h_x)));
  CUDA_OK(cudaMalloc(&d_out, 4 * sizeof(uint32_t)));
  CUDA_OK(cudaMemcpy(d_x, h_x, sizeof(h_x), cudaMemcpyHostToDevice));
  packing<<<1, 1>>>(d_x, d_out);
  uint32_t out[4];
  CUDA_OK(cudaMemcpy(out, d_out, sizeof(out), cudaMemcpyDeviceToHost));
  const uint32_t e_want = codec::float_to_e4m3(h_x[0]) | (codec::float_to_e4m3(h_x[1]) << 8) |
                          (codec::float_to_e4m3(h_x[2]) << 16) |
                          (static_cast<uint32_t>(codec::float_to_e4m3(h_x[3])) << 24);
  const uint32_t b_want = codec::float_to_bf16(h_x[0]) | (static_cast<uint32_t>(codec::float_to_bf16(h_x[1])) << 16);
  EXPECT_EQ(out[0], e_want);
  EXPECT_EQ(out[1], e_want);
  EXPECT_EQ(out[2], b_want);
  EXPECT_EQ(out[3], b_want);
  cudaFree(d_x);
  cudaFree(d_out);
}

}  // namespace
}  // namespace pcpkv
