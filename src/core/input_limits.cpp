// Limits on files a user names and on quoted values (include/pcpkv/core/input_limits.h).
#include "pcpkv/core/input_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "pcpkv/core/error.h"

namespace pcpkv {
namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The one rule, applied to stat() of the path and to fstat() of the opened descriptor.
int64_t check_stat(const struct stat& st, const std::string& flag, const std::string& path, int64_t max_bytes) {
  PCPKV_CHECK(S_ISREG(st.st_mode), "{}: '{}' is {}, not a regular file; pcpkv reads only regular files", flag,
              path, file_kind(st.st_mode));
  const auto size = static_cast<int64_t>(st.st_size);
  PCPKV_CHECK(max_bytes <= 0 || size <= max_bytes,
              "{}: '{}' has {} bytes, more than the {} bytes pcpkv reads from such a file", flag, path, size,
              max_bytes);
  return size;
}

}  // namespace

void check_json_depth(const std::string& text, const std::string& origin, int64_t offset_base, int max_depth) {
  int depth = 0, deepest = 0;
  int64_t passed_at = -1;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (depth > max_depth && passed_at < 0) passed_at = static_cast<int64_t>(i);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  PCPKV_CHECK(passed_at < 0,
              "{}: the JSON nests {} levels deep (pcpkv reads at most {}); the limit is passed at byte offset {}",
              origin, deepest, max_depth, offset_base + passed_at);
}

std::string clip(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) return s;
  return fmt::format("{}... ({} characters)", s.substr(0, max_chars), s.size());
}

std::string clip_middle(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) return s;
  const size_t tail = max_chars / 4, head = max_chars - tail;
  return fmt::format("{} ... [{} characters omitted] ... {}", s.substr(0, head), s.size() - head - tail,
                     s.substr(s.size() - tail));
}

int64_t check_input_file(const std::string& flag, const std::string& file, int64_t max_bytes) {
  PCPKV_CHECK(!file.empty(), "{}: the path is empty", flag);
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    const int err = errno;
    PCPKV_CHECK(err != ENOENT, "{}: no such file '{}'", flag, path);
    PCPKV_FAIL("{}: cannot read '{}': {}", flag, path, std::strerror(err));
  }
  return check_stat(st, flag, path, max_bytes);
}

std::string read_input_file(const std::string& flag, const std::string& file, int64_t max_bytes) {
  check_input_file(flag, file, max_bytes);
  const std::string path = clip(file);  // as messages quote it
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  PCPKV_CHECK(fd >= 0, "{}: cannot open '{}': {}", flag, path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  PCPKV_CHECK(::fstat(fd, &st) == 0, "{}: cannot read '{}': {}", flag, path, std::strerror(errno));
  const int64_t size = check_stat(st, flag, path, max_bytes);
  std::string text;
  text.reserve(static_cast<size_t>(size));
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    PCPKV_CHECK(n >= 0, "{}: reading '{}' failed: {}", flag, path, std::strerror(errno));
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    // The file may grow after fstat: the limit still holds.
    PCPKV_CHECK(max_bytes <= 0 || static_cast<int64_t>(text.size()) <= max_bytes,
                "{}: '{}' has more than the {} bytes pcpkv reads from such a file", flag, path, max_bytes);
  }
  return text;
}

}  // namespace pcpkv
