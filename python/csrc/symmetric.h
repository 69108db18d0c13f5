// python/csrc/symmetric.h: pcpkv symmetric memory (pcpkv/ranks/symmetric.h) as a torch custom class,
// torch.classes.pcpkv.SymmetricBuffer: every rank's buffer of a Bootstrap group mapped here, handed out as
// uint8 tensors. Host memory: POSIX shared memory (make_host_symmetric); CUDA: VMM handles passed as file
// descriptors (cuda::make_device_symmetric, CUDA builds).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <string>
#include <vector>

#include "bootstrap.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv_torch {

struct SymmetricHolder : torch::CustomClassHolder {
  // Shared with every tensor handed out (their deleters hold a reference): the mappings go when close() was
  // called and the last such tensor is gone, so no tensor ever points to unmapped memory.
  std::shared_ptr<pcpkv::SymmetricMemory> mem;
  c10::Device device;
  /// Collective over `boot` (see make_host_symmetric / make_device_symmetric); device_type "cpu" | "cuda"
  /// (the current CUDA device is device_index, set by the caller).
  SymmetricHolder(const c10::intrusive_ptr<BootstrapHolder>& boot, int64_t bytes, std::string name, int64_t fill,
                  std::string device_type, int64_t device_index);
  const pcpkv::SymmetricMemory& get(const char* what) const;
  /// uint8 [bytes]: rank r's buffer as mapped in this process.
  at::Tensor buffer(int64_t r) const;
};

}  // namespace pcpkv_torch
