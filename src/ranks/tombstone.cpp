// The rendezvous tombstone (see ranks/tombstone.h). File: token, boot id, CLOCK_BOOTTIME ns, keep-until
// CLOCK_BOOTTIME ns, reason, one per line (the reason is the rest of the file). Times are compared in the boot
// clock because a process's start time (/proc/self/stat) is counted from boot; the boot id keeps a file from
// before a reboot old.
#include "ranks/tombstone.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string_view>

#include <fmt/format.h>

namespace pcpkv::bootstrap_tombstone {
namespace {

std::atomic<int64_t> g_reported_ns{-1};

int64_t boot_clock_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// This process's start in the boot clock: field 22 of /proc/self/stat (clock ticks after boot), read after
// the command name's closing parenthesis (the name may hold spaces). The tick is rounded up: a process
// started within one tick (10 ms) before a tombstone counts as a later attempt's, since a retry can start
// that soon after the failed one ends, while a rank of the failed attempt began with it. 0 when unreadable:
// then every tombstone of this boot counts as this attempt's.
int64_t process_start_ns() {
  std::ifstream in("/proc/self/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i < 22) continue;
    int64_t ticks = 0;
    const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), ticks);
    const long hz = ::sysconf(_SC_CLK_TCK);
    if (ec != std::errc() || end != field.data() + field.size() || hz <= 0) return 0;
    return (ticks + 1) * (1'000'000'000 / hz);
  }
  return 0;
}

bool parse_int(const std::string& s, int64_t* out) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace

std::string path_of(const std::string& address) { return address + ".failed"; }

void write(const std::string& address, const std::string& token, const std::string& reason, double keep_s) {
  // A fresh file only: whatever sits at the temporary name (a FIFO would block the open, a symbolic link would
  // send the text to its target) is removed first, and O_EXCL | O_NOFOLLOW refuse one that reappears.
  // The text first: reading the boot id takes a descriptor, and a rank 0 that gives up for want of descriptors
  // (EMFILE) has freed just one for the file.
  const int64_t now = boot_clock_ns();
  // Capped: an infinite timeout keeps the file for ~30 years (until the next job at this address or a reboot).
  const double keep_ns = std::min(std::max(keep_s, 0.0), 1e9) * 1e9;
  const std::string text =
      fmt::format("{}\n{}\n{}\n{}\n{}", token, boot_id(), now, now + static_cast<int64_t>(keep_ns), reason);
  const std::string tmp = path_of(address) + ".tmp";
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return;
  const ssize_t n = ::write(fd, text.data(), text.size());
  ::close(fd);
  if (n == static_cast<ssize_t>(text.size())) ::rename(tmp.c_str(), path_of(address).c_str());
  ::unlink(tmp.c_str());
}

void remove(const std::string& address) { ::unlink(path_of(address).c_str()); }

Found read(const std::string& address, const std::string& token) {
  // Non-blocking and not through a link: a FIFO or device put at the name must not hang the rank.
  const int fd = ::open(path_of(address).c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return {};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return {};
  }
  std::string text(4096, '\0');
  const ssize_t n = ::read(fd, text.data(), text.size());
  ::close(fd);
  if (n <= 0) return {};
  text.resize(static_cast<size_t>(n));
  std::string line[4];
  size_t at = 0;
  for (std::string& l : line) {
    const auto nl = text.find('\n', at);
    if (nl == std::string::npos) return {};
    l = text.substr(at, nl - at);
    at = nl + 1;
  }
  Found f;
  int64_t keep_until = 0;
  if (line[0] != token || !parse_int(line[2], &f.written_ns) || !parse_int(line[3], &keep_until)) return {};
  f.reason = text.substr(at);
  f.earlier_boot = line[1] != boot_id();
  if (f.earlier_boot) return f;
  const int64_t start = process_start_ns();
  f.this_attempt = f.written_ns >= start && f.written_ns != g_reported_ns.load();
  if (f.written_ns < start) f.age_at_start_s = static_cast<double>(start - f.written_ns) * 1e-9;
  return f;
}

void sweep(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string me = boot_id();
  const int64_t now = boot_clock_ns();
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    constexpr std::string_view kSuffix = ".failed";
    if (path.size() <= kSuffix.size() || path.compare(path.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
      continue;
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    std::string text(4096, '\0');
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    const ssize_t n = regular ? ::read(fd, text.data(), text.size()) : -1;
    ::close(fd);
    if (n <= 0) continue;
    text.resize(static_cast<size_t>(n));
    std::istringstream lines(text);
    std::string token, boot, written, keep_until;
    int64_t until = 0;
    if (!std::getline(lines, token) || !std::getline(lines, boot) || !std::getline(lines, written) ||
        !std::getline(lines, keep_until) || !parse_int(keep_until, &until))
      continue;  // not a tombstone of this format: not ours to judge
    if (boot != me || now > until) ::unlink(path.c_str());
  }
}

void mark_reported(const Found& found) { g_reported_ns.store(found.written_ns); }

}  // namespace pcpkv::bootstrap_tombstone
