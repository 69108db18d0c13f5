// The CPU reference backend (pcpkv/publish/backend.h): PCP ranks are threads, each with its own cache replica and
// staging workspace, running the three transports of SPEC section 5 with the host fence (pcpkv/ranks/fence.h).
// The steps, their stage names and bytes come from the transport tables (publish/transport_table.h); this file
// maps each Op to the CPU oracle's kernels.
//
// Stage profile. Rank threads run each stage concurrently; stages are separated by a host barrier, and a
// stage's ms is the wall clock from the barrier that opens it to the one that closes it (mean over
// setup.repeats). Bytes: the tables' byte model (docs/perf.md), summed over ranks.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "pcpkv/core/rope.h"
#include "publish/publish_layout.h"
#include "publish/transport_table.h"

namespace pcpkv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kFenceTimeoutMs = 60000;  // a bug, not load, would ever reach it
constexpr int32_t kPublishBarrier = 0;      // fence barrier index of the publication
constexpr bool kFuseTopk = false;           // the top-k fill is its own step, as in the CUDA drivers

// What one publication hands back for a rank (fresh every call: it moves into the PublishResult).
struct RankState {
  std::vector<uint8_t> mla_alloc, index_alloc;   // whole allocations, kGuardByte outside written rows
  CacheTarget target;                            // this rank's replica
  std::vector<uint16_t> q_out;                   // [M, q_lora_rank]
  std::vector<int32_t> topk;                     // [M, topk_width]
  std::vector<uint64_t> pad;                     // fence signal pad [1][2][W]
  std::unique_ptr<HostFence> fence;
};

// Per-rank working memory kept by the backend across calls (reused storage avoids ~1 GB of fresh page faults
// per GLM-5 32K publication).
struct RankScratch {
  RankInputs in;
  std::vector<uint16_t> kv_c_out, k_pe_out, index_k_out;  // collect: [M, 512 | 64 | 128]
  std::vector<uint16_t> kv_c_all, k_pe_all, index_k_all;  // collect: [W * M, ...]
  std::unique_ptr<uint8_t[]> staging;                     // StagingGeometry::bytes(), symmetric across ranks
  int64_t staging_bytes = 0;
};

bool same_rope(const RopeConfig& a, const RopeConfig& b) {
  return a.scaling == b.scaling && a.theta == b.theta && a.factor == b.factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings && a.beta_fast == b.beta_fast &&
         a.beta_slow == b.beta_slow && a.mscale == b.mscale && a.mscale_all_dim == b.mscale_all_dim;
}

// The same checks as every other publication driver (CUDA, per-process): one definition.
void validate_setup(const PublishSetup& s, const GlobalInputs& in, Transport transport) {
  mp::validate_publish_setup(s);
  mp::validate_publish_inputs(s, in, transport);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : num_threads_(num_threads > 0 ? num_threads
                                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) {}

  std::string name() const override { return "cpu"; }
  std::string device() const override { return fmt::format("CPU ({} threads)", num_threads_); }

  PublishResult publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) override;

 private:
  std::shared_ptr<const RopeTable> rope_table(const RopeConfig& rope, int64_t num_positions);

  int num_threads_;
  std::mutex publish_mutex_;              // one publication at a time: they share scratch_
  std::vector<RankScratch> scratch_;
  std::mutex rope_mutex_;
  RopeConfig rope_key_;
  std::shared_ptr<const RopeTable> rope_;  // cached across calls (the table costs ~0.1 s at 32K positions)
};

std::shared_ptr<const RopeTable> CpuBackend::rope_table(const RopeConfig& rope, int64_t num_positions) {
  std::lock_guard<std::mutex> lock(rope_mutex_);
  if (!rope_ || !same_rope(rope_key_, rope) || rope_->num_positions < num_positions) {
    rope_ = std::make_shared<const RopeTable>(make_rope_table(rope, num_positions));
    rope_key_ = rope;
  }
  return rope_;
}

PublishResult CpuBackend::publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) {
  validate_setup(setup, inputs, transport);
  std::lock_guard<std::mutex> publish_lock(publish_mutex_);
  const ModelConfig& model = *setup.model;
  const PcpPlan& plan = *setup.plan;
  const CacheFormat fmt = setup.fmt;
  const int32_t W = plan.pcp_world;
  const int64_t M = plan.max_local_tokens;
  const int64_t q_rank = model.q_lora_rank;
  const bool fill_topk = setup.topk_width > 0 && fmt.has_indexer;  // shared layers keep the previous top-k
  const TransportRowLayout row_layout = transport_row_layout(fmt);
  const int threads_per_rank = std::max(1, num_threads_ / W);

  PublishResult result;
  result.transport = transport;
  // Geometry and allocation layout shared with the CUDA and per-process drivers (byte-comparable replicas).
  const mp::PublishLayout layout = mp::make_publish_layout(setup);
  result.mla_geometry = layout.mla;
  result.index_geometry = layout.index;
  const MlaCacheGeometry& mg = result.mla_geometry;
  const IndexerCacheGeometry& ig = result.index_geometry;
  result.mla_cache_offset = layout.head;
  result.index_cache_offset = layout.head;

  int64_t max_pos = 0;
  for (int64_t p : plan.global_positions) max_pos = std::max(max_pos, p);
  const std::shared_ptr<const RopeTable> rope = rope_table(model.rope, max_pos + 1);

  StagingGeometry sg;
  sg.num_ubatches = setup.num_ubatches;
  sg.pcp_world = W;
  sg.max_local_tokens = M;
  sg.row_bytes = row_layout.row_bytes;
  const int buffer_idx = setup.layer_idx & 1;

  const std::vector<mp::Step> steps = mp::steps(transport, layout, kFuseTopk);
  const size_t num_stages = steps.size();

  std::vector<RankState> ranks(static_cast<size_t>(W));
  if (scratch_.size() < static_cast<size_t>(W)) scratch_.resize(static_cast<size_t>(W));
  std::vector<CacheTarget> targets(static_cast<size_t>(W));
  std::vector<uint8_t*> row_dests_storage;  // [W][W]: rank r's row_dests = peers' staging slots of r

  // Per-rank setup (allocation, poisoning, local inputs), in the rank threads; not timed.
  auto prepare_rank = [&](int32_t r) {
    RankState& st = ranks[static_cast<size_t>(r)];
    RankScratch& sc = scratch_[static_cast<size_t>(r)];
    rank_inputs(inputs, plan, r, &sc.in);
    const int64_t head = layout.head;
    st.mla_alloc.assign(static_cast<size_t>(layout.mla_alloc_bytes), kGuardByte);
    st.index_alloc.assign(static_cast<size_t>(layout.index_alloc_bytes), kGuardByte);
    st.target.mla_base = st.mla_alloc.data() + head;
    st.target.mla = mg;
    st.target.index_base = st.index_alloc.data() + head;
    st.target.index = ig;
    targets[static_cast<size_t>(r)] = st.target;
    if (setup.materialize_q) st.q_out.assign(static_cast<size_t>(M * q_rank), 0xA5A5);
    if (fill_topk) st.topk.assign(static_cast<size_t>(M * setup.topk_width), static_cast<int32_t>(0xA5A5A5A5u));
    if (mp::uses(steps, mp::Op::kDispatchMaterialize)) {
      sc.kv_c_out.assign(static_cast<size_t>(M * 512), 0xA5A5);
      sc.k_pe_out.assign(static_cast<size_t>(M * 64), 0xA5A5);
      sc.kv_c_all.resize(static_cast<size_t>(W * M * 512));
      sc.k_pe_all.resize(static_cast<size_t>(W * M * 64));
      sc.index_k_out.assign(fmt.has_indexer ? static_cast<size_t>(M * 128) : 0, 0xA5A5);
      sc.index_k_all.resize(fmt.has_indexer ? static_cast<size_t>(W * M * 128) : 0);
    }
    if (mp::uses(steps, mp::Op::kDispatchStage) && sc.staging_bytes < sg.bytes()) {
      sc.staging.reset(new uint8_t[static_cast<size_t>(sg.bytes())]);  // contents unspecified until written
      sc.staging_bytes = sg.bytes();
    }
  };

  // Fence pads are set up (zeroed) before any rank runs.
  std::vector<uint64_t*> pads(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r) {
    ranks[static_cast<size_t>(r)].pad.assign(static_cast<size_t>(fence_pad_elems(1, W)), 0);
    pads[static_cast<size_t>(r)] = ranks[static_cast<size_t>(r)].pad.data();
  }
  for (int32_t r = 0; r < W; ++r) ranks[static_cast<size_t>(r)].fence = std::make_unique<HostFence>(r, W, 1, pads);

  // Stage timestamps: one per barrier phase; phase 0 = everyone prepared, then per repeat 1 + num_stages.
  std::vector<Clock::time_point> stamps;
  stamps.reserve(1 + static_cast<size_t>(setup.repeats) * (1 + num_stages));
  auto on_phase = [&stamps]() noexcept { stamps.push_back(Clock::now()); };
  std::barrier phase_barrier(W, on_phase);
  std::atomic<bool> failed{false};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(W));

  auto base_dispatch = [&](int32_t r, RankState& st, const RankScratch& sc) {
    mp::DispatchInputs di;
    di.q_c = sc.in.q_c.data();
    di.kv = sc.in.kv.data();
    di.k_pe = sc.in.k_pe.data();
    di.index_k = sc.in.index_k.data();
    di.positions = sc.in.positions.data();
    di.q_norm_w = inputs.weights.q_norm_w.data();
    di.kv_norm_w = inputs.weights.kv_norm_w.data();
    di.index_ln_w = inputs.weights.index_ln_w.data();
    di.index_ln_b = inputs.weights.index_ln_b.data();
    di.rope_cos_sin = rope->cos_sin.data();
    di.rope_num_positions = rope->num_positions;
    di.q_c_out = st.q_out.data();
    di.topk = kFuseTopk ? st.topk.data() : nullptr;
    di.topk_indexer_rows = plan.ranks[static_cast<size_t>(r)].num_local_tokens;  // fused fill: setup.topk_fill_mode
    DispatchParams d = mp::base_dispatch_params(setup, layout, di);
    if (!kFuseTopk) {
      d.topk_fill = nullptr;  // the topk-fill step
      d.topk_width = 0;
    }
    return d;
  };

  if (mp::uses(steps, mp::Op::kDispatchStage)) row_dests_storage.resize(static_cast<size_t>(W) * W);

  // One small function per Op of the transport table.
  auto run_step = [&](int32_t r, const mp::Step& step) {
    RankState& st = ranks[static_cast<size_t>(r)];
    RankScratch& sc = scratch_[static_cast<size_t>(r)];
    switch (step.op) {
      case mp::Op::kTopkFill:  // rows [topk_first_row, M) (setup.topk_fill_mode); the rest keep the poison
        std::fill(st.topk.begin() + mp::topk_first_row(setup, r) * setup.topk_width, st.topk.end(), -1);
        break;
      case mp::Op::kDispatchMaterialize: {
        DispatchParams d = base_dispatch(r, st, sc);
        d.kv_c_out = sc.kv_c_out.data();
        d.k_pe_out = sc.k_pe_out.data();
        d.index_k_out = fmt.has_indexer ? sc.index_k_out.data() : nullptr;
        dispatch_reference(d, threads_per_rank);
        break;
      }
      case mp::Op::kDispatchStage: {
        // Rank r's rows land in every peer's staging buffer at [buffer][ubatch 0][src rank r][0].
        DispatchParams d = base_dispatch(r, st, sc);
        uint8_t** dests = row_dests_storage.data() + static_cast<size_t>(r) * W;
        for (int32_t peer = 0; peer < W; ++peer)
          dests[peer] = scratch_[static_cast<size_t>(peer)].staging.get() + sg.row_offset(buffer_idx, 0, r, 0);
        d.row_dests = dests;
        d.num_row_dests = W;
        d.row_bytes = row_layout.row_bytes;
        dispatch_reference(d, threads_per_rank);
        break;
      }
      case mp::Op::kDispatchDirect: {
        DispatchParams d = base_dispatch(r, st, sc);
        d.slot_mapping = sc.in.slot_mapping.data();
        d.indexer_slot_mapping = plan.ranks[static_cast<size_t>(r)].index_slots_or_null();
        d.targets = targets.data();
        d.num_targets = W;
        dispatch_reference(d, threads_per_rank);
        break;
      }
      case mp::Op::kGather:
        // Three all-gathers: every rank copies every rank's padded rows, rank-major.
        for (int32_t src = 0; src < W; ++src) {
          const RankScratch& s = scratch_[static_cast<size_t>(src)];
          std::copy(s.kv_c_out.begin(), s.kv_c_out.end(), sc.kv_c_all.begin() + src * M * 512);
          std::copy(s.k_pe_out.begin(), s.k_pe_out.end(), sc.k_pe_all.begin() + src * M * 64);
          if (fmt.has_indexer)
            std::copy(s.index_k_out.begin(), s.index_k_out.end(), sc.index_k_all.begin() + src * M * 128);
        }
        break;
      case mp::Op::kInsert: {
        InsertParams p;
        p.num_tokens = W * M;
        p.kv_c = sc.kv_c_all.data();
        p.k_pe = sc.k_pe_all.data();
        p.index_k = fmt.has_indexer ? sc.index_k_all.data() : nullptr;
        p.slot_mapping = plan.gathered_slot_mapping.data();
        p.indexer_slot_mapping = plan.gathered_index_slots_or_null();
        p.fmt = fmt;
        p.target = st.target;
        insert_reference(p, threads_per_rank);
        break;
      }
      case mp::Op::kFence: st.fence->arrive_and_wait(kPublishBarrier, kFenceTimeoutMs); break;
      case mp::Op::kCombine: {
        CombineParams p;
        p.rows = sc.staging.get() + sg.row_offset(buffer_idx, 0, 0, 0);
        p.num_src_ranks = W;
        p.max_local_tokens = M;
        p.row_bytes = row_layout.row_bytes;
        p.slot_mapping = plan.gathered_slot_mapping.data();
        p.indexer_slot_mapping = plan.gathered_index_slots_or_null();
        p.fmt = fmt;
        p.target = st.target;
        combine_reference(p, threads_per_rank);
        break;
      }
    }
  };

  auto rank_main = [&](int32_t r) {
    try {
      prepare_rank(r);
      phase_barrier.arrive_and_wait();
      if (failed.load()) return;
      for (int32_t rep = 0; rep < setup.repeats; ++rep) {
        for (size_t stage = 0; stage < num_stages; ++stage) {
          run_step(r, steps[stage]);
          phase_barrier.arrive_and_wait();
          if (failed.load()) return;
        }
        phase_barrier.arrive_and_wait();  // closes the repeat (keeps repeats apart)
        if (failed.load()) return;
      }
    } catch (...) {
      errors[static_cast<size_t>(r)] = std::current_exception();
      failed.store(true);
      phase_barrier.arrive_and_drop();  // let the others finish the phase, see `failed`, and stop
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(W));
  for (int32_t r = 0; r < W; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);

  // ---- profile ----
  std::vector<double> stage_ms(num_stages, 0.0);
  for (int32_t rep = 0; rep < setup.repeats; ++rep) {
    const size_t base = 1 + static_cast<size_t>(rep) * (num_stages + 1);  // stamps[base - 1] opens the repeat
    for (size_t k = 0; k < num_stages; ++k)
      stage_ms[k] += std::chrono::duration<double, std::milli>(stamps[base + k] - stamps[base + k - 1]).count();
  }
  const mp::ByteModel bytes = mp::make_byte_model(setup, layout, kFuseTopk);
  for (size_t k = 0; k < num_stages; ++k)
    result.profile.stages.push_back(
        Stage{steps[k].name, stage_ms[k] / setup.repeats, mp::step_bytes_all_ranks(steps[k], bytes)});

  // ---- hand the allocations over (they are host memory already) ----
  for (RankState& st : ranks) {
    result.mla_alloc.push_back(std::move(st.mla_alloc));
    result.index_alloc.push_back(std::move(st.index_alloc));
    if (setup.materialize_q) result.q_c_out.push_back(std::move(st.q_out));
    if (fill_topk) result.topk.push_back(std::move(st.topk));
  }
  return result;
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_unique<CpuBackend>(num_threads); }

}  // namespace pcpkv
