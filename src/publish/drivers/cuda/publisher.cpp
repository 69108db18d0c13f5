// Publisher: see publisher.h.
#include "publish/drivers/cuda/publisher.h"

#include <algorithm>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/core/rope.h"
#include "publish/drivers/transport_table.h"

namespace pcpkv::cuda {

// ---- PublishVariant -----------------------------------------------------------------------------------

std::string PublishVariant::name() const {
  return fmt::format("{}:{}:{}{}", to_string(dispatch), fuse_topk ? "fused" : "separate",
                     combine_rows_per_warp == 0 ? kDefaultCombineRowsPerWarp : combine_rows_per_warp,
                     pdl ? ":pdl" : "");
}

PublishVariant PublishVariant::parse(const std::string& s) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t colon = s.find(':', start);
    parts.push_back(s.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  PCPKV_CHECK(!parts.empty() && parts.size() <= 4,
              "variant '{}': expected <dispatch>[:<fused|separate>[:<1|2|4>[:pdl]]]", clip(s));
  PublishVariant v;
  v.pdl = false;
  v.dispatch = parse_dispatch_variant(parts[0]);
  if (parts.size() > 1) {
    PCPKV_CHECK(parts[1] == "fused" || parts[1] == "separate", "variant '{}': top-k fill '{}' is not fused or separate",
                clip(s), clip(parts[1]));
    v.fuse_topk = parts[1] == "fused";
  }
  if (parts.size() > 2) {
    PCPKV_CHECK(parts[2] == "1" || parts[2] == "2" || parts[2] == "4",
                "variant '{}': combine rows per warp '{}' is not 1, 2 or 4", clip(s), clip(parts[2]));
    v.combine_rows_per_warp = std::stoi(parts[2]);
  }
  if (parts.size() > 3) {
    PCPKV_CHECK(parts[3] == "pdl", "variant '{}': the 4th part '{}' is not pdl", clip(s), clip(parts[3]));
    v.pdl = true;
  }
  return v;
}

PublishVariant collect_baseline_variant() {
  PublishVariant v;
  v.dispatch = DispatchVariant::kPrefetch;
  v.fuse_topk = false;
  v.combine_rows_per_warp = 1;
  v.pdl = false;
  return v;
}

PublishVariant PublisherOptions::default_variant() {
  PublishVariant v;
  v.pdl = pdl::enabled();
  return v;
}

// ---- StageTimer ----------------------------------------------------------------------------------------

void StageTimer::start(cudaStream_t stream) {
  used_ = 0;
  names_.clear();
  if (events_.empty()) events_.emplace_back();
  PCPKV_CUDA_CHECK(cudaEventRecord(events_[0].get(), stream));
  used_ = 1;
}

void StageTimer::mark(const std::string& name, cudaStream_t stream) {
  PCPKV_CHECK(used_ >= 1, "StageTimer::mark('{}') before start()", name);
  if (events_.size() <= used_) events_.emplace_back();
  PCPKV_CUDA_CHECK(cudaEventRecord(events_[used_].get(), stream));
  names_.push_back(name);
  ++used_;
}

std::vector<std::pair<std::string, double>> StageTimer::read() const {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 1; i < used_; ++i) out.emplace_back(names_[i - 1], elapsed_ms(events_[i - 1], events_[i]));
  return out;
}

// ---- per-rank device state -----------------------------------------------------------------------------

struct Publisher::InputSet {
  DeviceBuffer q_c, kv, k_pe, index_k;  // [M, ...] bf16
  DeviceBuffer q_out;                   // [M, q_lora_rank] bf16
  int32_t* topk = nullptr;              // [M, topk_width] int32, inside topk_sets_[set]
};

struct Publisher::RankState {
  std::vector<InputSet> sets;
  DeviceBuffer positions;   // [M] int64
  DeviceBuffer slots;       // [M] int64
  DeviceBuffer index_slots;  // [M] int64 indexer slots (the plan's own indexer blocks), else unused
  DeviceBuffer caches;      // layout.caches_bytes: mla allocation | pad | indexer allocation
  DeviceBuffer staging;     // StagingGeometry bytes
  DeviceBuffer kv_c_out, k_pe_out, index_k_out;  // collect: [M, 512 | 64 | 128] bf16
  DeviceBuffer kv_c_all, k_pe_all, index_k_all;  // collect: [W * M, ...]
  DeviceBuffer row_dests;   // [W] uint8_t*: where this rank's transport rows go (every peer's staging)
  std::vector<uint8_t*> host_row_dests;
  CacheTarget target;
};

namespace {

template <class T>
DeviceBuffer upload_or_empty(const std::vector<T>& v) {
  return v.empty() ? DeviceBuffer(16) : DeviceBuffer::from(v);
}

std::vector<uint8_t> download_range(const DeviceBuffer& b, int64_t offset, int64_t bytes) {
  std::vector<uint8_t> v(static_cast<size_t>(bytes));
  if (bytes > 0)
    PCPKV_CUDA_CHECK(cudaMemcpy(v.data(), b.data() + offset, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  return v;
}

// The topk-fill step of one rank: rows [topk_first_row, M) of its buffer `rank_topk` [M, topk_width]
// (setup.topk_fill_mode; kTail / kNone leave the rows the indexer writes alone).
void fill_rank_topk(const PublishSetup& setup, int32_t rank, int32_t* rank_topk, cudaStream_t stream) {
  const int64_t first = topk_first_row(setup, rank);
  launch_fill_minus_one(rank_topk + first * setup.topk_width,
                        (setup.plan->max_local_tokens - first) * setup.topk_width, stream);
}

void poison_buffer(const DeviceBuffer& b) {
  if (b.bytes() > 0) PCPKV_CUDA_CHECK(cudaMemset(b.data(), kGuardByte, static_cast<size_t>(b.bytes())));
}

}  // namespace

Publisher::Publisher(const PublishSetup& setup, const GlobalInputs& inputs, const PublisherOptions& options)
    : setup_(setup),
      options_(options),
      fence_((validate_publish_setup(setup), setup.plan->pcp_world), setup.num_ubatches, options.fence_timeout_ms) {
  validate_publish_inputs(setup, inputs, Transport::kDirect);
  PCPKV_CHECK(options.num_sets >= 1, "publisher: num_sets = {} must be >= 1", options.num_sets);
  const PcpPlan& plan = *setup.plan;
  const ModelConfig& model = *setup.model;
  layout_ = make_publish_layout(setup);
  world_ = plan.pcp_world;
  max_local_tokens_ = plan.max_local_tokens;
  q_lora_rank_ = model.q_lora_rank;
  const int64_t M = max_local_tokens_;
  const int32_t W = world_;

  // Shared: weights, rope table, gathered slot mapping.
  q_norm_w_ = upload_or_empty(inputs.weights.q_norm_w);
  kv_norm_w_ = upload_or_empty(inputs.weights.kv_norm_w);
  index_ln_w_ = upload_or_empty(inputs.weights.index_ln_w);
  index_ln_b_ = upload_or_empty(inputs.weights.index_ln_b);
  const RopeTable rope = make_rope_table(model.rope, layout_.max_position + 1);
  rope_ = DeviceBuffer::from(rope.cos_sin);
  rope_num_positions_ = rope.num_positions;
  gathered_slots_ = upload_or_empty(plan.gathered_slot_mapping);
  gathered_index_slots_ = upload_or_empty(plan.gathered_indexer_slot_mapping);
  has_index_slots_ = plan.has_index_slots();

  const bool collect_index = setup.fmt.has_indexer;
  // All ranks' top-k buffers of one input set are contiguous: the fill is one byte fill.
  for (int s = 0; s < options.num_sets; ++s)
    topk_sets_.emplace_back(std::max<int64_t>(16, layout_.fill_topk ? W * M * setup.topk_width * 4 : 0));
  for (int32_t r = 0; r < W; ++r) {
    auto st = std::make_unique<RankState>();
    const RankInputs in = rank_inputs(inputs, plan, r);
    st->sets.resize(static_cast<size_t>(options.num_sets));
    for (int s = 0; s < options.num_sets; ++s) {
      InputSet& set = st->sets[static_cast<size_t>(s)];
      set.q_c = upload_or_empty(in.q_c);
      set.kv = upload_or_empty(in.kv);
      set.k_pe = upload_or_empty(in.k_pe);
      set.index_k = upload_or_empty(in.index_k);
      set.q_out.reset(std::max<int64_t>(16, M * q_lora_rank_ * 2));
      set.topk = topk_sets_[static_cast<size_t>(s)].as<int32_t>() + (layout_.fill_topk ? r * M * setup.topk_width : 0);
    }
    st->positions = upload_or_empty(in.positions);
    st->slots = upload_or_empty(in.slot_mapping);
    st->index_slots = upload_or_empty(plan.ranks[static_cast<size_t>(r)].indexer_slot_mapping);
    st->caches.reset(layout_.caches_bytes);
    st->staging.reset(std::max<int64_t>(16, layout_.staging.bytes()));
    st->kv_c_out.reset(std::max<int64_t>(16, M * 512 * 2));
    st->k_pe_out.reset(std::max<int64_t>(16, M * 64 * 2));
    st->index_k_out.reset(std::max<int64_t>(16, collect_index ? M * 128 * 2 : 0));
    st->kv_c_all.reset(std::max<int64_t>(16, W * M * 512 * 2));
    st->k_pe_all.reset(std::max<int64_t>(16, W * M * 64 * 2));
    st->index_k_all.reset(std::max<int64_t>(16, collect_index ? W * M * 128 * 2 : 0));
    st->target.mla_base = st->caches.data() + layout_.head;
    st->target.mla = layout_.mla;
    st->target.index_base = st->caches.data() + layout_.index_region_offset + layout_.head;
    st->target.index = layout_.index;
    host_targets_.push_back(st->target);
    ranks_.push_back(std::move(st));
  }
  targets_ = DeviceBuffer::from(host_targets_);
  // Rank r's transport rows land in every peer's staging buffer at [layer half][ubatch 0][src rank r][0].
  const int buffer_idx = setup.layer_idx & 1;
  for (int32_t r = 0; r < W; ++r) {
    RankState& st = *ranks_[static_cast<size_t>(r)];
    for (int32_t peer = 0; peer < W; ++peer)
      st.host_row_dests.push_back(ranks_[static_cast<size_t>(peer)]->staging.data() +
                                  layout_.staging.row_offset(buffer_idx, 0, r, 0));
    st.row_dests = DeviceBuffer::from(st.host_row_dests);
  }
  poison();
}

Publisher::~Publisher() = default;

int64_t Publisher::input_set_bytes() const {
  const InputSet& s = ranks_[0]->sets[0];
  return world_ * (s.q_c.bytes() + s.kv.bytes() + s.k_pe.bytes() + s.index_k.bytes() + s.q_out.bytes()) +
         topk_sets_[0].bytes();
}

void Publisher::poison() {
  for (const DeviceBuffer& b : topk_sets_) poison_buffer(b);
  for (auto& st : ranks_) {
    for (InputSet& s : st->sets) poison_buffer(s.q_out);
    for (const DeviceBuffer* b : {&st->caches, &st->staging, &st->kv_c_out, &st->k_pe_out, &st->index_k_out,
                                  &st->kv_c_all, &st->k_pe_all, &st->index_k_all})
      poison_buffer(*b);
  }
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
}

DispatchJob Publisher::dispatch_job(int32_t rank, Op op, const InputSet& set) const {
  const RankState& st = *ranks_[static_cast<size_t>(rank)];
  DispatchInputs in;
  in.q_c = set.q_c.as<const uint16_t>();
  in.kv = set.kv.as<const uint16_t>();
  in.k_pe = set.k_pe.as<const uint16_t>();
  in.index_k = set.index_k.as<const uint16_t>();
  in.positions = st.positions.as<const int64_t>();
  in.q_norm_w = q_norm_w_.as<const float>();
  in.kv_norm_w = kv_norm_w_.as<const float>();
  in.index_ln_w = index_ln_w_.as<const float>();
  in.index_ln_b = index_ln_b_.as<const float>();
  in.rope_cos_sin = rope_.as<const float>();
  in.rope_num_positions = rope_num_positions_;
  in.q_c_out = set.q_out.as<uint16_t>();
  in.topk = set.topk;
  in.topk_indexer_rows = setup_.plan->ranks[static_cast<size_t>(rank)].num_local_tokens;
  DispatchJob job;
  job.params = base_dispatch_params(setup_, layout_, in);
  DispatchParams& d = job.params;
  if (!options_.variant.fuse_topk) {
    d.topk_fill = nullptr;  // its own step (a byte fill)
    d.topk_width = 0;
  }
  if (op == Op::kDispatchMaterialize) {
    d.kv_c_out = st.kv_c_out.as<uint16_t>();
    d.k_pe_out = st.k_pe_out.as<uint16_t>();
    d.index_k_out = setup_.fmt.has_indexer ? st.index_k_out.as<uint16_t>() : nullptr;
  } else if (op == Op::kDispatchStage) {
    d.row_dests = st.row_dests.as<uint8_t* const>();
    d.num_row_dests = world_;
    d.row_bytes = layout_.row.row_bytes;
    job.host_row_dests = st.host_row_dests;
  } else {
    PCPKV_CHECK(op == Op::kDispatchDirect, "publisher: op {} is not a dispatch", static_cast<int>(op));
    d.slot_mapping = st.slots.as<const int64_t>();
    d.indexer_slot_mapping = has_index_slots_ ? st.index_slots.as<const int64_t>() : nullptr;
    d.targets = targets_.as<const CacheTarget>();
    d.num_targets = world_;
    job.host_targets = host_targets_;
  }
  return job;
}

void Publisher::enqueue(Transport transport, cudaStream_t stream, StageTimer* timer) {
  const int s = next_set_;
  next_set_ = (next_set_ + 1) % options_.num_sets;
  last_set_ = s;
  // PDL for the staging / direct chain dispatch -> fence -> combine; collect stays as engines run it.
  const bool pdl = options_.variant.pdl && transport != Transport::kCollect;
  if (timer) timer->start(stream);
  for (const Step& step : steps(transport, layout_, options_.variant.fuse_topk)) {
    run_step(step.op, s, stream, pdl);
    if (timer) timer->mark(step.name, stream);
  }
}

void Publisher::enqueue_rank_dispatch(int32_t rank, Transport transport, cudaStream_t stream) {
  PCPKV_CHECK(rank >= 0 && rank < world_, "enqueue_rank_dispatch: rank {} is not in [0, {})", rank, world_);
  const int s = next_set_;
  next_set_ = (next_set_ + 1) % options_.num_sets;
  last_set_ = s;
  const PublishVariant& v = options_.variant;
  const InputSet& set = ranks_[static_cast<size_t>(rank)]->sets[static_cast<size_t>(s)];
  for (const Step& step : steps(transport, layout_, v.fuse_topk)) {
    if (step.op == Op::kTopkFill) {
      fill_rank_topk(setup_, rank, set.topk, stream);
    } else if (step.op == Op::kDispatchMaterialize || step.op == Op::kDispatchStage ||
               step.op == Op::kDispatchDirect) {
      const DispatchJob job = dispatch_job(rank, step.op, set);
      launch_dispatch(&job, 1, stream, v.dispatch, false);
      return;  // the steps after the dispatch (fence, combine, ...) are not this case's
    }
  }
}

// One small function per Op of the transport table; each launches the op for all W ranks.
void Publisher::run_step(Op op, int set, cudaStream_t stream, bool pdl) {
  switch (op) {
    case Op::kTopkFill:
      if (setup_.topk_fill_mode == TopkFill::kFull) {  // every rank's buffer: one byte fill
        launch_fill_minus_one(topk_sets_[static_cast<size_t>(set)].as<int32_t>(),
                              world_ * max_local_tokens_ * setup_.topk_width, stream);
      } else {
        for (int32_t r = 0; r < world_; ++r)
          fill_rank_topk(setup_, r, ranks_[static_cast<size_t>(r)]->sets[static_cast<size_t>(set)].topk, stream);
      }
      return;
    case Op::kDispatchMaterialize:
    case Op::kDispatchStage:
    case Op::kDispatchDirect: return enqueue_dispatch(op, set, stream, pdl);
    case Op::kGather: return enqueue_gather(stream);
    case Op::kInsert: return enqueue_insert(stream);
    case Op::kFence: return fence_.enqueue(0, stream, pdl);
    case Op::kCombine: return enqueue_combine(stream, pdl);
  }
}

void Publisher::enqueue_dispatch(Op op, int set, cudaStream_t stream, bool pdl) {
  std::vector<DispatchJob> jobs;
  jobs.reserve(static_cast<size_t>(world_));
  for (int32_t r = 0; r < world_; ++r)
    jobs.push_back(dispatch_job(r, op, ranks_[static_cast<size_t>(r)]->sets[static_cast<size_t>(set)]));
  launch_dispatch(jobs.data(), world_, stream, options_.variant.dispatch, pdl);
}

void Publisher::enqueue_gather(cudaStream_t stream) {
  // The three all-gathers (kv_c, k_pe, index_k), rank-major like NCCL's.
  auto gather = [&](DeviceBuffer RankState::*out, DeviceBuffer RankState::*all, int64_t width) {
    std::vector<const void*> src;
    std::vector<void*> dst;
    for (auto& st : ranks_) {
      src.push_back(((*st).*out).data());
      dst.push_back(((*st).*all).data());
    }
    launch_all_gather(src, dst, max_local_tokens_ * width * 2, stream);
  };
  gather(&RankState::kv_c_out, &RankState::kv_c_all, 512);
  gather(&RankState::k_pe_out, &RankState::k_pe_all, 64);
  if (setup_.fmt.has_indexer) gather(&RankState::index_k_out, &RankState::index_k_all, 128);
}

void Publisher::enqueue_insert(cudaStream_t stream) {
  const bool idx = setup_.fmt.has_indexer;
  std::vector<InsertParams> ins(static_cast<size_t>(world_));
  for (int32_t r = 0; r < world_; ++r) {
    const RankState& st = *ranks_[static_cast<size_t>(r)];
    InsertParams& p = ins[static_cast<size_t>(r)];
    p.num_tokens = world_ * max_local_tokens_;
    p.kv_c = st.kv_c_all.as<const uint16_t>();
    p.k_pe = st.k_pe_all.as<const uint16_t>();
    p.index_k = idx ? st.index_k_all.as<const uint16_t>() : nullptr;
    p.slot_mapping = gathered_slots_.as<const int64_t>();
    p.indexer_slot_mapping = gathered_index_slots();
    p.fmt = setup_.fmt;
    p.target = st.target;
  }
  launch_insert_mla(ins.data(), world_, stream);
  if (idx) launch_insert_indexer(ins.data(), world_, stream);
}

void Publisher::enqueue_combine(cudaStream_t stream, bool pdl) {
  const int buffer_idx = setup_.layer_idx & 1;
  std::vector<CombineParams> comb(static_cast<size_t>(world_));
  for (int32_t r = 0; r < world_; ++r) {
    const RankState& st = *ranks_[static_cast<size_t>(r)];
    CombineParams& p = comb[static_cast<size_t>(r)];
    p.rows = st.staging.data() + layout_.staging.row_offset(buffer_idx, 0, 0, 0);
    p.num_src_ranks = world_;
    p.max_local_tokens = max_local_tokens_;
    p.row_bytes = layout_.row.row_bytes;
    p.slot_mapping = gathered_slots_.as<const int64_t>();
    p.indexer_slot_mapping = gathered_index_slots();
    p.fmt = setup_.fmt;
    p.target = st.target;
  }
  launch_combine(comb.data(), world_, stream, options_.variant.combine_rows_per_warp, pdl);
}

std::vector<Stage> Publisher::stage_model(Transport transport) const {
  const bool fused = options_.variant.fuse_topk;
  const ByteModel bytes = make_byte_model(setup_, layout_, fused);
  std::vector<Stage> out;
  for (const Step& step : steps(transport, layout_, fused))
    out.push_back({step.name, 0.0, step_bytes_all_ranks(step, bytes)});
  return out;
}

PublishResult Publisher::download(Transport transport) const {
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  PublishResult r;
  r.transport = transport;
  r.mla_geometry = layout_.mla;
  r.index_geometry = layout_.index;
  r.mla_cache_offset = layout_.head;
  r.index_cache_offset = layout_.head;
  const int64_t M = max_local_tokens_;
  for (const auto& st : ranks_) {
    r.mla_alloc.push_back(download_range(st->caches, 0, layout_.mla_alloc_bytes));
    r.index_alloc.push_back(download_range(st->caches, layout_.index_region_offset, layout_.index_alloc_bytes));
    const InputSet& set = st->sets[static_cast<size_t>(last_set_)];
    if (setup_.materialize_q) r.q_c_out.push_back(set.q_out.download<uint16_t>(M * q_lora_rank_));
    if (layout_.fill_topk) {
      std::vector<int32_t> topk(static_cast<size_t>(M * setup_.topk_width));
      PCPKV_CUDA_CHECK(cudaMemcpy(topk.data(), set.topk, topk.size() * 4, cudaMemcpyDeviceToHost));
      r.topk.push_back(std::move(topk));
    }
  }
  return r;
}

}  // namespace pcpkv::cuda
