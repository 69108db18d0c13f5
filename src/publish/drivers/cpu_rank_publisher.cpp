// Process groups, the peer-watching fence wait, and the CPU per-process publication driver
// (see pcpkv/publish/multiproc.h).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/core/rope.h"
#include "pcpkv/ranks/symmetric.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"

namespace pcpkv {

// ---- groups ----------------------------------------------------------------------------------------

GroupLayout GroupLayout::make(int32_t world_size, int32_t tp_size) {
  PCPKV_CHECK(world_size >= 1, "world size must be >= 1, got {}", world_size);
  PCPKV_CHECK(tp_size >= 1, "--tp must be >= 1, got {}", tp_size);
  PCPKV_CHECK(world_size % tp_size == 0, "--tp {} does not divide the world size {}", tp_size, world_size);
  GroupLayout l;
  l.world_size = world_size;
  l.tp_size = tp_size;
  l.pcp_size = world_size / tp_size;
  return l;
}

std::vector<int32_t> GroupLayout::pcp_group_members(int32_t group_idx) const {
  PCPKV_CHECK(group_idx >= 0 && group_idx < tp_size, "PCP group {} is outside [0, {})", group_idx, tp_size);
  std::vector<int32_t> m(static_cast<size_t>(pcp_size));
  for (int32_t i = 0; i < pcp_size; ++i) m[static_cast<size_t>(i)] = group_idx * pcp_size + i;
  return m;
}

std::unique_ptr<Bootstrap> make_pcp_group(Bootstrap& world, const GroupLayout& layout) {
  PCPKV_CHECK(layout.world_size == world.world_size(), "group layout is for {} processes, the job has {}",
              layout.world_size, world.world_size());
  return world.split(layout.pcp_group_of(world.rank()), layout.pcp_rank_of(world.rank()));
}

// ---- liveness-aware fence wait ---------------------------------------------------------------------

bool process_alive(int64_t pid) {
  if (pid <= 0) return false;
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X' && state != 'x';
}

void fence_wait_watching_peers(HostFence& fence, int32_t barrier_idx, int64_t timeout_ms,
                               const std::vector<int64_t>& pids, const std::string& what,
                               const std::vector<int32_t>& global_ranks) {
  using Clock = std::chrono::steady_clock;
  const uint64_t e = fence.arrive(barrier_idx);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  constexpr int64_t kSliceMs = 50;
  for (;;) {
    const int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    try {
      fence.wait(barrier_idx, e, std::clamp<int64_t>(left, 1, kSliceMs));
      return;
    } catch (const FenceTimeout& t) {
      const int32_t m = t.missing_rank();
      const int64_t pid = (m >= 0 && m < static_cast<int32_t>(pids.size())) ? pids[static_cast<size_t>(m)] : 0;
      const double waited = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      const std::string who = describe_rank(m, global_ranks, pids);
      if (pid > 0 && !process_alive(pid))
        throw FenceTimeout(fmt::format("{}: {} is gone (exited or killed) without arriving at fence barrier {} "
                                       "epoch {}; rank {} stopped waiting after {:.0f} ms",
                                       what, who, barrier_idx, e, fence.rank(), waited),
                           m, fmt::format("{}:{}", __FILE__, __LINE__));
      if (Clock::now() >= deadline)
        throw FenceTimeout(fmt::format("{}: {} never arrived at fence barrier {} epoch {}; rank {} waited {} ms "
                                       "(the timeout)",
                                       what, who, barrier_idx, e, fence.rank(), timeout_ms),
                           m, fmt::format("{}:{}", __FILE__, __LINE__));
    }
  }
}

RankPublishResult RankPublisher::publish_graph_replays(const GlobalInputs&, Transport, int32_t) {
  PCPKV_FAIL("publish_graph_replays: the {} backend has no CUDA graphs", backend());
}

// ---- CPU rank publisher ----------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;
constexpr int32_t kStartBarrier = 0;    // every replica poisoned before any peer writes into it
constexpr int32_t kPublishBarrier = 1;  // the publication fence of SPEC section 5
constexpr int32_t kNumBarriers = 2;
constexpr bool kFuseTopk = false;       // the top-k fill is its own step, as in every driver

class CpuRankPublisher final : public RankPublisher {
 public:
  CpuRankPublisher(Bootstrap& group, const PublishSetup& setup, const RankPublishOptions& options)
      : group_(group), setup_(setup), options_(options) {
    validate_publish_setup(setup_);
    const int32_t W = setup_.plan->pcp_world;
    PCPKV_CHECK(group.world_size() == W,
                "publish: the plan's PCP world is {}, but this process group has {} processes", W, group.world_size());
    PCPKV_CHECK(options_.fence_timeout_ms > 0, "publish: fence_timeout_ms = {} must be > 0", options_.fence_timeout_ms);
    if (options_.global_ranks.empty())
      for (int32_t r = 0; r < W; ++r) options_.global_ranks.push_back(r);
    PCPKV_CHECK(static_cast<int32_t>(options_.global_ranks.size()) == W, "publish: {} global ranks for {} PCP ranks",
                options_.global_ranks.size(), W);
    layout_ = make_publish_layout(setup_);
    rope_ = make_rope_table(setup_.model->rope, layout_.max_position + 1);
    caches_ = make_host_symmetric(group_, layout_.caches_bytes, "caches", kGuardByte);
    pads_ = make_host_symmetric(group_, fence_pad_bytes(kNumBarriers, W), "fence pads", 0);
    std::vector<uint64_t*> pads;
    for (int32_t r = 0; r < W; ++r) pads.push_back(reinterpret_cast<uint64_t*>(pads_->ptr(r)));
    fence_ = std::make_unique<HostFence>(group_.rank(), W, kNumBarriers, pads);
    // Every pad is zero (make_host_symmetric filled it) before anyone's first arrive.
    group_.barrier();
  }

  std::string backend() const override { return "cpu"; }
  std::string device() const override {
    return fmt::format("CPU, process {} of {} ({} threads)", group_.rank(), group_.world_size(), options_.num_threads);
  }

  RankPublishResult publish(const GlobalInputs& inputs, Transport transport) override;
  std::vector<uint8_t> read_mla_alloc(int32_t r) override {
    const uint8_t* p = caches_->ptr(r);
    return {p, p + layout_.mla_alloc_bytes};
  }
  std::vector<uint8_t> read_index_alloc(int32_t r) override {
    const uint8_t* p = caches_->ptr(r) + layout_.index_region_offset;
    return {p, p + layout_.index_alloc_bytes};
  }
  std::vector<uint64_t> replica_slot_hashes(const std::vector<int64_t>& slots,
                                            const std::vector<int64_t>& index_slots = {}) override {
    return slot_hashes_reference(target_of(group_.rank()), setup_.fmt, slots, index_slots);
  }

 private:
  CacheTarget target_of(int32_t r) const {
    CacheTarget t;
    t.mla_base = caches_->ptr(r) + layout_.head;
    t.mla = layout_.mla;
    t.index_base = caches_->ptr(r) + layout_.index_region_offset + layout_.head;
    t.index = layout_.index;
    return t;
  }
  void fence(int32_t barrier_idx, const char* what) {
    fence_wait_watching_peers(*fence_, barrier_idx, options_.fence_timeout_ms, group_.pids(),
                              fmt::format("publish ({} fence)", what), options_.global_ranks);
  }

  Bootstrap& group_;
  PublishSetup setup_;
  RankPublishOptions options_;
  PublishLayout layout_;
  RopeTable rope_;
  std::unique_ptr<SymmetricMemory> caches_, pads_, staging_, collect_;
  std::unique_ptr<HostFence> fence_;
};

RankPublishResult CpuRankPublisher::publish(const GlobalInputs& inputs, Transport transport) {
  validate_publish_inputs(setup_, inputs, transport);
  const PcpPlan& plan = *setup_.plan;
  const int32_t W = plan.pcp_world;
  const int32_t me = group_.rank();
  const int64_t M = plan.max_local_tokens;
  const CacheFormat fmt = setup_.fmt;
  const int threads = std::max(1, options_.num_threads);
  const int buffer_idx = setup_.layer_idx & 1;
  const std::vector<Step> steps = pcpkv::steps(transport, layout_, kFuseTopk);
  // Collective allocations on first use of a transport (every rank runs the same transport sequence).
  if (uses(steps, Op::kDispatchStage) && !staging_)
    staging_ = make_host_symmetric(group_, layout_.staging.bytes(), "staging", 0);
  if (uses(steps, Op::kDispatchMaterialize) && !collect_)
    collect_ = make_host_symmetric(group_, layout_.collect_bytes, "collect rows", 0);

  const RankInputs in = rank_inputs(inputs, plan, me);
  std::vector<uint16_t> q_out(setup_.materialize_q ? static_cast<size_t>(M * setup_.model->q_lora_rank) : 0, 0xA5A5);
  std::vector<int32_t> topk(layout_.fill_topk ? static_cast<size_t>(M * setup_.topk_width) : 0,
                            static_cast<int32_t>(0xA5A5A5A5u));
  std::vector<CacheTarget> targets(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r) targets[static_cast<size_t>(r)] = target_of(r);
  std::vector<uint8_t*> row_dests(static_cast<size_t>(W));
  std::vector<uint16_t> kv_all, kpe_all, idx_all;
  if (uses(steps, Op::kGather)) {
    kv_all.resize(static_cast<size_t>(W * M * 512));
    kpe_all.resize(static_cast<size_t>(W * M * 64));
    if (fmt.has_indexer) idx_all.resize(static_cast<size_t>(W * M * 128));
  }

  DispatchInputs di;
  di.q_c = in.q_c.data();
  di.kv = in.kv.data();
  di.k_pe = in.k_pe.data();
  di.index_k = fmt.has_indexer ? in.index_k.data() : nullptr;
  di.positions = in.positions.data();
  di.q_norm_w = inputs.weights.q_norm_w.data();
  di.kv_norm_w = inputs.weights.kv_norm_w.data();
  di.index_ln_w = inputs.weights.index_ln_w.data();
  di.index_ln_b = inputs.weights.index_ln_b.data();
  di.rope_cos_sin = rope_.cos_sin.data();
  di.rope_num_positions = rope_.num_positions;
  di.q_c_out = q_out.data();
  di.topk = nullptr;  // the topk-fill step
  auto dispatch_params = [&] {
    DispatchParams d = base_dispatch_params(setup_, layout_, di);
    d.topk_fill = nullptr;
    d.topk_width = 0;
    return d;
  };
  auto run_dispatch = [&](const DispatchParams& d) {
    dispatch_reference(d, threads);
    if (options_.kill_pcp_rank == me) ::raise(SIGKILL);  // test hook: die between dispatch and fence
  };

  // One small function per Op of the transport table.
  auto run_step = [&](const Step& step) {
    switch (step.op) {
      case Op::kTopkFill:  // rows [topk_first_row, M) (setup.topk_fill_mode); the rest keep the poison
        std::fill(topk.begin() + topk_first_row(setup_, me) * setup_.topk_width, topk.end(), -1);
        break;
      case Op::kDispatchMaterialize: {
        DispatchParams d = dispatch_params();
        uint8_t* mine = collect_->local();
        d.kv_c_out = reinterpret_cast<uint16_t*>(mine + layout_.collect_kv_offset);
        d.k_pe_out = reinterpret_cast<uint16_t*>(mine + layout_.collect_kpe_offset);
        d.index_k_out = fmt.has_indexer ? reinterpret_cast<uint16_t*>(mine + layout_.collect_index_offset) : nullptr;
        run_dispatch(d);
        break;
      }
      case Op::kDispatchStage: {
        // This rank's rows land in every peer's staging buffer at [buffer][ubatch 0][src rank me][0].
        DispatchParams d = dispatch_params();
        for (int32_t peer = 0; peer < W; ++peer)
          row_dests[static_cast<size_t>(peer)] = staging_->ptr(peer) + layout_.staging.row_offset(buffer_idx, 0, me, 0);
        d.row_dests = row_dests.data();
        d.num_row_dests = W;
        d.row_bytes = layout_.row.row_bytes;
        run_dispatch(d);
        break;
      }
      case Op::kDispatchDirect: {
        DispatchParams d = dispatch_params();
        d.slot_mapping = in.slot_mapping.data();
        d.indexer_slot_mapping = plan.ranks[static_cast<size_t>(me)].index_slots_or_null();
        d.targets = targets.data();
        d.num_targets = W;
        run_dispatch(d);
        break;
      }
      case Op::kGather:
        fence(kPublishBarrier, "all-gather");  // every peer's rows are final
        for (int32_t src = 0; src < W; ++src) {
          const uint8_t* p = collect_->ptr(src);
          std::memcpy(kv_all.data() + src * M * 512, p + layout_.collect_kv_offset, static_cast<size_t>(M * 512 * 2));
          std::memcpy(kpe_all.data() + src * M * 64, p + layout_.collect_kpe_offset, static_cast<size_t>(M * 64 * 2));
          if (fmt.has_indexer)
            std::memcpy(idx_all.data() + src * M * 128, p + layout_.collect_index_offset,
                        static_cast<size_t>(M * 128 * 2));
        }
        break;
      case Op::kInsert: {
        InsertParams p;
        p.num_tokens = W * M;
        p.kv_c = kv_all.data();
        p.k_pe = kpe_all.data();
        p.index_k = fmt.has_indexer ? idx_all.data() : nullptr;
        p.slot_mapping = plan.gathered_slot_mapping.data();
        p.indexer_slot_mapping = plan.gathered_index_slots_or_null();
        p.fmt = fmt;
        p.target = targets[static_cast<size_t>(me)];
        insert_reference(p, threads);
        break;
      }
      case Op::kFence: fence(kPublishBarrier, "publication"); break;
      case Op::kCombine: {
        CombineParams p;
        p.rows = staging_->local() + layout_.staging.row_offset(buffer_idx, 0, 0, 0);
        p.num_src_ranks = W;
        p.max_local_tokens = M;
        p.row_bytes = layout_.row.row_bytes;
        p.slot_mapping = plan.gathered_slot_mapping.data();
        p.indexer_slot_mapping = plan.gathered_index_slots_or_null();
        p.fmt = fmt;
        p.target = targets[static_cast<size_t>(me)];
        combine_reference(p, threads);
        break;
      }
    }
  };

  std::vector<double> stage_ms(steps.size(), 0.0);
  for (int32_t rep = 0; rep < setup_.repeats; ++rep) {
    // Poison this replica, then meet: no peer writes into it before this point.
    std::memset(caches_->local(), kGuardByte, static_cast<size_t>(layout_.caches_bytes));
    fence(kStartBarrier, "start");
    for (size_t k = 0; k < steps.size(); ++k) {
      const auto t0 = Clock::now();
      run_step(steps[k]);
      stage_ms[k] += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
  }

  if (options_.corrupt_pcp_rank == me) {  // test hook: after the last fence, no peer writes here any more
    const std::vector<int64_t> written = written_slots(plan);
    if (!written.empty()) caches_->local()[layout_.head + layout_.mla.row_offset(written.front()) + 7] ^= 0x01;
  }

  RankPublishResult res;
  res.pcp_rank = me;
  res.pcp_world = W;
  res.transport = transport;
  res.mla_geometry = layout_.mla;
  res.index_geometry = layout_.index;
  res.mla_cache_offset = layout_.head;
  res.index_cache_offset = layout_.head;
  res.mla_alloc = read_mla_alloc(me);
  res.index_alloc = read_index_alloc(me);
  res.q_c_out = std::move(q_out);
  res.topk = std::move(topk);
  for (int32_t b = 0; b < kNumBarriers; ++b) res.fence_epochs.push_back(fence_->epoch(b));
  const ByteModel bytes = make_byte_model(setup_, layout_, kFuseTopk);
  for (size_t k = 0; k < steps.size(); ++k)
    res.profile.stages.push_back(Stage{steps[k].name, stage_ms[k] / setup_.repeats, steps[k].bytes(bytes, me)});
  return res;
}

}  // namespace

std::unique_ptr<RankPublisher> make_cpu_rank_publisher(Bootstrap& group, const PublishSetup& setup,
                                                       const RankPublishOptions& options) {
  return std::make_unique<CpuRankPublisher>(group, setup, options);
}

}  // namespace pcpkv
