// pcpkv/device/ptx_ordering.h: the PTX memory-ordering helpers of every cross-rank protocol (the fence of
// pcpkv/device/fence_kernel.h, the all-reduce's flags in src/serving/drivers/cuda/allreduce_cuda.cu), written once.
// System scope throughout: the peers are other GPUs or processes reading through NVLink / PCIe mappings
// or host-mapped memory, so .gpu scope would not order what they see. Plain ld / st only: no multimem /
// multicast instructions (NVLink multicast is off on the machines the project runs on).
//
//   st_release_sys(p, v)   st.release.sys.global: every earlier write of this thread is visible to any
//                          thread that acquire-loads v from p
//   ld_acquire_sys(p)      ld.acquire.sys.global: later reads see what the releasing writer wrote before
//   fence_sys()            __threadfence_system (a seq_cst fence at system scope): orders every earlier
//                          write of this thread, plain stores included, before every later one
//   globaltimer_ns()       %globaltimer, nanoseconds, for bounded waits (not for ordering)
// Device code only (nvcc); the header is empty for a host compiler.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
namespace pcpkv::ptx {

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_sys() { __threadfence_system(); }
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace pcpkv::ptx
#endif  // __CUDACC__
