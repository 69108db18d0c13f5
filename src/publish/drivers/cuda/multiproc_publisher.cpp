// The CUDA per-process publication driver (cuda::make_rank_publisher in pcpkv/publish/cuda_multiproc.h): this
// process is one PCP rank on its device; caches, staging rows, collect rows and fence pads are device
// symmetric memory; the kernels are the cuda engineer's launchers (pcpkv/publish/kernels.h), called with one job.
#include <signal.h>

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "pcpkv/publish/kernels.h"
#include "publish/drivers/cuda/multiproc_fence.h"
#include "publish/drivers/cuda/publisher.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/ranks/launch.h"
#include "pcpkv/core/rope.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"

namespace pcpkv::cuda {

namespace {

using namespace cuda;
constexpr int32_t kStartBarrier = 0;
constexpr int32_t kPublishBarrier = 1;
constexpr int32_t kNumBarriers = 2;
constexpr bool kFuseTopk = false;  // the top-k fill is its own step (a byte fill), as in the CUDA backend

template <class T>
DeviceBuffer upload_or_empty(const std::vector<T>& v) {
  return v.empty() ? DeviceBuffer(16) : DeviceBuffer::from(v);
}

class CudaRankPublisher final : public RankPublisher {
 public:
  CudaRankPublisher(Bootstrap& group, const PublishSetup& setup, const RankPublishOptions& options)
      : group_(group), setup_(setup), options_(options) {
    validate_publish_setup(setup_);
    const int32_t W = setup_.plan->pcp_world;
    PCPKV_CHECK(group.world_size() == W,
                "publish: the plan's PCP world is {}, but this process group has {} processes", W, group.world_size());
    check_collect_via(options_.collect_via);
    if (options_.global_ranks.empty())
      for (int32_t r = 0; r < W; ++r) options_.global_ranks.push_back(r);
    device_ = select_rank_device(group, options_.device_idx);
    stream_holder_ = std::make_unique<Stream>();  // on this rank's device
    cudaDeviceProp prop{};
    PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = fmt::format("{} (device {}), process {} of {}", prop.name, device_, group.rank(), W);
    layout_ = make_publish_layout(setup_);
    const RopeTable rope = make_rope_table(setup_.model->rope, layout_.max_position + 1);
    rope_ = DeviceBuffer::from(rope.cos_sin);
    rope_num_positions_ = rope.num_positions;
    gathered_slots_ = upload_or_empty(setup_.plan->gathered_slot_mapping);
    gathered_index_slots_ = upload_or_empty(setup_.plan->gathered_indexer_slot_mapping);
    const int64_t M = setup_.plan->max_local_tokens;
    q_out_.reset(std::max<int64_t>(16, M * setup_.model->q_lora_rank * 2));
    topk_.reset(std::max<int64_t>(16, layout_.fill_topk ? M * setup_.topk_width * 4 : 0));
    caches_ = make_device_symmetric(group_, layout_.caches_bytes, "caches", kGuardByte);
    fence_ = std::make_unique<RankFence>(group_, kNumBarriers, options_.fence_timeout_ms, options_.global_ranks);
    // Every replica as seen from this process: the direct transport's targets.
    for (int32_t r = 0; r < W; ++r) {
      CacheTarget t;
      t.mla_base = caches_->ptr(r) + layout_.head;
      t.mla = layout_.mla;
      t.index_base = caches_->ptr(r) + layout_.index_region_offset + layout_.head;
      t.index = layout_.index;
      host_targets_.push_back(t);
    }
    targets_ = DeviceBuffer::from(host_targets_);
  }

  ~CudaRankPublisher() override { cudaStreamSynchronize(stream_holder_->get()); }

  std::string backend() const override { return "cuda"; }
  std::string device() const override { return device_name_; }

  RankPublishResult publish(const GlobalInputs& inputs, Transport transport) override {
    prepare(inputs, transport);
    PCPKV_CHECK(options_.warmup_runs >= 0, "publish: warmup_runs = {} must be >= 0", options_.warmup_runs);
    PCPKV_CHECK(options_.flush_l2_bytes >= 0, "publish: flush_l2_bytes = {} must be >= 0", options_.flush_l2_bytes);
    if (options_.flush_l2_bytes > 0 && l2_scratch_.bytes() < options_.flush_l2_bytes)
      l2_scratch_.reset(options_.flush_l2_bytes);
    // Warm-up runs first (untimed): NCCL's and the kernels' first-call setup stays out of the samples.
    for (int32_t rep = 0; rep < options_.warmup_runs; ++rep) {
      enqueue_run(transport, stream(), nullptr, options_.flush_l2_bytes > 0);
      fence_->wait(stream(), fmt::format("publish ({}, warm-up)", to_string(transport)));
    }
    std::vector<double> ms;
    std::vector<std::string> names;
    std::vector<std::vector<double>> samples;
    for (int32_t rep = 0; rep < setup_.repeats; ++rep) {
      StageTimer timer;
      enqueue_run(transport, stream(), &timer, options_.flush_l2_bytes > 0);
      fence_->wait(stream(), fmt::format("publish ({})", to_string(transport)));
      const auto stages = timer.read();
      if (ms.empty()) {
        for (const auto& [n, t] : stages) names.push_back(n);
        ms.assign(stages.size(), 0.0);
      }
      samples.emplace_back();
      for (size_t k = 0; k < stages.size() && k < ms.size(); ++k) {
        ms[k] += stages[k].second;
        samples.back().push_back(stages[k].second);
      }
    }
    if (options_.corrupt_pcp_rank == group_.rank()) corrupt_own_replica();
    RankPublishResult res = download(transport);
    // Bytes: this rank's share of the tables' byte model, step k timed as names[k].
    const std::vector<Step> steps = pcpkv::steps(transport, layout_, kFuseTopk);
    const ByteModel bytes = make_byte_model(setup_, layout_, kFuseTopk);
    for (size_t k = 0; k < names.size(); ++k)
      res.profile.stages.push_back(Stage{names[k], ms[k] / setup_.repeats, steps.at(k).bytes(bytes, group_.rank())});
    res.stage_samples_ms = std::move(samples);
    return res;
  }

  RankPublishResult publish_graph_replays(const GlobalInputs& inputs, Transport transport, int32_t replays) override {
    PCPKV_CHECK(replays >= 1, "graph replays = {} must be >= 1", replays);
    prepare(inputs, transport);
    // One eager run first: lazy module loading and NCCL's first-use setup stay out of the capture.
    enqueue_run(transport, stream(), nullptr);
    fence_->wait(stream(), fmt::format("publish ({}, before capture)", to_string(transport)));
    cudaGraph_t graph = nullptr;
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
    const auto counts_before = fences_enqueued_;
    try {
      enqueue_run(transport, stream(), nullptr);
    } catch (...) {
      cudaStreamEndCapture(stream(), &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PCPKV_CUDA_CHECK(inst);
    // The capture enqueued no work but counted its fences once; every replay runs them.
    for (int32_t b = 0; b < kNumBarriers; ++b) {
      const int64_t per_run = fences_enqueued_[static_cast<size_t>(b)] - counts_before[static_cast<size_t>(b)];
      fence_->note_replayed(b, per_run * (replays - 1));
    }
    for (int32_t i = 0; i < replays; ++i) {
      const cudaError_t e = cudaGraphLaunch(exec, stream());
      if (e != cudaSuccess) {
        cudaGraphExecDestroy(exec);
        PCPKV_CUDA_CHECK(e);
      }
    }
    try {
      fence_->wait(stream(), fmt::format("publish ({}, graph replays)", to_string(transport)));
    } catch (...) {
      cudaGraphExecDestroy(exec);
      throw;
    }
    cudaGraphExecDestroy(exec);
    RankPublishResult res = download(transport);
    res.graph_replays = replays;
    return res;
  }

  std::vector<uint8_t> read_mla_alloc(int32_t r) override { return read(caches_->ptr(r), layout_.mla_alloc_bytes); }
  std::vector<uint8_t> read_index_alloc(int32_t r) override {
    return read(caches_->ptr(r) + layout_.index_region_offset, layout_.index_alloc_bytes);
  }
  std::vector<uint64_t> replica_slot_hashes(const std::vector<int64_t>& slots,
                                            const std::vector<int64_t>& index_slots = {}) override {
    // The kernel cannot check the slots it reads: the host does, here.
    const bool own = !index_slots.empty();
    PCPKV_CHECK(!own || index_slots.size() == slots.size(), "slot hashes: index_slots has {} entries, slots {}",
                index_slots.size(), slots.size());
    const int64_t n = static_cast<int64_t>(slots.size());
    validate_hash_slots(slots.data(), n, layout_.mla.num_slots(), "slots", own);
    if (own && setup_.fmt.has_indexer)
      validate_hash_slots(index_slots.data(), n, layout_.index.num_slots(), "index_slots", true);
    if (slots.empty()) return {};
    const DeviceBuffer d_slots = DeviceBuffer::from(slots);
    const DeviceBuffer d_index_slots = own ? DeviceBuffer::from(index_slots) : DeviceBuffer();
    DeviceBuffer d_hashes(static_cast<int64_t>(slots.size() * sizeof(uint64_t)));
    const CacheTarget& t = host_targets_[static_cast<size_t>(group_.rank())];
    if (own)
      launch_slot_hashes_own_index(t, setup_.fmt, d_slots.as<const int64_t>(), d_index_slots.as<const int64_t>(), n,
                                   d_hashes.as<uint64_t>(), stream());
    else
      launch_slot_hashes(t, setup_.fmt, d_slots.as<const int64_t>(), n, d_hashes.as<uint64_t>(), stream());
    PCPKV_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return d_hashes.download<uint64_t>(static_cast<int64_t>(slots.size()));
  }

 private:
  cudaStream_t stream() const { return stream_holder_->get(); }
  static std::vector<uint8_t> read(const uint8_t* p, int64_t bytes) {
    std::vector<uint8_t> v(static_cast<size_t>(bytes));
    PCPKV_CUDA_CHECK(cudaMemcpy(v.data(), p, v.size(), cudaMemcpyDeviceToHost));
    return v;
  }

  // Test hook (RankPublishOptions::corrupt_pcp_rank): one bit of this replica's first written MLA row, after the
  // publication fence (no peer writes into it any more).
  void corrupt_own_replica() {
    const std::vector<int64_t> written = written_slots(*setup_.plan);
    if (written.empty()) return;
    PCPKV_CUDA_CHECK(cudaStreamSynchronize(stream()));
    uint8_t* p = caches_->local() + layout_.head + layout_.mla.row_offset(written.front()) + 7;
    uint8_t b = 0;
    PCPKV_CUDA_CHECK(cudaMemcpy(&b, p, 1, cudaMemcpyDeviceToHost));
    b ^= 0x01;
    PCPKV_CUDA_CHECK(cudaMemcpy(p, &b, 1, cudaMemcpyHostToDevice));
  }

  // Uploads this rank's inputs and sets up what the transport needs (collectively, on first use).
  void prepare(const GlobalInputs& inputs, Transport transport) {
    validate_publish_inputs(setup_, inputs, transport);
    const PcpPlan& plan = *setup_.plan;
    const int32_t W = plan.pcp_world;
    const int32_t me = group_.rank();
    const int64_t M = plan.max_local_tokens;
    const std::vector<Step> steps = pcpkv::steps(transport, layout_, kFuseTopk);
    if (uses(steps, Op::kDispatchStage) && !staging_) {
      staging_ = make_device_symmetric(group_, std::max<int64_t>(16, layout_.staging.bytes()), "staging", 0);
      const int buffer_idx = setup_.layer_idx & 1;
      host_row_dests_.clear();
      for (int32_t peer = 0; peer < W; ++peer)
        host_row_dests_.push_back(staging_->ptr(peer) + layout_.staging.row_offset(buffer_idx, 0, me, 0));
      row_dests_ = DeviceBuffer::from(host_row_dests_);
    }
    if (uses(steps, Op::kDispatchMaterialize) && !collect_) {
      collect_ = make_device_symmetric(group_, layout_.collect_bytes, "collect rows", 0);
      kv_all_.reset(W * M * 512 * 2);
      kpe_all_.reset(W * M * 64 * 2);
      idx_all_.reset(std::max<int64_t>(16, setup_.fmt.has_indexer ? W * M * 128 * 2 : 0));
      use_nccl_ = false;
      if (options_.collect_via != "p2p") {
        // auto: NCCL only when every rank has its own GPU (NcclAllGather checks; all ranks agree).
        cudaDeviceProp prop{};
        PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
        char uuid[16];
        std::memcpy(uuid, prop.uuid.bytes, 16);
        std::vector<char> all(16 * static_cast<size_t>(W));
        group_.all_gather(uuid, 16, all.data());
        bool distinct = true;
        for (int32_t a = 0; a < W; ++a)
          for (int32_t b = a + 1; b < W; ++b)
            distinct = distinct && std::memcmp(&all[16 * a], &all[16 * b], 16) != 0;
        if (options_.collect_via == "nccl" || (distinct && have_nccl())) {
          nccl_ = std::make_unique<NcclAllGather>(group_);
          use_nccl_ = true;
        }
      }
    }
    const RankInputs in = rank_inputs(inputs, plan, me);
    q_c_ = upload_or_empty(in.q_c);
    kv_ = upload_or_empty(in.kv);
    k_pe_ = upload_or_empty(in.k_pe);
    index_k_ = upload_or_empty(in.index_k);
    positions_ = upload_or_empty(in.positions);
    slots_ = upload_or_empty(in.slot_mapping);
    index_slots_ = upload_or_empty(plan.ranks[static_cast<size_t>(me)].indexer_slot_mapping);
    q_norm_w_ = upload_or_empty(inputs.weights.q_norm_w);
    kv_norm_w_ = upload_or_empty(inputs.weights.kv_norm_w);
    index_ln_w_ = upload_or_empty(inputs.weights.index_ln_w);
    index_ln_b_ = upload_or_empty(inputs.weights.index_ln_b);
    PCPKV_CUDA_CHECK(cudaMemset(q_out_.data(), 0xA5, static_cast<size_t>(q_out_.bytes())));
    PCPKV_CUDA_CHECK(cudaMemset(topk_.data(), 0xA5, static_cast<size_t>(topk_.bytes())));
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void fence(int32_t barrier_idx, cudaStream_t s) {
    fence_->enqueue(barrier_idx, s);
    ++fences_enqueued_[static_cast<size_t>(barrier_idx)];
  }

  // One publication on stream s: poison this replica, start fence, then the transport table's steps (SPEC
  // section 5).
  void enqueue_run(Transport transport, cudaStream_t s, StageTimer* timer, bool flush_l2 = false) {
    PCPKV_CUDA_CHECK(cudaMemsetAsync(caches_->local(), kGuardByte, static_cast<size_t>(layout_.caches_bytes), s));
    if (flush_l2 && l2_scratch_.bytes() > 0)  // evicts the poisoned caches and the inputs from L2
      PCPKV_CUDA_CHECK(cudaMemsetAsync(l2_scratch_.data(), flush_value_++ & 0xff,
                                       static_cast<size_t>(l2_scratch_.bytes()), s));
    fence(kStartBarrier, s);
    if (timer) timer->start(s);
    for (const Step& step : steps(transport, layout_, kFuseTopk)) {
      run_step(step.op, s);
      if (timer) timer->mark(step.name, s);
    }
  }

  // One small function per Op of the transport table.
  void run_step(Op op, cudaStream_t s) {
    switch (op) {
      case Op::kTopkFill:
      {  // rows [topk_first_row, M) (setup.topk_fill_mode: kTail / kNone leave the indexer's rows alone)
        const int64_t first = topk_first_row(setup_, group_.rank());
        launch_fill_minus_one(topk_.as<int32_t>() + first * setup_.topk_width,
                              (setup_.plan->max_local_tokens - first) * setup_.topk_width, s);
        return;
      }
      case Op::kDispatchMaterialize:
      case Op::kDispatchStage:
      case Op::kDispatchDirect: return enqueue_dispatch(op, s);
      case Op::kGather: return enqueue_gather(s);
      case Op::kInsert: return enqueue_insert(s);
      case Op::kFence: return fence(kPublishBarrier, s);
      case Op::kCombine: return enqueue_combine(s);
    }
  }

  void enqueue_dispatch(Op op, cudaStream_t s) {
    const int32_t W = setup_.plan->pcp_world;
    DispatchInputs in;
    in.q_c = q_c_.as<const uint16_t>();
    in.kv = kv_.as<const uint16_t>();
    in.k_pe = k_pe_.as<const uint16_t>();
    in.index_k = index_k_.as<const uint16_t>();
    in.positions = positions_.as<const int64_t>();
    in.q_norm_w = q_norm_w_.as<const float>();
    in.kv_norm_w = kv_norm_w_.as<const float>();
    in.index_ln_w = index_ln_w_.as<const float>();
    in.index_ln_b = index_ln_b_.as<const float>();
    in.rope_cos_sin = rope_.as<const float>();
    in.rope_num_positions = rope_num_positions_;
    in.q_c_out = q_out_.as<uint16_t>();
    in.topk = topk_.as<int32_t>();
    in.topk_indexer_rows = setup_.plan->ranks[static_cast<size_t>(group_.rank())].num_local_tokens;
    DispatchJob job;
    job.params = base_dispatch_params(setup_, layout_, in);
    DispatchParams& d = job.params;
    d.topk_fill = nullptr;  // the topk-fill step
    d.topk_width = 0;
    if (op == Op::kDispatchMaterialize) {
      uint8_t* mine = collect_->local();
      d.kv_c_out = reinterpret_cast<uint16_t*>(mine + layout_.collect_kv_offset);
      d.k_pe_out = reinterpret_cast<uint16_t*>(mine + layout_.collect_kpe_offset);
      d.index_k_out = setup_.fmt.has_indexer ? reinterpret_cast<uint16_t*>(mine + layout_.collect_index_offset) : nullptr;
    } else if (op == Op::kDispatchStage) {
      d.row_dests = row_dests_.as<uint8_t* const>();
      d.num_row_dests = W;
      d.row_bytes = layout_.row.row_bytes;
      job.host_row_dests = host_row_dests_;
    } else {
      d.slot_mapping = slots_.as<const int64_t>();
      d.indexer_slot_mapping = setup_.plan->has_index_slots() ? index_slots_.as<const int64_t>() : nullptr;
      d.targets = targets_.as<const CacheTarget>();
      d.num_targets = W;
      job.host_targets = host_targets_;
    }
    launch_dispatch(&job, 1, s);
    if (options_.kill_pcp_rank == group_.rank()) {  // test hook: die between the dispatch and the fence
      cudaStreamSynchronize(s);
      ::raise(SIGKILL);
    }
  }

  void enqueue_gather(cudaStream_t s) {
    const int32_t W = setup_.plan->pcp_world;
    const int64_t M = setup_.plan->max_local_tokens;
    const bool idx = setup_.fmt.has_indexer;
    const int64_t kv_bytes = M * 512 * 2, kpe_bytes = M * 64 * 2, idx_bytes = M * 128 * 2;
    if (use_nccl_) {
      const uint8_t* mine = collect_->local();
      nccl_->all_gather(mine + layout_.collect_kv_offset, kv_all_.data(), kv_bytes, s);
      nccl_->all_gather(mine + layout_.collect_kpe_offset, kpe_all_.data(), kpe_bytes, s);
      if (idx) nccl_->all_gather(mine + layout_.collect_index_offset, idx_all_.data(), idx_bytes, s);
      return;
    }
    // p2p: after the fence every peer's rows are final; read them through the mappings.
    fence(kPublishBarrier, s);
    for (int32_t src = 0; src < W; ++src) {
      const uint8_t* p = collect_->ptr(src);
      PCPKV_CUDA_CHECK(cudaMemcpyAsync(kv_all_.data() + src * kv_bytes, p + layout_.collect_kv_offset,
                                       static_cast<size_t>(kv_bytes), cudaMemcpyDeviceToDevice, s));
      PCPKV_CUDA_CHECK(cudaMemcpyAsync(kpe_all_.data() + src * kpe_bytes, p + layout_.collect_kpe_offset,
                                       static_cast<size_t>(kpe_bytes), cudaMemcpyDeviceToDevice, s));
      if (idx)
        PCPKV_CUDA_CHECK(cudaMemcpyAsync(idx_all_.data() + src * idx_bytes, p + layout_.collect_index_offset,
                                         static_cast<size_t>(idx_bytes), cudaMemcpyDeviceToDevice, s));
    }
  }

  void enqueue_insert(cudaStream_t s) {
    const bool idx = setup_.fmt.has_indexer;
    InsertParams p;
    p.num_tokens = setup_.plan->pcp_world * setup_.plan->max_local_tokens;
    p.kv_c = kv_all_.as<const uint16_t>();
    p.k_pe = kpe_all_.as<const uint16_t>();
    p.index_k = idx ? idx_all_.as<const uint16_t>() : nullptr;
    p.slot_mapping = gathered_slots_.as<const int64_t>();
    p.indexer_slot_mapping = setup_.plan->has_index_slots() ? gathered_index_slots_.as<const int64_t>() : nullptr;
    p.fmt = setup_.fmt;
    p.target = host_targets_[static_cast<size_t>(group_.rank())];
    launch_insert_mla(&p, 1, s);
    if (idx) launch_insert_indexer(&p, 1, s);
  }

  void enqueue_combine(cudaStream_t s) {
    CombineParams p;
    p.rows = staging_->local() + layout_.staging.row_offset(setup_.layer_idx & 1, 0, 0, 0);
    p.num_src_ranks = setup_.plan->pcp_world;
    p.max_local_tokens = setup_.plan->max_local_tokens;
    p.row_bytes = layout_.row.row_bytes;
    p.slot_mapping = gathered_slots_.as<const int64_t>();
    p.indexer_slot_mapping = setup_.plan->has_index_slots() ? gathered_index_slots_.as<const int64_t>() : nullptr;
    p.fmt = setup_.fmt;
    p.target = host_targets_[static_cast<size_t>(group_.rank())];
    launch_combine(&p, 1, s);
  }

  RankPublishResult download(Transport transport) {
    PCPKV_CUDA_CHECK(cudaStreamSynchronize(stream()));
    RankPublishResult res;
    res.pcp_rank = group_.rank();
    res.pcp_world = group_.world_size();
    res.transport = transport;
    res.mla_geometry = layout_.mla;
    res.index_geometry = layout_.index;
    res.mla_cache_offset = layout_.head;
    res.index_cache_offset = layout_.head;
    res.mla_alloc = read_mla_alloc(group_.rank());
    res.index_alloc = read_index_alloc(group_.rank());
    const int64_t M = setup_.plan->max_local_tokens;
    if (setup_.materialize_q) res.q_c_out = q_out_.download<uint16_t>(M * setup_.model->q_lora_rank);
    if (layout_.fill_topk) res.topk = topk_.download<int32_t>(M * setup_.topk_width);
    res.fence_epochs = fence_->epochs();
    return res;
  }

  Bootstrap& group_;
  PublishSetup setup_;
  RankPublishOptions options_;
  int32_t device_ = 0;
  std::string device_name_;
  PublishLayout layout_;
  std::unique_ptr<Stream> stream_holder_;
  DeviceBuffer rope_, gathered_slots_, gathered_index_slots_, index_slots_, q_out_, topk_, targets_, row_dests_;
  int64_t rope_num_positions_ = 0;
  DeviceBuffer q_c_, kv_, k_pe_, index_k_, positions_, slots_, q_norm_w_, kv_norm_w_, index_ln_w_, index_ln_b_;
  DeviceBuffer kv_all_, kpe_all_, idx_all_;
  DeviceBuffer l2_scratch_;  // RankPublishOptions::flush_l2_bytes
  int flush_value_ = 1;
  std::vector<CacheTarget> host_targets_;
  std::vector<uint8_t*> host_row_dests_;
  std::unique_ptr<SymmetricMemory> caches_, staging_, collect_;
  std::unique_ptr<RankFence> fence_;
  std::unique_ptr<NcclAllGather> nccl_;
  bool use_nccl_ = false;
  std::array<int64_t, kNumBarriers> fences_enqueued_{};
};

}  // namespace

std::unique_ptr<RankPublisher> make_rank_publisher(Bootstrap& group, const PublishSetup& setup,
                                                   const RankPublishOptions& options) {
  return std::make_unique<CudaRankPublisher>(group, setup, options);
}

}  // namespace pcpkv::cuda
