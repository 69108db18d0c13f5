// tools/pcpkv/launch_cmds.h: the multi-process subcommands registered by add_launch_command
// (cmd_launch.cpp): `launch` (spawn N ranks), `mp-publish` (one rank of a publication), `bench-fence`
// (fence latency per layer), `bench-allreduce`, `bench-link`, and what they share (rank_command.cpp; the --gpus
// lists: list_flags.h).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/multiproc.h"

namespace CLI {
class App;
}

namespace pcpkv::cli {

/// The subcommands that run as one rank of a launched job (they meet the other ranks through the
/// launcher's PCPKV_BOOTSTRAP); `launch` refuses any other command unless --program names an executable.
constexpr const char* kRankPrograms[] = {"mp-publish", "bench-fence", "bench-allreduce"};

/// Exit code of a rank whose peer failed (a fence timeout, a rank gone, a rendezvous that failed).
constexpr int kExitPeerFailed = 4;

void add_mp_publish_command(CLI::App& app);   // cmd_mp_publish.cpp (mp_publish.h: setup, loop, report)
void add_bench_fence_command(CLI::App& app);  // cmd_bench_fence.cpp
void add_bench_allreduce_command(CLI::App& app);  // cmd_bench_allreduce.cpp (launched, one GPU per rank)
void add_bench_link_command(CLI::App& app);   // cmd_bench_link.cpp (one process, every GPU)

/// This process's place in the job: from `pcpkv launch` / torchrun variables, or a world of one.
std::unique_ptr<Bootstrap> connect_world();

/// "FNV-64 <hex> of <n> bytes" of a file's contents (or why it cannot be read): how a path flag (--config) enters
/// the fields the ranks agree on, since one path may hold other bytes for another rank.
std::string file_fingerprint(const std::string& path);

/// "cpu" | "cuda" | "auto" -> the rank publisher factory; *resolved names the backend picked. Throws
/// pcpkv::Error saying why when CUDA is asked for and unavailable.
RankPublisherFactory rank_publisher_factory(const std::string& backend, std::string* resolved);

/// A rank program's whole run: reads the rank variables (bootstrap_config_from_env: a bad one is refused by this
/// rank alone, as it cannot reach the others), runs `check` (every flag check that needs no world; throws
/// pcpkv::Error), meets the other ranks and runs fn. With peers, a failed check is not thrown before the
/// rendezvous: the rank joins carrying it and, right after, every rank learns every rank's verdict
/// (Bootstrap::agree) and refuses with exit 2 naming each failing rank and its message, so no rank waits out the
/// rendezvous timeout for a rank that quit (the rule: a bad argument on one rank is named on all ranks,
/// promptly). This comes before fn (which calls agree_on): a bad flag is a clearer error than the
/// disagreement it causes. Without peers (no rank variables, or a world of one) `check` throws as before:
/// "pcpkv: error: --flag: ...". Returns the exit code (run_as_rank's).
int run_rank_program(const char* cmd, const std::function<void()>& check, const std::function<int(Bootstrap&)>& fn);

/// A CLI11 parse error (unknown flag, bad number) of a rank program with peers, carried like a failed check: the
/// rank still knows its rank variables, so it joins the rendezvous and every rank names it (exit 2). nullopt when
/// cmd is no rank program or there are no peers (or the rank variables are bad): the caller prints it as usual.
std::optional<int> carry_parse_error(const std::string& cmd, const std::string& message);

/// Runs fn as one rank and returns fn's result, or for an exception its exit code, after printing it as
/// "pcpkv: error: <cmd> rank r: ..." (one line) and telling the other ranks (Bootstrap::abort; world may be
/// null before the rendezvous): FenceTimeout and "bootstrap:" errors kExitPeerFailed, other pcpkv::Error (bad
/// input) 2, a CLI::Error (CLI::RuntimeError: a command's chosen exit code) its own code and message (none
/// printed when empty), any other exception 3 ("internal: ...").
int run_as_rank(const char* cmd, Bootstrap* world, const std::function<int()>& fn);

}  // namespace pcpkv::cli
