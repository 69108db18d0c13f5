// Framed messages over a stream socket, with optional SCM_RIGHTS descriptors, for the bootstrap.
// Frame = {u32 magic, u32 type, u64 payload bytes} + payload. Every call is bounded by a deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "pcpkv/ranks/bootstrap.h"

namespace pcpkv::bootstrap_wire {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

enum class FrameType : uint32_t { kHello = 1, kWelcome = 2, kReject = 3, kData = 4, kFd = 5, kAbort = 6 };
enum class IoStatus { kOk, kTimeout, kClosed, kError };

struct Frame {
  FrameType type = FrameType::kData;
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;  // descriptors that arrived with the frame (close-on-exec)
};

/// Milliseconds until the deadline, clamped to [0, INT_MAX]; for poll().
int ms_left(Deadline d);

/// Sends one frame; pass_fd >= 0 travels with it (SCM_RIGHTS). Never raises SIGPIPE.
IoStatus send_frame(int sock, FrameType type, const void* payload, size_t bytes, Deadline d, int pass_fd = -1);

/// Receives one whole frame. kClosed: the peer closed the connection (EOF or reset) before a whole frame.
/// A bad magic number or a payload over 4 GiB gives kError.
IoStatus recv_frame(int sock, Deadline d, Frame* out);

}  // namespace pcpkv::bootstrap_wire
