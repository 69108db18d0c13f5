// The SPEC section 5 fence kernel (device code in pcpkv/device/fence_kernel.h) and its host side.
#include "core/cuda/check.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda {
namespace {

constexpr int kFenceThreads = 32;  // one warp polls up to 32 peers at once

__global__ void __launch_bounds__(kFenceThreads) fence_kernel(const __grid_constant__ FenceArgs a) {
  // PDL: the fence orders what the previous kernel (the dispatch) wrote; it must have completed first.
  pdl::wait();
  pdl::launch_dependents();
  fence_block(a);
}

}  // namespace

void launch_fence(const FenceArgs& args, int num_blocks, cudaStream_t stream, bool pdl) {
  PCPKV_CHECK(args.world >= 1, "fence: world = {} must be >= 1", args.world);
  PCPKV_CHECK(num_blocks >= 1 && args.first_rank >= 0 && args.first_rank + num_blocks <= args.world,
              "fence: ranks [{}, {}) are not inside the world of {}", args.first_rank, args.first_rank + num_blocks,
              args.world);
  PCPKV_CHECK(args.num_barriers >= 1 && args.barrier_idx >= 0 && args.barrier_idx < args.num_barriers,
              "fence: barrier_idx = {} is out of range [0, {})", args.barrier_idx, args.num_barriers);
  PCPKV_CHECK(args.pads != nullptr && args.epochs != nullptr, "fence: pads and epochs must be set");
  if (pdl) {
    PCPKV_CUDA_CHECK(pdl::launch(fence_kernel, dim3(num_blocks), dim3(kFenceThreads), 0, stream, true, args));
  } else {
    fence_kernel<<<num_blocks, kFenceThreads, 0, stream>>>(args);
  }
  PCPKV_CUDA_CHECK_LAUNCH();
}

void throw_if_fence_timeout(const FenceError& error, double timeout_ms) {
  const volatile FenceError& e = error;
  if (e.flag != kFenceErrorFlag) return;
  const int missing = e.missing_rank;
  throw FenceTimeout(fmt::format("fence: rank {} waited {:.0f} ms at barrier {} for epoch {}, but rank {} never "
                                 "arrived (its slot holds epoch {})",
                                 static_cast<int>(e.waiting_rank), timeout_ms, static_cast<int>(e.barrier_idx),
                                 static_cast<uint64_t>(e.epoch), missing, static_cast<uint64_t>(e.seen)),
                     missing);
}

}  // namespace pcpkv::cuda
