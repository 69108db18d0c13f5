// pcpkv/ranks/fence.h: the SPEC section 5 fence on the host, over raw pointers, so one implementation serves
// rank threads of one process and rank processes that share POSIX shared memory.
//
// Protocol (identical to the GPU fence kernel): every rank owns a signal pad
//   pad[num_barriers][2][W] uint64, zeroed at setup, 8-byte aligned, mapped by every rank;
// and a private epoch counter per barrier index. A call at barrier idx:
//   e = ++epoch[idx];  p = e & 1;
//   release-store e into pad_of(peer)[idx][p][my_rank] for every peer (self included);
//   acquire-poll own pad[idx][p][0..W) until every slot == e.
// A rank can be at most one epoch ahead of the slowest peer (it cannot pass epoch e+1 before everyone
// reached e+1), so the two parity slots never lose an epoch. Everything written before the call by any rank
// is visible to every rank after it returns (release/acquire pairs through the pad).
//
// Memory: accesses go through std::atomic_ref<uint64_t>, which is lock-free and address-free on the
// platforms pcpkv supports, so the pad can live in memory shared between processes (mmap MAP_SHARED).
#pragma once

#include <cstdint>
#include <vector>

namespace pcpkv {

/// Number of uint64 elements of one rank's signal pad: num_barriers * 2 * world.
constexpr int64_t fence_pad_elems(int32_t num_barriers, int32_t world) {
  return int64_t{num_barriers} * 2 * world;
}
/// Bytes of one rank's signal pad.
constexpr int64_t fence_pad_bytes(int32_t num_barriers, int32_t world) {
  return fence_pad_elems(num_barriers, world) * 8;
}

/// Zeroes a pad (setup, before any rank's first call). pad: fence_pad_elems(...) uint64, 8-byte aligned.
void zero_fence_pad(uint64_t* pad, int32_t num_barriers, int32_t world);

/// One rank's handle on the fence. Not thread-safe: one caller per rank. Copyable state is the epochs.
class HostFence {
 public:
  /// pads[r] = rank r's signal pad as mapped in this process (pads.size() == world); each 8-byte aligned,
  /// fence_pad_elems(num_barriers, world) uint64, zeroed before any rank calls. Throws pcpkv::Error on a
  /// bad rank/world/num_barriers, a null or misaligned pad.
  HostFence(int32_t rank, int32_t world, int32_t num_barriers, std::vector<uint64_t*> pads);

  /// Arrive at barrier barrier_idx and wait for all W ranks. Backs off (spin, yield, then sleeps of up to
  /// 200 us) so that more ranks than cores make progress. Throws pcpkv::FenceTimeout naming the first rank that
  /// has not arrived (and the epoch waited for) when timeout_ms passes.
  void arrive_and_wait(int32_t barrier_idx, int64_t timeout_ms);

  /// The two halves of arrive_and_wait, for callers that overlap work between them or watch peers while
  /// waiting: arrive() publishes the next epoch and returns it; wait() polls for it. wait() changes no state,
  /// so after a FenceTimeout it may be called again for the same epoch (e.g. in slices, checking that peer
  /// processes are alive); the next arrive() at that barrier is valid only after a wait() for the previous
  /// epoch returned.
  uint64_t arrive(int32_t barrier_idx);
  void wait(int32_t barrier_idx, uint64_t epoch, int64_t timeout_ms);

  /// Epochs completed or started at barrier_idx (0 before the first call).
  uint64_t epoch(int32_t barrier_idx) const;
  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  int32_t num_barriers() const { return num_barriers_; }

 private:
  int64_t slot_index(int32_t barrier_idx, uint64_t parity, int32_t src_rank) const {
    return (int64_t{barrier_idx} * 2 + static_cast<int64_t>(parity)) * world_ + src_rank;
  }
  void check_barrier(int32_t barrier_idx) const;

  int32_t rank_ = 0;
  int32_t world_ = 1;
  int32_t num_barriers_ = 1;
  std::vector<uint64_t*> pads_;
  std::vector<uint64_t> epochs_;  // [num_barriers], private to this rank
};

}  // namespace pcpkv
