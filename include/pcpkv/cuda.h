// pcpkv/cuda.h: the CUDA backend's host entry points. No CUDA headers needed to include this.
#pragma once

#include <memory>
#include <string>

#include "pcpkv/backend.h"

namespace pcpkv::cuda {

/// Number of visible CUDA devices; 0 (and *why_not set) when the runtime or driver is missing.
int device_count(std::string* why_not = nullptr);

/// The CUDA backend: W logical PCP ranks on one GPU, each with its own replica and staging buffer.
/// Throws pcpkv::Error when no device is usable.
std::unique_ptr<Backend> make_backend(int device_idx = 0);

}  // namespace pcpkv::cuda
