// Host fence (SPEC section 5) over raw pad pointers: threads or processes sharing memory.
#include "pcpkv/ranks/fence.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "pcpkv/core/error.h"
#include "pcpkv/core/interrupt.h"

namespace pcpkv {
namespace {

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "the fence needs lock-free (hence address-free) 64-bit atomics to work across processes");
static_assert(std::atomic_ref<uint64_t>::required_alignment == 8, "pads are 8-byte aligned");

void store_release(uint64_t* p, uint64_t v) { std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release); }
uint64_t load_acquire(uint64_t* p) { return std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire); }

bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }

}  // namespace

void zero_fence_pad(uint64_t* pad, int32_t num_barriers, int32_t world) {
  PCPKV_CHECK(pad != nullptr && aligned8(pad), "fence: pad {} must be non-null and 8-byte aligned",
              static_cast<const void*>(pad));
  const int64_t n = fence_pad_elems(num_barriers, world);
  for (int64_t i = 0; i < n; ++i) std::atomic_ref<uint64_t>(pad[i]).store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

HostFence::HostFence(int32_t rank, int32_t world, int32_t num_barriers, std::vector<uint64_t*> pads)
    : rank_(rank), world_(world), num_barriers_(num_barriers), pads_(std::move(pads)) {
  PCPKV_CHECK(world >= 1, "fence: world = {} must be >= 1", world);
  PCPKV_CHECK(rank >= 0 && rank < world, "fence: rank = {} is out of range [0, {})", rank, world);
  PCPKV_CHECK(num_barriers >= 1, "fence: num_barriers = {} must be >= 1", num_barriers);
  PCPKV_CHECK(static_cast<int64_t>(pads_.size()) == world, "fence: {} pads for world = {}", pads_.size(), world);
  for (size_t r = 0; r < pads_.size(); ++r)
    PCPKV_CHECK(pads_[r] != nullptr && aligned8(pads_[r]), "fence: pads[{}] = {} must be non-null and 8-byte aligned",
                r, static_cast<const void*>(pads_[r]));
  epochs_.assign(static_cast<size_t>(num_barriers), 0);
}

void HostFence::check_barrier(int32_t barrier_idx) const {
  PCPKV_CHECK(barrier_idx >= 0 && barrier_idx < num_barriers_, "fence: barrier_idx = {} is out of range [0, {})",
              barrier_idx, num_barriers_);
}

uint64_t HostFence::epoch(int32_t barrier_idx) const {
  check_barrier(barrier_idx);
  return epochs_[static_cast<size_t>(barrier_idx)];
}

uint64_t HostFence::arrive(int32_t barrier_idx) {
  check_barrier(barrier_idx);
  const uint64_t e = ++epochs_[static_cast<size_t>(barrier_idx)];
  const uint64_t parity = e & 1;
  for (int32_t peer = 0; peer < world_; ++peer)
    store_release(pads_[static_cast<size_t>(peer)] + slot_index(barrier_idx, parity, rank_), e);
  return e;
}

void HostFence::wait(int32_t barrier_idx, uint64_t e, int64_t timeout_ms) {
  check_barrier(barrier_idx);
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  uint64_t* own = pads_[static_cast<size_t>(rank_)];
  const uint64_t parity = e & 1;
  int32_t next = 0;  // ranks below `next` have been seen at epoch e
  auto next_check = Clock::now() + std::chrono::milliseconds(kInterruptPollMs);
  for (int64_t spin = 0;; ++spin) {
    while (next < world_ && load_acquire(own + slot_index(barrier_idx, parity, next)) == e) ++next;
    if (next == world_) return;
    // Back off: a short spin, then yield, then sleeps that grow to 200 us (8 ranks on 2 cores must all run).
    if (spin < 64) continue;
    if (spin < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 20 : 200));
    }
    if ((spin & 15) == 0 && Clock::now() >= next_check) {
      check_interrupt();  // Ctrl-C under Python: within kInterruptPollMs, not at the timeout
      next_check = Clock::now() + std::chrono::milliseconds(kInterruptPollMs);
    }
    if ((spin & 15) == 0 && Clock::now() >= deadline) {
      const uint64_t seen = load_acquire(own + slot_index(barrier_idx, parity, next));
      throw FenceTimeout(fmt::format("fence: rank {} waited {} ms at barrier {} for epoch {}: rank {} never arrived "
                                     "(its slot holds epoch {})",
                                     rank_, timeout_ms, barrier_idx, e, next, seen),
                         next, fmt::format("{}:{}", __FILE__, __LINE__));
    }
  }
}

void HostFence::arrive_and_wait(int32_t barrier_idx, int64_t timeout_ms) {
  wait(barrier_idx, arrive(barrier_idx), timeout_ms);
}

}  // namespace pcpkv
