// pcpkv/device/fence_kernel.h: the SPEC section 5 fence as device code, for ranks that share a GPU (W
// logical ranks in one process) and for rank processes whose pads are mapped through CUDA IPC / VMM.
//
// Protocol (the same as the host fence of pcpkv/ranks/fence.h, same pad layout):
//   every rank owns a signal pad pad[num_barriers][2][W] uint64 (fence_pad_elems), zeroed at setup and
//   mapped by every rank; and a device-resident epoch counter per barrier index, private to the rank.
//   A call at barrier idx:  e = ++epoch[idx] (on the device, so CUDA-graph replays advance it);  p = e & 1;
//   release-store (system scope) e into pad_of(peer)[idx][p][my_rank] for every peer, self included;
//   acquire-poll (system scope) own pad[idx][p][0..W) until every slot holds e.
//   A rank is at most one epoch ahead of the slowest peer, so the parity slots never lose an epoch.
//   The wait is bounded (globaltimer): on timeout the first waiter that gives up writes a FenceError naming
//   the missing rank into host-mapped memory and the block returns (no trap), so the host can throw
//   pcpkv::FenceTimeout after synchronizing.
//
// One block serves one rank: block b of a launch acts as rank first_rank + b. A process that hosts all W
// ranks launches W blocks (they are co-resident, so nobody waits on a block that cannot start); a process
// per rank launches one block. Any block size >= 1 works; W threads poll in parallel.
#pragma once

#include <cstdint>

#include "pcpkv/device/config.h"

namespace pcpkv {

/// Written once, by the first block whose wait ran out. Lives in host-mapped memory; `flag` is written
/// last (after a system fence), so a host that sees flag == kFenceErrorFlag sees the other fields.
struct FenceError {
  uint32_t flag = 0;          // 0: no error; kFenceErrorFlag: the fields below are valid
  int32_t waiting_rank = -1;  // the rank that gave up
  int32_t missing_rank = -1;  // the first peer whose slot never showed the epoch
  int32_t barrier_idx = -1;
  uint64_t epoch = 0;         // the epoch waited for
  uint64_t seen = 0;          // what the missing rank's slot held at the end
};
constexpr uint32_t kFenceErrorFlag = 0xFE0CE001u;

/// Arguments of one fence launch. All pointers are device-visible.
struct FenceArgs {
  uint64_t* const* pads = nullptr;  // [world] pads[p] = rank p's pad [num_barriers][2][world] uint64
  uint64_t* epochs = nullptr;       // [num_blocks][num_barriers] epochs of the ranks this launch serves
  uint32_t* claim = nullptr;        // device word, 0 at setup: elects the one block that writes `error`
  FenceError* error = nullptr;      // host-mapped; null: a timeout is only visible through the pads
  int32_t first_rank = 0;           // block b acts as rank first_rank + b
  int32_t world = 1;
  int32_t barrier_idx = 0;
  int32_t num_barriers = 1;
  uint64_t timeout_ns = 10'000'000'000ull;  // bound on the wait (globaltimer nanoseconds)
};

#if defined(__CUDACC__)
namespace fence_detail {

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace fence_detail

/// The whole fence for the rank this block serves. Call from every thread of the block (it uses
/// __syncthreads). Returns after all W ranks arrived, or after the timeout (then `error` says who was
/// missing, and the fence state is undefined until the host zeroes pads, epochs and claim).
__device__ inline void fence_block(const FenceArgs& a) {
  using namespace fence_detail;
  __shared__ uint64_t s_epoch;
  const int32_t me = a.first_rank + static_cast<int32_t>(blockIdx.x);
  uint64_t* epoch = a.epochs + static_cast<int64_t>(blockIdx.x) * a.num_barriers + a.barrier_idx;
  // Everything this GPU wrote before this kernel (earlier kernels in stream order) must be visible to
  // every peer before it can see our epoch: a full system fence, then the release stores.
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t e = *epoch + 1;
    *epoch = e;
    s_epoch = e;
  }
  __threadfence_system();
  __syncthreads();
  const uint64_t e = s_epoch;
  const int64_t slot_base = (static_cast<int64_t>(a.barrier_idx) * 2 + static_cast<int64_t>(e & 1)) * a.world;
  for (int32_t peer = threadIdx.x; peer < a.world; peer += blockDim.x)
    st_release_sys(a.pads[peer] + slot_base + me, e);
  const uint64_t* own = a.pads[me] + slot_base;
  const uint64_t start = globaltimer_ns();
  for (int32_t peer = threadIdx.x; peer < a.world; peer += blockDim.x) {
    uint32_t spins = 0;
    uint64_t v;
    // Wrap-safe "v >= e": a peer never runs more than one epoch ahead, and never writes this parity slot
    // with e + 1, so equality is what arrives; >= keeps a late reader correct after a reset to a higher base.
    while (static_cast<int64_t>((v = ld_acquire_sys(own + peer)) - e) < 0) {
      if (++spins > 64) __nanosleep(64);
      if ((spins & 255u) == 0 && globaltimer_ns() - start > a.timeout_ns) {
        if (a.claim != nullptr && atomicCAS(a.claim, 0u, 1u) == 0u && a.error != nullptr) {
          volatile FenceError* err = a.error;
          err->waiting_rank = me;
          err->missing_rank = peer;
          err->barrier_idx = a.barrier_idx;
          err->epoch = e;
          err->seen = v;
          __threadfence_system();
          err->flag = kFenceErrorFlag;
          __threadfence_system();
        }
        break;
      }
    }
  }
  __syncthreads();
}

#endif  // __CUDACC__

}  // namespace pcpkv
