// Starts and watches the rank processes of one local job (see pcpkv/ranks/launch.h).
#include "pcpkv/ranks/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "core/fatal_signals.h"
#include "ranks/fd_limit.h"

extern char** environ;

namespace pcpkv {
namespace {

using Clock = std::chrono::steady_clock;

// Signals that stop the job: SIGINT and SIGTERM end the launch with the ranks' exit code (they are stopped);
// the others whose default action ends a process (a lost terminal, SIGQUIT, SIGUSR1/2, SIGALRM, SIGPWR, SIGIO, a
// real-time signal, ...) would have ended the launcher at once, leaving its directory and the ranks behind: they
// stop the ranks too, and once the directory is gone the launcher ends by the same signal (its default action), as
// it would have without pcpkv. Not the launcher's own faults (a handler that returns would re-run them), nor
// SIGPIPE, which it ignores while it runs.
bool is_stop_signal(int sig) {
  return signals::default_action_ends_process(sig) && !signals::is_fault_signal(sig) && sig != SIGPIPE;
}
std::atomic<int> g_signals{0};  // stop signals received by the launcher
std::atomic<int> g_reraise{0};  // the first of them other than SIGINT / SIGTERM, raised again at the end
void on_signal(int sig) {
  if (sig != SIGINT && sig != SIGTERM) {
    int none = 0;
    g_reraise.compare_exchange_strong(none, sig);
  }
  g_signals.fetch_add(1);
}

// Installs on_signal for the stop signals (one not ignored: `nohup pcpkv launch` keeps ignoring SIGHUP) and
// SIG_IGN for SIGPIPE while the launch runs; restores the previous actions when it ends, however it ends.
class SignalScope {
 public:
  SignalScope() {
    g_signals = 0;
    g_reraise = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig = 1; sig < _NSIG; ++sig) {
      hooked_[sig] = false;
      if (!is_stop_signal(sig) || ::sigaction(sig, nullptr, &old_[sig]) != 0) continue;
      if (old_[sig].sa_handler != SIG_IGN) hooked_[sig] = ::sigaction(sig, &sa, nullptr) == 0;
    }
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  ~SignalScope() {
    for (int sig = 1; sig < _NSIG; ++sig)
      if (hooked_[sig]) ::sigaction(sig, &old_[sig], nullptr);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction old_[_NSIG] {};
  bool hooked_[_NSIG] {};
  struct sigaction old_pipe_ {};
};

// The ranks' relayed stdout and the first error writing to it (ENOSPC, EPIPE): a report that never reached stdout
// must not pass for success (the launch exited 0 with its stdout on /dev/full). One launch at a time per process.
int g_relay_out_fd = -1;
int g_relay_out_errno = 0;

void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (fd == g_relay_out_fd && g_relay_out_errno == 0) g_relay_out_errno = n < 0 ? errno : EIO;
      return;
    }
    done += static_cast<size_t>(n);
  }
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

// One relayed output stream of one rank.
struct Stream {
  int fd = -1;          // read end (parent), -1 when closed or not relayed
  int32_t rank = 0;
  int dest_fd = 1;
  bool drop = false;    // read and discard (rank0 mode: other ranks' stdout)
  bool prefix = true;
  std::string partial;  // an unfinished line
};

void relay(Stream& s, bool flush_partial) {
  char buf[65536];
  for (;;) {
    const ssize_t n = s.fd >= 0 ? ::read(s.fd, buf, sizeof(buf)) : 0;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {  // EOF or error: the rank closed the stream
      if (s.fd >= 0) ::close(s.fd);
      s.fd = -1;
      flush_partial = true;
      break;
    }
    if (s.drop) continue;
    s.partial.append(buf, static_cast<size_t>(n));
    std::string out;
    size_t start = 0;
    for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
      if (s.prefix) out += fmt::format("[rank {}] ", s.rank);
      out.append(s.partial, start, nl + 1 - start);
    }
    s.partial.erase(0, start);
    write_all(s.dest_fd, out);
  }
  if (flush_partial && !s.partial.empty() && !s.drop) {
    write_all(s.dest_fd, (s.prefix ? fmt::format("[rank {}] ", s.rank) : std::string()) + s.partial + "\n");
    s.partial.clear();
  }
}

constexpr const char* kLaunchDirPrefix = "pcpkv-launch-";
constexpr const char* kOwnerFile = "launcher.pid";

// Private directories of launchers that died without cleaning up (kill -9): owned by this user, with an
// owner file naming a pid that no longer exists. A directory without the file (another launcher between
// mkdtemp and writing it) or of a live pid is left alone.
void remove_stale_launch_dirs(const std::string& parent) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kLaunchDirPrefix, 0) != 0) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    std::ifstream f(it->path() / kOwnerFile);
    long pid = 0;
    if (!(f >> pid) || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    fs::remove_all(it->path(), rm);
  }
}

}  // namespace

LaunchOutput parse_launch_output(const std::string& s) {
  if (s == "prefix") return LaunchOutput::kPrefix;
  if (s == "rank0") return LaunchOutput::kRank0;
  if (s == "raw") return LaunchOutput::kRaw;
  PCPKV_FAIL("--output: unknown value '{}'; known: prefix, rank0, raw", clip(s));
}

int32_t pick_device_round_robin(int32_t local_rank, int32_t num_visible_devices) {
  PCPKV_CHECK(num_visible_devices >= 1, "no GPU is visible to rank (local rank {})", local_rank);
  if (const char* v = read_env("PCPKV_DEVICE"); v && *v) {
    char* end = nullptr;
    const long d = std::strtol(v, &end, 10);
    PCPKV_CHECK(end != v && *end == '\0' && d >= 0 && d < num_visible_devices,
                "PCPKV_DEVICE='{}' is not a device index in [0, {})", clip(v), num_visible_devices);
    return static_cast<int32_t>(d);
  }
  return local_rank % num_visible_devices;
}

LaunchResult launch_ranks(const LaunchOptions& opts, int out_fd, int err_fd) {
  PCPKV_CHECK(opts.nproc >= 1 && opts.nproc <= 1024, "--nproc must be in [1, 1024], got {}", opts.nproc);
  PCPKV_CHECK(!opts.argv.empty() && !opts.argv[0].empty(),
              "launch: no command given; usage: pcpkv launch --nproc N -- <pcpkv subcommand> [args]");
  PCPKV_CHECK(::access(opts.argv[0].c_str(), X_OK) == 0, "launch: '{}' is not an executable file: {}", clip(opts.argv[0]),
              std::strerror(errno));
  PCPKV_CHECK(opts.bootstrap_timeout_s > 0, "--timeout must be > 0, got {}", opts.bootstrap_timeout_s);
  PCPKV_CHECK(opts.grace_s >= 0, "--grace must be >= 0, got {}", opts.grace_s);
  // nan and -1 meant "no limit" silently (the test is max_time_s > 0); 0 is the one spelling of that.
  PCPKV_CHECK(opts.max_time_s >= 0, "--max-time must be >= 0 seconds (0: no limit), got {}", opts.max_time_s);
  g_relay_out_fd = out_fd;
  g_relay_out_errno = 0;

  // Private rendezvous directory and job token.
  std::string parent = opts.socket_dir;
  if (parent.empty()) {
    const char* t = std::getenv("TMPDIR");
    parent = (t && *t) ? t : "/tmp";
  }
  // Checked before any rank starts (each rank would otherwise fail on its own): the socket path must fit
  // sun_path. (A rank's Bootstrap::split adds ".s<seq>c<color>" and checks that longer name itself.)
  constexpr size_t kSunPathMax = sizeof(sockaddr_un{}.sun_path) - 1;
  const std::string socket_rel = std::string("/") + kLaunchDirPrefix + "XXXXXX/rendezvous.sock";
  const size_t socket_len = parent.size() + socket_rel.size();
  PCPKV_CHECK(socket_len <= kSunPathMax,
              "{}: '{}' is too long ({} bytes): the rendezvous socket '<dir>{}' in it would be {} bytes, and a "
              "Unix socket path holds at most {}; give a directory of at most {} bytes",
              opts.socket_dir.empty() ? "TMPDIR (the default of --socket-dir)" : "--socket-dir", clip(parent),
              parent.size(), socket_rel, socket_len, kSunPathMax, kSunPathMax - socket_rel.size());
  // The launcher keeps the read ends of two pipes per relayed rank: a job that cannot fit under the open-file limit
  // (raised to the hard limit first; the ranks inherit it) says so before anything starts.
  if (opts.output != LaunchOutput::kRaw) {
    const int64_t need = fd_limit::open_now() + 2 * int64_t{opts.nproc} + 16;
    if (const std::string why = fd_limit::fit(need); !why.empty())
      throw std::system_error(EMFILE, std::generic_category(),
                              fmt::format("launch --nproc {}: relaying the ranks' output needs about {} open files, "
                                          "but {}: raise the hard limit (ulimit -Hn) or give --output raw",
                                          opts.nproc, need, why));
  }
  remove_stale_launch_dirs(parent);
  // Before the directory exists: a signal from here on stops the ranks and removes it (every stop signal).
  std::optional<SignalScope> signals;
  signals.emplace();
  std::string tmpl = parent + "/" + kLaunchDirPrefix + "XXXXXX";
  PCPKV_CHECK(::mkdtemp(tmpl.data()) != nullptr, "launch: cannot create a private directory in '{}': {}", parent,
              std::strerror(errno));
  const std::string dir = tmpl;
  {
    std::ofstream owner(dir + "/" + kOwnerFile);
    owner << ::getpid() << "\n";
  }
  struct DirRemover {
    std::string path;
    void remove_now() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
      path.clear();
    }
    ~DirRemover() { remove_now(); }
  } remover{dir};
  const std::string socket_path = dir + "/rendezvous.sock";
  const std::string token = make_job_token();

  // Environment of every rank: ours, minus variables we set, plus the job's.
  std::vector<std::string> base_env;
  const std::vector<std::string> ours = {kEnvRank,     kEnvWorldSize, kEnvLocalRank, kEnvLocalWorldSize,
                                         kEnvBootstrap, kEnvJobToken, kEnvTimeout,   "PCPKV_DEVICE"};
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (std::find(ours.begin(), ours.end(), key) == ours.end()) base_env.push_back(kv);
  }
  for (const auto& [k, v] : opts.extra_env) base_env.push_back(k + "=" + v);

  const int n = opts.nproc;
  LaunchResult result;
  result.ranks.resize(static_cast<size_t>(n));
  std::vector<Stream> streams;
  std::vector<pid_t> pids(static_cast<size_t>(n), -1);
  const pid_t launcher_pid = ::getpid();
  const auto t0 = Clock::now();

  // The system refused a pipe or a process part-way (EMFILE, EAGAIN): the ranks started so far are killed and
  // reaped and their pipes closed (which gives back the descriptors remove_all needs), then the directory goes.
  // Not bad input: std::system_error (exit code 3 in the CLI).
  int in_flight[4] = {-1, -1, -1, -1};
  auto give_up = [&](const char* what) {
    const int err = errno;
    for (int fd : in_flight)
      if (fd >= 0) ::close(fd);
    for (Stream& s : streams)
      if (s.fd >= 0) ::close(s.fd);
    streams.clear();
    for (pid_t& pid : pids)
      if (pid > 0) ::kill(pid, SIGKILL);
    for (pid_t& pid : pids)
      if (pid > 0) ::waitpid(pid, nullptr, 0);
    remover.remove_now();
    const auto started = std::count_if(pids.begin(), pids.end(), [](pid_t p) { return p > 0; });
    throw std::system_error(err, std::generic_category(),
                            fmt::format("launch: {} failed after starting {} of {} rank(s) (they were stopped; is the "
                                        "descriptor or process limit too low? ulimit -n, ulimit -u)",
                                        what, started, n));
  };

  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env = base_env;
    env.push_back(fmt::format("{}={}", kEnvRank, r));
    env.push_back(fmt::format("{}={}", kEnvWorldSize, n));
    env.push_back(fmt::format("{}={}", kEnvLocalRank, r));
    env.push_back(fmt::format("{}={}", kEnvLocalWorldSize, n));
    env.push_back(fmt::format("{}={}", kEnvBootstrap, socket_path));
    env.push_back(fmt::format("{}={}", kEnvJobToken, token));
    env.push_back(fmt::format("{}={}", kEnvTimeout, opts.bootstrap_timeout_s));
    if (!opts.gpus.empty())
      env.push_back(fmt::format("PCPKV_DEVICE={}", opts.gpus[static_cast<size_t>(r) % opts.gpus.size()]));
    std::vector<char*> envp, argv;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = opts.argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);

    // Pipes for the streams we relay: [0] stdout, [1] stderr.
    int pipes[2][2] = {{-1, -1}, {-1, -1}};
    const bool relay_out = opts.output == LaunchOutput::kPrefix || (opts.output == LaunchOutput::kRank0 && r != 0);
    const bool relay_err = relay_out;
    for (int k = 0; k < 2; ++k)
      if (k == 0 ? relay_out : relay_err) {
        if (::pipe2(pipes[k], O_CLOEXEC) != 0) give_up("pipe");
        in_flight[2 * k] = pipes[k][0];
        in_flight[2 * k + 1] = pipes[k][1];
      }

    const pid_t pid = ::fork();
    if (pid < 0) give_up("fork");
    if (pid == 0) {
      // Child: die with the launcher; default signal handling; stdout/stderr into the pipes.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher_pid) ::_exit(126);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      if (pipes[0][1] >= 0) ::dup2(pipes[0][1], 1);
      if (pipes[1][1] >= 0) ::dup2(pipes[1][1], 2);
      ::execve(argv[0], argv.data(), envp.data());
      const std::string msg = fmt::format("pcpkv launch: rank {}: cannot execute '{}': {}\n", r, args[0],
                                          std::strerror(errno));
      write_all(2, msg);
      ::_exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
    result.ranks[static_cast<size_t>(r)].rank = r;
    result.ranks[static_cast<size_t>(r)].pid = pid;
    for (int k = 0; k < 2; ++k) {
      if (pipes[k][0] < 0) continue;
      ::close(pipes[k][1]);
      ::fcntl(pipes[k][0], F_SETFL, ::fcntl(pipes[k][0], F_GETFL) | O_NONBLOCK);
      Stream s;
      s.fd = pipes[k][0];
      s.rank = r;
      s.dest_fd = k == 0 ? out_fd : err_fd;
      s.drop = opts.output == LaunchOutput::kRank0 && k == 0;
      s.prefix = true;
      streams.push_back(std::move(s));
    }
    std::fill(std::begin(in_flight), std::end(in_flight), -1);
  }

  int running = n;
  int first_failed = -1;  // the first rank reported failed (the exit code's rank), -1 while none has
  Clock::time_point first_failure{};
  bool sent_term = false, sent_kill = false;
  Clock::time_point term_time{};
  int signals_seen = 0;

  auto stop_all = [&](int sig) {
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<size_t>(r)] > 0) {
        ::kill(pids[static_cast<size_t>(r)], sig);
        result.ranks[static_cast<size_t>(r)].stopped_by_launcher = true;
      }
  };

  while (running > 0 || std::any_of(streams.begin(), streams.end(), [](const Stream& s) { return s.fd >= 0; })) {
    std::vector<pollfd> pfds;
    std::vector<size_t> idx;
    for (size_t i = 0; i < streams.size(); ++i)
      if (streams[i].fd >= 0) {
        pfds.push_back({streams[i].fd, POLLIN, 0});
        idx.push_back(i);
      }
    if (!pfds.empty())
      ::poll(pfds.data(), pfds.size(), 50);
    else
      ::usleep(20000);
    for (size_t i = 0; i < pfds.size(); ++i)
      if (pfds[i].revents) relay(streams[idx[i]], false);

    // Reap every rank that ended since the last sweep, then report them. Ranks found in one sweep ended within
    // one poll interval of each other, in an order waitpid cannot tell; the ones a signal ended (not by the
    // launcher) come first: the others exited or were stopped because of it (a rank that exits with 4 because a
    // peer is gone cannot have ended before that peer). That order decides the first failure below.
    std::vector<int> ended;
    for (int r = 0; r < n; ++r) {
      pid_t& pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) != pid) continue;
      RankExit& e = result.ranks[static_cast<size_t>(r)];
      e.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      e.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      pid = -1;
      --running;
      ended.push_back(r);
    }
    const auto cause_rank = [&](int r) {  // 0: killed by a signal (a crash, a kill), 1: exited, 2: stopped by us
      const RankExit& e = result.ranks[static_cast<size_t>(r)];
      return e.stopped_by_launcher ? 2 : e.signal != 0 ? 0 : 1;
    };
    std::stable_sort(ended.begin(), ended.end(), [&](int a, int b) { return cause_rank(a) < cause_rank(b); });
    for (int r : ended) {
      RankExit& e = result.ranks[static_cast<size_t>(r)];
      if (!e.ok()) {
        // Flush what the rank printed before saying it failed.
        for (Stream& s : streams)
          if (s.rank == r) relay(s, true);
        const std::string what =
            e.signal ? fmt::format("was killed by signal {} ({})", e.signal, signal_name(e.signal))
                     : fmt::format("exited with code {}", e.exit_code);
        const std::string why_stopped =
            !e.stopped_by_launcher ? std::string()
            : first_failed >= 0    ? fmt::format(" (terminated by the launcher because rank {} failed first)",
                                                 first_failed)
                                   : std::string(" (stopped by the launcher)");
        write_all(err_fd, fmt::format("pcpkv launch: rank {} (pid {}) {} after {:.1f} s{}\n", r, e.pid, what,
                                      e.seconds, why_stopped));
        if (first_failed < 0) {
          first_failed = r;
          first_failure = Clock::now();
          if (running > 0)
            write_all(err_fd, fmt::format("pcpkv launch: rank {} failed first ({}); the other {} rank(s) get {:g} s "
                                          "to notice and exit, then SIGTERM\n",
                                          r, e.signal ? signal_name(e.signal) : fmt::format("exit code {}",
                                                                                            e.exit_code),
                                          running, opts.grace_s));
        }
      }
    }
    if (running == 0) continue;  // drain the pipes

    const auto now = Clock::now();
    const int sigs = g_signals.load();
    if (sigs > signals_seen) {
      signals_seen = sigs;
      write_all(err_fd, fmt::format("pcpkv launch: interrupted; stopping {} rank(s)\n", running));
      stop_all(sigs > 1 ? SIGKILL : SIGTERM);
      if (!sent_term) {
        sent_term = true;
        term_time = now;
      }
    }
    const bool grace_over = first_failed >= 0 && now - first_failure > std::chrono::duration<double>(opts.grace_s);
    const bool time_over = opts.max_time_s > 0 && now - t0 > std::chrono::duration<double>(opts.max_time_s);
    if (!sent_term && (grace_over || time_over)) {
      write_all(err_fd, fmt::format("pcpkv launch: {}; sending SIGTERM to {} rank(s) still running\n",
                                    time_over ? fmt::format("--max-time {} s is over", opts.max_time_s)
                                              : fmt::format("rank {} failed and --grace {} s is over", first_failed,
                                                            opts.grace_s),
                                    running));
      stop_all(SIGTERM);
      sent_term = true;
      term_time = now;
    }
    if (sent_term && !sent_kill && now - term_time > std::chrono::seconds(5)) {
      stop_all(SIGKILL);
      sent_kill = true;
    }
  }
  for (Stream& s : streams) relay(s, true);

  if (const int sig = g_reraise.load(); sig != 0) {
    // Ranks stopped: remove the directory, then end as that signal would have ended the launcher.
    remover.remove_now();
    signals.reset();
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  remover.remove_now();  // before the handlers go: a signal from now on meets no directory to leave
  signals.reset();

  // Exit code: the first failed rank, in the order reported (by time, and within one sweep the signal deaths).
  const RankExit* first = first_failed >= 0 ? &result.ranks[static_cast<size_t>(first_failed)] : nullptr;
  int num_failed = 0;
  for (const RankExit& e : result.ranks) {
    if (e.ok()) continue;
    ++num_failed;
    result.summary += fmt::format("rank {} (pid {}): {}\n", e.rank, e.pid,
                                  e.signal ? fmt::format("killed by {}", signal_name(e.signal))
                                           : fmt::format("exit code {}", e.exit_code));
  }
  if (first) {
    result.exit_code = first->signal ? 128 + first->signal : first->exit_code;
    if (result.exit_code == 0) result.exit_code = 1;
    write_all(err_fd, fmt::format("pcpkv launch: {} of {} rank(s) failed; the first was rank {}\n", num_failed, n,
                                  first->rank));
  } else if (g_relay_out_errno != 0) {
    write_all(err_fd, fmt::format("pcpkv: error: launch: cannot write the ranks' output to stdout: {}\n",
                                  std::strerror(g_relay_out_errno)));
    result.exit_code = 3;  // as any command whose report never reached stdout
  }
  g_relay_out_fd = -1;
  return result;
}

}  // namespace pcpkv
