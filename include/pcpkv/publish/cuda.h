// pcpkv/publish/cuda.h: the CUDA backend's host entry points. No CUDA headers needed to include this.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/core/cuda_device.h"
#include "pcpkv/publish/backend.h"

namespace pcpkv::cuda {

/// The CUDA backend: W logical PCP ranks on one GPU, each with its own replica and staging buffer.
/// Throws pcpkv::Error when no device is usable.
std::unique_ptr<Backend> make_backend(int device_idx = 0);

}  // namespace pcpkv::cuda
