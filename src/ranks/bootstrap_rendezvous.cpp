// The rendezvous (see pcpkv/ranks/bootstrap.h): rank 0 listens and accepts every rank of its job, checking each
// peer's user, token, world size and rank; the others connect, say hello and wait for rank 0's welcome. A rank 0
// that gives up leaves its reason in a tombstone (ranks/tombstone.h) for ranks that have not connected yet.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/interrupt.h"
#include "ranks/bootstrap_impl.h"
#include "ranks/bootstrap_socket.h"
#include "ranks/fd_limit.h"
#include "ranks/tombstone.h"

namespace pcpkv {

using namespace bootstrap_wire;
using namespace bootstrap_socket;

namespace {

constexpr uint32_t kProtocolVersion = 2;  // 2: the hello names the job (job_bytes)

// How long rank 0 still waits for rank r after refusing a peer of another job token that claimed rank r (see
// RefusedClaim in rendezvous_root): long enough for another job's ranks started alongside this one's.
constexpr double kRefusedClaimGraceS = 5.0;

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

}  // namespace

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
  // A timeout within the grace ends the wait first anyway, with the message of a timeout.
  const bool timeout_beyond_grace = cfg.timeout_s > kRefusedClaimGraceS;

  // A peer refused for a wrong token that claims a rank of this world still missing: another job's rank on this
  // port (the reason for the token check: TwoTorchrunJobsOnOnePortNeverMeet) or this job's own rank started with
  // other flags (torchrun-style ranks without PCPKV_JOB_ID hash their command line into the token). Rank 0 cannot
  // tell them apart, so it waits kRefusedClaimGraceS more for the right rank: another job's peer comes alongside
  // this job's own rank, which then connects; when no rank of that number follows, the refused process was the
  // only one there is, and waiting out the whole timeout would only delay naming it. A refused peer of another
  // world size or of a rank already connected cannot be this job's and changes nothing.
  struct RefusedClaim {
    int32_t rank;
    int64_t pid;
    std::string job;
    Clock::time_point at;
  };
  std::vector<RefusedClaim> claims;
  auto give_up_on_claims = [&]() {
    for (const RefusedClaim& c : claims) {
      if (conns[c.rank] || Clock::now() - c.at < std::chrono::duration<double>(kRefusedClaimGraceS)) continue;
      fail_job(fmt::format("rendezvous failed at rank 0 ('{}'): rank {} of world size {} never connected, but pid {} "
                           "claiming rank {} was refused {:g} s ago for a wrong job token: it belongs to {}, this "
                           "rank 0 to {}. Ranks started with other flags or environment get another job token: start "
                           "every rank with the same command line, or give them one PCPKV_JOB_ID (ranks that then "
                           "disagree are named by the flag)",
                           cfg.address, c.rank, world, c.pid, c.rank, kRefusedClaimGraceS, job_name(c.job),
                           job_name(cfg.job)));
    }
  };

  auto reject = [&](int fd, const std::string& why) {
    send_frame(fd, FrameType::kReject, why.data(), why.size(), Clock::now() + std::chrono::milliseconds(200));
  };

  while (accepted < world - 1) {
    std::vector<pollfd> pfds{{listener.get(), POLLIN, 0}};
    for (auto& p : pending) pfds.push_back({p.fd.get(), POLLIN, 0});
    const int left = ms_left(dl);
    const int n = ::poll(pfds.data(), pfds.size(), std::min(left, kInterruptPollMs));
    give_up_on_claims();
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
        if (h.world_size == world && h.rank > 0 && h.rank < world && !conns[h.rank] && timeout_beyond_grace)
          claims.push_back({h.rank, h.pid, peer_job, Clock::now()});
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
        // the listener readable, so waiting on would spin past the timeout. The listener goes first: its descriptor
        // is the one the tombstone needs, and the ranks queued behind it see their connection closed and read it.
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
  // however soon after this process's start it was written (the start time has a 10 ms tick: judged by time alone,
  // a tombstone within it reads as an earlier attempt's and the reason is lost).
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
