// pcpkv/core/cuda_device.h: which CUDA devices this process sees (CUDA builds; no CUDA headers needed).
#pragma once

#include <string>

namespace pcpkv::cuda {

/// Number of visible CUDA devices; 0 (and *why_not set) when the runtime or driver is missing.
int device_count(std::string* why_not = nullptr);

}  // namespace pcpkv::cuda
