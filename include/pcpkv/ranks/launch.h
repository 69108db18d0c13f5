// pcpkv/ranks/launch.h: start N local rank processes of one job and watch them (`pcpkv launch`).
//
// The launcher makes a private directory (mode 0700) for the rendezvous socket and a fresh job token,
// starts every rank with the environment of pcpkv/ranks/bootstrap.h (PCPKV_RANK, PCPKV_WORLD_SIZE,
// PCPKV_LOCAL_RANK, PCPKV_LOCAL_WORLD_SIZE, PCPKV_BOOTSTRAP, PCPKV_JOB_TOKEN, PCPKV_BOOTSTRAP_TIMEOUT_S and,
// with a GPU list, PCPKV_DEVICE), relays their output, and reports every rank that fails: its exit code or
// the signal that killed it. It never touches CUDA (ranks must initialize CUDA themselves, after the fork).
// When a rank fails, the others are expected to notice (a fence or a bootstrap collective names the
// missing rank) and exit on their own; those still running grace_s after the first failure get SIGTERM, then
// SIGKILL 5 s later (as torchrun stops a job's workers), and are reported as terminated because of that rank.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace pcpkv {

enum class LaunchOutput : uint8_t {
  kPrefix,  // every line of every rank, prefixed "[rank k] " (stdout to stdout, stderr to stderr)
  kRank0,   // rank 0's output as is; the other ranks' stderr prefixed, their stdout dropped
  kRaw,     // every rank writes straight to the launcher's stdout / stderr
};
/// "prefix" | "rank0" | "raw"; throws pcpkv::Error naming the flag and value otherwise.
LaunchOutput parse_launch_output(const std::string& s);

struct LaunchOptions {
  int32_t nproc = 1;                       // ranks to start, >= 1
  std::vector<std::string> argv;           // program and its arguments; argv[0] is an executable path
  double bootstrap_timeout_s = 60.0;       // PCPKV_BOOTSTRAP_TIMEOUT_S of every rank
  double grace_s = 2.0;                    // after the first failure, how long the others may take to exit (a
                                           // peer that notices exits in ms; one stuck in its rendezvous would
                                           // wait its whole timeout)
  double max_time_s = 0.0;                 // > 0: the whole job is stopped (and fails) after this long
  LaunchOutput output = LaunchOutput::kPrefix;
  std::vector<int32_t> gpus;               // non-empty: rank with local rank l gets PCPKV_DEVICE=gpus[l % n]
  std::string socket_dir;                  // where the private directory goes (default $TMPDIR, else /tmp);
                                           // refused when the socket path inside would not fit sun_path
  std::vector<std::pair<std::string, std::string>> extra_env;  // set for every rank
};

struct RankExit {
  int32_t rank = 0;
  int64_t pid = 0;
  int exit_code = -1;   // exit status, -1 when a signal ended it
  int signal = 0;       // the signal that ended it, 0 when it exited
  bool stopped_by_launcher = false;  // SIGTERM/SIGKILL sent by the launcher after the grace period
  double seconds = 0;   // from the launch to its end
  bool ok() const { return exit_code == 0; }
};

struct LaunchResult {
  std::vector<RankExit> ranks;  // [nproc]
  /// 0 when every rank exited 0; else the first failed rank's exit code, or 128 + signal when it was killed.
  /// First: in the order the launcher found them ended; among ranks found in one poll, a signal death (not the
  /// launcher's own SIGTERM / SIGKILL) before an exit, before a rank the launcher stopped.
  int exit_code = 0;
  std::string summary;          // one line per failed rank, empty when all succeeded
};

/// Starts opts.nproc processes of opts.argv and waits for all of them. Writes the ranks' output and the
/// launcher's own messages ("pcpkv launch: rank 2 (pid 4711) was killed by signal 9 (SIGKILL) after 1.3 s")
/// to out_fd / err_fd. Throws pcpkv::Error for bad options (nproc < 1, empty argv, a program that does not
/// exist, a socket_dir too long for a Unix socket path) before starting anything. The private directory
/// holds a launcher.pid file; directories of launchers that died without cleaning up (kill -9: this user's,
/// their pid gone) are removed by the next launch in the same parent directory.
LaunchResult launch_ranks(const LaunchOptions& opts, int out_fd = 1, int err_fd = 2);

/// Device index for this rank: PCPKV_DEVICE when set, else local_rank % num_visible_devices (round-robin:
/// several ranks share a GPU when there are fewer GPUs than ranks). Throws when num_visible_devices < 1 or
/// PCPKV_DEVICE is malformed or out of range.
int32_t pick_device_round_robin(int32_t local_rank, int32_t num_visible_devices);

}  // namespace pcpkv
