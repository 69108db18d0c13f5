// src/core/cuda/check.h: CUDA runtime / driver error checks that throw pcpkv::Error with file:line.
#pragma once

#include <cuda_runtime_api.h>

#include "pcpkv/core/error.h"

namespace pcpkv::cuda {

[[noreturn]] inline void cuda_fail(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(err), cudaGetErrorString(err), call),
              fmt::format("{}:{}", file, line));
}

}  // namespace pcpkv::cuda

/// Throws pcpkv::Error naming the CUDA error and the call when `call` does not return cudaSuccess.
#define PCPKV_CUDA_CHECK(call)                                                          \
  do {                                                                                  \
    const cudaError_t pcpkv_err_ = (call);                                              \
    if (pcpkv_err_ != cudaSuccess) ::pcpkv::cuda::cuda_fail(pcpkv_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch: a launch error (bad configuration, too many resources) becomes a pcpkv::Error.
#define PCPKV_CUDA_CHECK_LAUNCH() PCPKV_CUDA_CHECK(cudaGetLastError())
