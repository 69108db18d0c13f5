// The transport tables and their byte model (see transport_table.h; docs/perf.md section 1).
#include "publish/drivers/transport_table.h"

#include <algorithm>
#include <array>

#include "pcpkv/core/error.h"

namespace pcpkv {
namespace {

// ---- byte model, one rank's share per step ----------------------------------------------------------------

// Every dispatch reads its inputs and writes q_c_out (and the top-k rows when the fill is fused).
int64_t topk_rank_bytes(const ByteModel& m, int32_t rank) {
  return m.topk_rows[static_cast<size_t>(rank)] * m.topk_row_bytes;
}
int64_t dispatch_base(const ByteModel& m, int32_t rank, int64_t extra_read_per_row) {
  return m.rows * (m.read_per_row + extra_read_per_row + m.q_out_bytes) +
         (m.topk_in_dispatch ? topk_rank_bytes(m, rank) : 0);
}
int64_t cache_row_bytes(const ByteModel& m) { return m.mla_bytes + m.index_slot_bytes; }

int64_t topk_fill_bytes(const ByteModel& m, int32_t rank) { return m.topk_in_dispatch ? 0 : topk_rank_bytes(m, rank); }
int64_t dispatch_materialize_bytes(const ByteModel& m, int32_t rank) {
  return dispatch_base(m, rank, 0) + m.rows * m.bf16_row_bytes;
}
int64_t dispatch_stage_bytes(const ByteModel& m, int32_t rank) {
  return dispatch_base(m, rank, 0) + m.rows * m.world * m.transport_row_bytes;  // W transport rows per row
}
int64_t dispatch_direct_bytes(const ByteModel& m, int32_t rank) {
  // + the slot (8 B) read per row; W cache rows written per row with a slot.
  return dispatch_base(m, rank, 8) + m.written[static_cast<size_t>(rank)] * m.world * cache_row_bytes(m);
}
int64_t gather_bytes(const ByteModel& m, int32_t) {
  return m.world * m.rows * m.bf16_row_bytes * 2;  // every rank's padded rows, read and written
}
int64_t insert_bytes(const ByteModel& m, int32_t) {
  return m.written_all * (m.bf16_row_bytes + cache_row_bytes(m));
}
int64_t fence_bytes(const ByteModel& m, int32_t) { return m.world * 16; }  // W signal stores + W polled 8 B slots
int64_t combine_bytes(const ByteModel& m, int32_t) {
  return m.written_all * (m.transport_row_bytes + cache_row_bytes(m));
}

// ---- the tables -------------------------------------------------------------------------------------------

constexpr Step kTopkFill{Op::kTopkFill, "topk-fill", topk_fill_bytes};

constexpr std::array kCollect{
    kTopkFill,
    Step{Op::kDispatchMaterialize, "dispatch", dispatch_materialize_bytes},
    Step{Op::kGather, "all-gather", gather_bytes},
    Step{Op::kInsert, "insert", insert_bytes},
};
constexpr std::array kStaging{
    kTopkFill,
    Step{Op::kDispatchStage, "dispatch", dispatch_stage_bytes},
    Step{Op::kFence, "fence", fence_bytes},
    Step{Op::kCombine, "combine", combine_bytes},
};
constexpr std::array kDirect{
    kTopkFill,
    Step{Op::kDispatchDirect, "dispatch", dispatch_direct_bytes},
    Step{Op::kFence, "fence", fence_bytes},
};

}  // namespace

std::span<const Step> transport_table(Transport t) {
  switch (t) {
    case Transport::kCollect: return kCollect;
    case Transport::kStaging: return kStaging;
    case Transport::kDirect: return kDirect;
  }
  PCPKV_FAIL("publish: transport = {} is not a Transport", static_cast<int>(t));
}

std::vector<Step> steps(Transport t, const PublishLayout& l, bool fuse_topk) {
  const bool fill_step = l.fill_topk && !fuse_topk;
  std::vector<Step> out;
  for (const Step& s : transport_table(t))
    if (s.op != Op::kTopkFill || fill_step) out.push_back(s);
  return out;
}

bool uses(const std::vector<Step>& steps, Op op) {
  return std::any_of(steps.begin(), steps.end(), [op](const Step& s) { return s.op == op; });
}

ByteModel make_byte_model(const PublishSetup& s, const PublishLayout& l, bool fuse_topk) {
  const PcpPlan& plan = *s.plan;
  const int64_t idx = s.fmt.has_indexer ? 1 : 0;
  ByteModel m;
  m.world = plan.pcp_world;
  m.rows = plan.max_local_tokens;
  m.q_out_bytes = s.materialize_q ? 2 * s.model->q_lora_rank : 0;
  m.read_per_row = m.q_out_bytes + 1024 + 128 + idx * 256 + 8;  // q_c is read as wide as q_c_out is written
  m.topk_row_bytes = l.fill_topk ? 4 * s.topk_width : 0;
  m.topk_in_dispatch = fuse_topk;
  m.bf16_row_bytes = 1024 + 128 + idx * 256;
  m.mla_bytes = l.row.mla_bytes;
  m.index_slot_bytes = idx * kIndexerSlotBytes;
  m.transport_row_bytes = l.row.row_bytes;
  for (int32_t r = 0; r < m.world; ++r) {
    const RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
    // rows [topk_first_row, M) of the buffer (setup.topk_fill_mode; full: every row, padding included)
    m.topk_rows.push_back(l.fill_topk ? m.rows - topk_first_row(s, r) : 0);
    m.written.push_back(std::count_if(rp.slot_mapping.begin(), rp.slot_mapping.end(), [](int64_t x) { return x >= 0; }));
    m.written_all += m.written.back();
  }
  return m;
}

int64_t step_bytes_all_ranks(const Step& step, const ByteModel& m) {
  int64_t b = 0;
  for (int32_t r = 0; r < m.world; ++r) b += step.bytes(m, r);
  return b;
}

std::vector<std::string> stage_names(Transport t, const PublishLayout& l, bool fuse_topk) {
  std::vector<std::string> out;
  for (const Step& s : steps(t, l, fuse_topk)) out.emplace_back(s.name);
  return out;
}

}  // namespace pcpkv
