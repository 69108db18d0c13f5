// Device discovery (pcpkv/core/cuda_device.h) and small per-device facts the launchers need (core/cuda/device.h).
#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "pcpkv/core/cuda_device.h"

namespace pcpkv {
namespace cuda {

int device_count(std::string* why_not) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    if (why_not)
      *why_not = fmt::format("cudaGetDeviceCount failed: {} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
    return 0;
  }
  if (n == 0 && why_not) *why_not = "cudaGetDeviceCount reports 0 devices";
  return n;
}

}  // namespace cuda

namespace cuda {

int num_sms() {
  static std::mutex mu;
  static std::unordered_map<int, int> cache;
  int device = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 0;
  PCPKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cache.emplace(device, sms);
  return sms;
}

}  // namespace cuda
}  // namespace pcpkv
