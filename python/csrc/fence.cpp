// python/csrc/fence.cpp: torch.ops.pcpkv.fence (schema: registry.cpp; docstring: pcpkv_torch/ops.py fence), the SPEC
// section 5 fence of the ranks one call hosts. The arguments by name (FenceArgs), the CPU implementation over host
// pads (the same protocol as pcpkv::HostFence and the device fence) and, in CUDA builds, the CUDA one on pcpkv's
// launch_fence.
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "binding.h"
#include "checks.h"
#include "pcpkv/core/interrupt.h"
#include "pcpkv/device/fence_kernel.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#include "pcpkv/publish/kernels.h"
#endif

namespace pcpkv_torch {
namespace {

struct FenceArgs {
  at::Tensor pad_table, epochs, claim, error;
  int64_t first_rank = 0, world = 0, num_barriers = 0, barrier_idx = 0, timeout_us = 0;
  std::vector<at::Tensor> written;
};

constexpr Binding kFence{"pcpkv::fence",
                         PCPKV_ARG(FenceArgs, pad_table),
                         PCPKV_ARG(FenceArgs, epochs),
                         PCPKV_ARG(FenceArgs, claim),
                         PCPKV_ARG(FenceArgs, error),
                         PCPKV_ARG(FenceArgs, first_rank),
                         PCPKV_ARG(FenceArgs, world),
                         PCPKV_ARG(FenceArgs, num_barriers),
                         PCPKV_ARG(FenceArgs, barrier_idx),
                         PCPKV_ARG(FenceArgs, timeout_us),
                         PCPKV_ARG(FenceArgs, written)};

// The ranks [first_rank, first_rank + epochs.size(0)) hosted by this call, over host pads: arrive for every hosted
// rank, then wait for every hosted rank, so that one call may host all W ranks of a single process.
void fence_cpu(const FenceArgs& a) {
  // claim is the CUDA fence's (it elects the block that reports a timeout); here it must only be on the CPU.
  TORCH_CHECK_VALUE(a.claim.device().is_cpu(), "fence: claim is on ", a.claim.device(), " but epochs on cpu");
  check_written_devices("fence", a.written, "epochs", c10::Device(c10::kCPU));
  const std::vector<uint8_t*> pads = read_pointer_table(a.pad_table, "fence: pad_table");
  TORCH_CHECK_VALUE(static_cast<int64_t>(pads.size()) == a.world, "fence: pad_table has ", pads.size(),
                    " entries but world = ", a.world);
  TORCH_CHECK_VALUE(a.epochs.device().is_cpu() && a.epochs.scalar_type() == at::kLong && a.epochs.dim() == 2 &&
                        a.epochs.size(1) == a.num_barriers && a.epochs.is_contiguous(),
                    "fence: epochs: expected contiguous CPU int64 [num_local_ranks, num_barriers=", a.num_barriers,
                    "], got ", describe(a.epochs));
  const int64_t n = a.epochs.size(0);
  TORCH_CHECK_VALUE(a.first_rank >= 0 && n >= 1 && a.first_rank + n <= a.world, "fence: ranks [", a.first_rank, ", ",
                    a.first_rank + n, ") are not inside [0, world=", a.world, ")");
  TORCH_CHECK_VALUE(a.barrier_idx >= 0 && a.barrier_idx < a.num_barriers, "fence: barrier_idx = ", a.barrier_idx,
                    " is out of range [0, ", a.num_barriers, ")");
  TORCH_CHECK_VALUE(a.timeout_us > 0 && a.timeout_us <= kMaxFenceTimeoutUs, "fence: timeout_us = ", a.timeout_us,
                    " must be in [1, ", kMaxFenceTimeoutUs, "] (one day)");
  TORCH_CHECK_VALUE(a.error.device().is_cpu() && a.error.scalar_type() == at::kByte &&
                        a.error.numel() == static_cast<int64_t>(sizeof(pcpkv::FenceError)) && a.error.is_contiguous(),
                    "fence: error: expected a contiguous CPU uint8 [", sizeof(pcpkv::FenceError), "], got ",
                    describe(a.error));
  for (size_t r = 0; r < pads.size(); ++r)
    TORCH_CHECK_VALUE(pads[r] != nullptr && reinterpret_cast<uintptr_t>(pads[r]) % 8 == 0, "fence: pad_table[", r,
                      "] is null or not 8-byte aligned");
  auto slot = [&](int64_t owner, uint64_t parity, int64_t src) {
    auto* pad = reinterpret_cast<uint64_t*>(pads[static_cast<size_t>(owner)]);
    return std::atomic_ref<uint64_t>(pad[(a.barrier_idx * 2 + static_cast<int64_t>(parity)) * a.world + src]);
  };
  int64_t* ep = a.epochs.data_ptr<int64_t>();
  std::vector<uint64_t> e(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) {
    e[b] = static_cast<uint64_t>(ep[b * a.num_barriers + a.barrier_idx]) + 1;
    ep[b * a.num_barriers + a.barrier_idx] = static_cast<int64_t>(e[b]);
    for (int64_t peer = 0; peer < a.world; ++peer)
      slot(peer, e[b] & 1, a.first_rank + b).store(e[b], std::memory_order_release);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(a.timeout_us);
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(pcpkv::kInterruptPollMs);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t me = a.first_rank + b;
    for (int64_t peer = 0; peer < a.world; ++peer) {
      uint32_t spins = 0;
      uint64_t v;
      while (static_cast<int64_t>((v = slot(me, e[b] & 1, peer).load(std::memory_order_acquire)) - e[b]) < 0) {
        if (++spins > 64) std::this_thread::yield();
        if ((spins & 1023u) == 0 && std::chrono::steady_clock::now() >= next_check) {
          pcpkv::check_interrupt();  // Ctrl-C: KeyboardInterrupt now, not at the timeout (bootstrap.cpp sets it)
          next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(pcpkv::kInterruptPollMs);
        }
        if ((spins & 1023u) == 0 && std::chrono::steady_clock::now() > deadline) {
          pcpkv::FenceError err;
          err.flag = pcpkv::kFenceErrorFlag;
          err.waiting_rank = static_cast<int32_t>(me);
          err.missing_rank = static_cast<int32_t>(peer);
          err.barrier_idx = static_cast<int32_t>(a.barrier_idx);
          err.epoch = e[b];
          err.seen = v;
          std::memcpy(a.error.data_ptr(), &err, sizeof(err));
          translate_errors([&]() -> int {
            throw pcpkv::FenceTimeout(fmt::format("fence: rank {} waited {} us at barrier {} for epoch {}, rank {} "
                                                  "never arrived (its slot holds {})",
                                                  me, a.timeout_us, a.barrier_idx, e[b], peer, v),
                                      static_cast<int>(peer));
          });
        }
      }
    }
  }
}

#ifdef PCPKV_TORCH_CUDA
void fence_cuda(const FenceArgs& a) {
  require_cuda(a.epochs, "fence: epochs");
  const c10::Device dev = a.epochs.device();
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK_VALUE(a.world >= 1 && a.world <= 1024, "fence: world = ", a.world, " must be in [1, 1024]");
  TORCH_CHECK_VALUE(a.pad_table.device() == dev &&
                        (a.pad_table.scalar_type() == at::kLong || a.pad_table.scalar_type() == at::kUInt64) &&
                        a.pad_table.dim() == 1 && a.pad_table.size(0) == a.world && a.pad_table.is_contiguous(),
                    "fence: pad_table: expected int64 [world=", a.world, "] peer pad pointers on ", dev, ", got ",
                    describe(a.pad_table));
  TORCH_CHECK_VALUE(a.epochs.scalar_type() == at::kLong && a.epochs.dim() == 2 && a.epochs.size(1) == a.num_barriers &&
                        a.epochs.is_contiguous(),
                    "fence: epochs: expected contiguous int64 [num_local_ranks, num_barriers=", a.num_barriers,
                    "], got ", describe(a.epochs));
  const int64_t n = a.epochs.size(0);
  TORCH_CHECK_VALUE(a.first_rank >= 0 && n >= 1 && a.first_rank + n <= a.world, "fence: ranks [", a.first_rank, ", ",
                    a.first_rank + n, ") are not inside [0, world=", a.world, ")");
  TORCH_CHECK_VALUE(a.barrier_idx >= 0 && a.barrier_idx < a.num_barriers, "fence: barrier_idx = ", a.barrier_idx,
                    " is out of range [0, ", a.num_barriers, ")");
  TORCH_CHECK_VALUE(a.claim.device() == dev && a.claim.scalar_type() == at::kInt && a.claim.numel() == 1,
                    "fence: claim: expected int32 [1] on ", dev, ", got ", describe(a.claim));
  TORCH_CHECK_VALUE(a.error.device().is_cpu() && a.error.is_pinned() && a.error.scalar_type() == at::kByte &&
                        a.error.numel() == static_cast<int64_t>(sizeof(pcpkv::FenceError)) && a.error.is_contiguous(),
                    "fence: error: expected a pinned CPU uint8 [", sizeof(pcpkv::FenceError),
                    "] (pcpkv_torch.FenceState allocates it), got ", describe(a.error));
  TORCH_CHECK_VALUE(a.timeout_us > 0 && a.timeout_us <= kMaxFenceTimeoutUs, "fence: timeout_us = ", a.timeout_us,
                    " must be in [1, ", kMaxFenceTimeoutUs, "] (one day)");
  check_written_devices("fence", a.written, "epochs", dev);
  pcpkv::FenceArgs f;
  f.pads = reinterpret_cast<uint64_t* const*>(a.pad_table.data_ptr());
  f.epochs = reinterpret_cast<uint64_t*>(a.epochs.data_ptr());
  f.claim = reinterpret_cast<uint32_t*>(a.claim.data_ptr());
  // Pinned host memory is device-addressable at its host address under unified addressing (every 64-bit
  // CUDA platform), so no runtime call is needed here (this op may run inside a graph capture).
  f.error = static_cast<pcpkv::FenceError*>(a.error.data_ptr());
  f.first_rank = static_cast<int32_t>(a.first_rank);
  f.world = static_cast<int32_t>(a.world);
  f.barrier_idx = static_cast<int32_t>(a.barrier_idx);
  f.num_barriers = static_cast<int32_t>(a.num_barriers);
  f.timeout_ns = static_cast<uint64_t>(a.timeout_us) * 1000u;
  translate_errors([&] { pcpkv::cuda::launch_fence(f, static_cast<int>(n), current_stream(dev)); });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("fence", kernel<kFence, &fence_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("fence", kernel<kFence, &fence_cuda>()); }
#endif

}  // namespace pcpkv_torch
