// The pieces every rank-side subcommand shares (launch_cmds.h): meeting the other ranks, the rank
// publisher of a --backend, running as one rank (errors told to the peers, exit codes).
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/fnv1a.h"
#include "error_line.h"
#include "launch_cmds.h"
#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/publish/backend.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {

std::unique_ptr<Bootstrap> connect_world() {
  std::optional<BootstrapConfig> c = bootstrap_config_from_env();
  if (!c) {
    BootstrapConfig one;
    one.source = "single process (no PCPKV_RANK or RANK in the environment)";
    c = one;
  }
  return Bootstrap::connect(*c);
}

std::string file_fingerprint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return fmt::format("unreadable: {}", std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return fmt::format("FNV-64 {:016x} of {} bytes", fnv1a(bytes.data(), bytes.size()), bytes.size());
}

RankPublisherFactory rank_publisher_factory(const std::string& backend, std::string* resolved) {
  check_backend_name(backend);
  if (backend == "cpu") {
    *resolved = "cpu";
    return make_cpu_rank_publisher;
  }
  std::string why;
  const bool have_cuda = cuda_backend_available(&why);
#if defined(PCPKV_HAVE_CUDA)
  if (have_cuda) {
    *resolved = "cuda";
    return cuda::make_rank_publisher;
  }
#else
  if (have_cuda) why = "this pcpkv CLI was compiled without PCPKV_HAVE_CUDA (its multi-process CUDA path is off)";
#endif
  PCPKV_CHECK(backend == "auto", "--backend cuda: unavailable: {}", why);
  *resolved = "cpu";
  return make_cpu_rank_publisher;
}

int run_rank_program(const char* cmd, const std::function<void()>& check, const std::function<int(Bootstrap&)>& fn) {
  std::optional<BootstrapConfig> config;
  const int env_code = run_as_rank(cmd, nullptr, [&] {
    config = bootstrap_config_from_env();
    return 0;
  });
  if (env_code != 0) return env_code;
  std::string verdict;  // empty: every check passed
  if (!config || config->world_size == 1) {
    check();  // nobody to tell: "pcpkv: error: --flag: ...", exit 2, as for any single-process command
  } else {
    try {
      check();
    } catch (const Error& e) {
      verdict = e.what();
    }
  }
  std::unique_ptr<Bootstrap> world;
  return run_as_rank(cmd, nullptr, [&] {
    try {
      world = connect_world();
    } catch (const Error& e) {
      // This rank's own bad argument is the cause to report (exit 2); e.g. its other flags gave it another job
      // token under torchrun without PCPKV_JOB_ID, so rank 0 refused it.
      if (verdict.empty()) throw;
      throw Error(fmt::format("{} (and the rendezvous failed: {})", verdict, e.what()));
    }
    return run_as_rank(cmd, world.get(), [&] {
      world->agree(verdict.empty(), verdict, "the argument check",
                   "every rank refuses; nothing was allocated or written");
      return fn(*world);
    });
  });
}

std::optional<int> carry_parse_error(const std::string& cmd, const std::string& message) {
  bool rank_program = false;
  for (const char* p : kRankPrograms) rank_program = rank_program || cmd == p;
  if (!rank_program) return std::nullopt;
  try {
    const std::optional<BootstrapConfig> c = bootstrap_config_from_env();
    if (!c || c->world_size == 1) return std::nullopt;
  } catch (const Error&) {
    return std::nullopt;  // cannot reach the others: the parse error alone, as before
  }
  return run_rank_program(
      cmd.c_str(), [&] { throw Error(message); }, [](Bootstrap&) { return 0; });
}

int run_as_rank(const char* cmd, Bootstrap* world, const std::function<int()>& fn) {
  // "pcpkv: error: mp-publish rank 1: ...", the one-line form of every CLI error.
  // Before the rendezvous there is no world yet: the launcher's rank variable names the rank, pcpkv launch's
  // PCPKV_RANK first, as the bootstrap reads them (checked when it is read; clipped here, since it is not yet).
  const char* env_rank = read_env(kEnvRank);
  if (!env_rank || !*env_rank) env_rank = read_env("RANK");
  const std::string who = world ? fmt::format("{} rank {}", cmd, world->rank())
                                : fmt::format("{} rank {}", cmd, env_rank && *env_rank ? clip(env_rank) : "?");
  try {
    return fn();
  } catch (const FenceTimeout& e) {
    print_error(fmt::format("{}: {}", who, e.what()));
    if (world) world->abort(clip_middle(e.what()));
    return kExitPeerFailed;
  } catch (const Error& e) {
    const std::string msg = e.what();
    print_error(fmt::format("{}: {}", who, msg));
    if (world) world->abort(clip_middle(msg));
    return msg.rfind("bootstrap:", 0) == 0 ? kExitPeerFailed : 2;
  } catch (const CLI::Error& e) {
    // CLI::RuntimeError(message, code): how a command chooses its exit code (3 for a failed --save). Keep the
    // code, and the message when there is one, as main() does outside a rank; it is not an internal error.
    const std::string msg = e.what();
    if (!msg.empty()) print_error(fmt::format("{}: {}", who, msg));
    if (world && e.get_exit_code() != 0)
      world->abort(clip_middle(msg.empty() ? fmt::format("exit code {}", e.get_exit_code()) : msg));
    return e.get_exit_code();
  } catch (const std::exception& e) {
    print_error(fmt::format("{}: internal: {}", who, e.what()));
    if (world) world->abort(clip_middle(e.what()));
    return 3;
  }
}

}  // namespace pcpkv::cli
