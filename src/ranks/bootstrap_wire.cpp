// Framed socket I/O for the bootstrap (see bootstrap_wire.h).
#include "ranks/bootstrap_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "pcpkv/core/interrupt.h"

namespace pcpkv::bootstrap_wire {
namespace {

constexpr uint32_t kMagic = 0x564b4350;  // "PCKV"
constexpr uint64_t kMaxPayload = uint64_t{4} << 30;

struct Header {
  uint32_t magic;
  uint32_t type;
  uint64_t bytes;
};

// Waits until sock is readable (events = POLLIN) or writable (POLLOUT), or the deadline passes; runs the
// interrupt check (pcpkv/core/interrupt.h) at least every kInterruptPollMs.
IoStatus wait_for(int sock, short events, Deadline d) {
  for (;;) {
    pollfd p{sock, events, 0};
    const int left = ms_left(d);
    const int n = ::poll(&p, 1, std::min(left, kInterruptPollMs));
    if (n < 0 && errno == EINTR) {
      check_interrupt();
      continue;
    }
    if (n < 0) return IoStatus::kError;
    if (n == 0) {
      if (left <= kInterruptPollMs) return IoStatus::kTimeout;
      check_interrupt();
      continue;
    }
    return IoStatus::kOk;  // readable, writable, or hung up: the next call tells which
  }
}

IoStatus send_bytes(int sock, const uint8_t* data, size_t n, Deadline d, int pass_fd) {
  size_t sent = 0;
  bool fd_sent = pass_fd < 0;
  while (sent < n || !fd_sent) {
    iovec iov{const_cast<uint8_t*>(data + sent), n - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
    if (!fd_sent) {
      msg.msg_control = ctrl;
      msg.msg_controllen = sizeof(ctrl);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    const ssize_t k = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        const IoStatus st = wait_for(sock, POLLOUT, d);
        if (st != IoStatus::kOk) return st;
        continue;
      }
      return (errno == EPIPE || errno == ECONNRESET) ? IoStatus::kClosed : IoStatus::kError;
    }
    fd_sent = true;  // the descriptor rides on the first byte that went out
    sent += static_cast<size_t>(k);
  }
  return IoStatus::kOk;
}

IoStatus recv_bytes(int sock, uint8_t* data, size_t n, Deadline d, std::vector<UniqueFd>* fds) {
  size_t got = 0;
  while (got < n) {
    const IoStatus w = wait_for(sock, POLLIN, d);
    if (w != IoStatus::kOk) return w;
    iovec iov{data + got, n - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    const ssize_t k = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno == ECONNRESET ? IoStatus::kClosed : IoStatus::kError;
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(fd);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) return IoStatus::kError;
    if (k == 0) return IoStatus::kClosed;
    got += static_cast<size_t>(k);
  }
  return IoStatus::kOk;
}

}  // namespace

int ms_left(Deadline d) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

IoStatus send_frame(int sock, FrameType type, const void* payload, size_t bytes, Deadline d, int pass_fd) {
  const Header h{kMagic, static_cast<uint32_t>(type), bytes};
  IoStatus st = send_bytes(sock, reinterpret_cast<const uint8_t*>(&h), sizeof(h), d, pass_fd);
  if (st != IoStatus::kOk || bytes == 0) return st;
  return send_bytes(sock, static_cast<const uint8_t*>(payload), bytes, d, -1);
}

IoStatus recv_frame(int sock, Deadline d, Frame* out) {
  Header h{};
  out->fds.clear();
  IoStatus st = recv_bytes(sock, reinterpret_cast<uint8_t*>(&h), sizeof(h), d, &out->fds);
  if (st != IoStatus::kOk) return st;
  if (h.magic != kMagic || h.bytes > kMaxPayload) return IoStatus::kError;
  out->type = static_cast<FrameType>(h.type);
  // The buffer grows with the bytes that arrive, not with the size the header claims: a hostile or broken
  // peer announcing 4 GiB and sending nothing must not make this process allocate 4 GiB.
  out->payload.clear();
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  for (uint64_t got = 0; got < h.bytes;) {
    const uint64_t n = std::min(kChunk, h.bytes - got);
    out->payload.resize(got + n);
    st = recv_bytes(sock, out->payload.data() + got, n, d, &out->fds);
    if (st != IoStatus::kOk) return st;
    got += n;
  }
  return IoStatus::kOk;
}

}  // namespace pcpkv::bootstrap_wire
