// python/csrc/symmetric_cuda.cpp: the CUDA half of torch.classes.pcpkv.SymmetricBuffer (CUDA builds only):
// pcpkv's VMM symmetric memory (src/ranks/cuda/symmetric_vmm.cpp) on the current device.
#include "pcpkv/ranks/cuda.h"
#include "symmetric.h"

namespace pcpkv_torch {

std::unique_ptr<pcpkv::SymmetricMemory> make_device_symmetric(pcpkv::Bootstrap& group, int64_t bytes,
                                                              const std::string& name, uint8_t fill) {
  return pcpkv::cuda::make_device_symmetric(group, bytes, name, fill);
}

void set_device_symmetric_failure(int64_t group_rank, const std::string& why) {
  pcpkv::cuda::set_device_symmetric_failure_for_test(static_cast<int32_t>(group_rank), why);
}

}  // namespace pcpkv_torch
