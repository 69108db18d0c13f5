// libFuzzer target: the bootstrap's frame decoder (recv_frame) reading a hostile peer's byte stream.
// The bytes go into one end of a socket pair, that end closes, and frames are read until the stream ends.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "ranks/bootstrap_wire.h"

namespace bw = pcpkv::bootstrap_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
  // -max_len keeps inputs far below the socket buffer: the write never blocks.
  size_t off = 0;
  while (off < size) {
    const ssize_t k = ::send(sv[1], data + off, size - off, MSG_NOSIGNAL);
    if (k <= 0) std::abort();
    off += static_cast<size_t>(k);
  }
  ::close(sv[1]);
  const auto deadline = bw::Clock::now() + std::chrono::seconds(2);
  for (int i = 0; i < 1024; ++i) {
    bw::Frame f;
    if (bw::recv_frame(sv[0], deadline, &f) != bw::IoStatus::kOk) break;
  }
  ::close(sv[0]);
  return 0;
}
