// The star through rank 0 (see bootstrap_impl.h): how a rank tells the others it failed or was interrupted, and the
// bounded gather / send every collective and the rendezvous build on.
#include "ranks/bootstrap_impl.h"

#include <poll.h>

#include <cerrno>
#include <cstring>

#include <fmt/ranges.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/interrupt.h"
#include "ranks/bootstrap_socket.h"
#include "ranks/tombstone.h"

namespace pcpkv {

using namespace bootstrap_wire;
using bootstrap_socket::errno_text;

namespace {

// Sends a frame and ignores the outcome, whatever happens (an interrupt check that throws included): for messages
// sent on the way out.
void send_frame_quiet(int fd, FrameType type, const std::string& text, Deadline dl) noexcept {
  try {
    send_frame(fd, type, text.data(), text.size(), dl);
  } catch (...) {
  }
}

}  // namespace

void Bootstrap::Impl::fail_job(const std::string& message, int skip_rank) {
  if (in_rendezvous) bootstrap_tombstone::write(cfg.address, cfg.token, message, tombstone_keep_s());
  for (int r = 1; r < cfg.world_size; ++r) {
    if (r == skip_rank || !conns[r]) continue;
    send_frame(conns[r].get(), FrameType::kAbort, message.data(), message.size(), Clock::now() + std::chrono::milliseconds(200));
  }
  throw Error(fmt::format("bootstrap: {}", message));
}

void Bootstrap::Impl::interruptible() {
  try {
    check_interrupt();
  } catch (...) {
    const std::string why = fmt::format("{} was interrupted (a signal such as Ctrl-C)", who(cfg.rank));
    const Deadline dl = Clock::now() + std::chrono::milliseconds(200);
    if (is_root()) {
      if (in_rendezvous)
        bootstrap_tombstone::write(cfg.address, cfg.token, why, tombstone_keep_s());
      for (int r = 1; r < static_cast<int>(conns.size()); ++r)
        if (conns[r]) send_frame_quiet(conns[r].get(), FrameType::kAbort, why, dl);
    } else if (!conns.empty() && conns[0]) {
      send_frame_quiet(conns[0].get(), FrameType::kAbort, why, dl);
    }
    throw;
  }
}

std::vector<Frame> Bootstrap::Impl::root_gather(FrameType expected, const char* op) {
  std::vector<Frame> frames(cfg.world_size);
  std::vector<bool> done(cfg.world_size, false);
  done[0] = true;
  const Deadline dl = deadline();
  int remaining = cfg.world_size - 1;
  while (remaining > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> ranks;
    for (int r = 1; r < cfg.world_size; ++r)
      if (!done[r]) {
        pfds.push_back({conns[r].get(), POLLIN, 0});
        ranks.push_back(r);
      }
    const int left = ms_left(dl);
    const int n = ::poll(pfds.data(), pfds.size(), std::min(left, kInterruptPollMs));
    if ((n < 0 && errno == EINTR) || (n == 0 && left > kInterruptPollMs)) {
      interruptible();
      continue;
    }
    if (n < 0) fail_job(fmt::format("rank 0: poll failed during {}: {}", op, errno_text(errno)));
    if (n == 0) {
      std::vector<std::string> missing;
      for (int r : ranks) missing.push_back(who(r));
      fail_job(fmt::format("{} timed out after {} s at rank 0 waiting for {} (stuck, or not calling {})", op,
                           cfg.timeout_s, fmt::join(missing, ", "), op));
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const int r = ranks[i];
      Frame f;
      const IoStatus st = recv_frame(conns[r].get(), dl, &f);
      if (st == IoStatus::kClosed)
        fail_job(fmt::format("{} closed its connection during {} (exited or killed?)", who(r), op), r);
      if (st == IoStatus::kTimeout)
        fail_job(fmt::format("{} timed out after {} s at rank 0 receiving from {}", op, cfg.timeout_s, who(r)), r);
      if (st != IoStatus::kOk)
        fail_job(fmt::format("{}: receiving from {} failed: {}", op, who(r), errno_text(errno)), r);
      if (f.type == FrameType::kAbort)
        fail_job(fmt::format("{} aborted: {}", who(r), std::string(f.payload.begin(), f.payload.end())), r);
      if (f.type != expected)
        fail_job(fmt::format("protocol error during {}: {} sent frame type {} (expected {}); do all ranks run "
                             "the same pcpkv build and the same collectives in the same order?",
                             op, who(r), static_cast<uint32_t>(f.type), static_cast<uint32_t>(expected)),
                 r);
      frames[r] = std::move(f);
      done[r] = true;
      --remaining;
    }
  }
  return frames;
}

void Bootstrap::Impl::root_send_all(FrameType type, const std::vector<uint8_t>& payload, const char* op) {
  const Deadline dl = deadline();
  for (int r = 1; r < cfg.world_size; ++r) {
    const IoStatus st = send_frame(conns[r].get(), type, payload.data(), payload.size(), dl);
    if (st != IoStatus::kOk)
      fail_job(fmt::format("{}: sending to {} failed ({}; exited or killed?)", op, who(r),
                           st == IoStatus::kTimeout ? "timed out" : "connection closed"),
               r);
  }
}

Frame Bootstrap::Impl::follower_recv(FrameType expected, const char* op) {
  Frame f;
  const IoStatus st = recv_frame(conns[0].get(), follower_deadline(), &f);
  if (st == IoStatus::kClosed)
    throw Error(fmt::format("bootstrap: {} closed its connection during {} (exited or killed?)", who(0), op));
  if (st == IoStatus::kTimeout)
    throw Error(fmt::format("bootstrap: {} timed out after {} s at rank {} waiting for rank 0", op, cfg.timeout_s,
                            cfg.rank));
  if (st != IoStatus::kOk)
    throw Error(fmt::format("bootstrap: {}: receiving from rank 0 failed: {}", op, errno_text(errno)));
  if (f.type == FrameType::kAbort)
    throw Error(fmt::format("bootstrap: {}", std::string(f.payload.begin(), f.payload.end())));
  if (f.type != expected)
    throw Error(fmt::format("bootstrap: protocol error during {}: rank 0 sent frame type {} (expected {})", op,
                            static_cast<uint32_t>(f.type), static_cast<uint32_t>(expected)));
  return f;
}

void Bootstrap::Impl::follower_send(FrameType type, const void* data, size_t bytes, const char* op, int pass_fd) {
  const IoStatus st = send_frame(conns[0].get(), type, data, bytes, follower_deadline(), pass_fd);
  if (st == IoStatus::kOk) return;
  // Rank 0 may have closed the link after sending an abort that explains why: prefer its message.
  Frame f;
  if (recv_frame(conns[0].get(), Clock::now() + std::chrono::milliseconds(100), &f) == IoStatus::kOk &&
      f.type == FrameType::kAbort)
    throw Error(fmt::format("bootstrap: {}", std::string(f.payload.begin(), f.payload.end())));
  throw Error(fmt::format("bootstrap: {}: sending to {} failed ({}; exited or killed?)", op, who(0),
                          st == IoStatus::kTimeout ? "timed out" : "connection closed"));
}

}  // namespace pcpkv
