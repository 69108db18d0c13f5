// Parameter checks of the kernel contracts (pcpkv/publish/dispatch.h), shared by the CPU reference and any launcher
// that wants the same messages. Nothing here writes memory.
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "pcpkv/publish/validate.h"
#include "pcpkv/core/byte_range.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"

namespace pcpkv {
namespace {

// Slots a target can address: the smaller of its MLA and (indexer layers) indexer caches.
int64_t target_num_slots(const CacheTarget& t, const CacheFormat& fmt) {
  int64_t n = t.mla.num_slots();
  if (fmt.has_indexer) n = std::min(n, t.index.num_slots());
  return n;
}

// The slot mappings of a call against its targets. One mapping (index_slots null) addresses both caches: its slots
// must exist in the smaller. With an indexer mapping (docs/spec.md section 4.2) each is checked against its own cache.
// slot_name / index_name: "dispatch: slot_mapping", "dispatch: indexer_slot_mapping" (literals: no formatting per
// call).
void check_slot_mappings(const char* slot_name, const char* index_name, const int64_t* slots,
                         const int64_t* index_slots, int64_t n, const CacheTarget* targets, int32_t num_targets,
                         const CacheFormat& fmt) {
  if (index_slots == nullptr) {
    int64_t num_slots = target_num_slots(targets[0], fmt);
    for (int32_t d = 1; d < num_targets; ++d) num_slots = std::min(num_slots, target_num_slots(targets[d], fmt));
    validate_slot_mapping(slots, n, num_slots, slot_name);
    return;
  }
  int64_t mla_slots = targets[0].mla.num_slots(), index_slots_n = targets[0].index.num_slots();
  for (int32_t d = 1; d < num_targets; ++d) {
    mla_slots = std::min(mla_slots, targets[d].mla.num_slots());
    index_slots_n = std::min(index_slots_n, targets[d].index.num_slots());
  }
  validate_slot_mapping(slots, n, mla_slots, slot_name);
  validate_slot_mapping(index_slots, n, index_slots_n, index_name);
}

// An indexer slot mapping needs an indexer cache to address.
void check_indexer_slot_mapping(const char* op, const int64_t* index_slots, const CacheFormat& fmt) {
  PCPKV_CHECK(index_slots == nullptr || fmt.has_indexer, "{}: indexer_slot_mapping is set but fmt.has_indexer = false",
              op);
}

void check_eps(float eps, const char* name) {
  PCPKV_CHECK(std::isfinite(eps) && eps >= 0.0f, "{} = {} must be finite and >= 0", name, eps);
}

void check_rope_style(RopeStyle s, const char* name) {
  PCPKV_CHECK(s == RopeStyle::kInterleaved || s == RopeStyle::kNeox, "{} = {} is not a RopeStyle", name,
              static_cast<int>(s));
}

// A region of memory one call reads or writes, named by its field ("target.mla_base", "jobs[1].targets[3].index_base").
// The name is kept in parts and formatted only for the error: the check runs on every launch (~2.5 us per dispatch of
// 8 targets with formatted names, measured on the 2-core CI machine).
struct Region {
  const char* field;
  ByteRange range;
  int index = -1;              // field[index]
  const char* part = nullptr;  // field.part
  int job = -1;                // jobs[job].field
};

std::string name_of(const Region& r) {
  std::string s = r.job >= 0 ? fmt::format("jobs[{}].{}", r.job, r.field) : std::string(r.field);
  if (r.index >= 0) s += fmt::format("[{}]", r.index);
  if (r.part != nullptr) s += fmt::format(".{}", r.part);
  return s;
}

// rows rows of width elements of elem_bytes bytes, stride elements apart: ((rows - 1) * stride + width) * elem_bytes
// bytes (saturated: a hostile count must not wrap to a small range). Strides are checked >= width before.
ByteRange rows_range(const void* p, int64_t rows, int64_t stride, int64_t width, int64_t elem_bytes) {
  if (rows <= 0 || width <= 0) return {};
  const unsigned __int128 n = (static_cast<unsigned __int128>(rows - 1) * static_cast<uint64_t>(stride) +
                               static_cast<uint64_t>(width)) * static_cast<uint64_t>(elem_bytes);
  return byte_range(p, n > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(n));
}
// rows dense rows of width elements.
ByteRange dense_rows(const void* p, int64_t rows, int64_t width, int64_t elem_bytes) {
  return rows_range(p, rows, width, width, elem_bytes);
}

// The caches a target's rows land in, up to the end of its last slot (the extent of the uint8 [num_blocks,
// block_size, row] tensors the torch ops take; pcpkv_torch.CacheTargets computes the same). Geometry validated.
void add_target(std::vector<Region>& out, const CacheTarget& t, const CacheFormat& fmt, const char* field, int index,
                int job) {
  // [base, end of the last slot): (num_blocks - 1) block strides, then the last block's rows.
  const auto extent = [](int64_t num_blocks, int64_t block_stride, int64_t last_block_bytes) -> uint64_t {
    return num_blocks <= 0 ? 0 : static_cast<uint64_t>((num_blocks - 1) * block_stride + last_block_bytes);
  };
  const int64_t mla_last = (t.mla.block_size - 1) * t.mla.row_stride + mla_row_bytes(fmt.kv_format);
  out.push_back({field, byte_range(t.mla_base, extent(t.mla.num_blocks, t.mla.block_stride, mla_last)), index,
                 "mla_base", job});
  if (!fmt.has_indexer) return;
  const int64_t index_last = int64_t{t.index.block_size} * kIndexerSlotBytes;
  out.push_back({field, byte_range(t.index_base, extent(t.index.num_blocks, t.index.block_stride, index_last)), index,
                 "index_base", job});
}

// Throws naming the first output of `writes` that shares a byte with another output or with an input of `reads`,
// and that one (first_overlap). The kernels read and write rows in any order (on the GPU many blocks at once), so
// an output over an input or over another output corrupts rows another token reads or writes.
void refuse_overlap(const char* op, const std::vector<Region>& writes, const std::vector<Region>& reads) {
  std::vector<ByteRange> w, r;
  w.reserve(writes.size());
  r.reserve(reads.size());
  for (const Region& x : writes) w.push_back(x.range);
  for (const Region& x : reads) r.push_back(x.range);
  const auto hit = first_overlap(w, r, true);
  if (!hit) return;
  const Region& a = writes[hit->first];
  const Region& b = hit->second < writes.size() ? writes[hit->second] : reads[hit->second - writes.size()];
  PCPKV_FAIL("{}: {} (bytes [{:#x}, {:#x})) overlaps {} (bytes [{:#x}, {:#x})): an output must not share memory "
             "with an input or another output (rows are read and written in any order)",
             op, name_of(a), a.range.lo, a.range.hi, name_of(b), b.range.lo, b.range.hi);
}

// What one combine / insert job writes (its target) and reads; job >= 0 names the fields "jobs[job].field".
void combine_regions(const CombineParams& p, int job, std::vector<Region>& writes, std::vector<Region>& reads) {
  const int64_t n = int64_t{p.num_src_ranks} * p.max_local_tokens;
  add_target(writes, p.target, p.fmt, "target", -1, job);
  reads.push_back({"rows", dense_rows(p.rows, n, p.row_bytes, 1), -1, nullptr, job});
  reads.push_back({"slot_mapping", dense_rows(p.slot_mapping, n, 1, 8), -1, nullptr, job});
  reads.push_back({"indexer_slot_mapping", dense_rows(p.indexer_slot_mapping, n, 1, 8), -1, nullptr, job});
}

void insert_regions(const InsertParams& p, int job, std::vector<Region>& writes, std::vector<Region>& reads) {
  const int64_t T = p.num_tokens;
  add_target(writes, p.target, p.fmt, "target", -1, job);
  reads.push_back({"kv_c", dense_rows(p.kv_c, T, kKvLoraRank, 2), -1, nullptr, job});
  reads.push_back({"k_pe", dense_rows(p.k_pe, T, kRopeDims, 2), -1, nullptr, job});
  if (p.fmt.has_indexer) reads.push_back({"index_k", dense_rows(p.index_k, T, kIndexHeadDim, 2), -1, nullptr, job});
  reads.push_back({"slot_mapping", dense_rows(p.slot_mapping, T, 1, 8), -1, nullptr, job});
  reads.push_back({"indexer_slot_mapping", dense_rows(p.indexer_slot_mapping, T, 1, 8), -1, nullptr, job});
}

// The jobs of one launch run at once: no job's output may overlap another job's output or any job's input.
template <class Params, class RegionsFn>
void refuse_overlap_between_jobs(const char* op, const Params* jobs, int num_jobs, RegionsFn regions) {
  if (num_jobs < 2) return;  // one job: its shape check compared its own regions
  std::vector<Region> writes, reads;
  for (int i = 0; i < num_jobs; ++i) regions(jobs[i], i, writes, reads);
  refuse_overlap(op, writes, reads);
}

}  // namespace

void validate_cache_format(const CacheFormat& fmt) {
  PCPKV_CHECK(fmt.kv_format == KvFormat::kBf16 || fmt.kv_format == KvFormat::kFp8 ||
                  fmt.kv_format == KvFormat::kFp8DsMla,
              "fmt.kv_format = {} is not a KvFormat", static_cast<int>(fmt.kv_format));
  PCPKV_CHECK(fmt.ds_mla_scale == DsMlaScale::kPow2 || fmt.ds_mla_scale == DsMlaScale::kRaw,
              "fmt.ds_mla_scale = {} is not a DsMlaScale", static_cast<int>(fmt.ds_mla_scale));
  // Whatever kv_format (as before): a subnormal scale passed here and made x / k_scale inf.
  if (const auto why = scale_problem(fmt.k_scale)) PCPKV_FAIL("fmt.k_scale = {} {}", fmt.k_scale, *why);
}

void validate_cache_target(const CacheTarget& t, const CacheFormat& fmt, const char* name, int index) {
  const auto indexed = [&] { return index >= 0 ? fmt::format("[{}]", index) : std::string(); };
  PCPKV_CHECK(t.mla_base != nullptr, "{}{}.mla_base is null", name, indexed());
  if (fmt.has_indexer)
    PCPKV_CHECK(t.index_base != nullptr, "{}{}.index_base is null on a layer with an indexer", name, indexed());
  try {
    validate_geometry(t.mla, fmt.kv_format);
    if (fmt.has_indexer) validate_geometry(t.index);
  } catch (const Error& e) {  // the geometry's message does not know which target it is
    throw Error(fmt::format("{}{}: {}", name, indexed(), e.what()), e.where());
  }
  // One slot, one row in each cache: slot = block * block_size + offset (SPEC section 4) with one block_size, as
  // vLLM allocates both caches from one block table. Other block sizes put a token's indexer row in another block.
  if (fmt.has_indexer)
    PCPKV_CHECK(t.index.block_size == t.mla.block_size,
                "{}{}: indexer cache block_size = {} differs from the MLA cache's {}: both caches of a target are "
                "addressed by one slot (block * block_size + offset)",
                name, indexed(), t.index.block_size, t.mla.block_size);
}

void validate_dispatch_shape(const DispatchParams& p) {
  const int64_t T = p.num_tokens;
  PCPKV_CHECK(T >= 0, "dispatch: num_tokens = {} must be >= 0", T);
  validate_cache_format(p.fmt);
  check_rope_style(p.mla_rope, "dispatch: mla_rope");
  check_rope_style(p.index_rope, "dispatch: index_rope");
  // Q norm: all or nothing.
  if (p.q_c_out != nullptr || p.q_c != nullptr) {
    PCPKV_CHECK(T == 0 || (p.q_c != nullptr && p.q_c_out != nullptr), "dispatch: q_c ({}) and q_c_out ({}) go together",
                p.q_c ? "set" : "null", p.q_c_out ? "set" : "null");
    PCPKV_CHECK(p.q_lora_rank >= 8 && p.q_lora_rank <= kMaxQLoraRank && p.q_lora_rank % 8 == 0,
                "dispatch: q_lora_rank = {} must be a multiple of 8 in [8, {}]", p.q_lora_rank, kMaxQLoraRank);
    PCPKV_CHECK(p.q_c_stride >= p.q_lora_rank, "dispatch: q_c_stride = {} is smaller than q_lora_rank = {}",
                p.q_c_stride, p.q_lora_rank);
    PCPKV_CHECK(p.q_norm_w != nullptr, "dispatch: q_norm_w is null");
    check_eps(p.q_eps, "dispatch: q_eps");
  }
  PCPKV_CHECK(T == 0 || p.kv != nullptr, "dispatch: kv is null");
  PCPKV_CHECK(p.kv_stride >= kKvLoraRank, "dispatch: kv_stride = {} is smaller than 512", p.kv_stride);
  PCPKV_CHECK(T == 0 || p.k_pe != nullptr, "dispatch: k_pe is null");
  PCPKV_CHECK(p.k_pe_stride >= kRopeDims, "dispatch: k_pe_stride = {} is smaller than 64", p.k_pe_stride);
  PCPKV_CHECK(p.kv_norm_w != nullptr, "dispatch: kv_norm_w is null");
  check_eps(p.kv_eps, "dispatch: kv_eps");
  PCPKV_CHECK(T == 0 || p.positions != nullptr, "dispatch: positions is null");
  PCPKV_CHECK(p.rope_cos_sin != nullptr, "dispatch: rope_cos_sin is null");
  PCPKV_CHECK(p.rope_num_positions >= 1, "dispatch: rope_num_positions = {} must be >= 1", p.rope_num_positions);
  if (p.fmt.has_indexer) {
    PCPKV_CHECK(T == 0 || p.index_k != nullptr, "dispatch: index_k is null but fmt.has_indexer = true");
    PCPKV_CHECK(p.index_k_stride >= kIndexHeadDim, "dispatch: index_k_stride = {} is smaller than 128",
                p.index_k_stride);
    PCPKV_CHECK(p.index_ln_w != nullptr && p.index_ln_b != nullptr, "dispatch: index_ln_w / index_ln_b is null");
    check_eps(p.index_eps, "dispatch: index_eps");
  } else {
    PCPKV_CHECK(p.index_k == nullptr, "dispatch: index_k is set but fmt.has_indexer = false");
    PCPKV_CHECK(p.index_k_out == nullptr, "dispatch: index_k_out is set but fmt.has_indexer = false");
  }
  if (p.topk_fill != nullptr)
    PCPKV_CHECK(p.topk_width >= 1 && p.topk_width <= INT32_MAX,
                "dispatch: topk_width = {} must be in [1, 2^31) when topk_fill is set", p.topk_width);
  PCPKV_CHECK(p.topk_fill_mode == TopkFill::kFull || p.topk_fill_mode == TopkFill::kTail ||
                  p.topk_fill_mode == TopkFill::kNone,
              "dispatch: topk_fill_mode = {} is not a TopkFill", static_cast<int>(p.topk_fill_mode));
  if (p.topk_fill_mode == TopkFill::kTail)
    PCPKV_CHECK(p.topk_indexer_rows >= 0 && p.topk_indexer_rows <= T,
                "dispatch: topk_indexer_rows = {} must be in [0, num_tokens = {}] for topk_fill_mode = tail",
                p.topk_indexer_rows, T);
  PCPKV_CHECK(p.num_targets >= 0, "dispatch: num_targets = {} must be >= 0", p.num_targets);
  if (p.num_targets > 0) {
    PCPKV_CHECK(p.targets != nullptr, "dispatch: targets is null for num_targets = {}", p.num_targets);
    PCPKV_CHECK(T == 0 || p.slot_mapping != nullptr, "dispatch: slot_mapping is null but num_targets = {}",
                p.num_targets);
    for (int32_t d = 0; d < p.num_targets; ++d)
      validate_cache_target(p.targets[d], p.fmt, "dispatch: targets", d);
  }
  check_indexer_slot_mapping("dispatch", p.indexer_slot_mapping, p.fmt);
  PCPKV_CHECK(p.num_row_dests >= 0, "dispatch: num_row_dests = {} must be >= 0", p.num_row_dests);
  if (p.num_row_dests > 0) {
    PCPKV_CHECK(p.row_dests != nullptr, "dispatch: row_dests is null for num_row_dests = {}", p.num_row_dests);
    for (int32_t d = 0; d < p.num_row_dests; ++d)
      PCPKV_CHECK(p.row_dests[d] != nullptr, "dispatch: row_dests[{}] is null", d);
    const int64_t want = transport_row_layout(p.fmt).row_bytes;
    PCPKV_CHECK(p.row_bytes == want, "dispatch: row_bytes = {} but a {}{} transport row has {} B", p.row_bytes,
                to_string(p.fmt.kv_format), p.fmt.has_indexer ? " + indexer" : "", want);
  }
  // No output (cache targets, transport rows, materialized tensors) over an input or another output.
  std::vector<Region> writes, reads;
  writes.reserve(2 * static_cast<size_t>(p.num_targets) + static_cast<size_t>(p.num_row_dests) + 5);
  reads.reserve(14);  // 13, and the indexer slot mapping when given
  for (int32_t d = 0; d < p.num_targets; ++d) add_target(writes, p.targets[d], p.fmt, "targets", d, -1);
  for (int32_t d = 0; d < p.num_row_dests; ++d)
    writes.push_back({"row_dests", dense_rows(p.row_dests[d], T, p.row_bytes, 1), d});
  writes.push_back({"q_c_out", dense_rows(p.q_c_out, T, p.q_lora_rank, 2)});
  writes.push_back({"kv_c_out", dense_rows(p.kv_c_out, T, kKvLoraRank, 2)});
  writes.push_back({"k_pe_out", dense_rows(p.k_pe_out, T, kRopeDims, 2)});
  writes.push_back({"index_k_out", dense_rows(p.index_k_out, T, kIndexHeadDim, 2)});
  writes.push_back({"topk_fill", dense_rows(p.topk_fill, T, p.topk_width, 4)});
  reads.push_back({"q_c", rows_range(p.q_c, T, p.q_c_stride, p.q_lora_rank, 2)});
  reads.push_back({"kv", rows_range(p.kv, T, p.kv_stride, kKvLoraRank, 2)});
  reads.push_back({"k_pe", rows_range(p.k_pe, T, p.k_pe_stride, kRopeDims, 2)});
  if (p.fmt.has_indexer) reads.push_back({"index_k", rows_range(p.index_k, T, p.index_k_stride, kIndexHeadDim, 2)});
  reads.push_back({"positions", dense_rows(p.positions, T, 1, 8)});
  reads.push_back({"slot_mapping", dense_rows(p.slot_mapping, T, 1, 8)});
  if (p.indexer_slot_mapping != nullptr)  // the default form's checks stay as they were (host time per launch)
    reads.push_back({"indexer_slot_mapping", dense_rows(p.indexer_slot_mapping, T, 1, 8)});
  reads.push_back({"q_norm_w", dense_rows(p.q_norm_w, 1, p.q_lora_rank, 4)});
  reads.push_back({"kv_norm_w", dense_rows(p.kv_norm_w, 1, kKvLoraRank, 4)});
  if (p.fmt.has_indexer) {
    reads.push_back({"index_ln_w", dense_rows(p.index_ln_w, 1, kIndexHeadDim, 4)});
    reads.push_back({"index_ln_b", dense_rows(p.index_ln_b, 1, kIndexHeadDim, 4)});
  }
  reads.push_back({"rope_cos_sin", dense_rows(p.rope_cos_sin, p.rope_num_positions, kRopeDims, 4)});
  refuse_overlap("dispatch", writes, reads);
}

void validate_dispatch(const DispatchParams& p) {
  validate_dispatch_shape(p);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t pos = p.positions[t];
    PCPKV_CHECK(pos >= 0 && pos < p.rope_num_positions, "dispatch: positions[{}] = {} is out of range [0, {})", t,
                pos, p.rope_num_positions);
  }
  if (p.num_targets > 0)
    check_slot_mappings("dispatch: slot_mapping", "dispatch: indexer_slot_mapping", p.slot_mapping,
                        p.indexer_slot_mapping, p.num_tokens, p.targets, p.num_targets, p.fmt);
}

void validate_combine_shape(const CombineParams& p) {
  validate_cache_format(p.fmt);
  PCPKV_CHECK(p.num_src_ranks >= 0, "combine: num_src_ranks = {} must be >= 0", p.num_src_ranks);
  PCPKV_CHECK(p.max_local_tokens >= 0, "combine: max_local_tokens = {} must be >= 0", p.max_local_tokens);
  const int64_t n = int64_t{p.num_src_ranks} * p.max_local_tokens;
  const int64_t want = transport_row_layout(p.fmt).row_bytes;
  PCPKV_CHECK(p.row_bytes == want, "combine: row_bytes = {} but a {}{} transport row has {} B", p.row_bytes,
              to_string(p.fmt.kv_format), p.fmt.has_indexer ? " + indexer" : "", want);
  PCPKV_CHECK(n == 0 || p.rows != nullptr, "combine: rows is null for {} rows", n);
  PCPKV_CHECK(n == 0 || p.slot_mapping != nullptr, "combine: slot_mapping is null for {} rows", n);
  check_indexer_slot_mapping("combine", p.indexer_slot_mapping, p.fmt);
  validate_cache_target(p.target, p.fmt, "combine: target");
  std::vector<Region> writes, reads;
  combine_regions(p, -1, writes, reads);
  refuse_overlap("combine", writes, reads);
}

void validate_combine_jobs(const CombineParams* jobs, int num_jobs) {
  refuse_overlap_between_jobs("combine", jobs, num_jobs, combine_regions);
}

void validate_combine(const CombineParams& p) {
  validate_combine_shape(p);
  check_slot_mappings("combine: slot_mapping", "combine: indexer_slot_mapping", p.slot_mapping, p.indexer_slot_mapping,
                      int64_t{p.num_src_ranks} * p.max_local_tokens, &p.target, 1, p.fmt);
}

void validate_insert_shape(const InsertParams& p) {
  validate_cache_format(p.fmt);
  const int64_t T = p.num_tokens;
  PCPKV_CHECK(T >= 0, "insert: num_tokens = {} must be >= 0", T);
  if (T > 0) {
    PCPKV_CHECK(p.kv_c != nullptr, "insert: kv_c is null");
    PCPKV_CHECK(p.k_pe != nullptr, "insert: k_pe is null");
    PCPKV_CHECK(p.slot_mapping != nullptr, "insert: slot_mapping is null");
    if (p.fmt.has_indexer) PCPKV_CHECK(p.index_k != nullptr, "insert: index_k is null but fmt.has_indexer = true");
  }
  if (!p.fmt.has_indexer) PCPKV_CHECK(p.index_k == nullptr, "insert: index_k is set but fmt.has_indexer = false");
  check_indexer_slot_mapping("insert", p.indexer_slot_mapping, p.fmt);
  validate_cache_target(p.target, p.fmt, "insert: target");
  std::vector<Region> writes, reads;
  insert_regions(p, -1, writes, reads);
  refuse_overlap("insert", writes, reads);
}

void validate_insert_jobs(const InsertParams* jobs, int num_jobs) {
  refuse_overlap_between_jobs("insert", jobs, num_jobs, insert_regions);
}

void validate_insert(const InsertParams& p) {
  validate_insert_shape(p);
  check_slot_mappings("insert: slot_mapping", "insert: indexer_slot_mapping", p.slot_mapping, p.indexer_slot_mapping,
                      p.num_tokens, &p.target, 1, p.fmt);
}

}  // namespace pcpkv
