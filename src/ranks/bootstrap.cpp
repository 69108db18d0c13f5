// Rendezvous over a Unix-domain socket and star collectives through rank 0 (see pcpkv/ranks/bootstrap.h).
#include "pcpkv/ranks/bootstrap.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/interrupt.h"
#include "ranks/bootstrap_wire.h"
#include "ranks/fd_limit.h"
#include "ranks/tombstone.h"

namespace pcpkv {

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

using namespace bootstrap_wire;

namespace {

constexpr uint32_t kProtocolVersion = 2;  // 2: the hello names the job (job_bytes)
constexpr double kMaxTimeoutS = 1e9;  // steady_clock counts int64 ns (~292 years): 1e9 s leaves room for now()

// HELLO payload: fixed fields, then the token bytes, then the job's name (BootstrapConfig::job, for
// messages only).
struct HelloFixed {
  uint32_t version;
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_world_size;
  uint32_t job_bytes;
  int64_t pid;
  uint64_t token_bytes;
};

// "job 'MASTER_PORT 29500, command ...'" or "an unnamed job".
std::string job_name(const std::string& job) { return job.empty() ? "an unnamed job" : "job '" + clip(job) + "'"; }

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

// Sends a frame and ignores the outcome, whatever happens (an interrupt check that throws included): for messages
// sent on the way out.
void send_frame_quiet(int fd, FrameType type, const std::string& text, Deadline dl) noexcept {
  try {
    send_frame(fd, type, text.data(), text.size(), dl);
  } catch (...) {
  }
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

}  // namespace

struct Bootstrap::Impl {
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
  [[noreturn]] void fail_job(const std::string& message, int skip_rank = -1) {
    if (in_rendezvous) bootstrap_tombstone::write(cfg.address, cfg.token, message, tombstone_keep_s());
    for (int r = 1; r < cfg.world_size; ++r) {
      if (r == skip_rank || !conns[r]) continue;
      send_frame(conns[r].get(), FrameType::kAbort, message.data(), message.size(), Clock::now() + std::chrono::milliseconds(200));
    }
    throw Error(fmt::format("bootstrap: {}", message));
  }

  // Runs the interrupt check (pcpkv/core/interrupt.h); when it throws, the other ranks are told first (rank 0
  // tells every connected rank, and leaves a tombstone during the rendezvous; a follower tells rank 0), so that
  // they fail now naming this rank, not at their timeout.
  void interruptible() {
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

  // Rank 0: receive one frame of type `expected` from every peer. Frames come back in rank order.
  std::vector<Frame> root_gather(FrameType expected, const char* op) {
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

  // Rank 0: send a frame to every peer.
  void root_send_all(FrameType type, const std::vector<uint8_t>& payload, const char* op) {
    const Deadline dl = deadline();
    for (int r = 1; r < cfg.world_size; ++r) {
      const IoStatus st = send_frame(conns[r].get(), type, payload.data(), payload.size(), dl);
      if (st != IoStatus::kOk)
        fail_job(fmt::format("{}: sending to {} failed ({}; exited or killed?)", op, who(r),
                             st == IoStatus::kTimeout ? "timed out" : "connection closed"),
                 r);
    }
  }

  // Non-root: receive one frame from rank 0 of type `expected`; aborts and failures throw.
  Frame follower_recv(FrameType expected, const char* op) {
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

  void follower_send(FrameType type, const void* data, size_t bytes, const char* op, int pass_fd = -1) {
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

  void rendezvous_root();
  void rendezvous_follower();
};

// ---- rendezvous ----------------------------------------------------------------------------------

void Bootstrap::Impl::rendezvous_root() {
  const int world = cfg.world_size;
  conns.resize(world);
  pids.assign(world, 0);
  pids[0] = ::getpid();
  if (world == 1) return;

  ensure_private_dir(cfg.address);
  const sockaddr_un addr = make_addr(cfg.address);
  // Before anything at the address is touched: the socket and tombstone may be another live job's.
  address_lock = lock_address(cfg.address, cfg.job);
  bootstrap_tombstone::remove(cfg.address);  // an earlier attempt's
  // What crashed or failed jobs at other addresses of this private directory left (a Python group picks a fresh
  // address per setup, so nothing else would ever remove them).
  sweep_stale_locks(dir_of(cfg.address));
  bootstrap_tombstone::sweep(dir_of(cfg.address));
  in_rendezvous = true;
  // Before any rank is accepted: a job that cannot fit says so now, on every rank (the tombstone), instead of
  // failing part-way with EMFILE.
  if (const std::string why = fit_descriptor_limit(world, 0); !why.empty()) fail_job(why);
  struct stat st {};
  if (::lstat(cfg.address.c_str(), &st) == 0) {
    // A socket left by an earlier job with this address; anything else is not ours to delete.
    PCPKV_CHECK(S_ISSOCK(st.st_mode), "bootstrap: '{}' exists and is not a socket", cfg.address);
    ::unlink(cfg.address.c_str());
  }
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  PCPKV_CHECK(listener, "bootstrap: socket() failed: {}", errno_text(errno));
  PCPKV_CHECK(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0,
              "bootstrap: rank 0 cannot bind '{}': {}", cfg.address, errno_text(errno));
  ::chmod(cfg.address.c_str(), 0600);
  struct Unlinker {
    std::string path;
    ~Unlinker() { ::unlink(path.c_str()); }
  } unlinker{cfg.address};
  PCPKV_CHECK(::listen(listener.get(), world + 16) == 0, "bootstrap: listen failed: {}", errno_text(errno));

  struct Pending {
    UniqueFd fd;
    pid_t pid = 0;
  };
  std::vector<Pending> pending;
  std::vector<std::string> refused;
  const Deadline dl = deadline();
  int accepted = 0;
  const uid_t my_uid = ::geteuid();

  auto reject = [&](int fd, const std::string& why) {
    send_frame(fd, FrameType::kReject, why.data(), why.size(), Clock::now() + std::chrono::milliseconds(200));
  };

  while (accepted < world - 1) {
    std::vector<pollfd> pfds{{listener.get(), POLLIN, 0}};
    for (auto& p : pending) pfds.push_back({p.fd.get(), POLLIN, 0});
    const int left = ms_left(dl);
    const int n = ::poll(pfds.data(), pfds.size(), std::min(left, kInterruptPollMs));
    if ((n < 0 && errno == EINTR) || (n == 0 && left > kInterruptPollMs)) {
      interruptible();
      continue;
    }
    PCPKV_CHECK(n >= 0, "bootstrap: poll failed: {}", errno_text(errno));
    // The deadline holds even while poll keeps reporting events (a listener that stays readable).
    if (n == 0 || Clock::now() >= dl) {
      std::vector<int> missing;
      for (int r = 1; r < world; ++r)
        if (!conns[r]) missing.push_back(r);
      std::string note;
      if (!refused.empty()) note = fmt::format("; refused {} connection(s): {}", refused.size(), fmt::join(refused, "; "));
      fail_job(fmt::format("rendezvous timed out after {} s at rank 0 ('{}'): rank(s) {} of world size {} never "
                           "connected{}",
                           cfg.timeout_s, cfg.address, fmt::join(missing, ", "), world, note));
    }
    // Hellos of pending connections first (indices shift when we erase, so walk backwards).
    for (size_t i = pfds.size() - 1; i >= 1; --i) {
      if (pfds[i].revents == 0) continue;
      Pending p = std::move(pending[i - 1]);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i - 1));
      Frame f;
      const IoStatus io = recv_frame(p.fd.get(), std::min(dl, Clock::now() + std::chrono::seconds(5)), &f);
      if (io != IoStatus::kOk || f.type != FrameType::kHello || f.payload.size() < sizeof(HelloFixed)) {
        refused.push_back(fmt::format("pid {}: no valid hello", p.pid));
        continue;
      }
      HelloFixed h{};
      std::memcpy(&h, f.payload.data(), sizeof(h));
      if (h.version != kProtocolVersion || h.token_bytes > f.payload.size() ||
          f.payload.size() != sizeof(h) + h.token_bytes + h.job_bytes) {
        reject(p.fd.get(), fmt::format("protocol version {} differs from rank 0's {}", h.version, kProtocolVersion));
        refused.push_back(fmt::format("pid {}: protocol version {}", p.pid, h.version));
        continue;
      }
      const char* body = reinterpret_cast<const char*>(f.payload.data() + sizeof(h));
      const std::string token(body, h.token_bytes);
      const std::string peer_job(body + h.token_bytes, h.job_bytes);
      if (token != cfg.token) {
        // A process of another job (or a stale one): refuse it, keep waiting for the right one.
        reject(p.fd.get(), fmt::format("job token mismatch: this process (pid {}) belongs to {}, rank 0 (pid {}) at "
                                       "'{}' to {}; ranks of different jobs never meet (give each job its own "
                                       "MASTER_PORT or PCPKV_JOB_ID; a stale PCPKV_JOB_TOKEN?)",
                                       h.pid, job_name(peer_job), pids[0], cfg.address, job_name(cfg.job)));
        refused.push_back(fmt::format("pid {} claiming rank {} of {}: wrong job token", h.pid, h.rank,
                                      job_name(peer_job)));
        std::fprintf(stderr, "pcpkv bootstrap: refused a connection from pid %lld claiming rank %d of %s: wrong job "
                     "token\n", static_cast<long long>(h.pid), h.rank, job_name(peer_job).c_str());
        continue;
      }
      // Same job, inconsistent launch: fatal for everyone.
      if (h.world_size != world) {
        const std::string why = fmt::format("world size mismatch: rank {} (pid {}) has world size {}, rank 0 (pid {}) "
                                            "has {}; every rank must be started with the same WORLD_SIZE",
                                            h.rank, h.pid, h.world_size, pids[0], world);
        reject(p.fd.get(), why);
        fail_job(why);
      }
      if (h.rank <= 0 || h.rank >= world) {
        const std::string why = fmt::format("pid {} claims rank {}, outside [1, {})", h.pid, h.rank, world);
        reject(p.fd.get(), why);
        fail_job(why);
      }
      if (conns[h.rank]) {
        const std::string why =
            fmt::format("two processes claim rank {}: pid {} and pid {}", h.rank, pids[h.rank], h.pid);
        reject(p.fd.get(), why);
        fail_job(why);
      }
      conns[h.rank] = std::move(p.fd);
      pids[h.rank] = h.pid;
      ++accepted;
    }
    if (pfds[0].revents != 0) {
      UniqueFd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c) {
        const int err = errno;
        // A connection that went away before it was accepted, or a signal: wait on.
        if (err == EINTR || err == EAGAIN || err == EWOULDBLOCK || err == ECONNABORTED || err == EPROTO) continue;
        // Anything else (EMFILE, ENFILE, ENOBUFS, ENOMEM) would fail again at once: the connection stays queued and
        // the listener readable, and rank 0 spun past its timeout. The listener goes first: its descriptor is the
        // one the tombstone needs, and the ranks queued behind it see their connection closed and read it.
        listener.reset();
        pending.clear();
        const std::string limit =
            err == EMFILE ? fmt::format(" (the open-file limit, RLIMIT_NOFILE, is {})", fd_limit::describe()) : "";
        fail_job(fmt::format("rendezvous failed at rank 0 ('{}'): accepting rank connections failed: {}{}; {} of the "
                             "{} other rank(s) had connected",
                             cfg.address, errno_text(err), limit, accepted, world - 1));
      }
      uid_t uid = 0;
      pid_t pid = 0;
      if (!peer_uid(c.get(), &uid, &pid)) {
        refused.push_back("a peer whose credentials could not be read");
        continue;
      }
      if (uid != my_uid) {
        reject(c.get(), fmt::format("peer pid {} runs as uid {}, the job as uid {}", pid, uid, my_uid));
        refused.push_back(fmt::format("pid {}: another user (uid {})", pid, uid));
        std::fprintf(stderr, "pcpkv bootstrap: refused a connection from pid %d of uid %u (not this user)\n", pid, uid);
        continue;
      }
      pending.push_back({std::move(c), pid});
    }
  }
  // WELCOME carries every rank's pid.
  std::vector<uint8_t> payload(world * sizeof(int64_t));
  std::memcpy(payload.data(), pids.data(), payload.size());
  root_send_all(FrameType::kWelcome, payload, "rendezvous");
  in_rendezvous = false;
}

void Bootstrap::Impl::rendezvous_follower() {
  const sockaddr_un addr = make_addr(cfg.address);
  (void)fit_descriptor_limit(cfg.world_size, cfg.rank);  // raises the soft limit when it must; judged in connect()
  const Deadline dl = deadline();
  conns.resize(1);
  pids.assign(cfg.world_size, 0);
  pids[cfg.rank] = ::getpid();
  // Rank 0's reason when it gave up this attempt's rendezvous (ranks/tombstone.h), else "".
  // connected: the rank 0 this rank reached removed any earlier tombstone before it listened, so one now is its own,
  // however soon after this process's start it was written (within the start time's 10 ms tick it read as an
  // earlier attempt's: "rank 0 closed the connection during rendezvous", the reason lost).
  auto rank0_gave_up = [&](bool connected = false) {
    const bootstrap_tombstone::Found t = bootstrap_tombstone::read(cfg.address, cfg.token);
    // token_per_attempt: no retry shares the token, so a rank that started after rank 0 gave up (24 ranks forked on
    // 2 cores) is still of this attempt.
    const bool ours = (connected || cfg.token_per_attempt) && !t.reason.empty() && !t.earlier_boot;
    if (!(t.this_attempt || ours)) return std::string();
    bootstrap_tombstone::mark_reported(t);
    return t.reason;
  };
  // A connected rank whose connection rank 0 closed: rank 0 may close first and write its tombstone just after (a
  // failing accept frees the listener's descriptor for it), so the reason is awaited up to 1 s before it is given up.
  auto rank0_reason_after_close = [&]() {
    const Deadline until = Clock::now() + std::chrono::seconds(1);
    for (;;) {
      if (std::string why = rank0_gave_up(true); !why.empty() || Clock::now() >= until) return why;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  int last_err = 0;
  for (;;) {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    PCPKV_CHECK(s, "bootstrap: socket() failed: {}", errno_text(errno));
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
      conns[0] = std::move(s);
      break;
    }
    last_err = errno;
    if (const std::string why = rank0_gave_up(); !why.empty())
      PCPKV_FAIL("bootstrap: rank 0 gave up the rendezvous at '{}' before rank {} connected: {}", cfg.address,
                 cfg.rank, why);
    PCPKV_CHECK(last_err == ENOENT || last_err == ECONNREFUSED || last_err == EAGAIN || last_err == EINTR,
                "bootstrap: rank {} cannot connect to '{}': {}", cfg.rank, cfg.address, errno_text(last_err));
    if (Clock::now() >= dl) {
      // A rank 0 with this token that gave up before this process started: a late rank or an earlier attempt.
      std::string earlier;
      if (const auto t = bootstrap_tombstone::read(cfg.address, cfg.token); !t.reason.empty() && !t.this_attempt)
        earlier = fmt::format("; an earlier rank 0 with this job token gave up {}: {}",
                              t.earlier_boot ? std::string("before this host's last boot")
                                             : fmt::format("{:.1f} s before this process started", t.age_at_start_s),
                              t.reason);
      PCPKV_FAIL("bootstrap: rendezvous timed out after {} s at rank {}: nobody accepts connections at '{}' ({}); "
                 "is rank 0 running with the same PCPKV_BOOTSTRAP / MASTER_PORT?{}",
                 cfg.timeout_s, cfg.rank, cfg.address, errno_text(last_err), earlier);
    }
    interruptible();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  uid_t uid = 0;
  pid_t pid = 0;
  PCPKV_CHECK(peer_uid(conns[0].get(), &uid, &pid), "bootstrap: cannot read rank 0's credentials: {}",
              errno_text(errno));
  PCPKV_CHECK(uid == ::geteuid(),
              "bootstrap: the process listening at '{}' (pid {}) runs as uid {}, not as this user (uid {}); "
              "refusing to join it",
              cfg.address, pid, uid, ::geteuid());
  pids[0] = pid;

  const std::string job = clip(cfg.job);
  HelloFixed h{kProtocolVersion, cfg.rank, cfg.world_size, cfg.local_rank, cfg.local_world_size,
               static_cast<uint32_t>(job.size()), static_cast<int64_t>(::getpid()), cfg.token.size()};
  std::vector<uint8_t> hello(sizeof(h) + cfg.token.size() + job.size());
  std::memcpy(hello.data(), &h, sizeof(h));
  std::memcpy(hello.data() + sizeof(h), cfg.token.data(), cfg.token.size());
  std::memcpy(hello.data() + sizeof(h) + cfg.token.size(), job.data(), job.size());
  if (send_frame(conns[0].get(), FrameType::kHello, hello.data(), hello.size(), dl) != IoStatus::kOk) {
    if (const std::string why = rank0_reason_after_close(); !why.empty())
      PCPKV_FAIL("bootstrap: rank 0 (pid {}) gave up the rendezvous: {}", pid, why);
    PCPKV_FAIL("bootstrap: rank {} could not send its hello to rank 0 (pid {})", cfg.rank, pid);
  }

  Frame f;
  const IoStatus st = recv_frame(conns[0].get(), follower_deadline(), &f);
  PCPKV_CHECK(st != IoStatus::kTimeout,
              "bootstrap: rendezvous timed out after {} s at rank {}: rank 0 (pid {}) is up but not every rank "
              "arrived",
              cfg.timeout_s, cfg.rank, pid);
  if (st != IoStatus::kOk) {
    // Rank 0 may have failed the job while our hello was still unread (it then never told us): its
    // tombstone says why.
    if (const std::string why = rank0_reason_after_close(); !why.empty())
      PCPKV_FAIL("bootstrap: rank 0 (pid {}) gave up the rendezvous: {}", pid, why);
    PCPKV_FAIL("bootstrap: rank 0 (pid {}) closed the connection during rendezvous", pid);
  }
  const std::string text(f.payload.begin(), f.payload.end());
  if (f.type == FrameType::kReject)
    PCPKV_FAIL("bootstrap: rank 0 (pid {}) refused rank {} (pid {}): {}", pid, cfg.rank, ::getpid(), text);
  if (f.type == FrameType::kAbort) PCPKV_FAIL("bootstrap: {}", text);
  PCPKV_CHECK(f.type == FrameType::kWelcome && f.payload.size() == cfg.world_size * sizeof(int64_t),
              "bootstrap: protocol error: unexpected reply from rank 0 during rendezvous");
  std::memcpy(pids.data(), f.payload.data(), f.payload.size());
}

// ---- Bootstrap -----------------------------------------------------------------------------------

Bootstrap::Bootstrap(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Bootstrap::~Bootstrap() = default;

std::unique_ptr<Bootstrap> Bootstrap::connect(const BootstrapConfig& config) {
  PCPKV_CHECK(config.world_size >= 1, "bootstrap: world_size must be >= 1, got {}", config.world_size);
  PCPKV_CHECK(config.rank >= 0 && config.rank < config.world_size, "bootstrap: rank {} is outside [0, {})",
              config.rank, config.world_size);
  PCPKV_CHECK(config.local_world_size >= 1, "bootstrap: local_world_size must be >= 1, got {}",
              config.local_world_size);
  PCPKV_CHECK(config.local_rank >= 0 && config.local_rank < config.local_world_size,
              "bootstrap: local_rank {} is outside [0, {})", config.local_rank, config.local_world_size);
  PCPKV_CHECK(config.timeout_s > 0, "bootstrap: timeout must be > 0 s, got {}", config.timeout_s);
  PCPKV_CHECK(config.world_size == 1 || !config.token.empty(), "bootstrap: the job token is empty");
  PCPKV_CHECK(config.world_size == 1 || !config.address.empty(), "bootstrap: the socket address is empty");
  auto impl = std::make_unique<Impl>();
  impl->cfg = config;
  if (config.rank == 0)
    impl->rendezvous_root();
  else
    impl->rendezvous_follower();
  auto b = std::unique_ptr<Bootstrap>(new Bootstrap(std::move(impl)));
  // Each follower's own limit, shared (rank 0 judged the job by its own before accepting): one too low passed and
  // later failed alone, sharing descriptors ("receiving from rank 0 failed: Success"), its peers told nothing.
  const std::string mine = config.rank == 0 ? "" : fit_descriptor_limit(config.world_size, config.rank);
  for (const auto& why : b->all_gather_v(mine.data(), mine.size()))
    PCPKV_CHECK(why.empty(), "bootstrap: {}", std::string(why.begin(), why.end()));
  return b;
}

int32_t Bootstrap::rank() const { return impl_->cfg.rank; }
int32_t Bootstrap::world_size() const { return impl_->cfg.world_size; }
int32_t Bootstrap::local_rank() const { return impl_->cfg.local_rank; }
int32_t Bootstrap::local_world_size() const { return impl_->cfg.local_world_size; }
const BootstrapConfig& Bootstrap::config() const { return impl_->cfg; }
const std::vector<int64_t>& Bootstrap::pids() const { return impl_->pids; }

std::vector<std::vector<uint8_t>> Bootstrap::all_gather_v(const void* send, size_t bytes) {
  Impl& m = *impl_;
  const int world = m.cfg.world_size;
  std::vector<std::vector<uint8_t>> out(world);
  const auto* src = static_cast<const uint8_t*>(send);
  if (world == 1) {
    out[0].assign(src, src + bytes);
    return out;
  }
  if (m.is_root()) {
    std::vector<Frame> frames = m.root_gather(FrameType::kData, "all_gather");
    frames[0].payload.assign(src, src + bytes);
    std::vector<uint8_t> packed;
    for (int r = 0; r < world; ++r) {
      const uint64_t n = frames[r].payload.size();
      packed.insert(packed.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 8);
      packed.insert(packed.end(), frames[r].payload.begin(), frames[r].payload.end());
      out[r] = std::move(frames[r].payload);
    }
    m.root_send_all(FrameType::kData, packed, "all_gather");
    return out;
  }
  m.follower_send(FrameType::kData, send, bytes, "all_gather");
  const Frame f = m.follower_recv(FrameType::kData, "all_gather");
  size_t pos = 0;
  for (int r = 0; r < world; ++r) {
    uint64_t n = 0;
    PCPKV_CHECK(pos + 8 <= f.payload.size(), "bootstrap: all_gather reply from rank 0 is truncated");
    std::memcpy(&n, f.payload.data() + pos, 8);
    pos += 8;
    PCPKV_CHECK(pos + n <= f.payload.size(), "bootstrap: all_gather reply from rank 0 is truncated");
    out[r].assign(f.payload.begin() + static_cast<std::ptrdiff_t>(pos),
                  f.payload.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  }
  return out;
}

void Bootstrap::all_gather(const void* send, size_t bytes, void* recv) {
  const auto blobs = all_gather_v(send, bytes);
  auto* dst = static_cast<uint8_t*>(recv);
  for (size_t r = 0; r < blobs.size(); ++r) {
    if (blobs[r].size() != bytes) {
      const std::string why = fmt::format("all_gather: {} contributed {} bytes, rank {} expected {}",
                                          impl_->who(static_cast<int>(r)), blobs[r].size(), rank(), bytes);
      abort(why);
      throw Error("bootstrap: " + why);
    }
    std::memcpy(dst + r * bytes, blobs[r].data(), bytes);
  }
}

std::vector<UniqueFd> Bootstrap::all_gather_fds(int fd) {
  Impl& m = *impl_;
  const int world = m.cfg.world_size;
  PCPKV_CHECK(fd >= 0, "bootstrap: all_gather_fds: fd {} is not open", fd);
  std::vector<UniqueFd> out(world);
  UniqueFd own(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  PCPKV_CHECK(own, "bootstrap: all_gather_fds: dup of fd {} failed: {}", fd, errno_text(errno));
  if (world == 1) {
    out[0] = std::move(own);
    return out;
  }
  const uint8_t tag = 0;
  if (m.is_root()) {
    std::vector<Frame> frames = m.root_gather(FrameType::kFd, "all_gather_fds");
    out[0] = std::move(own);
    for (int r = 1; r < world; ++r) {
      if (frames[r].fds.size() != 1)
        m.fail_job(fmt::format("all_gather_fds: {} sent {} descriptors, expected 1", m.who(r), frames[r].fds.size()));
      out[r] = std::move(frames[r].fds[0]);
    }
    const Deadline dl = m.deadline();
    for (int p = 1; p < world; ++p)
      for (int r = 0; r < world; ++r)
        if (send_frame(m.conns[p].get(), FrameType::kFd, &tag, 1, dl, out[r].get()) != IoStatus::kOk)
          m.fail_job(fmt::format("all_gather_fds: sending to {} failed (exited or killed?)", m.who(p)), p);
    return out;
  }
  m.follower_send(FrameType::kFd, &tag, 1, "all_gather_fds", fd);
  for (int r = 0; r < world; ++r) {
    Frame f = m.follower_recv(FrameType::kFd, "all_gather_fds");
    PCPKV_CHECK(f.fds.size() == 1, "bootstrap: all_gather_fds: rank 0 sent {} descriptors for rank {}, expected 1",
                f.fds.size(), r);
    out[r] = std::move(f.fds[0]);
  }
  out[m.cfg.rank] = std::move(own);  // the caller's own descriptor, not the round trip through rank 0
  return out;
}

void Bootstrap::barrier() {
  const uint8_t b = 0;
  (void)all_gather_v(&b, 1);
}

void Bootstrap::agree(bool ok, const std::string& why, const std::string& what) {
  std::string mine(1, ok ? '1' : '0');
  mine += why;
  const auto all = all_gather_v(mine.data(), mine.size());
  std::vector<std::string> failures;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty() && all[r][0] == '1') continue;
    const std::string reason = all[r].size() > 1 ? std::string(all[r].begin() + 1, all[r].end()) : "(no reason given)";
    failures.push_back(fmt::format("rank {}: {}", r, reason));
  }
  if (!failures.empty())
    throw Error(fmt::format("{} failed on {} of {} ranks (none uses it): {}", what, failures.size(), all.size(),
                            fmt::join(failures, "; ")));
}

std::unique_ptr<Bootstrap> Bootstrap::split(int32_t color, int32_t key) {
  Impl& m = *impl_;
  const int32_t seq = m.split_seq++;
  int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * m.cfg.world_size);
  all_gather(mine, sizeof(mine), all.data());
  if (color < 0) return nullptr;
  std::vector<std::pair<int32_t, int32_t>> members;  // (key, rank)
  for (int r = 0; r < m.cfg.world_size; ++r)
    if (all[2 * r] == color) members.emplace_back(all[2 * r + 1], r);
  std::sort(members.begin(), members.end());
  BootstrapConfig sub = m.cfg;
  sub.world_size = static_cast<int32_t>(members.size());
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].second == m.cfg.rank) sub.rank = static_cast<int32_t>(i);
  sub.token = fmt::format("{}/split{}/color{}", m.cfg.token, seq, color);
  sub.address = fmt::format("{}.s{}c{}", m.cfg.address, seq, color);
  sub.source = fmt::format("{} (split {} color {})", m.cfg.source, seq, color);
  // Every sub-group needs at least its own socket path; world-size-1 groups need none.
  return connect(sub);
}

void Bootstrap::abort(const std::string& why) noexcept {
  try {
    Impl& m = *impl_;
    const std::string msg = fmt::format("{} aborted: {}", m.who(m.cfg.rank), why);
    const Deadline dl = Clock::now() + std::chrono::milliseconds(200);
    if (m.is_root()) {
      for (int r = 1; r < m.cfg.world_size; ++r)
        if (m.conns[r]) send_frame(m.conns[r].get(), FrameType::kAbort, msg.data(), msg.size(), dl);
    } else if (!m.conns.empty() && m.conns[0]) {
      // Rank 0 forwards it, naming this rank, at its next gather.
      send_frame(m.conns[0].get(), FrameType::kAbort, why.data(), why.size(), dl);
    }
  } catch (...) {
  }
}

// ---- configuration from the environment -------------------------------------------------------------

namespace {

const char* env(const char* name) {
  const char* v = read_env(name);
  return (v && *v) ? v : nullptr;
}

constexpr int32_t kMaxEnvInt = 1 << 20;

int32_t env_int(const char* name, int32_t lo, int32_t hi = kMaxEnvInt) {
  const char* v = env(name);
  PCPKV_CHECK(v != nullptr, "bootstrap: environment variable {} is {}", name,
              read_env(name) ? "set but empty" : "not set");
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  PCPKV_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi,
              "bootstrap: {}='{}' is not an integer in [{}, {}]", name, clip(v), lo, hi);
  return static_cast<int32_t>(x);
}

// A launcher sets a rank's variables together; one set without the other is a broken launch, not a
// single-process run (which would silently do other work than the job asked for).
void check_set_together(const char* rank, const char* world, const std::vector<const char*>& others) {
  std::vector<const char*> all = {rank, world};
  all.insert(all.end(), others.begin(), others.end());
  for (const char* name : all) {
    if (!env(name)) continue;
    for (const char* needed : {rank, world}) {
      PCPKV_CHECK(env(needed) != nullptr,
                  "bootstrap: {}='{}' is set but {} is not; a launcher sets {} and {} together (unset {} for a "
                  "single-process run)",
                  name, clip(env(name)), needed, rank, world, name);
    }
  }
}

// pcpkv's rendezvous is single-host: every rank of the job is local, so the local values equal the global
// ones. Different values mean a multi-host job (its other hosts could never connect) or a broken launcher.
void check_local(const BootstrapConfig& c, const char* rank, const char* world, const char* local_rank,
                 const char* local_world) {
  PCPKV_CHECK(c.local_world_size == c.world_size,
              "bootstrap: {}={} differs from {}={}: the job spans more than this host, but pcpkv's rendezvous and "
              "symmetric memory are single-host",
              local_world, c.local_world_size, world, c.world_size);
  PCPKV_CHECK(c.local_rank == c.rank,
              "bootstrap: {}={} differs from {}={}: on one host every rank's local rank equals its rank", local_rank,
              c.local_rank, rank, c.rank);
}

// FNV-1a of this process's command line (/proc/self/cmdline): the ranks of one torchrun-style job run one
// command; two jobs on one MASTER_PORT (other seeds, other flags) run different ones.
std::pair<uint64_t, std::string> command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : raw) h = (h ^ ch) * 1099511628211ull;
  std::string text = raw;
  std::replace(text.begin(), text.end(), '\0', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return {h, text};
}

bool address_is_local(const std::string& addr) {
  if (addr == "localhost" || addr == "localhost.localdomain" || addr == "ip6-localhost") return true;
  in_addr a4{};
  in6_addr a6{};
  if (::inet_pton(AF_INET, addr.c_str(), &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127) return true;
  if (::inet_pton(AF_INET6, addr.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6)) return true;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) {
    const std::string h(host);
    if (addr == h || addr == h.substr(0, h.find('.'))) return true;
  }
  // One of this host's own interface addresses.
  ifaddrs* list = nullptr;
  bool found = false;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
      if (!i->ifa_addr) continue;
      char buf[INET6_ADDRSTRLEN] = {};
      if (i->ifa_addr->sa_family == AF_INET)
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      else if (i->ifa_addr->sa_family == AF_INET6)
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf, sizeof(buf));
      found = addr == buf;
    }
    ::freeifaddrs(list);
  }
  return found;
}

}  // namespace

std::optional<BootstrapConfig> bootstrap_config_from_env() {
  BootstrapConfig c;
  if (const char* t = env(kEnvTimeout)) {
    char* end = nullptr;
    c.timeout_s = std::strtod(t, &end);
    PCPKV_CHECK(end != t && *end == '\0' && c.timeout_s > 0, "bootstrap: {}='{}' is not a positive number of seconds",
                kEnvTimeout, clip(t));
  }
  const bool launched = env(kEnvRank) || env(kEnvWorldSize) || env(kEnvLocalRank) || env(kEnvLocalWorldSize);
  if (launched) {
    check_set_together(kEnvRank, kEnvWorldSize, {kEnvLocalRank, kEnvLocalWorldSize});
    c.world_size = env_int(kEnvWorldSize, 1);
    c.rank = env_int(kEnvRank, 0);
    c.local_world_size = env(kEnvLocalWorldSize) ? env_int(kEnvLocalWorldSize, 1) : c.world_size;
    c.local_rank = env(kEnvLocalRank) ? env_int(kEnvLocalRank, 0) : c.rank;
    const char* addr = env(kEnvBootstrap);
    const char* token = env(kEnvJobToken);
    PCPKV_CHECK(addr != nullptr, "bootstrap: {} is set but {} (the socket path) is not", kEnvRank, kEnvBootstrap);
    PCPKV_CHECK(token != nullptr, "bootstrap: {} is set but {} is not", kEnvRank, kEnvJobToken);
    c.address = addr;
    c.token = token;
    c.job = fmt::format("pcpkv launch (pid {})", ::getppid());
    c.source = "pcpkv launch";
    c.token_per_attempt = true;  // a fresh token per launch (a retry is another launch)
    PCPKV_CHECK(c.rank < c.world_size, "bootstrap: {}={} must be < {}={}", kEnvRank, c.rank, kEnvWorldSize,
                c.world_size);
    check_local(c, kEnvRank, kEnvWorldSize, kEnvLocalRank, kEnvLocalWorldSize);
    return c;
  }
  if (!(env("RANK") || env("WORLD_SIZE") || env("LOCAL_RANK") || env("LOCAL_WORLD_SIZE"))) return std::nullopt;
  check_set_together("RANK", "WORLD_SIZE", {"LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  c.world_size = env_int("WORLD_SIZE", 1);
  c.rank = env_int("RANK", 0);
  c.local_world_size = env("LOCAL_WORLD_SIZE") ? env_int("LOCAL_WORLD_SIZE", 1) : c.world_size;
  c.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", 0) : c.rank;
  PCPKV_CHECK(c.rank < c.world_size, "bootstrap: RANK={} must be < WORLD_SIZE={}", c.rank, c.world_size);
  check_local(c, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  const char* master = env("MASTER_ADDR");
  const std::string master_addr = master ? master : "127.0.0.1";
  // A switch: "yes" or "true" is refused by name rather than read as off (and then as "not this host").
  const bool allow = read_env_switch(kEnvAllowNonlocal);
  PCPKV_CHECK(allow || address_is_local(master_addr),
              "bootstrap: MASTER_ADDR='{}' is not this host; pcpkv's rendezvous and symmetric memory are "
              "single-host (a Unix-domain socket and file-descriptor passing); run the ranks of one host "
              "together, or set {}=1 if '{}' is this host under another name",
              clip(master_addr), kEnvAllowNonlocal, clip(master_addr));
  const int32_t port = env_int("MASTER_PORT", 1, 65535);
  const char* dir = env("PCPKV_BOOTSTRAP_DIR");
  if (!dir) dir = env("TMPDIR");
  c.address = fmt::format("{}/pcpkv-{}/port{}.sock", dir ? dir : "/tmp", ::geteuid(), port);
  // The job's identity: an explicit one, else the run id and the command line. torchrun's default run id
  // is "none" for every job, so it alone cannot tell two jobs apart.
  const char* run_id = env("TORCHELASTIC_RUN_ID");
  if (run_id && std::string(run_id) == "none") run_id = nullptr;
  const auto [cmd_hash, cmd] = command_line();
  if (const char* t = env(kEnvJobToken)) {
    c.token = t;
    c.job = fmt::format("MASTER_PORT {}, {}", port, kEnvJobToken);
  } else if (const char* id = env(kEnvJobId)) {
    c.token = fmt::format("job:{}", id);
    c.job = fmt::format("MASTER_PORT {}, {}={}", port, kEnvJobId, clip(id, 64));
  } else {
    c.token = fmt::format("{}/cmd:{:016x}", run_id ? fmt::format("torchelastic:{}", run_id) : fmt::format("port:{}", port),
                          cmd_hash);
    c.job = fmt::format("MASTER_PORT {}{}, command '{}'", port,
                        run_id ? fmt::format(", TORCHELASTIC_RUN_ID={}", clip(run_id, 64)) : std::string(),
                        clip(cmd, 120));
  }
  c.source = "torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)";
  return c;
}

std::string make_job_token() {
  uint8_t bytes[16] = {};
  UniqueFd f(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  PCPKV_CHECK(f, "bootstrap: cannot open /dev/urandom: {}", std::strerror(errno));
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::read(f.get(), bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    PCPKV_CHECK(n > 0, "bootstrap: reading /dev/urandom failed: {}", std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  std::string hex;
  for (uint8_t b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace pcpkv
