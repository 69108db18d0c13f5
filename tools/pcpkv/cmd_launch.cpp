// `pcpkv launch --nproc N -- <pcpkv subcommand> [args]`: start N local rank processes of one job; it
// also registers the rank-side subcommands (launch_cmds.h; their shared pieces: rank_command.cpp).
//
// Exit code: 0 when every rank exited 0; otherwise that of the first rank that failed (128 + signal when a
// signal killed it).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits.h>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "error_line.h"
#include "launch_cmds.h"
#include "list_flags.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/ranks/launch.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {

namespace {

std::string self_exe() {
  char buf[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  PCPKV_CHECK(n > 0, "launch: cannot find this executable (/proc/self/exe): {}", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

struct LaunchFlags {
  int32_t nproc = 0;
  double timeout_s = 60.0;
  double grace_s = 2.0;  // LaunchOptions::grace_s
  double max_time_s = 0.0;
  std::string output = "prefix";
  std::string gpus;
  std::string program;
  std::string socket_dir;
  std::vector<std::string> command;
};

// Only the rank programs make sense under launch: another subcommand (run, info, attention, ...) would
// just run N times side by side, and a nested launch would start N separate jobs of M ranks each.
void check_rank_program(const std::string& command, int32_t nproc) {
  std::string names;
  for (const char* p : kRankPrograms) {
    if (command == p) return;
    names += (names.empty() ? "" : ", ") + std::string(p);
  }
  PCPKV_CHECK(command != "launch",
              "launch --nproc {} -- launch: a nested launch is refused: each of the {} ranks would start its own "
              "separate job; give one launch with the total --nproc. The rank programs are: {}",
              nproc, nproc, names);
  PCPKV_FAIL("launch --nproc {} -- {}: '{}' is not a rank program: it would only run {} times side by side, each "
             "alone. The rank programs are: {} (--program starts another executable)",
             nproc, clip(command), clip(command), nproc, names);
}

// The ranks' command line asks for the CPU backend (--backend cpu or --backend=cpu; the last one counts).
bool ranks_use_cpu_backend(const std::vector<std::string>& cmd) {
  std::string backend;
  for (size_t i = 0; i < cmd.size(); ++i) {
    if (cmd[i] == "--backend" && i + 1 < cmd.size()) backend = cmd[i + 1];
    if (cmd[i].rfind("--backend=", 0) == 0) backend = cmd[i].substr(10);
  }
  return backend == "cpu";
}

}  // namespace

void add_launch_command(CLI::App& app) {
  auto f = std::make_shared<LaunchFlags>();
  CLI::App* sub = app.add_subcommand(
      "launch",
      "Start N local rank processes of one job: pcpkv launch --nproc N -- <pcpkv subcommand> [args]. Each rank "
      "gets PCPKV_RANK, PCPKV_WORLD_SIZE, PCPKV_LOCAL_RANK, PCPKV_BOOTSTRAP (a private Unix socket) and a "
      "per-job PCPKV_JOB_TOKEN; GPUs go round-robin (local rank % visible GPUs), so N ranks may share one GPU.");
  sub->add_option("--nproc,-n", f->nproc, "Rank processes to start (>= 1)")->required();
  sub->add_option("--timeout", f->timeout_s, "Rendezvous and collective timeout of every rank, seconds")
      ->capture_default_str();
  sub->add_option("--grace", f->grace_s,
                  "After a rank fails, seconds the others get to report it and exit before SIGTERM (SIGKILL 5 s later)")
      ->capture_default_str();
  sub->add_option("--max-time", f->max_time_s, "Stop the whole job after this many seconds (0: no limit)")
      ->capture_default_str();
  sub->add_option("--output", f->output,
                  "prefix: every line as '[rank k] ...'; rank0: rank 0 as is, others' stderr prefixed; raw")
      ->capture_default_str();
  CLI::Option* gpus = sub->add_option("--gpus", f->gpus, "Comma list of device indices, assigned round-robin "
                                                         "(default: local rank % visible GPUs, chosen by each rank)");
  sub->add_option("--program", f->program,
                  "Executable to start instead of this pcpkv (its arguments follow --)");
  sub->add_option("--socket-dir", f->socket_dir, "Directory for the private rendezvous directory (default $TMPDIR "
                                                 "or /tmp)");
  // Everything after -- is the ranks' command line (options included).
  sub->add_option("command", f->command, "The ranks' command after --: a pcpkv subcommand and its flags")
      ->expected(-1);
  sub->callback([f, gpus] {
    std::vector<std::string> cmd = f->command;
    PCPKV_CHECK(!cmd.empty(),
                "launch: no command; usage: pcpkv launch --nproc N -- <pcpkv subcommand> [args], e.g. pcpkv launch "
                "--nproc 4 -- mp-publish --backend cpu");
    if (f->program.empty()) check_rank_program(cmd.front(), f->nproc);
    LaunchOptions o;
    o.nproc = f->nproc;
    o.bootstrap_timeout_s = f->timeout_s;
    o.grace_s = f->grace_s;
    o.max_time_s = f->max_time_s;
    o.output = parse_launch_output(f->output);
    o.socket_dir = f->socket_dir;
    o.gpus = parse_device_list(f->gpus, "--gpus", gpus->count() > 0);
    if (!o.gpus.empty() && ranks_use_cpu_backend(cmd)) {
      print_stderr(fmt::format("pcpkv launch: note: --gpus {} is not used: the ranks run --backend cpu\n", f->gpus));
    }
    if (f->program.empty()) {
      o.argv.push_back(self_exe());
    } else {
      o.argv.push_back(f->program);
    }
    o.argv.insert(o.argv.end(), cmd.begin(), cmd.end());
    LaunchResult r;
    try {
      r = launch_ranks(o);
    } catch (const std::system_error& e) {
      throw CLI::RuntimeError(e.what(), 3);  // the system refused a resource: not bad input (README: exit codes)
    }
    if (r.exit_code != 0) throw CLI::RuntimeError("", r.exit_code);
  });
  add_mp_publish_command(app);
  add_bench_fence_command(app);
  add_bench_allreduce_command(app);
  add_bench_link_command(app);
}

}  // namespace pcpkv::cli
