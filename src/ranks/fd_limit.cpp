// The open-file limit (see ranks/fd_limit.h).
#include "ranks/fd_limit.h"

#include <dirent.h>
#include <sys/resource.h>

#include <fmt/format.h>

namespace pcpkv::fd_limit {
namespace {

std::string text(rlim_t v) { return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v); }

bool fits(const rlimit& l, int64_t need) {
  return l.rlim_cur == RLIM_INFINITY || static_cast<int64_t>(l.rlim_cur) >= need;
}

}  // namespace

int64_t open_now() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  int64_t n = 0;
  while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n > 0 ? n - 1 : 0;  // less the descriptor reading the directory
}

std::string describe() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return "unknown";
  return fmt::format("{} (soft; hard limit {})", text(rl.rlim_cur), text(rl.rlim_max));
}

std::string fit(int64_t need) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || fits(rl, need)) return "";
  rlimit raised = rl;
  raised.rlim_cur = rl.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0 && fits(raised, need)) return "";
  return fmt::format("the open-file limit (RLIMIT_NOFILE) is {} with a hard limit of {}, the most it can be raised to",
                     text(rl.rlim_cur), text(rl.rlim_max));
}

}  // namespace pcpkv::fd_limit
