// Bootstrap::Impl: one rank's links of the star through rank 0 and the messaging every collective and the rendezvous
// share (bootstrap_star.cpp); the rendezvous that makes the links is bootstrap_rendezvous.cpp, the collectives
// bootstrap.cpp.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "ranks/bootstrap_wire.h"

namespace pcpkv {

struct Bootstrap::Impl {
  using Clock = bootstrap_wire::Clock;
  using Deadline = bootstrap_wire::Deadline;
  using Frame = bootstrap_wire::Frame;
  using FrameType = bootstrap_wire::FrameType;

  // steady_clock counts int64 ns (~292 years): 1e9 s leaves room for now().
  static constexpr double kMaxTimeoutS = 1e9;

  BootstrapConfig cfg;
  std::vector<int64_t> pids;
  std::vector<UniqueFd> conns;  // rank 0: [world] (entry 0 unused); others: [1], the link to rank 0
  int32_t split_seq = 0;
  UniqueFd address_lock;        // rank 0: held while this Bootstrap lives (lock_address)
  bool in_rendezvous = false;   // rank 0: a failure now also leaves a tombstone for ranks not yet connected

  // Rank 0: the lock file goes with the Bootstrap (unlinked while still held: see lock_address).
  ~Impl() {
    if (address_lock) ::unlink((cfg.address + ".lock").c_str());
  }

  bool is_root() const { return cfg.rank == 0; }
  std::string who(int r) const {
    if (r >= 0 && r < static_cast<int>(pids.size()) && pids[r] > 0) return fmt::format("rank {} (pid {})", r, pids[r]);
    return fmt::format("rank {}", r);
  }
  Deadline deadline() const {
    // A timeout past ~31 years (inf, 1e300) means "no limit": capped so now + timeout cannot overflow.
    const double ms = std::min(cfg.timeout_s, kMaxTimeoutS) * 1000.0;
    return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(ms));
  }
  // Non-root ranks wait a little longer than rank 0, so rank 0's message naming the missing rank
  // arrives before their own (less informative) timeout.
  Deadline follower_deadline() const { return deadline() + std::chrono::seconds(2); }

  // A rank of this attempt started before rank 0 gave up and waits at most its timeout (and the 2 s of
  // follower_deadline) from its start: the tombstone is kept that long, and 10 s more.
  double tombstone_keep_s() const { return std::min(cfg.timeout_s, kMaxTimeoutS) + 12.0; }

  // Rank 0: a peer failed; tell every other peer and throw.
  [[noreturn]] void fail_job(const std::string& message, int skip_rank = -1);

  // Runs the interrupt check (pcpkv/core/interrupt.h); when it throws, the other ranks are told first (rank 0
  // tells every connected rank, and leaves a tombstone during the rendezvous; a follower tells rank 0), so that
  // they fail now naming this rank, not at their timeout.
  void interruptible();

  // Rank 0: receive one frame of type `expected` from every peer. Frames come back in rank order.
  std::vector<Frame> root_gather(FrameType expected, const char* op);

  // Rank 0: send a frame to every peer.
  void root_send_all(FrameType type, const std::vector<uint8_t>& payload, const char* op);

  // Non-root: receive one frame from rank 0 of type `expected`; aborts and failures throw.
  Frame follower_recv(FrameType expected, const char* op);

  // Non-root: send a frame to rank 0; a failure throws, with rank 0's abort message when it left one.
  void follower_send(FrameType type, const void* data, size_t bytes, const char* op, int pass_fd = -1);

  void rendezvous_root();
  void rendezvous_follower();
};

}  // namespace pcpkv
