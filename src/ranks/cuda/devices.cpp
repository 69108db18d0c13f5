// Which device a rank process uses, and its free memory (pcpkv/ranks/cuda.h).
#include <cuda_runtime_api.h>

#include <string>

#include "core/cuda/check.h"
#include "pcpkv/core/cuda_device.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/ranks/cuda.h"
#include "pcpkv/ranks/launch.h"

namespace pcpkv::cuda {

int32_t select_rank_device(const Bootstrap& world, int32_t device_idx) {
  std::string why;
  const int n = device_count(&why);
  PCPKV_CHECK(n > 0, "rank {}: no CUDA device: {}", world.rank(), why);
  int32_t d = device_idx;
  if (d < 0) d = pick_device_round_robin(world.local_rank(), n);
  PCPKV_CHECK(d < n, "rank {}: device {} is not one of the {} visible devices", world.rank(), d, n);
  PCPKV_CUDA_CHECK(cudaSetDevice(d));
  PCPKV_CUDA_CHECK(cudaFree(nullptr));  // create the primary context now, not inside a timed region
  return d;
}

int64_t device_free_bytes() {
  size_t free_bytes = 0, total = 0;
  PCPKV_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return static_cast<int64_t>(free_bytes);
}

}  // namespace pcpkv::cuda
