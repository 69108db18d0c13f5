// pcpkv/core/pdl.h: Programmatic Dependent Launch (PDL) for chains of pcpkv kernels (SPEC section 7).
//
// A kernel launched with programmatic stream serialization may start before the previous kernel on its
// stream has finished (as soon as that kernel triggers, or as its CTAs retire). The trigger only allows the
// early launch; it gives NO memory visibility. So the contract for every kernel launched through
// pdl::launch with pdl on:
//   * call pdl::wait() (griddepcontrol.wait = cudaGridDependencySynchronize) before the first read of
//     anything the previous kernel wrote AND before the first write of anything the previous kernel reads
//     (WAR: buffers reused across graph replays);
//   * work before the wait may only touch data no kernel of the chain writes (weights, constants): the
//     router GEMM streams its weights there, which is the point;
//   * pdl::launch_dependents() after the wait lets the next kernel start its own pre-wait part early.
//     Because every kernel triggers only after its own wait, kernel k+2 cannot start before kernel k
//     completed, so a chain never overlaps more than two kernels.
// Both device calls are no-ops when the kernel was launched without the attribute (and before sm_90).
//
// The switch: pdl::enabled() is off by default and on when PCPKV_PDL=1 is in the environment (0 or empty: off;
// any other value is refused: read_env_switch of pcpkv/core/env.h); set_enabled() overrides it for the process.
// pcpkv's launchers take an explicit bool; engines pass pdl::enabled().
//
// The host part needs no CUDA headers; the launch helper and the device calls exist only under nvcc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pcpkv::pdl {

/// Whether PDL launches are on for this process (PCPKV_PDL=1, or set_enabled(true)). Throws pcpkv::Error naming
/// PCPKV_PDL and its value when it is set to anything but 1, 0 or empty (and set_enabled was not called).
bool enabled();
/// Overrides the environment for the rest of the process.
void set_enabled(bool on);

}  // namespace pcpkv::pdl

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include <utility>

namespace pcpkv::pdl {

/// Waits until every prerequisite grid has completed and its memory is visible (griddepcontrol.wait).
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Allows the next kernel of the stream to launch now (griddepcontrol.launch_dependents). No visibility.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/// cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization set to `pdl`.
/// Usage: PCPKV_CUDA_CHECK-style: auto err = pdl::launch(kernel, grid, block, smem, stream, pdl::enabled(), args...);
template <typename... Params, typename... Args>
inline cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attrs;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace pcpkv::pdl
#endif
