// pcpkv/ranks/bootstrap.h: rendezvous and small host collectives for one-process-per-rank jobs, without MPI.
//
// Rank 0 listens on a Unix-domain socket (a path in a 0700 directory, socket mode 0600); the other ranks
// connect to it. Unix-domain sockets never leave the host, which is what symmetric memory needs anyway
// (SPEC section 5: within one host, buffers are shared by passing file descriptors). Every connection is
// checked twice: the peer process must run as the same user (SO_PEERCRED, both directions) and must
// present the same per-job token. Collectives go through rank 0 (a star), which is plenty for setup-time
// traffic: small byte blobs, file descriptors (SCM_RIGHTS), barriers and the all-or-nothing agreement.
//
// Every blocking call is bounded by BootstrapConfig::timeout_s and ends in a pcpkv::Error that names the
// rank that is missing or gone (e.g. "bootstrap: rank 2 (pid 4711) closed its connection during
// all_gather (exited or killed?)"); when one rank fails or aborts, rank 0 tells every other rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pcpkv {

/// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// Who this process is and where to meet the others.
struct BootstrapConfig {
  int32_t rank = 0;              // [0, world_size)
  int32_t world_size = 1;        // >= 1
  int32_t local_rank = 0;        // rank among the processes of this host (GPU choice: local_rank % num_gpus)
  int32_t local_world_size = 1;
  std::string address;           // filesystem path of rank 0's Unix-domain socket (< 108 bytes)
  std::string token;             // per-job token; every rank must present the same one (non-empty)
  std::string job;               // the job's name in messages ("MASTER_PORT 29500, command '...'"), never the token
  double timeout_s = 60.0;       // bound of every blocking step (rendezvous and each collective); inf: none
  std::string source;            // where the values came from ("pcpkv launch", "torchrun env", "test")
  bool token_per_attempt = false;  // the token names this attempt alone (pcpkv launch makes one per launch): rank 0's
                                   // tombstone carrying it is this attempt's, however late a rank starts
};

/// Environment variables `pcpkv launch` sets for each rank process.
constexpr const char* kEnvRank = "PCPKV_RANK";
constexpr const char* kEnvWorldSize = "PCPKV_WORLD_SIZE";
constexpr const char* kEnvLocalRank = "PCPKV_LOCAL_RANK";
constexpr const char* kEnvLocalWorldSize = "PCPKV_LOCAL_WORLD_SIZE";
constexpr const char* kEnvBootstrap = "PCPKV_BOOTSTRAP";      // socket path
constexpr const char* kEnvJobToken = "PCPKV_JOB_TOKEN";
constexpr const char* kEnvJobId = "PCPKV_JOB_ID";          // torchrun-style jobs: names the job
constexpr const char* kEnvTimeout = "PCPKV_BOOTSTRAP_TIMEOUT_S";
constexpr const char* kEnvAllowNonlocal = "PCPKV_ALLOW_NONLOCAL_MASTER";

/// Reads the rank's identity from the environment:
///  * `pcpkv launch`: PCPKV_RANK, PCPKV_WORLD_SIZE, PCPKV_LOCAL_RANK, PCPKV_LOCAL_WORLD_SIZE,
///    PCPKV_BOOTSTRAP (socket path), PCPKV_JOB_TOKEN;
///  * torchrun and similar: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
///    MASTER_ADDR must name this host (a loopback address, "localhost" or this host's name) unless
///    PCPKV_ALLOW_NONLOCAL_MASTER=1; the socket is ${PCPKV_BOOTSTRAP_DIR:-${TMPDIR:-/tmp}}/pcpkv-<uid>/
///    port<MASTER_PORT>.sock; the token (the job's identity) is PCPKV_JOB_TOKEN, else "job:" +
///    PCPKV_JOB_ID (either alone), else TORCHELASTIC_RUN_ID (unless "none", torchrun's default) or the port,
///    together with a hash of the command line: two such jobs on one MASTER_PORT with other flags (another
///    --seed) never meet. Ranks of one job with other flags are the rank programs' to refuse (agree_on).
/// PCPKV_BOOTSTRAP_TIMEOUT_S overrides the timeout (seconds). Returns nullopt when none of the rank
/// variables is present (a plain single-process run). Throws pcpkv::Error naming the variable and value
/// when one is malformed or half set (RANK=abc, RANK >= WORLD_SIZE, WORLD_SIZE without RANK, LOCAL_RANK
/// alone, LOCAL_WORLD_SIZE != WORLD_SIZE or LOCAL_RANK != RANK (single host), MASTER_PORT outside
/// [1, 65535], a remote MASTER_ADDR, PCPKV_ALLOW_NONLOCAL_MASTER other than 1 / 0 / empty (read_env_switch of
/// pcpkv/core/env.h), ...).
std::optional<BootstrapConfig> bootstrap_config_from_env();

/// A fresh random per-job token (128 bits from /dev/urandom, hex).
std::string make_job_token();

class Bootstrap {
 public:
  /// Rendezvous: rank 0 binds and listens on config.address, the others connect (retrying until rank 0
  /// is up). Returns once all world_size ranks are connected and accepted. Throws pcpkv::Error on:
  /// a bad config, a peer of another user, a world-size mismatch or duplicate rank (fatal for the whole
  /// job: every connected rank is told), this process's token being refused, or the timeout (naming
  /// the ranks that never came, and how many connections were refused for a wrong token).
  /// A connection with a wrong token is refused (naming both jobs) and does not stop rank 0 from waiting for
  /// the right one; when the refused process claimed a rank of this world size that still does not connect
  /// within 5 s, rank 0 gives up naming it (this job's rank started with other flags, most likely).
  /// Rank 0 holds the address (a lock next to the socket) while the Bootstrap lives: a
  /// second rank 0 at the same address (another job on the same MASTER_PORT) is refused at once.
  static std::unique_ptr<Bootstrap> connect(const BootstrapConfig& config);

  ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  int32_t rank() const;
  int32_t world_size() const;
  int32_t local_rank() const;
  int32_t local_world_size() const;
  const BootstrapConfig& config() const;
  /// Process ids of every rank, [world_size] (for messages and tests).
  const std::vector<int64_t>& pids() const;

  /// Every rank contributes `bytes` bytes; recv receives [world_size][bytes] in rank order. Every rank must
  /// pass the same `bytes` (a mismatch throws on rank 0 and aborts the job).
  void all_gather(const void* send, size_t bytes, void* recv);
  /// Variable-size all-gather: returns [world_size] blobs.
  std::vector<std::vector<uint8_t>> all_gather_v(const void* send, size_t bytes);
  /// Passes one file descriptor per rank to every rank over SCM_RIGHTS. fd must be open (it stays owned
  /// by the caller). Returns [world_size] new descriptors (rank()'s entry is a dup of fd), close-on-exec.
  std::vector<UniqueFd> all_gather_fds(int fd);
  void barrier();

  /// All-or-nothing agreement: every rank says whether its part of `what` succeeded. Returns when all
  /// did; otherwise throws pcpkv::Error on every rank, naming each failed rank and its reason: "symmetric memory
  /// 'caches': create failed on 1 of 4 ranks (none uses it): rank 1: mmap of rank 3's buffer failed: Cannot
  /// allocate memory" (`outcome` is the parenthesis: what the refusal means for the job).
  void agree(bool ok, const std::string& why, const std::string& what, const std::string& outcome = "none uses it");

  /// What the ranks must share (a run's whole configuration), as ordered (field, value) pairs, e.g.
  /// {{"--seed", "7"}, {"--transport", "direct"}}. One 8-byte digest per rank is all-gathered; only when the
  /// digests differ do the lists travel, so that every rank throws the same pcpkv::Error naming the first field
  /// that differs from rank 0's and both values: "<what>: ranks disagree on --seed: rank 0 has 0, rank 1 has 7"
  /// (no prefix when what is empty). Call it right after the rendezvous, before anything is allocated or written.
  void agree_on(const std::string& what, const std::vector<std::pair<std::string, std::string>>& fields);

  /// Splits the job into groups (like MPI_Comm_split; collective over all ranks): ranks with the same
  /// color form a group, ordered by (key, rank). Each group gets its own socket and token, so groups run
  /// their collectives independently. color < 0: this rank joins no group (returns nullptr).
  std::unique_ptr<Bootstrap> split(int32_t color, int32_t key);

  /// Tells the other ranks that this one is giving up (best effort, never throws). Their next
  /// collective throws pcpkv::Error("bootstrap: rank r aborted: <why>").
  void abort(const std::string& why) noexcept;

  struct Impl;

 private:
  explicit Bootstrap(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pcpkv
