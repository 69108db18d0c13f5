// The CPU reference backend (pcpkv/publish/backend.h): PCP ranks are threads, each with its own cache replica and
// staging workspace, running the three transports of SPEC section 5 with the host fence (pcpkv/ranks/fence.h).
// The steps, their stage names and bytes come from the transport tables (publish/drivers/transport_table.h); this file
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
#include <functional>
#include <mutex>
#include <thread>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "pcpkv/core/rope.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"

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
  validate_publish_setup(s);
  validate_publish_inputs(s, in, transport);
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

// One publication of the CPU backend: what every rank thread shares, and one small function per Op of the
// transport table. Lives for one CpuBackend::publish call.
class Publication {
 public:
  Publication(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport,
              std::shared_ptr<const RopeTable> rope, std::vector<RankScratch>& scratch, int num_threads);
  PublishResult run();

 private:
  // Stamps the wall clock each time every rank has reached the barrier (std::barrier's completion step).
  struct StampPhase {
    std::vector<Clock::time_point>* stamps;
    void operator()() noexcept { stamps->push_back(Clock::now()); }
  };

  void prepare_rank(int32_t r);
  void run_ranks();
  void rank_main(int32_t r, std::barrier<StampPhase>& phase_barrier);
  void run_step(int32_t r, const Step& step);
  DispatchParams base_dispatch(int32_t r);
  void topk_fill_step(int32_t r);
  void dispatch_materialize(int32_t r);
  void dispatch_stage(int32_t r);
  void dispatch_direct(int32_t r);
  void gather(int32_t r);
  void insert(int32_t r);
  void combine(int32_t r);
  void write_profile();
  void hand_over_allocations();

  const PublishSetup& setup_;
  const GlobalInputs& inputs_;
  const PcpPlan& plan_;
  const CacheFormat fmt_;
  const int32_t W_;
  const int64_t M_;
  const bool fill_topk_;  // shared layers keep the previous top-k
  const TransportRowLayout row_layout_;
  const int threads_per_rank_;
  const PublishLayout layout_;  // shared with the CUDA and per-process drivers (byte-comparable replicas)
  const std::shared_ptr<const RopeTable> rope_;
  StagingGeometry sg_;
  const int buffer_idx_;
  const std::vector<Step> steps_;
  std::vector<RankScratch>& scratch_;
  std::vector<RankState> ranks_;
  std::vector<CacheTarget> targets_;
  std::vector<uint8_t*> row_dests_storage_;  // [W][W]: rank r's row_dests = peers' staging slots of r
  std::vector<uint64_t*> pads_;
  // Stage timestamps: one per barrier phase; phase 0 = everyone prepared, then per repeat 1 + num_stages.
  std::vector<Clock::time_point> stamps_;
  std::atomic<bool> failed_{false};
  std::vector<std::exception_ptr> errors_;
  PublishResult result_;
};

Publication::Publication(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport,
                         std::shared_ptr<const RopeTable> rope, std::vector<RankScratch>& scratch, int num_threads)
    : setup_(setup),
      inputs_(inputs),
      plan_(*setup.plan),
      fmt_(setup.fmt),
      W_(plan_.pcp_world),
      M_(plan_.max_local_tokens),
      fill_topk_(setup.topk_width > 0 && fmt_.has_indexer),
      row_layout_(transport_row_layout(fmt_)),
      threads_per_rank_(std::max(1, num_threads / W_)),
      layout_(make_publish_layout(setup)),
      rope_(std::move(rope)),
      buffer_idx_(setup.layer_idx & 1),
      steps_(steps(transport, layout_, kFuseTopk)),
      scratch_(scratch),
      ranks_(static_cast<size_t>(W_)),
      targets_(static_cast<size_t>(W_)),
      pads_(static_cast<size_t>(W_)),
      errors_(static_cast<size_t>(W_)) {
  result_.transport = transport;
  result_.mla_geometry = layout_.mla;
  result_.index_geometry = layout_.index;
  result_.mla_cache_offset = layout_.head;
  result_.index_cache_offset = layout_.head;
  sg_.num_ubatches = setup.num_ubatches;
  sg_.pcp_world = W_;
  sg_.max_local_tokens = M_;
  sg_.row_bytes = row_layout_.row_bytes;
  if (scratch_.size() < static_cast<size_t>(W_)) scratch_.resize(static_cast<size_t>(W_));
  if (uses(steps_, Op::kDispatchStage)) row_dests_storage_.resize(static_cast<size_t>(W_) * W_);
  // Fence pads are set up (zeroed) before any rank runs.
  for (int32_t r = 0; r < W_; ++r) {
    ranks_[static_cast<size_t>(r)].pad.assign(static_cast<size_t>(fence_pad_elems(1, W_)), 0);
    pads_[static_cast<size_t>(r)] = ranks_[static_cast<size_t>(r)].pad.data();
  }
  for (int32_t r = 0; r < W_; ++r) ranks_[static_cast<size_t>(r)].fence = std::make_unique<HostFence>(r, W_, 1, pads_);
}

PublishResult Publication::run() {
  run_ranks();
  write_profile();
  hand_over_allocations();
  return std::move(result_);
}

// Per-rank setup (allocation, poisoning, local inputs), in the rank threads; not timed.
void Publication::prepare_rank(int32_t r) {
  RankState& st = ranks_[static_cast<size_t>(r)];
  RankScratch& sc = scratch_[static_cast<size_t>(r)];
  rank_inputs(inputs_, plan_, r, &sc.in);
  const int64_t head = layout_.head;
  st.mla_alloc.assign(static_cast<size_t>(layout_.mla_alloc_bytes), kGuardByte);
  st.index_alloc.assign(static_cast<size_t>(layout_.index_alloc_bytes), kGuardByte);
  st.target.mla_base = st.mla_alloc.data() + head;
  st.target.mla = result_.mla_geometry;
  st.target.index_base = st.index_alloc.data() + head;
  st.target.index = result_.index_geometry;
  targets_[static_cast<size_t>(r)] = st.target;
  if (setup_.materialize_q) st.q_out.assign(static_cast<size_t>(M_ * setup_.model->q_lora_rank), 0xA5A5);
  if (fill_topk_) st.topk.assign(static_cast<size_t>(M_ * setup_.topk_width), static_cast<int32_t>(0xA5A5A5A5u));
  if (uses(steps_, Op::kDispatchMaterialize)) {
    sc.kv_c_out.assign(static_cast<size_t>(M_ * 512), 0xA5A5);
    sc.k_pe_out.assign(static_cast<size_t>(M_ * 64), 0xA5A5);
    sc.kv_c_all.resize(static_cast<size_t>(W_ * M_ * 512));
    sc.k_pe_all.resize(static_cast<size_t>(W_ * M_ * 64));
    sc.index_k_out.assign(fmt_.has_indexer ? static_cast<size_t>(M_ * 128) : 0, 0xA5A5);
    sc.index_k_all.resize(fmt_.has_indexer ? static_cast<size_t>(W_ * M_ * 128) : 0);
  }
  if (uses(steps_, Op::kDispatchStage) && sc.staging_bytes < sg_.bytes()) {
    sc.staging.reset(new uint8_t[static_cast<size_t>(sg_.bytes())]);  // contents unspecified until written
    sc.staging_bytes = sg_.bytes();
  }
}

// One thread per rank; stages are separated by a barrier whose completion stamps the clock.
void Publication::run_ranks() {
  stamps_.reserve(1 + static_cast<size_t>(setup_.repeats) * (1 + steps_.size()));
  std::barrier<StampPhase> phase_barrier(W_, StampPhase{&stamps_});
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(W_));
  for (int32_t r = 0; r < W_; ++r) threads.emplace_back(&Publication::rank_main, this, r, std::ref(phase_barrier));
  for (auto& t : threads) t.join();
  for (auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

void Publication::rank_main(int32_t r, std::barrier<StampPhase>& phase_barrier) {
  try {
    prepare_rank(r);
    phase_barrier.arrive_and_wait();
    if (failed_.load()) return;
    for (int32_t rep = 0; rep < setup_.repeats; ++rep) {
      for (const Step& step : steps_) {
        run_step(r, step);
        phase_barrier.arrive_and_wait();
        if (failed_.load()) return;
      }
      phase_barrier.arrive_and_wait();  // closes the repeat (keeps repeats apart)
      if (failed_.load()) return;
    }
  } catch (...) {
    errors_[static_cast<size_t>(r)] = std::current_exception();
    failed_.store(true);
    phase_barrier.arrive_and_drop();  // let the others finish the phase, see `failed_`, and stop
  }
}

// One small function per Op of the transport table.
void Publication::run_step(int32_t r, const Step& step) {
  switch (step.op) {
    case Op::kTopkFill: topk_fill_step(r); break;
    case Op::kDispatchMaterialize: dispatch_materialize(r); break;
    case Op::kDispatchStage: dispatch_stage(r); break;
    case Op::kDispatchDirect: dispatch_direct(r); break;
    case Op::kGather: gather(r); break;
    case Op::kInsert: insert(r); break;
    case Op::kFence: ranks_[static_cast<size_t>(r)].fence->arrive_and_wait(kPublishBarrier, kFenceTimeoutMs); break;
    case Op::kCombine: combine(r); break;
  }
}

DispatchParams Publication::base_dispatch(int32_t r) {
  RankState& st = ranks_[static_cast<size_t>(r)];
  const RankScratch& sc = scratch_[static_cast<size_t>(r)];
  DispatchInputs di;
  di.q_c = sc.in.q_c.data();
  di.kv = sc.in.kv.data();
  di.k_pe = sc.in.k_pe.data();
  di.index_k = sc.in.index_k.data();
  di.positions = sc.in.positions.data();
  di.q_norm_w = inputs_.weights.q_norm_w.data();
  di.kv_norm_w = inputs_.weights.kv_norm_w.data();
  di.index_ln_w = inputs_.weights.index_ln_w.data();
  di.index_ln_b = inputs_.weights.index_ln_b.data();
  di.rope_cos_sin = rope_->cos_sin.data();
  di.rope_num_positions = rope_->num_positions;
  di.q_c_out = st.q_out.data();
  di.topk = kFuseTopk ? st.topk.data() : nullptr;
  di.topk_indexer_rows = plan_.ranks[static_cast<size_t>(r)].num_local_tokens;  // fused fill: setup.topk_fill_mode
  DispatchParams d = base_dispatch_params(setup_, layout_, di);
  if (!kFuseTopk) {
    d.topk_fill = nullptr;  // the topk-fill step
    d.topk_width = 0;
  }
  return d;
}

// Rows [topk_first_row, M) (setup.topk_fill_mode); the rest keep the poison.
void Publication::topk_fill_step(int32_t r) {
  std::vector<int32_t>& topk = ranks_[static_cast<size_t>(r)].topk;
  std::fill(topk.begin() + topk_first_row(setup_, r) * setup_.topk_width, topk.end(), -1);
}

void Publication::dispatch_materialize(int32_t r) {
  RankScratch& sc = scratch_[static_cast<size_t>(r)];
  DispatchParams d = base_dispatch(r);
  d.kv_c_out = sc.kv_c_out.data();
  d.k_pe_out = sc.k_pe_out.data();
  d.index_k_out = fmt_.has_indexer ? sc.index_k_out.data() : nullptr;
  dispatch_reference(d, threads_per_rank_);
}

// Rank r's rows land in every peer's staging buffer at [buffer][ubatch 0][src rank r][0].
void Publication::dispatch_stage(int32_t r) {
  DispatchParams d = base_dispatch(r);
  uint8_t** dests = row_dests_storage_.data() + static_cast<size_t>(r) * W_;
  for (int32_t peer = 0; peer < W_; ++peer)
    dests[peer] = scratch_[static_cast<size_t>(peer)].staging.get() + sg_.row_offset(buffer_idx_, 0, r, 0);
  d.row_dests = dests;
  d.num_row_dests = W_;
  d.row_bytes = row_layout_.row_bytes;
  dispatch_reference(d, threads_per_rank_);
}

void Publication::dispatch_direct(int32_t r) {
  DispatchParams d = base_dispatch(r);
  d.slot_mapping = scratch_[static_cast<size_t>(r)].in.slot_mapping.data();
  d.indexer_slot_mapping = plan_.ranks[static_cast<size_t>(r)].index_slots_or_null();
  d.targets = targets_.data();
  d.num_targets = W_;
  dispatch_reference(d, threads_per_rank_);
}

// Three all-gathers: every rank copies every rank's padded rows, rank-major.
void Publication::gather(int32_t r) {
  RankScratch& sc = scratch_[static_cast<size_t>(r)];
  for (int32_t src = 0; src < W_; ++src) {
    const RankScratch& s = scratch_[static_cast<size_t>(src)];
    std::copy(s.kv_c_out.begin(), s.kv_c_out.end(), sc.kv_c_all.begin() + src * M_ * 512);
    std::copy(s.k_pe_out.begin(), s.k_pe_out.end(), sc.k_pe_all.begin() + src * M_ * 64);
    if (fmt_.has_indexer)
      std::copy(s.index_k_out.begin(), s.index_k_out.end(), sc.index_k_all.begin() + src * M_ * 128);
  }
}

void Publication::insert(int32_t r) {
  RankScratch& sc = scratch_[static_cast<size_t>(r)];
  InsertParams p;
  p.num_tokens = W_ * M_;
  p.kv_c = sc.kv_c_all.data();
  p.k_pe = sc.k_pe_all.data();
  p.index_k = fmt_.has_indexer ? sc.index_k_all.data() : nullptr;
  p.slot_mapping = plan_.gathered_slot_mapping.data();
  p.indexer_slot_mapping = plan_.gathered_index_slots_or_null();
  p.fmt = fmt_;
  p.target = ranks_[static_cast<size_t>(r)].target;
  insert_reference(p, threads_per_rank_);
}

void Publication::combine(int32_t r) {
  CombineParams p;
  p.rows = scratch_[static_cast<size_t>(r)].staging.get() + sg_.row_offset(buffer_idx_, 0, 0, 0);
  p.num_src_ranks = W_;
  p.max_local_tokens = M_;
  p.row_bytes = row_layout_.row_bytes;
  p.slot_mapping = plan_.gathered_slot_mapping.data();
  p.indexer_slot_mapping = plan_.gathered_index_slots_or_null();
  p.fmt = fmt_;
  p.target = ranks_[static_cast<size_t>(r)].target;
  combine_reference(p, threads_per_rank_);
}

// A stage's ms: mean over repeats of the time between the barriers that open and close it.
void Publication::write_profile() {
  const size_t num_stages = steps_.size();
  std::vector<double> stage_ms(num_stages, 0.0);
  for (int32_t rep = 0; rep < setup_.repeats; ++rep) {
    const size_t base = 1 + static_cast<size_t>(rep) * (num_stages + 1);  // stamps[base - 1] opens the repeat
    for (size_t k = 0; k < num_stages; ++k)
      stage_ms[k] += std::chrono::duration<double, std::milli>(stamps_[base + k] - stamps_[base + k - 1]).count();
  }
  const ByteModel bytes = make_byte_model(setup_, layout_, kFuseTopk);
  for (size_t k = 0; k < num_stages; ++k)
    result_.profile.stages.push_back(
        Stage{steps_[k].name, stage_ms[k] / setup_.repeats, step_bytes_all_ranks(steps_[k], bytes)});
}

// The allocations are host memory already: they move into the result.
void Publication::hand_over_allocations() {
  for (RankState& st : ranks_) {
    result_.mla_alloc.push_back(std::move(st.mla_alloc));
    result_.index_alloc.push_back(std::move(st.index_alloc));
    if (setup_.materialize_q) result_.q_c_out.push_back(std::move(st.q_out));
    if (fill_topk_) result_.topk.push_back(std::move(st.topk));
  }
}

int64_t max_global_position(const PcpPlan& plan) {
  int64_t max_pos = 0;
  for (int64_t p : plan.global_positions) max_pos = std::max(max_pos, p);
  return max_pos;
}

PublishResult CpuBackend::publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) {
  validate_setup(setup, inputs, transport);
  std::lock_guard<std::mutex> publish_lock(publish_mutex_);
  std::shared_ptr<const RopeTable> rope = rope_table(setup.model->rope, max_global_position(*setup.plan) + 1);
  return Publication(setup, inputs, transport, std::move(rope), scratch_, num_threads_).run();
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_unique<CpuBackend>(num_threads); }

}  // namespace pcpkv
