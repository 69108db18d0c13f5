// Shared helpers of the libFuzzer targets: hand the fuzz bytes to parsers that only read from a path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace pcpkv::fuzz {

/// The bytes as a regular file (memfd: no disk, no cleanup); path() is /proc/self/fd/N. A memfd passes
/// read_input_file's regular-file rule like a real file would.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("pcpkv-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) std::abort();
    size_t off = 0;
    while (off < size) {
      const ssize_t k = ::write(fd_, data + off, size - off);
      if (k <= 0) std::abort();
      off += static_cast<size_t>(k);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace pcpkv::fuzz
