// `pcpkv mp-publish`: one process's rank of a layer's publication, one process per rank.
// Run it under `pcpkv launch --nproc N` (or torchrun): the world of N processes is split into --tp PCP
// groups of N / tp ranks ({0..P-1}, {P..2P-1}, ...); each group publishes its own batch (seed + group
// index, so a write that crossed groups would show) with each requested transport, and each group's
// rank 0 checks every replica of its group byte for byte against the single-process CPU reference and
// prints the group's stage table and verdict. Stage times (CUDA): each rank's median over --repeats timed
// runs after --warmup untimed ones (CUDA events per stage), every rank's column, and the max over ranks;
// the total is each rank's median run total, max over ranks; the speedup over collect of the same run;
// for staging and direct the bytes each GPU receives through the dispatch's P2P stores and the bandwidth
// that achieves (with --link-gbps also the floor received bytes / link bandwidth); staging == direct over
// every replica (FNV-64 of all bytes).
//
// Exit code (every rank agrees): 0 all checks passed, 1 a check failed, 2 bad input,
// 4 a peer failed (killed, stuck past the fence timeout, or gone from the rendezvous).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "launch_cmds.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/ranks/symmetric.h"
#include "pcpkv/publish/checks.h"
#include "publish/publish_layout.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {
namespace {

// Free bytes of this rank's device (CUDA), -1 on the CPU backend.
int64_t device_free_bytes(const std::string& backend) {
#if defined(PCPKV_HAVE_CUDA)
  if (backend == "cuda") return cuda::device_free_bytes();
#endif
  (void)backend;
  return -1;
}

struct MpPublishFlags {
  std::string model = "glm-5";
  std::string config;
  int64_t tokens = 4096;
  int32_t decodes = 2;
  int32_t block_size = 64;
  std::string kv_format = "fp8_ds_mla";
  std::string ds_mla_scale = "pow2";
  double k_scale = 1.0;
  std::string layer = "indexer";
  std::string transport = "all";
  std::string backend = "auto";
  int32_t tp = 1;
  uint64_t seed = 0;
  int32_t repeats = 1;
  int32_t threads = 1;
  int64_t topk_width = 0;
  std::string topk_fill = "full";  // full | tail | none (pcpkv/publish/dispatch.h TopkFill)
  int64_t guard_bytes = 256;
  int64_t base_offset = 0;
  int64_t fence_timeout_ms = 30000;
  bool no_check = false;
  bool json = false;
  int32_t kill_rank = -1;
  std::string collect_via = "auto";
  int32_t graph_replays = 0;
  bool leak_check = false;
  int32_t warmup = 0;
  double flush_l2_mb = 0;
  double link_gbps = 0;
  bool md_rows = false;
  std::string pcp;  // hidden: refused with a pointer to launch --nproc (mp-publish's world comes from the launcher)
  bool pcp_given = false;
  bool ds_mla_scale_given = false, k_scale_given = false;  // for the notes on flags the format ignores
};

std::vector<Transport> parse_transports(const std::string& s) {
  if (s == "all") return {Transport::kCollect, Transport::kStaging, Transport::kDirect};
  std::vector<Transport> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    out.push_back(parse_transport(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

// FNV-1a over bytes: a fingerprint of every replica, to compare transports (staging == direct) cheaply.
uint64_t fnv1a(const std::vector<uint8_t>& v, uint64_t h = 1469598103934665603ull) {
  for (uint8_t b : v) h = (h ^ b) * 1099511628211ull;
  return h;
}

struct TransportReport {
  Transport transport;
  std::vector<Stage> stages;        // per stage the max over ranks of each rank's median; bytes summed over ranks
  std::vector<std::vector<double>> rank_stage_ms;  // [rank][stage] each rank's median over the timed runs
  std::vector<double> rank_total_ms;               // [rank] median over runs of the run's stage sum
  double total_ms = 0;              // max over ranks of rank_total_ms
  int32_t samples = 0;              // timed runs per rank
  uint64_t replicas_hash = 0;       // fingerprint of every replica of the group (checked runs)
  double stage_ms(const std::string& name) const {
    for (const Stage& s : stages)
      if (s.name == name) return s.ms;
    return 0.0;
  }
  bool checked = false;
  bool identical = true;            // every replica == the single-process reference, byte for byte
  int64_t bytes_compared = 0;
  int64_t bytes_differing = 0;
  std::string first_diff;
  int32_t graph_replays = 0;        // > 0: the bytes checked are those after this many CUDA graph replays
  bool epochs_ok = true;            // graph replays: the fence epochs advanced once per replay
  std::string epochs_note;
  int64_t guard_bad = 0;
  std::string guard_first;
  bool q_topk_ok = true;
  bool ok() const { return identical && guard_bad == 0 && q_topk_ok && epochs_ok; }
};

// Bytes the dispatch's P2P stores move between GPUs (the byte model of mp::stage_bytes_for_rank): direct stores
// every written row's final cache bytes into every replica; staging stores all M packed rows into every
// peer's staging slot. Own-replica stores are local, not counted.
struct P2pBytes {
  int64_t max_received = 0;  // the GPU that receives the most
  int64_t max_sent = 0;
};
P2pBytes p2p_bytes(const PublishSetup& s, Transport t) {
  const PcpPlan& plan = *s.plan;
  const mp::PublishLayout l = mp::make_publish_layout(s);
  const int32_t W = plan.pcp_world;
  const int64_t cache_row_bytes = l.row.mla_bytes + (s.fmt.has_indexer ? kIndexerSlotBytes : 0);
  std::vector<int64_t> sent_per_peer(static_cast<size_t>(W));
  for (int32_t q = 0; q < W; ++q) {
    const RankPlan& rp = plan.ranks[static_cast<size_t>(q)];
    const int64_t written =
        std::count_if(rp.slot_mapping.begin(), rp.slot_mapping.end(), [](int64_t x) { return x >= 0; });
    sent_per_peer[static_cast<size_t>(q)] =
        t == Transport::kDirect ? written * cache_row_bytes : plan.max_local_tokens * l.row.row_bytes;
  }
  P2pBytes b;
  int64_t total = 0;
  for (int64_t v : sent_per_peer) total += v;
  for (int32_t r = 0; r < W; ++r) {
    b.max_received = std::max(b.max_received, total - sent_per_peer[static_cast<size_t>(r)]);
    b.max_sent = std::max(b.max_sent, sent_per_peer[static_cast<size_t>(r)] * (W - 1));
  }
  return b;
}

// A fence bound past a day is a typo, and one near INT64_MAX overflows the deadline into the past.
constexpr int64_t kMaxFenceTimeoutMs = int64_t{24} * 3600 * 1000;

// Every flag that needs no world, cheapest first; run before the rendezvous, so a typo is refused by each
// rank on its own ("pcpkv: error: --flag: ...", exit 2) and nothing is connected, allocated or printed.
void check_flags(const MpPublishFlags& f) {
  // `run` and `attention` take --pcp; here the launcher decides the world (CLI11 alone would say "The
  // following arguments were not expected: 0 --pcp").
  PCPKV_CHECK(!f.pcp_given,
              "--pcp {}: mp-publish has no --pcp flag: its PCP world size is the number of ranks the launcher starts "
              "divided by --tp, e.g. pcpkv launch --nproc 4 -- mp-publish --tp 1 publishes with PCP 4",
              f.pcp);
  PCPKV_CHECK(f.tokens >= 0, "--tokens: must be >= 0, got {}", f.tokens);
  PCPKV_CHECK(f.decodes >= 0, "--decodes: must be >= 0, got {}", f.decodes);
  PCPKV_CHECK(f.tokens > 0 || f.decodes > 0, "--tokens 0 --decodes 0: the batch is empty");
  check_block_size_flag(f.block_size);
  PCPKV_CHECK(f.tp >= 1, "--tp: must be >= 1, got {}", f.tp);
  PCPKV_CHECK(f.repeats >= 1, "--repeats: must be >= 1, got {}", f.repeats);
  PCPKV_CHECK(f.warmup >= 0, "--warmup: must be >= 0, got {}", f.warmup);
  PCPKV_CHECK(f.threads >= 1, "--threads: must be >= 1, got {}", f.threads);
  PCPKV_CHECK(f.threads <= 1024, "--threads: {} is more than pcpkv supports (1024)", f.threads);
  PCPKV_CHECK(f.topk_width >= 0, "--topk-width: must be >= 0, got {}", f.topk_width);
  parse_topk_fill(f.topk_fill, "--topk-fill");
  PCPKV_CHECK(f.guard_bytes >= 0, "--guard-bytes: must be >= 0, got {}", f.guard_bytes);
  PCPKV_CHECK(f.base_offset >= 0, "--base-offset: must be >= 0, got {}", f.base_offset);
  PCPKV_CHECK((f.guard_bytes + f.base_offset) % 16 == 0,
              "--guard-bytes {} --base-offset {}: their sum must be a multiple of 16 (the cache's alignment)",
              f.guard_bytes, f.base_offset);
  PCPKV_CHECK(f.fence_timeout_ms >= 1 && f.fence_timeout_ms <= kMaxFenceTimeoutMs,
              "--fence-timeout-ms: must be in [1, {}] (one day), got {}", kMaxFenceTimeoutMs, f.fence_timeout_ms);
  PCPKV_CHECK(f.graph_replays >= 0, "--graph-replays: must be >= 0, got {}", f.graph_replays);
  PCPKV_CHECK(f.kill_rank >= -1, "--kill-rank: must be a rank (>= 0) or -1 (off), got {}", f.kill_rank);
  PCPKV_CHECK(std::isfinite(f.k_scale) && f.k_scale > 0, "--k-scale: must be positive and finite, got {}", f.k_scale);
  PCPKV_CHECK(std::isfinite(f.flush_l2_mb) && f.flush_l2_mb >= 0, "--flush-l2-mb: must be >= 0 and finite, got {}",
              f.flush_l2_mb);
  PCPKV_CHECK(std::isfinite(f.link_gbps) && f.link_gbps >= 0, "--link-gbps: must be >= 0 and finite, got {}",
              f.link_gbps);
  PCPKV_CHECK(f.layer == "indexer" || f.layer == "shared", "--layer: '{}' is not indexer or shared", f.layer);
  PCPKV_CHECK(f.backend == "auto" || f.backend == "cpu" || f.backend == "cuda",
              "--backend: unknown backend '{}'; known: auto, cpu, cuda", f.backend);
  PCPKV_CHECK(f.collect_via == "auto" || f.collect_via == "nccl" || f.collect_via == "p2p",
              "--collect-via: '{}' is not auto, nccl or p2p", f.collect_via);
  (void)parse_kv_format(f.kv_format, "kv-format");
  (void)parse_ds_mla_scale(f.ds_mla_scale, "ds-mla-scale");
  (void)parse_transports(f.transport);
  if (f.config.empty()) (void)preset(f.model);
}

// ---- memory, estimated from the flags before the rendezvous ------------------------------------------
//
// One rank's peak, added up from what it holds at once (long double: --tokens 99999999999 must give a
// message, not an overflow): the whole group's plan and generated inputs (every rank generates them), the
// rope table, its own replica (shared memory), its local inputs and q_c_out, the staging / collect
// buffers of the transports asked for; a PCP group's rank 0 (unless --no-check) also holds the CPU
// reference's W replicas and scratch, a copy of every replica of its group, and the peers' replicas it
// reads (their shared-memory pages count in its RSS). The job's need is the sum over this host's ranks.
// Measured per rank with `pcpkv launch --nproc N --program /usr/bin/time -- -f %M pcpkv mp-publish ...`
// (CPU backend, glm-5, this 2-core machine), estimate / peak RSS, checking rank (rank 0) and another:
//   --tokens 65536 (one process, all transports):                  2.85 / 2.29 GB (+24%)
//   --nproc 2 --tokens 65536:                                      2.77 / 2.49 GB (+11%), 1.30 / 1.06 GB (+22%)
//   --nproc 4 --tokens 32768 --transport collect:                  1.44 / 1.36 GB (+6%),  0.52 / 0.43 GB (+22%)
//   --nproc 2 --tokens 20000 --decodes 30 --kv-format fp8 --transport staging:
//                                                                  3.40 / 3.16 GB (+8%),  1.05 / 0.95 GB (+10%)
//   --nproc 4 --tp 2 --tokens 40000 --layer shared --kv-format fp8: 1.57 / 1.40 GB (+12%), 0.76 / 0.59 GB (+28%)
//   --tokens 2000 --decodes 50 --kv-format fp8 --no-check:          1.95 / 1.88 GB (+4%)
// so the estimate is 4% to 28% above the measured peak (least when the replicas dominate). The sum over
// ranks counts a shared-memory replica in every rank that touched it, so the job's sum is an upper bound.
struct MpShape {
  long double tokens = 0, decodes = 0, block_size = 64, world = 1;  // world: ranks of one PCP group
  long double q_rank = 0, mla_row = 0, transport_row = 0, in_row = 0, collect_row = 0;
  long double topk_width = 0, alloc_extra = 0;
  bool staging = false, collect = false;

  long double num_tokens() const { return tokens + decodes; }
  // DualChunkSwap: two chunks of ceil(T / 2W) per rank; every rank holds every decode.
  long double max_local_tokens() const {
    return (tokens > 0 ? std::min(tokens, 2 * std::ceil(tokens / (2 * world))) : 0) + decodes;
  }
  // Null block + the prefill's blocks + decode i's (context 1000 (i + 1) + 7 i, then its token).
  long double blocks() const {
    return 1 + std::ceil(tokens / block_size) + decodes * (1001 / block_size + 1) +
           1007.0L * decodes * (decodes - 1) / (2 * block_size);
  }
  long double max_keys() const { return std::max(tokens, decodes > 0 ? 1000 * decodes + 7 * (decodes - 1) + 1 : 0); }
  long double replica() const { return blocks() * block_size * (mla_row + kIndexerSlotBytes) + alloc_extra; }
};

MpShape mp_shape(const MpPublishFlags& f, const ModelConfig& model, int64_t group_world) {
  MpShape s;
  CacheFormat fmt;
  fmt.kv_format = parse_kv_format(f.kv_format);
  fmt.has_indexer = f.layer == "indexer";
  s.tokens = static_cast<long double>(f.tokens);
  s.decodes = f.decodes;
  s.block_size = f.block_size;
  s.world = static_cast<long double>(group_world);
  s.q_rank = static_cast<long double>(model.q_lora_rank);
  s.mla_row = static_cast<long double>(mla_row_bytes(fmt.kv_format));
  s.transport_row = static_cast<long double>(transport_row_layout(fmt).row_bytes);
  s.collect_row = (kKvLoraRank + kRopeDims + (fmt.has_indexer ? kIndexHeadDim : 0)) * 2.0L;
  s.in_row = s.q_rank * 2 + s.collect_row;
  s.topk_width = fmt.has_indexer ? static_cast<long double>(f.topk_width) : 0;
  // Two allocations (MLA, indexer), each with guards on both sides and the base offset, 2 MiB rounding.
  s.alloc_extra = 2 * (2.0L * static_cast<long double>(f.guard_bytes) + static_cast<long double>(f.base_offset)) +
                  (2 << 20);
  for (Transport t : parse_transports(f.transport)) {
    s.staging = s.staging || t == Transport::kStaging;
    s.collect = s.collect || t == Transport::kCollect;
  }
  return s;
}

constexpr long double kRankBaseBytes = 64e6L;  // binary, libraries, thread stacks, allocator slack

MemoryEstimate mp_host_estimate(const MpShape& s, bool leader) {
  const long double N = s.num_tokens(), M = s.max_local_tokens(), W = s.world;
  MemoryEstimate m;
  m.add("base", kRankBaseBytes);
  m.add("plan", 20 * N + 32 * W * M + 4 * s.blocks() + 80 * (s.decodes + 1));
  m.add("inputs", N * (s.in_row + 8));
  m.add("rope table", s.max_keys() * 64 * 4);
  m.add("own replica and its copy in the result", 2 * s.replica());
  m.add("local inputs", M * (s.in_row + 16 + s.q_rank * 2 + s.topk_width * 4));
  m.add("published q_c_out and top-k", M * (s.q_rank * 2 + s.topk_width * 4));  // the rank's result, kept per transport
  if (s.staging) m.add("staging buffers", 2 * W * M * s.transport_row);
  if (s.collect) m.add("collect buffers", 2 * W * M * s.collect_row);
  if (leader) {
    // The CPU reference's W replicas, the W copies read back from the ranks (+ one in flight while a copy
    // replaces another) and the W - 1 peers' shared-memory replicas it reads.
    m.add("check: replicas", 3 * W * s.replica());
    long double scratch = W * M * (s.in_row + 16 + s.q_rank * 2 + s.topk_width * 4) + s.max_keys() * 64 * 4;
    if (s.collect) scratch += W * (M + W * M) * s.collect_row;
    if (s.staging) scratch += W * 2 * W * M * s.transport_row;
    m.add("check: reference scratch", scratch);
  }
  return m;
}

#if defined(PCPKV_HAVE_CUDA)
// One rank's device memory (CUDA backend): its replica, inputs, q_c_out and top-k, rope table, and the
// staging / collect buffers of the transports asked for (symmetric buffers round up to 2 MiB).
MemoryEstimate mp_device_estimate(const MpShape& s, const MpPublishFlags& f) {
  const long double M = s.max_local_tokens(), W = s.world;
  MemoryEstimate m;
  m.add("replica", s.replica());
  m.add("inputs, q_c_out and top-k", M * (s.in_row + 16 + s.q_rank * 2 + s.topk_width * 4));
  m.add("rope table", s.max_keys() * 64 * 4);
  if (s.staging) m.add("staging buffers", 2 * W * M * s.transport_row + (2 << 20));
  if (s.collect) m.add("collect buffers", 2 * W * M * s.collect_row + (2 << 20));
  m.add("L2 flush scratch", f.flush_l2_mb * 1024 * 1024);
  return m;
}
#endif

std::string mp_sizing_flags(const MpPublishFlags& f, int64_t world, int64_t local) {
  return fmt::format("--tokens {} --decodes {} --block-size {} --transport {} --tp {}{} ({} rank{}, {} on this host)",
                     f.tokens, f.decodes, f.block_size, f.transport, f.tp, f.no_check ? " --no-check" : "", world,
                     world == 1 ? "" : "s", local);
}

// Refuses, in every rank before the rendezvous, a job whose ranks on this host need more host memory than
// it has: each rank computes the same sum from the same flags and environment, so all refuse together and
// none waits for a peer. The world size comes from the launcher's environment (a world of one without it).
void check_mp_host_memory(const MpPublishFlags& f) {
  std::optional<BootstrapConfig> cfg;
  try {
    cfg = bootstrap_config_from_env();
  } catch (const Error&) {
    return;  // a malformed environment: the rendezvous names the variable
  }
  const int64_t world = cfg ? cfg->world_size : 1;
  const int64_t local = cfg ? std::clamp<int64_t>(cfg->local_world_size, 1, world) : 1;
  const int64_t rank = cfg ? cfg->rank : 0;
  const int64_t group_world = std::max<int64_t>(1, world / f.tp);
  const ModelConfig model = f.config.empty() ? preset(f.model) : load_hf_config(f.config, f.model);
  const MpShape s = mp_shape(f, model, group_world);
  // This host's ranks: the `local` consecutive ranks around this one; the PCP group leaders among them
  // (global rank % group size == 0) also check.
  const int64_t first = rank - rank % local;
  int64_t leaders = 0;
  for (int64_t r = first; r < first + local; ++r) leaders += (!f.no_check && r % group_world == 0) ? 1 : 0;
  const MemoryEstimate leader = mp_host_estimate(s, true), other = mp_host_estimate(s, false);
  MemoryEstimate job;
  const int64_t others = local - leaders;
  job.add(fmt::format("{} checking rank{}", leaders, leaders == 1 ? "" : "s"),
          static_cast<long double>(leaders) * leader.total());
  job.add(fmt::format("{} other rank{}", others, others == 1 ? "" : "s"),
          static_cast<long double>(others) * other.total());
  const HostMemory host = available_host_memory();
  std::string per_rank;
  if (leaders > 0) per_rank += fmt::format("; a checking rank (a PCP group's rank 0) holds {}", leader.describe(3));
  if (others > 0) per_rank += fmt::format("; {} rank holds {}", leaders > 0 ? "another" : "a", other.describe(3));
  check_memory_fits(mp_sizing_flags(f, world, local), "the publication", "host", job, host.bytes, host.source,
                    per_rank + "; give fewer --tokens or --decodes" + (f.no_check ? "" : ", or --no-check"));
}

#if defined(PCPKV_HAVE_CUDA)
// Refuses, on every rank together (Bootstrap::agree), a job whose ranks on one GPU need more device memory
// than it has free. Ranks of this host on the same device index add up (launch --gpus 0 puts them all on
// one GPU); an index names one GPU only when every rank sees the same devices, as under `pcpkv launch`,
// so elsewhere (torchrun with per-rank CUDA_VISIBLE_DEVICES) each rank counts alone. Not yet measured on a
// GPU: the estimate is the sum of the publisher's buffers (src/publish/cuda/multiproc_publisher.cpp).
void check_mp_device_memory(const MpPublishFlags& f, const ModelConfig& model, Bootstrap& world,
                            int64_t group_world, int32_t device) {
  const long double free = static_cast<long double>(cuda::device_free_bytes());  // before anyone allocates
  const MemoryEstimate mine = mp_device_estimate(mp_shape(f, model, group_world), f);
  std::vector<int32_t> devices(static_cast<size_t>(world.world_size()));
  world.all_gather(&device, sizeof(device), devices.data());
  int64_t sharers = 1;
  if (world.config().source == "pcpkv launch") {
    const int32_t local = std::max(1, world.local_world_size());
    const int32_t first = world.rank() - world.rank() % local;
    sharers = 0;
    for (int32_t r = first; r < first + local && r < world.world_size(); ++r)
      sharers += devices[static_cast<size_t>(r)] == device ? 1 : 0;
  }
  const long double need = static_cast<long double>(sharers) * mine.total();
  std::string why;
  if (need > free) {
    why = fmt::format("{}: the publication needs about {} of device memory on device {} ({} rank{} x {}: {}), more "
                      "than the {} free there; give fewer --tokens or --decodes, or more GPUs (launch --gpus)",
                      mp_sizing_flags(f, world.world_size(), world.local_world_size()), format_bytes(need), device,
                      sharers, sharers == 1 ? "" : "s", format_bytes(mine.total()), mine.describe(3), format_bytes(free));
  }
  world.agree(why.empty(), why, "the device memory check");
}
#endif

int mp_publish(const MpPublishFlags& f, Bootstrap& world) {
  const GroupLayout layout = GroupLayout::make(world.world_size(), f.tp);
  const int32_t group_idx = layout.pcp_group_of(world.rank());
  // Validate everything before the first collective allocation (the flags alone: check_flags).
  ModelConfig model = f.config.empty() ? preset(f.model) : load_hf_config(f.config, f.model);
  model.validate();
  PCPKV_CHECK(f.kill_rank < world.world_size(), "--kill-rank {} is not a rank of this {}-process job", f.kill_rank,
              world.world_size());
  PlanConfig pc;
  pc.pcp_world = layout.pcp_size;
  pc.pcp_rank_base = group_idx * layout.pcp_size;
  pc.block_size = f.block_size;
  pc.seed = f.seed;
  if (f.tokens > 0) pc.requests.push_back({RequestKind::kPrefill, f.tokens, 0});
  for (int32_t i = 0; i < f.decodes; ++i) pc.requests.push_back({RequestKind::kDecode, 1, 1000 * int64_t{i + 1} + 7 * i});
  PCPKV_CHECK(!pc.requests.empty(), "--tokens 0 --decodes 0: the batch is empty");
  const PcpPlan plan = make_plan(pc);
  CacheFormat fmt;
  fmt.kv_format = parse_kv_format(f.kv_format);
  fmt.ds_mla_scale = parse_ds_mla_scale(f.ds_mla_scale);
  fmt.k_scale = static_cast<float>(f.k_scale);
  fmt.has_indexer = f.layer == "indexer";
  const std::vector<Transport> transports = parse_transports(f.transport);
  // Each PCP group publishes its own inputs: the checks then catch a write that crossed groups.
  const uint64_t group_seed = f.seed + 1000003ull * static_cast<uint64_t>(group_idx);
  const GlobalInputs inputs = generate_inputs(model, plan, fmt.has_indexer, group_seed);

  PublishSetup setup;
  setup.model = &model;
  setup.plan = &plan;
  setup.fmt = fmt;
  setup.alloc.guard_bytes = f.guard_bytes;
  setup.alloc.base_offset = f.base_offset;
  setup.topk_width = f.topk_width;
  setup.topk_fill_mode = parse_topk_fill(f.topk_fill, "--topk-fill");
  setup.repeats = f.repeats;

  std::string backend_name;
  const RankPublisherFactory factory = rank_publisher_factory(f.backend, &backend_name);
#if defined(PCPKV_HAVE_CUDA)
  // This rank's device first (round-robin), so that nothing creates a context on another GPU.
  if (backend_name == "cuda") {
    const int32_t device = cuda::select_rank_device(world);
    check_mp_device_memory(f, model, world, layout.pcp_size, device);  // before the first device allocation
  }
#endif
  auto group = make_pcp_group(world, layout);
  RankPublishOptions opt;
  opt.fence_timeout_ms = f.fence_timeout_ms;
  opt.num_threads = f.threads;
  opt.global_ranks = layout.pcp_group_members(group_idx);
  opt.collect_via = f.collect_via;
  opt.warmup_runs = f.warmup;
  opt.flush_l2_bytes = static_cast<int64_t>(f.flush_l2_mb * 1024 * 1024);
  if (f.kill_rank >= 0 && layout.pcp_group_of(f.kill_rank) == group_idx) opt.kill_pcp_rank = layout.pcp_rank_of(f.kill_rank);
  PCPKV_CHECK(f.graph_replays == 0 || backend_name == "cuda", "--graph-replays needs the cuda backend (got {})",
              backend_name);
  const auto t0 = std::chrono::steady_clock::now();
  const bool leader = group->rank() == 0;

  // --leak-check: one warm-up round (lazy initialization), then count descriptors, shared-memory mappings
  // and free device memory before a second round and after its publisher is gone.
  std::string leak_note;
  bool leak_ok = true;
  if (f.leak_check) {
    for (int round = 0; round < 2; ++round) {
      group->barrier();
      const ResourceCounts before = count_process_resources();
      const int64_t free_before = device_free_bytes(backend_name);
      group->barrier();
      {
        auto p = factory(*group, setup, opt);
        for (Transport t : transports) p->publish(inputs, t);
        group->barrier();
      }
      group->barrier();
      const ResourceCounts after = count_process_resources();
      const int64_t free_after = device_free_bytes(backend_name);
      if (round == 1) {
        // Device memory: a leaked symmetric buffer is >= 2 MiB (the VMM granularity); the driver may keep a
        // few page-table pages, so differences below 1 MiB are not counted.
        leak_ok = after.open_fds == before.open_fds && after.shm_mappings == before.shm_mappings &&
                  free_before - free_after < (int64_t{1} << 20);
        leak_note = fmt::format("descriptors {} -> {}, shared-memory mappings {} -> {}{}", before.open_fds,
                                after.open_fds, before.shm_mappings, after.shm_mappings,
                                free_before >= 0 ? fmt::format(", free device memory {} -> {} bytes", free_before,
                                                               free_after)
                                                 : "");
      }
    }
  }

  auto pub = factory(*group, setup, opt);
  std::vector<TransportReport> reports;
  std::unique_ptr<Backend> ref_backend = leader && !f.no_check ? make_cpu_backend(f.threads) : nullptr;
  for (Transport t : transports) {
    RankPublishResult mine = pub->publish(inputs, t);
    // The timed runs' samples (the graph replays below are not timed). CPU: one sample, the mean.
    const StageProfile timed_profile = mine.profile;
    std::vector<std::vector<double>> timed_samples = mine.stage_samples_ms;
    if (timed_samples.empty()) {
      timed_samples.emplace_back();
      for (const Stage& s : timed_profile.stages) timed_samples.back().push_back(s.ms);
    }
    int32_t replays = 0;
    std::string epochs_note;
    bool epochs_ok = true;
    if (f.graph_replays > 0) {
      // Capture once, replay: every replay must advance the device epochs and leave the same bytes.
      const std::vector<uint64_t> e0 = mine.fence_epochs;
      mine = pub->publish_graph_replays(inputs, t, f.graph_replays);
      replays = f.graph_replays;
      const std::vector<uint64_t>& e1 = mine.fence_epochs;
      // Per run: one start fence, and one publication fence except collect over NCCL.
      const uint64_t runs = static_cast<uint64_t>(replays) + 1;  // + the eager run before the capture
      epochs_ok = e1.size() == e0.size() && e1.size() >= 1 && e1[0] == e0[0] + runs &&
                  (e1.size() < 2 || e1[1] == e0[1] || e1[1] == e0[1] + runs);
      epochs_note = fmt::format("start-fence epoch {} -> {}, publication-fence epoch {} -> {} over {} replays",
                                e0.empty() ? 0 : e0[0], e1.empty() ? 0 : e1[0], e0.size() > 1 ? e0[1] : 0,
                                e1.size() > 1 ? e1[1] : 0, replays);
    }
    // Every timed run's stage times of every rank: [rank][run][stage], and every rank's stage bytes.
    const size_t S = timed_profile.stages.size();
    const size_t R = timed_samples.size();
    const size_t W = static_cast<size_t>(group->world_size());
    std::vector<double> flat(R * S, 0.0);
    for (size_t run = 0; run < R; ++run)
      for (size_t k = 0; k < S && k < timed_samples[run].size(); ++k) flat[run * S + k] = timed_samples[run][k];
    std::vector<double> all_flat(flat.size() * W);
    std::vector<int64_t> bytes(S), all_bytes(S * W);
    for (size_t k = 0; k < S; ++k) bytes[k] = timed_profile.stages[k].bytes;
    if (!flat.empty()) {
      group->all_gather(flat.data(), flat.size() * sizeof(double), all_flat.data());
      group->all_gather(bytes.data(), bytes.size() * sizeof(int64_t), all_bytes.data());
    }
    TransportReport rep;
    rep.samples = static_cast<int32_t>(R);
    for (size_t q = 0; q < W; ++q) {
      std::vector<double> per_stage(S), totals(R, 0.0);
      for (size_t k = 0; k < S; ++k) {
        std::vector<double> v(R);
        for (size_t run = 0; run < R; ++run) {
          v[run] = all_flat[(q * R + run) * S + k];
          totals[run] += v[run];
        }
        per_stage[k] = percentile(v, 0.5);
      }
      rep.rank_stage_ms.push_back(per_stage);
      rep.rank_total_ms.push_back(percentile(totals, 0.5));
      rep.total_ms = std::max(rep.total_ms, rep.rank_total_ms.back());
    }
    rep.transport = t;
    rep.graph_replays = replays;
    rep.epochs_note = epochs_note;
    // Every rank's epochs must have advanced: agree within the group.
    uint8_t eok = epochs_ok ? 1 : 0;
    std::vector<uint8_t> all_eok(static_cast<size_t>(group->world_size()));
    group->all_gather(&eok, 1, all_eok.data());
    rep.epochs_ok = std::all_of(all_eok.begin(), all_eok.end(), [](uint8_t v) { return v == 1; });
    // Bytes: each rank's own byte model, summed (stage names differ from the CPU reference's: the CUDA
    // collect splits its insert into insert-mla and insert-indexer).
    for (size_t k = 0; k < S; ++k) {
      Stage s = timed_profile.stages[k];
      s.ms = 0;
      s.bytes = 0;
      for (size_t q = 0; q < W; ++q) {
        s.ms = std::max(s.ms, rep.rank_stage_ms[q][k]);
        s.bytes += all_bytes[q * S + k];
      }
      rep.stages.push_back(s);
    }
    if (ref_backend) {
      PublishSetup ref_setup = setup;
      ref_setup.repeats = 1;  // the reference's bytes do not depend on repeats; its time is not reported
      const PublishResult ref = ref_backend->publish(ref_setup, inputs, t);
      rep.checked = true;
      PublishResult got = ref;  // geometry from the reference, bytes from the replicas
      for (int32_t q = 0; q < group->world_size(); ++q) {
        got.mla_alloc[q] = pub->read_mla_alloc(q);
        got.index_alloc[q] = pub->read_index_alloc(q);
        rep.replicas_hash = fnv1a(got.index_alloc[q], fnv1a(got.mla_alloc[q], rep.replicas_hash ^ 0x9e37u));
        for (int which = 0; which < 2; ++which) {
          const auto& a = which == 0 ? got.mla_alloc[q] : got.index_alloc[q];
          const auto& b = which == 0 ? ref.mla_alloc[q] : ref.index_alloc[q];
          const ByteDiff d = compare_bytes(a, b);
          rep.bytes_compared += static_cast<int64_t>(a.size());
          rep.bytes_differing += d.num_diff;
          if (!d.equal() && rep.first_diff.empty())
            rep.first_diff = fmt::format("global rank {}'s {} replica: {} bytes differ, first at byte {}",
                                         opt.global_ranks[q], which == 0 ? "MLA" : "indexer", d.num_diff, d.first_diff);
        }
        const GuardReport g = check_untouched(got, q, plan, fmt);
        rep.guard_bad += g.num_bad;
        if (g.num_bad && rep.guard_first.empty())
          rep.guard_first = fmt::format("global rank {}: {}", opt.global_ranks[q], g.first);
      }
      rep.identical = rep.bytes_differing == 0;
      if (setup.materialize_q) rep.q_topk_ok = mine.q_c_out == ref.q_c_out[0];
      if (!mine.topk.empty()) rep.q_topk_ok = rep.q_topk_ok && mine.topk == ref.topk[0];
    }
    reports.push_back(std::move(rep));
    group->barrier();  // peers keep their replicas until the leader has read them
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  bool ok = leak_ok;
  for (const auto& r : reports) ok = ok && r.ok();
  bool same_staging_direct = true;
  if (leader) {
    std::string text = fmt::format(
        "pcpkv mp-publish: {} processes, TP {} x PCP {}; PCP group {} = global ranks {}..{}; backend {} ({})\n",
        world.world_size(), layout.tp_size, layout.pcp_size, group_idx, opt.global_ranks.front(),
        opt.global_ranks.back(), backend_name, pub->device());
    text += fmt::format("  model {}, {} tokens over {} ranks (max {} per rank), {} {}, block size {}, seed {}\n",
                        model.name, plan.num_global_tokens(), plan.pcp_world, plan.max_local_tokens,
                        to_string(fmt.kv_format), fmt.has_indexer ? "indexer layer" : "shared layer", plan.block_size,
                        group_seed);
    for (const std::string& n : unused_format_flag_notes(fmt.kv_format, f.ds_mla_scale_given, f.k_scale_given))
      text += fmt::format("  note: {}\n", n);
    const double collect_ms = [&] {
      for (const auto& r : reports)
        if (r.transport == Transport::kCollect) return r.total_ms;
      return 0.0;
    }();
    const int32_t G = group->world_size();
    for (const auto& r : reports) {
      // Per stage: each rank's median over the timed runs, and the max over ranks.
      text += fmt::format("  {:<8} stage           ms: median of {} run(s) per rank{}\n", to_string(r.transport),
                          r.samples, f.warmup > 0 ? fmt::format(" after {} warm-up", f.warmup) : "");
      std::string head = fmt::format("           {:<14}", "");
      for (int32_t q = 0; q < G; ++q) head += fmt::format(" {:>8}", fmt::format("rank {}", q));
      text += head + fmt::format(" {:>9}   {:>10}\n", "max", "MB (all)");
      for (size_t k = 0; k < r.stages.size(); ++k) {
        std::string line = fmt::format("           {:<14}", r.stages[k].name);
        for (int32_t q = 0; q < G; ++q) line += fmt::format(" {:>8.3f}", r.rank_stage_ms[q][k]);
        text += line + fmt::format(" {:>9.3f}   {:>10.2f}\n", r.stages[k].ms, r.stages[k].bytes / 1e6);
      }
      std::string line = fmt::format("           {:<14}", "total");
      for (int32_t q = 0; q < G; ++q) line += fmt::format(" {:>8.3f}", r.rank_total_ms[q]);
      text += line + fmt::format(" {:>9.3f}", r.total_ms);
      if (collect_ms > 0 && r.transport != Transport::kCollect && r.total_ms > 0)
        text += fmt::format("   {:.2f}x faster than collect", collect_ms / r.total_ms);
      text += "\n";
      if (r.transport != Transport::kCollect && G > 1) {
        // NVLink: what the P2P stores of the dispatch deliver to each GPU from its peers.
        const P2pBytes b = p2p_bytes(setup, r.transport);
        const double dispatch_ms = r.stage_ms("dispatch");
        text += fmt::format(
            "           P2P stores: up to {:.2f} MB received and {:.2f} MB sent per GPU during dispatch ({:.3f} ms): "
            "{:.1f} GB/s received per GPU",
            b.max_received / 1e6, b.max_sent / 1e6, dispatch_ms,
            dispatch_ms > 0 ? b.max_received / (dispatch_ms * 1e6) : 0.0);
        if (f.link_gbps > 0)
          text += fmt::format("; floor received / link ({:.0f} GB/s) = {:.3f} ms, dispatch = {:.2f}x that floor",
                              f.link_gbps, b.max_received / (f.link_gbps * 1e6),
                              dispatch_ms / (b.max_received / (f.link_gbps * 1e6)));
        text += "\n";
      }
      if (r.checked) {
        text += fmt::format("           replicas == single-process CPU reference: {} ({} bytes compared{})\n",
                            r.identical ? "PASS" : "FAIL", r.bytes_compared,
                            r.identical ? "" : "; " + r.first_diff);
        text += fmt::format("           guard bytes untouched: {}{}\n", r.guard_bad == 0 ? "PASS" : "FAIL",
                            r.guard_bad == 0 ? "" : fmt::format(" ({} bad; first: {})", r.guard_bad, r.guard_first));
        text += fmt::format("           rank 0 q_c_out / top-k == reference: {}\n", r.q_topk_ok ? "PASS" : "FAIL");
        if (r.graph_replays > 0)
          text += fmt::format("           CUDA graph: captured once, replayed {} times (bytes above are after the "
                              "last replay); epochs advanced every replay: {} ({})\n",
                              r.graph_replays, r.epochs_ok ? "PASS" : "FAIL", r.epochs_note);
      } else {
        text += "           (not checked: --no-check)\n";
      }
    }
    // staging and direct must leave the same bytes in every replica (both also equal the reference).
    const TransportReport* staging = nullptr;
    const TransportReport* direct = nullptr;
    for (const auto& r : reports) {
      if (r.checked && r.transport == Transport::kStaging) staging = &r;
      if (r.checked && r.transport == Transport::kDirect) direct = &r;
    }
    if (staging && direct) {
      same_staging_direct = staging->replicas_hash == direct->replicas_hash;
      text += fmt::format("  staging == direct (every replica, FNV-64 {:016x}): {}\n", direct->replicas_hash,
                          same_staging_direct ? "PASS" : "FAIL");
    }
    if (f.md_rows) {
      // Markdown rows for docs/perf.md (scripts/multigpu_run.sh collects the lines starting with "md|").
      for (const auto& r : reports) {
        std::string stages;
        for (const Stage& s : r.stages) stages += fmt::format("{}{} {:.3f}", stages.empty() ? "" : " + ", s.name, s.ms);
        std::string ranks;
        for (int32_t q = 0; q < G; ++q) ranks += fmt::format("{}{:.3f}", q ? " / " : "", r.rank_total_ms[q]);
        std::string p2p = "-";
        const double dispatch_ms = r.stage_ms("dispatch");
        if (r.transport != Transport::kCollect && G > 1 && dispatch_ms > 0) {
          const P2pBytes b = p2p_bytes(setup, r.transport);
          p2p = fmt::format("{:.0f} GB/s ({:.1f} MB)", b.max_received / (dispatch_ms * 1e6), b.max_received / 1e6);
          if (f.link_gbps > 0)
            p2p += fmt::format(", {:.2f}x floor", dispatch_ms / (b.max_received / (f.link_gbps * 1e6)));
        }
        text += fmt::format("md|| {} | {} | {} | {} | **{:.3f}** | {} | {} | {} | {} |\n", G, to_string(fmt.kv_format),
                            to_string(r.transport), stages, r.total_ms, ranks,
                            r.transport == Transport::kCollect || collect_ms <= 0
                                ? std::string("1.00x")
                                : fmt::format("{:.2f}x", collect_ms / r.total_ms),
                            p2p, !r.checked ? "not checked" : r.ok() ? "PASS" : "FAIL");
      }
    }
    if (f.leak_check)
      text += fmt::format("  leak check (rank {}): {} ({})\n", world.rank(), leak_ok ? "PASS" : "FAIL", leak_note);
    ok = ok && same_staging_direct;
    text += fmt::format("  verdict: {} ({:.2f} s)\n", ok ? "PASS" : "FAIL", total_s);
    if (f.json) {
      nlohmann::json j;
      j["world_size"] = world.world_size();
      j["tp"] = layout.tp_size;
      j["pcp"] = layout.pcp_size;
      j["pcp_group"] = group_idx;
      j["backend"] = backend_name;
      j["device"] = pub->device();
      j["ok"] = ok;
      if (f.leak_check) j["leak_check"] = {{"ok", leak_ok}, {"detail", leak_note}};
      for (const auto& r : reports) {
        nlohmann::json t;
        t["transport"] = to_string(r.transport);
        for (const Stage& s : r.stages) t["stages"].push_back({{"name", s.name}, {"ms", s.ms}, {"bytes", s.bytes}});
        t["rank_total_ms"] = r.rank_total_ms;
        t["rank_stage_ms"] = r.rank_stage_ms;
        t["total_ms"] = r.total_ms;
        t["samples"] = r.samples;
        t["checked"] = r.checked;
        t["identical"] = r.identical;
        t["bytes_compared"] = r.bytes_compared;
        t["guard_bad"] = r.guard_bad;
        t["graph_replays"] = r.graph_replays;
        t["epochs_ok"] = r.epochs_ok;
        j["transports"].push_back(t);
      }
      std::fputs(j.dump(2).c_str(), stdout);
      std::fputs("\n", stdout);
      std::fputs(text.c_str(), stderr);
    } else {
      std::fputs(text.c_str(), stdout);
    }
    std::fflush(stdout);
    std::fflush(stderr);
  }
  // Every rank exits with the same code: agree on the verdict of every group.
  uint8_t mine_ok = ok ? 1 : 0;
  std::vector<uint8_t> all_ok(static_cast<size_t>(world.world_size()));
  world.all_gather(&mine_ok, 1, all_ok.data());
  return std::all_of(all_ok.begin(), all_ok.end(), [](uint8_t v) { return v == 1; }) ? 0 : 1;
}

}  // namespace

void add_mp_publish_command(CLI::App& app) {
  auto f = std::make_shared<MpPublishFlags>();
  CLI::App* sub = app.add_subcommand(
      "mp-publish",
      "One rank of a multi-process publication; run it as: pcpkv launch --nproc N -- mp-publish [flags] (each PCP "
      "group's rank 0 checks every replica against the single-process CPU reference)");
  sub->add_option("--model", f->model, "Model preset: glm-5 | deepseek-v3.2")->capture_default_str();
  sub->add_option("--config", f->config, "HF config.json overriding the preset");
  sub->add_option("--tokens", f->tokens, "Tokens of the prefill request (0: none)")->capture_default_str();
  sub->add_option("--decodes", f->decodes, "Decode requests (rank 0 writes them)")->capture_default_str();
  sub->add_option("--block-size", f->block_size, "Tokens per cache block (power of two)")->capture_default_str();
  sub->add_option("--kv-format", f->kv_format, "fp8_ds_mla | fp8 | bf16")->capture_default_str();
  sub->add_option("--ds-mla-scale", f->ds_mla_scale, "pow2 | raw")->capture_default_str();
  sub->add_option("--k-scale", f->k_scale, "Static fp8 per-tensor scale")->capture_default_str();
  sub->add_option("--layer", f->layer, "indexer | shared")->capture_default_str();
  sub->add_option("--transport", f->transport, "all | comma list of collect, staging, direct")->capture_default_str();
  sub->add_option("--backend", f->backend, "auto | cpu | cuda (GPU: local rank % visible GPUs, or PCPKV_DEVICE)")
      ->capture_default_str();
  sub->add_option("--tp", f->tp, "TP size: the world splits into this many PCP groups of contiguous ranks")
      ->capture_default_str();
  sub->add_option("--seed", f->seed, "Input and block-table seed (PCP group g uses seed + 1000003 g)")
      ->capture_default_str();
  sub->add_option("--repeats", f->repeats,
                  "Timed publications per transport (CUDA: each rank's median per stage is printed; CPU: the mean)")
      ->capture_default_str();
  sub->add_option("--warmup", f->warmup, "CUDA: untimed publications per transport before the timed ones")
      ->capture_default_str();
  sub->add_option("--flush-l2-mb", f->flush_l2_mb,
                  "CUDA: before each run, overwrite a scratch buffer of this many MiB (cold L2; 0: off)")
      ->capture_default_str();
  sub->add_option("--link-gbps", f->link_gbps,
                  "Per-GPU receive bandwidth of the links in GB/s (e.g. pcpkv bench-link's all-pairs figure): "
                  "prints the floor received bytes / link bandwidth of the P2P stores")
      ->capture_default_str();
  sub->add_flag("--md-rows", f->md_rows, "Also print markdown table rows prefixed 'md|' (for docs/perf.md)");
  sub->add_option("--threads", f->threads, "CPU threads per rank process")->capture_default_str();
  sub->add_option("--topk-width", f->topk_width, "Fill a top-k buffer [T, width] with -1 (indexer layers; 0: off)")
      ->capture_default_str();
  sub->add_option("--topk-fill", f->topk_fill,
                  "Which top-k rows get -1: full (every row, what engines do), tail (only the padding rows past each "
                  "rank's local tokens: pcpkv's indexer top-k writes the rest) or none")
      ->capture_default_str();
  sub->add_option("--guard-bytes", f->guard_bytes, "Guard bytes (0xA5) before and after each cache")
      ->capture_default_str();
  sub->add_option("--base-offset", f->base_offset, "Offset of the cache inside its allocation")->capture_default_str();
  sub->add_option("--fence-timeout-ms", f->fence_timeout_ms, "Bound of every fence wait; past it the missing rank "
                                                             "is named and the rank exits 4")
      ->capture_default_str();
  sub->add_flag("--no-check", f->no_check, "Skip the byte check against the single-process CPU reference");
  sub->add_flag("--json", f->json, "Each group leader prints JSON on stdout (the table goes to stderr)");
  sub->add_option("--collect-via", f->collect_via,
                  "CUDA collect all-gathers: auto (NCCL when every rank has its own GPU, else p2p) | nccl | p2p")
      ->capture_default_str();
  sub->add_option("--graph-replays", f->graph_replays,
                  "CUDA: after each transport's run, capture one publication into a CUDA graph and replay it this "
                  "many times; the check then applies to the bytes after the last replay, and the fence epochs "
                  "must have advanced on every replay")
      ->capture_default_str();
  sub->add_flag("--leak-check", f->leak_check,
                "Before the checked run: two rounds of set-up, publish and teardown; descriptors, shared-memory "
                "mappings and free device memory after the second must equal those before it");
  sub->add_option("--kill-rank", f->kill_rank,
                  "Testing: this global rank SIGKILLs itself after its dispatch, before the fence");
  sub->add_option("--pcp", f->pcp, "Not a flag of mp-publish: the PCP world is launch --nproc / --tp")->group("");
  sub->callback([f, sub] {
    f->pcp_given = sub->count("--pcp") > 0;
    f->ds_mla_scale_given = sub->count("--ds-mla-scale") > 0;
    f->k_scale_given = sub->count("--k-scale") > 0;
    check_flags(*f);  // throws pcpkv::Error: "pcpkv: error: ...", exit code 2
    check_mp_host_memory(*f);  // before the rendezvous: every rank refuses on its own, none waits
    std::unique_ptr<Bootstrap> world;
    const int code = run_as_rank("mp-publish", nullptr, [&] {
      world = connect_world();
      return run_as_rank("mp-publish", world.get(), [&] { return mp_publish(*f, *world); });
    });
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
