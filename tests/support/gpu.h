// tests/support/gpu.h: the GPU tests' common guard (header-only; include only from CUDA-tier tests).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

namespace pcpkv::test {

/// True when a CUDA device is usable; otherwise *why says why (driver missing, no device).
inline bool have_gpu(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    *why = e != cudaSuccess ? cudaGetErrorString(e) : "0 devices";
    return false;
  }
  return true;
}

}  // namespace pcpkv::test

/// Skips the test, stating the reason, when no CUDA device is usable.
#define REQUIRE_GPU()                                                                        \
  do {                                                                                       \
    std::string why_;                                                                        \
    if (!::pcpkv::test::have_gpu(&why_)) GTEST_SKIP() << "no CUDA device: " << why_;         \
  } while (0)

/// Asserts a CUDA runtime call succeeded.
#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())
