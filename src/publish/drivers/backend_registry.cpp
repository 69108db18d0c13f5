// Picks the backend by name: "cpu", "cuda", or "auto" (CUDA when built with it and a GPU is visible).
#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda.h"
#endif

namespace pcpkv {

bool cuda_backend_available(std::string* why_not) {
#if defined(PCPKV_HAVE_CUDA)
  std::string why;
  const int n = cuda::device_count(&why);
  if (n > 0) return true;
  if (why_not) *why_not = why.empty() ? "no CUDA device is visible" : why;
  return false;
#else
  if (why_not) *why_not = "pcpkv was built without CUDA (nvcc not found at configure time)";
  return false;
#endif
}

void check_backend_name(const std::string& name) {
  PCPKV_CHECK(name == "auto" || name == "cpu" || name == "cuda", "--backend: unknown backend '{}'; known: auto, cpu, cuda",
              clip(name));
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  check_backend_name(name);
  if (name == "cpu") return make_cpu_backend();
  std::string why;  // "cuda" or "auto"
  if (cuda_backend_available(&why)) {
#if defined(PCPKV_HAVE_CUDA)
    return cuda::make_backend();
#endif
  }
  if (name == "auto") return make_cpu_backend();
  PCPKV_FAIL("--backend cuda: unavailable: {}", why);
}

}  // namespace pcpkv
