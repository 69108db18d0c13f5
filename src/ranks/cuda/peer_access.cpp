// This rank's row of the peer-access matrix for transport "auto" (cuda::peer_access_row, pcpkv/ranks/cuda.h).
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "core/cuda/check.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/ranks/cuda.h"

namespace pcpkv::cuda {

std::vector<bool> peer_access_row(Bootstrap& group) {
  // Each rank's GPU by UUID (equal: one GPU) and PCI bus id (device indices differ between processes when
  // CUDA_VISIBLE_DEVICES does).
  struct Id {
    char uuid[16];
    char bus[32];
  };
  int device = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  Id mine{};
  std::memcpy(mine.uuid, prop.uuid.bytes, sizeof(mine.uuid));
  PCPKV_CUDA_CHECK(cudaDeviceGetPCIBusId(mine.bus, sizeof(mine.bus) - 1, device));
  const auto W = static_cast<size_t>(group.world_size());
  std::vector<Id> all(W);
  group.all_gather(&mine, sizeof(Id), all.data());
  std::vector<bool> row(W, false);
  for (size_t b = 0; b < W; ++b) {
    if (std::memcmp(all[b].uuid, mine.uuid, sizeof(mine.uuid)) == 0) {
      row[b] = true;
      continue;
    }
    all[b].bus[sizeof(all[b].bus) - 1] = '\0';
    int peer = -1;
    if (cudaDeviceGetByPCIBusId(&peer, all[b].bus) != cudaSuccess) {
      (void)cudaGetLastError();  // not visible here: no peer access
      continue;
    }
    int can = 0;
    row[b] = cudaDeviceCanAccessPeer(&can, device, peer) == cudaSuccess && can != 0;
    (void)cudaGetLastError();
  }
  return row;
}

}  // namespace pcpkv::cuda
