// python/csrc/cuda_launch.h: what the CUDA halves of the op files share (CUDA builds only, PCPKV_TORCH_CUDA).
//
// Order in every CUDA implementation: all host-side checks first (tensor dtypes, shapes, devices, host tables,
// alignment the kernels need), then the launches, asynchronous on the current torch stream. A bad argument raises
// ValueError before anything is enqueued; no op synchronizes, allocates host memory or copies to the host, so every
// op is capturable into a CUDA graph. Slot and position *values* live on the device and are not read here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "checks.h"

namespace pcpkv_torch {

/// The current torch stream of device d: every launch goes there.
inline cudaStream_t current_stream(const c10::Device& d) { return c10::cuda::getCurrentCUDAStream(d.index()).stream(); }

inline uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

/// The op's reference argument (its device is the launch's): "name: expected a CUDA tensor, got ...".
inline void require_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.is_cuda(), name, ": expected a CUDA tensor, got ", describe(t));
}

}  // namespace pcpkv_torch
