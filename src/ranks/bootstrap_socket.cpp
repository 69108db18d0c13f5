// The bootstrap's socket address on disk (see bootstrap_socket.h).
#include "ranks/bootstrap_socket.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "ranks/fd_limit.h"

namespace pcpkv {

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace bootstrap_socket {
namespace {

// One rank 0 per address, for as long as its Bootstrap lives: a second job given the same MASTER_PORT (or
// PCPKV_BOOTSTRAP) is refused at once, as torchrun's store refuses a port in use, instead of taking over
// the socket and meeting the first job's ranks. flock() goes with the process: a killed job leaves no lock.
// The lock file goes with its Bootstrap (~Impl) and a crashed holder's is reclaimed by the next rank 0 in the
// directory (sweep_stale_locks): both unlink it while holding the lock, so a rank 0 that opened the file just before
// locks an unlinked inode; it sees that (the path names another inode or none) and starts over.
bool still_named(int fd, const std::string& path) {
  struct stat held {}, named {};
  return ::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
         held.st_ino == named.st_ino;
}

}  // namespace

std::string job_name(const std::string& job) { return job.empty() ? "an unnamed job" : "job '" + clip(job) + "'"; }

UniqueFd lock_address(const std::string& address, const std::string& job) {
  const std::string path = address + ".lock";
  UniqueFd fd;
  for (int attempt = 0;; ++attempt) {
    fd.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    PCPKV_CHECK(fd, "bootstrap: rank 0 cannot open the lock file '{}': {}", path, std::strerror(errno));
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0 || still_named(fd.get(), path) || attempt >= 100) break;
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    PCPKV_CHECK(err == EWOULDBLOCK, "bootstrap: rank 0 cannot lock '{}': {}", path, std::strerror(err));
    std::string holder(512, '\0');
    const ssize_t n = ::pread(fd.get(), holder.data(), holder.size(), 0);
    holder.resize(n > 0 ? static_cast<size_t>(n) : 0);
    PCPKV_FAIL("bootstrap: rank 0 of {} cannot rendezvous at '{}': it is in use by the rank 0 of another job "
               "({}); ranks of different jobs never meet: give each job its own MASTER_PORT (or PCPKV_BOOTSTRAP)",
               job_name(job), address, holder.empty() ? "pid unknown" : clip(holder));
  }
  const std::string me = fmt::format("pid {}, {}", ::getpid(), job_name(job));
  if (::ftruncate(fd.get(), 0) == 0) (void)!::pwrite(fd.get(), me.data(), me.size(), 0);
  return fd;
}

std::string errno_text(int err) { return std::strerror(err); }

// Lock files in `dir` whose holder is gone (a rank 0 killed before its Bootstrap closed; a closed one removes its
// own), with the socket such a rank 0 left: nobody holds the lock, so no live job uses the address.
void sweep_stale_locks(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  constexpr std::string_view kSuffix = ".lock";
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= kSuffix.size() || name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
      continue;
    const std::string path = dir + "/" + name;
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
    struct stat st {};
    if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0 || !still_named(fd.get(), path)) continue;
    const std::string socket = path.substr(0, path.size() - kSuffix.size());
    if (::lstat(socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(socket.c_str());
    ::unlink(path.c_str());
  }
  ::closedir(d);
}

// A rank's bootstrap holds at most a connection per peer (rank 0) and, while all_gather_fds shares buffers, a
// descriptor per rank, besides what the process has open: "" when the job fits (after raising the soft limit,
// fd_limit::fit), else why not.
std::string fit_descriptor_limit(int world, int rank) {
  const int64_t open = fd_limit::open_now();
  // 32: listener, lock, tombstone, sockets, slack
  const int64_t need = open + (rank == 0 ? 2 : 1) * int64_t{world} + 32;
  const std::string limit = fd_limit::fit(need);
  if (limit.empty()) return "";
  return fmt::format("a job of {} ranks needs about {} open files at rank {} ({} open now, a connection per rank and "
                     "a descriptor per rank while buffers are shared), but {}: raise the hard limit (ulimit -Hn, "
                     "/etc/security/limits.conf, the container's nofile) or run fewer ranks",
                     world, need, rank, open, limit);
}

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

bool peer_uid(int fd, uid_t* uid, pid_t* pid) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  *uid = cred.uid;
  *pid = cred.pid;
  return true;
}

sockaddr_un make_addr(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  PCPKV_CHECK(!path.empty() && path.size() < sizeof(addr.sun_path),
              "bootstrap: socket path '{}' must be 1..{} bytes long (it is {}); set PCPKV_BOOTSTRAP_DIR or "
              "TMPDIR to a shorter directory",
              path, sizeof(addr.sun_path) - 1, path.size());
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// The socket's directory must exist (created 0700 when missing) and be private to this user: a socket
// in a world-writable directory could be replaced by another user's listener.
void ensure_private_dir(const std::string& socket_path) {
  const std::string dir = dir_of(socket_path);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    PCPKV_CHECK(errno == ENOENT, "bootstrap: cannot stat socket directory '{}': {}", dir, errno_text(errno));
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      PCPKV_FAIL("bootstrap: cannot create socket directory '{}': {}", dir, errno_text(errno));
    PCPKV_CHECK(::lstat(dir.c_str(), &st) == 0, "bootstrap: cannot stat socket directory '{}': {}", dir,
                errno_text(errno));
  }
  PCPKV_CHECK(S_ISDIR(st.st_mode), "bootstrap: socket directory '{}' is not a directory", dir);
  PCPKV_CHECK(st.st_uid == ::geteuid(),
              "bootstrap: socket directory '{}' belongs to uid {}, not to this user (uid {}); pcpkv only "
              "rendezvouses in a directory of its own user",
              dir, st.st_uid, ::geteuid());
  PCPKV_CHECK((st.st_mode & 0077) == 0,
              "bootstrap: socket directory '{}' has mode {:04o}; it must be private to this user (0700) so "
              "that no other user can put a socket there",
              dir, st.st_mode & 07777);
}

}  // namespace bootstrap_socket
}  // namespace pcpkv
