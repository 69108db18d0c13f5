// `pcpkv mp-publish`, step 1 (mp_publish.h): the memory pre-checks estimated from the flags (host memory
// before the rendezvous, device memory agreed by every rank), then plan, inputs, group and options.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include <unistd.h>

#include <fmt/format.h>

#include "error_line.h"
#include "footprint.h"
#include "mp_publish.h"
#include "pcpkv/core/error.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/publish/transport_choice.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/ranks/cuda.h"
#endif

namespace pcpkv::cli {
namespace {

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
  BatchShape batch;  // footprint.h
  long double world = 1;  // ranks of one PCP group
  long double q_rank = 0;
  RowBytes row;
  long double topk_width = 0, alloc_extra = 0;
  bool staging = false, collect = false;

  long double num_tokens() const { return batch.tokens; }
  long double max_local_tokens() const { return batch.max_local_tokens(world); }
  long double max_keys() const { return batch.max_keys; }
  long double replica() const { return row.replica(batch.slots()) + alloc_extra; }
};

MpShape mp_shape(const MpPublishFlags& f, const ModelConfig& model, int64_t group_world) {
  MpShape s;
  const CacheFormat fmt = parse_format_flags(f);
  s.batch = BatchShape(f.block_size);
  if (f.tokens > 0) s.batch.add({RequestKind::kPrefill, f.tokens, 0});
  s.batch.add_decodes(f.decodes, 1000, 1007);  // decode i: context 1000 (i + 1) + 7 i, as mp_publish plans it
  s.world = static_cast<long double>(group_world);
  s.q_rank = static_cast<long double>(model.q_lora_rank);
  s.row = RowBytes::of(fmt, s.q_rank);
  s.topk_width = fmt.has_indexer ? static_cast<long double>(f.topk_width) : 0;
  // Two allocations (MLA, indexer), each with guards on both sides and the base offset, 2 MiB rounding.
  s.alloc_extra = 2 * (2.0L * static_cast<long double>(f.guard_bytes) + static_cast<long double>(f.base_offset)) +
                  (2 << 20);
  for (Transport t : candidate_transports(f.transport)) {
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
  m.add("plan", 20 * N + 32 * W * M + 4 * s.batch.blocks + 80 * (s.batch.decodes + 1));
  m.add("inputs", N * (s.row.input + 8));
  m.add("rope table", s.max_keys() * 64 * 4);
  m.add("own replica and its copy in the result", 2 * s.replica());
  m.add("local inputs", M * (s.row.input + 16 + s.q_rank * 2 + s.topk_width * 4));
  m.add("published q_c_out and top-k", M * (s.q_rank * 2 + s.topk_width * 4));  // the rank's result, kept per transport
  if (s.staging) m.add("staging buffers", 2 * W * M * s.row.transport);
  if (s.collect) m.add("collect buffers", 2 * W * M * s.row.bf16);
  if (leader) {
    // The CPU reference's W replicas, the W copies read back from the ranks (+ one in flight while a copy
    // replaces another) and the W - 1 peers' shared-memory replicas it reads.
    m.add("check: replicas", 3 * W * s.replica());
    long double scratch = W * M * (s.row.input + 16 + s.q_rank * 2 + s.topk_width * 4) + s.max_keys() * 64 * 4;
    if (s.collect) scratch += W * (M + W * M) * s.row.bf16;
    if (s.staging) scratch += W * 2 * W * M * s.row.transport;
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
  m.add("inputs, q_c_out and top-k", M * (s.row.input + 16 + s.q_rank * 2 + s.topk_width * 4));
  m.add("rope table", s.max_keys() * 64 * 4);
  if (s.staging) m.add("staging buffers", 2 * W * M * s.row.transport + (2 << 20));
  if (s.collect) m.add("collect buffers", 2 * W * M * s.row.bf16 + (2 << 20));
  m.add("L2 flush scratch", f.flush_l2_mb * 1024 * 1024);
  return m;
}
#endif

std::string mp_sizing_flags(const MpPublishFlags& f, int64_t world, int64_t local) {
  return fmt::format("--tokens {} --decodes {} --block-size {} --transport {} --tp {}{} ({} rank{}, {} on this host)",
                     f.tokens, f.decodes, f.block_size, f.transport, f.tp, f.no_check ? " --no-check" : "", world,
                     world == 1 ? "" : "s", local);
}

// --transport auto: the PCP group's topology (every rank's host name, and its row of peer access: shared
// memory within a host on the CPU, the same GPU or CUDA P2P access on CUDA), gathered over the group so that
// every rank decides the same.
TransportChoice auto_transport(Bootstrap& group, const std::string& backend) {
  constexpr size_t kHost = 64;
  const auto W = static_cast<size_t>(group.world_size());
  char host[kHost] = {};
  if (::gethostname(host, kHost - 1) != 0 || host[0] == '\0') std::snprintf(host, kHost, "localhost");
  std::vector<char> hosts(kHost * W);
  group.all_gather(host, kHost, hosts.data());
  Topology t;
  for (size_t r = 0; r < W; ++r) t.hosts.emplace_back(&hosts[kHost * r], ::strnlen(&hosts[kHost * r], kHost - 1));
  const auto me = static_cast<size_t>(group.rank());
  std::vector<uint8_t> row(W);
  for (size_t b = 0; b < W; ++b) row[b] = t.hosts[b] == t.hosts[me] ? 1 : 0;
#if defined(PCPKV_HAVE_CUDA)
  if (backend == "cuda") {
    const std::vector<bool> p2p = cuda::peer_access_row(group);
    for (size_t b = 0; b < W; ++b) row[b] = row[b] && p2p[b] ? 1 : 0;
    t.nccl_available = cuda::have_nccl();
  }
#else
  (void)backend;
#endif
  std::vector<uint8_t> all(W * W);
  group.all_gather(row.data(), W, all.data());
  for (size_t a = 0; a < W; ++a) t.peer_access.emplace_back(all.begin() + a * W, all.begin() + (a + 1) * W);
  return choose_transport(t);
}

// Refuses, checked by every rank before the rendezvous, a job whose ranks on this host need more host memory
// than it has: each rank computes the sum from its own flags and environment; a rank's refusal is carried into the
// rendezvous (run_rank_program), so a rank with another --tokens is named by all and none waits. The world size
// comes from the launcher's environment (a world of one without it).
}  // namespace

std::vector<Transport> candidate_transports(const std::string& transport) {
  if (transport == "auto") return {Transport::kCollect, Transport::kDirect};
  return parse_transport_list(transport);
}

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
// GPU: the estimate is the sum of the publisher's buffers (src/publish/drivers/cuda/multiproc_publisher.cpp).
static void check_mp_device_memory(const MpPublishFlags& f, const ModelConfig& model, Bootstrap& world,
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

void setup_mp_job(const MpPublishFlags& f, Bootstrap& world, MpJob& job) {
  job.layout = GroupLayout::make(world.world_size(), f.tp);
  const GroupLayout& layout = job.layout;
  job.group_idx = layout.pcp_group_of(world.rank());
  const int32_t group_idx = job.group_idx;
  // Validate everything before the first collective allocation (the flags alone: check_flags).
  job.model = f.config.empty() ? preset(f.model) : load_hf_config(f.config, f.model);
  job.model.validate();
  PCPKV_CHECK(f.kill_rank < world.world_size(), "--kill-rank {} is not a rank of this {}-process job", f.kill_rank,
              world.world_size());
  PCPKV_CHECK(f.corrupt_rank < world.world_size(), "--corrupt-rank {} is not a rank of this {}-process job",
              f.corrupt_rank, world.world_size());
  job.check_replicas = f.check_replicas || replica_check_from_env();
  PlanConfig pc;
  pc.pcp_world = layout.pcp_size;
  pc.pcp_rank_base = group_idx * layout.pcp_size;
  pc.block_size = f.block_size;
  pc.seed = f.seed;
  pc.local_order = parse_local_order(f.local_order, "--local-order");
  pc.decode_ownership = parse_decode_ownership(f.decode_ownership, "--decode-ownership");
  if (f.tokens > 0) pc.requests.push_back({RequestKind::kPrefill, f.tokens, 0});
  for (int32_t i = 0; i < f.decodes; ++i) pc.requests.push_back({RequestKind::kDecode, 1, 1000 * int64_t{i + 1} + 7 * i});
  PCPKV_CHECK(!pc.requests.empty(), "--tokens 0 --decodes 0: the batch is empty");
  job.plan = make_plan(pc);
  job.fmt = parse_format_flags(f);
  const CacheFormat& fmt = job.fmt;
  job.transports = candidate_transports(f.transport);  // "auto": decided after the rendezvous
  // Each PCP group publishes its own inputs: the checks then catch a write that crossed groups.
  job.group_seed = f.seed + 1000003ull * static_cast<uint64_t>(group_idx);
  job.inputs = generate_inputs(job.model, job.plan, fmt.has_indexer, job.group_seed);

  PublishSetup& setup = job.setup;
  setup.model = &job.model;
  setup.plan = &job.plan;
  setup.fmt = fmt;
  setup.alloc.guard_bytes = f.guard_bytes;
  setup.alloc.base_offset = f.base_offset;
  setup.topk_width = f.topk_width;
  setup.topk_fill_mode = parse_topk_fill(f.topk_fill, "--topk-fill");
  setup.repeats = f.repeats;

  std::string& backend_name = job.backend_name;
  job.factory = rank_publisher_factory(f.backend, &backend_name);
#if defined(PCPKV_HAVE_CUDA)
  // This rank's device first (round-robin), so that nothing creates a context on another GPU.
  if (backend_name == "cuda") {
    const int32_t device = cuda::select_rank_device(world);
    check_mp_device_memory(f, job.model, world, layout.pcp_size, device);  // before the first device allocation
  }
#endif
  job.group = make_pcp_group(world, layout);
  if (f.transport == "auto") {
    const TransportChoice choice = auto_transport(*job.group, backend_name);
    job.transports = {choice.transport};
    job.transport_reason = "--transport auto: " + choice.reason;
    if (job.group->rank() == 0)
      print_stderr(fmt::format("pcpkv mp-publish: PCP group {}: {}\n", group_idx, job.transport_reason));
  }
  RankPublishOptions& opt = job.opt;
  opt.fence_timeout_ms = f.fence_timeout_ms;
  opt.num_threads = f.threads;
  opt.global_ranks = layout.pcp_group_members(group_idx);
  opt.collect_via = f.collect_via;
  opt.warmup_runs = f.warmup;
  opt.flush_l2_bytes = static_cast<int64_t>(f.flush_l2_mb * 1024 * 1024);
  if (f.kill_rank >= 0 && layout.pcp_group_of(f.kill_rank) == group_idx) opt.kill_pcp_rank = layout.pcp_rank_of(f.kill_rank);
  if (f.corrupt_rank >= 0 && layout.pcp_group_of(f.corrupt_rank) == group_idx)
    opt.corrupt_pcp_rank = layout.pcp_rank_of(f.corrupt_rank);
  PCPKV_CHECK(f.graph_replays == 0 || backend_name == "cuda", "--graph-replays needs the cuda backend (got {})",
              backend_name);
  job.leader = job.group->rank() == 0;
}

}  // namespace pcpkv::cli
