// Tensor checks and the tensor -> contract translation of python/csrc/common.h.
#include "common.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace pcpkv_torch {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream s;
  s << t.scalar_type() << " " << t.sizes() << " strides " << t.strides() << " on " << t.device();
  return s.str();
}

int64_t check_bf16_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const c10::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), name, ": missing");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols &&
                        (t.stride(1) == 1 || cols == 1) && t.device() == device,
                    name, ": expected bfloat16 [", rows, ", ", cols, "] with unit inner stride on ", device, ", got ",
                    describe(t));
  TORCH_CHECK_VALUE(rows <= 1 || t.stride(0) >= cols, name, ": row stride ", t.stride(0), " overlaps rows of ", cols);
  return rows <= 1 ? cols : t.stride(0);
}

void check_dense(const at::Tensor& t, const char* name, at::IntArrayRef sizes, at::ScalarType dtype,
                 const c10::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), name, ": missing");
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() && t.device() == device, name,
                    ": expected contiguous ", dtype, " ", sizes, " on ", device, ", got ", describe(t));
}

void check_vector(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype, const c10::Device& device) {
  check_dense(t, name, {n}, dtype, device);
}

int64_t device_space(const c10::Device& d) {
  return int64_t{static_cast<int8_t>(d.type())} * 256 + (d.index() + 1);  // index -1 (the CPU's): 0
}

ByteRange byte_range(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || t.const_data_ptr() == nullptr) return {};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return pcpkv::byte_range(t.const_data_ptr(), static_cast<uint64_t>((last + 1) * t.element_size()),
                           device_space(t.device()));
}

std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<at::Tensor>& writes,
                                                       const std::vector<at::Tensor>& reads, bool writes_pairwise) {
  std::vector<ByteRange> w, r;
  for (const at::Tensor& t : writes) w.push_back(byte_range(t));
  for (const at::Tensor& t : reads) r.push_back(byte_range(t));
  return pcpkv::first_overlap(w, r, writes_pairwise);
}

namespace {

ByteRange range_of(const NamedTensor& n) { return n.tensor == nullptr ? ByteRange{} : byte_range(*n.tensor); }

std::string name_of(const NamedTensor& n) {
  return n.index >= 0 ? fmt::format("{}[{}]", n.name, n.index) : std::string(n.name);
}

std::string describe_named(const NamedTensor& n) { return n.tensor == nullptr ? "undefined" : describe(*n.tensor); }

}  // namespace

void refuse_overlap(const char* op, const Named& writes, const Named& reads, bool writes_pairwise) {
  std::vector<ByteRange> w, r;
  w.reserve(writes.size());
  r.reserve(reads.size());
  for (const NamedTensor& n : writes) w.push_back(range_of(n));
  for (const NamedTensor& n : reads) r.push_back(range_of(n));
  const auto hit = pcpkv::first_overlap(w, r, writes_pairwise);
  if (!hit) return;
  const NamedTensor& a = writes[hit->first];
  const NamedTensor& b = hit->second < writes.size() ? writes[hit->second] : reads[hit->second - writes.size()];
  TORCH_CHECK_VALUE(false, op, ": ", name_of(a), " (", describe_named(a), ") shares memory with ", name_of(b), " (",
                    describe_named(b),
                    "): an output must not overlap an input or another output (rows are read and written in any "
                    "order)");
}

void check_written_devices(const char* op, const std::vector<at::Tensor>& written, const char* ref,
                           const c10::Device& dev) {
  for (size_t i = 0; i < written.size(); ++i)
    TORCH_CHECK_VALUE(!written[i].defined() || written[i].device().type() == dev.type(), op, ": written[", i,
                      "] is on ", written[i].device(), " but ", ref, " on ", dev,
                      ": the tensors written declares must be on ", dev.type());
}

namespace {

// The caches a combine / insert writes (target_of checked them; the index cache only on a layer with an indexer).
Named written_caches(const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                     const pcpkv::CacheFormat& fmt) {
  return {{"mla_cache", &mla_cache}, {"index_cache", fmt.has_indexer ? maybe(index_cache) : nullptr}};
}

}  // namespace

pcpkv::CacheFormat make_format(const std::string& kv_format, const std::string& ds_mla_scale, double k_scale,
                               bool has_indexer) {
  return translate_errors([&] {
    pcpkv::CacheFormat f;
    f.kv_format = pcpkv::parse_kv_format(kv_format, "kv_format");
    f.ds_mla_scale = pcpkv::parse_ds_mla_scale(ds_mla_scale, "ds_mla_scale");
    // pcpkv::scale_problem, the rule pcpkv_torch.model.scale_problem mirrors; checked before the float32 cast.
    if (const auto why = pcpkv::scale_problem(k_scale)) PCPKV_FAIL("k_scale = {} {}", k_scale, *why);
    f.k_scale = static_cast<float>(k_scale);
    f.has_indexer = has_indexer;
    return f;
  });
}

pcpkv::MlaCacheGeometry mla_geometry_of(const at::Tensor& c, pcpkv::KvFormat fmt, const char* name) {
  const int64_t row = pcpkv::mla_row_bytes(fmt);
  TORCH_CHECK_VALUE(c.defined() && c.scalar_type() == at::kByte && c.dim() == 3 && c.size(2) == row &&
                        c.stride(2) == 1,
                    name, ": expected a uint8 [num_blocks, block_size, ", row, "] ", pcpkv::to_string(fmt),
                    " cache with unit inner stride, got ", describe(c));
  pcpkv::MlaCacheGeometry g;
  g.num_blocks = c.size(0);
  g.block_size = static_cast<int32_t>(c.size(1));
  g.row_stride = c.stride(1);
  g.block_stride = c.stride(0);
  translate_errors([&] { pcpkv::validate_geometry(g, fmt); });
  return g;
}

pcpkv::IndexerCacheGeometry index_geometry_of(const at::Tensor& c, const char* name) {
  TORCH_CHECK_VALUE(c.defined() && c.scalar_type() == at::kByte && c.dim() == 3 && c.size(2) == 132 &&
                        c.stride(2) == 1 && (c.size(1) <= 1 || c.stride(1) == 132),
                    name, ": expected a uint8 [num_blocks, block_size, 132] indexer cache (rows of one block ",
                    "contiguous, block stride >= block_size * 132), got ", describe(c));
  pcpkv::IndexerCacheGeometry g;
  g.num_blocks = c.size(0);
  g.block_size = static_cast<int32_t>(c.size(1));
  g.block_stride = c.size(0) <= 1 ? c.size(1) * 132 : c.stride(0);
  translate_errors([&] { pcpkv::validate_geometry(g); });
  return g;
}

pcpkv::CacheTarget target_of(const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                             const pcpkv::CacheFormat& fmt, const char* op) {
  pcpkv::CacheTarget t;
  const std::string mla_name = std::string(op) + ": mla_cache";
  t.mla = mla_geometry_of(mla_cache, fmt.kv_format, mla_name.c_str());
  t.mla_base = static_cast<uint8_t*>(mla_cache.data_ptr());
  if (fmt.has_indexer) {
    TORCH_CHECK_VALUE(has(index_cache), op, ": index_cache is required on a layer with an indexer (has_indexer)");
    const std::string name = std::string(op) + ": index_cache";
    TORCH_CHECK_VALUE(index_cache->device() == mla_cache.device(), name, " is on ", index_cache->device(),
                      " but mla_cache on ", mla_cache.device());
    t.index = index_geometry_of(*index_cache, name.c_str());
    t.index_base = static_cast<uint8_t*>(index_cache->data_ptr());
  }
  return t;
}

std::vector<pcpkv::CacheTarget> read_target_table(const at::Tensor& host, const char* name) {
  TORCH_CHECK_VALUE(host.device().is_cpu() && host.scalar_type() == at::kByte && host.dim() == 2 &&
                        host.size(1) == kTargetRecordBytes && host.is_contiguous(),
                    name, ": expected a contiguous CPU uint8 [num_targets, ", kTargetRecordBytes,
                    "] target table (pcpkv_torch.CacheTargets), got ", describe(host));
  std::vector<pcpkv::CacheTarget> out(static_cast<size_t>(host.size(0)));
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), out.size() * sizeof(pcpkv::CacheTarget));
  return out;
}

void check_uniform_targets(const std::vector<pcpkv::CacheTarget>& t, bool has_indexer, const char* name) {
  for (size_t d = 1; d < t.size(); ++d) {
    const pcpkv::MlaCacheGeometry &a = t[0].mla, &b = t[d].mla;
    TORCH_CHECK_VALUE(a.num_blocks == b.num_blocks && a.block_size == b.block_size && a.row_stride == b.row_stride &&
                          a.block_stride == b.block_stride,
                      name, "[", d, "]: MLA geometry (num_blocks ", b.num_blocks, ", block_size ", b.block_size,
                      ", row_stride ", b.row_stride, ", block_stride ", b.block_stride, ") differs from ", name,
                      "[0]'s (", a.num_blocks, ", ", a.block_size, ", ", a.row_stride, ", ", a.block_stride,
                      "): a table holds replicas of one geometry");
    if (!has_indexer) continue;
    const pcpkv::IndexerCacheGeometry &x = t[0].index, &y = t[d].index;
    TORCH_CHECK_VALUE(x.num_blocks == y.num_blocks && x.block_size == y.block_size && x.block_stride == y.block_stride,
                      name, "[", d, "]: indexer geometry (num_blocks ", y.num_blocks, ", block_size ", y.block_size,
                      ", block_stride ", y.block_stride, ") differs from ", name, "[0]'s (", x.num_blocks, ", ",
                      x.block_size, ", ", x.block_stride, "): a table holds replicas of one geometry");
  }
}

std::vector<uint8_t*> read_pointer_table(const at::Tensor& host, const char* name) {
  TORCH_CHECK_VALUE(host.device().is_cpu() && (host.scalar_type() == at::kLong || host.scalar_type() == at::kUInt64) &&
                        host.dim() == 1 && host.is_contiguous(),
                    name, ": expected a contiguous CPU int64/uint64 [n] pointer table, got ", describe(host));
  std::vector<uint8_t*> out(static_cast<size_t>(host.size(0)));
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), out.size() * sizeof(uint8_t*));
  return out;
}

pcpkv::DispatchParams make_dispatch_params(const DispatchArgs& a) {
  const c10::Device dev = a.kv.device();
  const int64_t T = a.kv.defined() && a.kv.dim() == 2 ? a.kv.size(0) : -1;
  TORCH_CHECK_VALUE(T >= 0, "dispatch: kv: expected bfloat16 [num_tokens, 512], got ", describe(a.kv));
  pcpkv::DispatchParams p;
  p.num_tokens = T;
  p.fmt = make_format(a.kv_format, a.ds_mla_scale, a.k_scale, a.has_indexer);
  p.kv_stride = check_bf16_rows(a.kv, "dispatch: kv", T, 512, dev);
  p.kv = static_cast<const uint16_t*>(a.kv.data_ptr());
  p.k_pe_stride = check_bf16_rows(a.k_pe, "dispatch: k_pe", T, 64, dev);
  p.k_pe = static_cast<const uint16_t*>(a.k_pe.data_ptr());
  check_vector(a.positions, "dispatch: positions", T, at::kLong, dev);
  p.positions = a.positions.data_ptr<int64_t>();
  check_vector(a.kv_norm_w, "dispatch: kv_norm_w", 512, at::kFloat, dev);
  p.kv_norm_w = a.kv_norm_w.data_ptr<float>();
  TORCH_CHECK_VALUE(a.rope_cos_sin.scalar_type() == at::kFloat && a.rope_cos_sin.dim() == 2 &&
                        a.rope_cos_sin.size(1) == 64 && a.rope_cos_sin.is_contiguous() &&
                        a.rope_cos_sin.device() == dev,
                    "dispatch: rope_cos_sin: expected contiguous float32 [num_positions, 64] on ", dev, ", got ",
                    describe(a.rope_cos_sin));
  p.rope_cos_sin = a.rope_cos_sin.data_ptr<float>();
  p.rope_num_positions = a.rope_cos_sin.size(0);
  // Checked as given: 1e300 became the float32 inf, which the library then reported as "q_eps = inf".
  const auto eps = [](double v, const char* name) {
    TORCH_CHECK_VALUE(!(std::abs(v) > std::numeric_limits<float>::max()), "dispatch: ", name, " = ", v,
                      " overflows the float32 the kernels read (it must be finite and >= 0)");
    return static_cast<float>(v);
  };
  p.q_eps = eps(a.q_eps, "q_eps");
  p.kv_eps = eps(a.kv_eps, "kv_eps");
  p.index_eps = eps(a.index_eps, "index_eps");
  p.mla_rope = a.mla_rope_interleaved ? pcpkv::RopeStyle::kInterleaved : pcpkv::RopeStyle::kNeox;
  p.index_rope = a.index_rope_interleaved ? pcpkv::RopeStyle::kInterleaved : pcpkv::RopeStyle::kNeox;
  p.index_hadamard = a.index_hadamard;

  TORCH_CHECK_VALUE(has(a.q_c) == has(a.q_c_out), "dispatch: q_c and q_c_out go together (q_c ",
                    has(a.q_c) ? "given" : "missing", ", q_c_out ", has(a.q_c_out) ? "given" : "missing", ")");
  if (has(a.q_c)) {
    TORCH_CHECK_VALUE(a.q_c->dim() == 2, "dispatch: q_c: expected bfloat16 [num_tokens, q_lora_rank], got ",
                      describe(*a.q_c));
    const int64_t r = a.q_c->size(1);
    // Here and not only in the library's validate_dispatch_shape, which checks q_lora_rank when q_c or q_c_out is
    // set: a zero-width q_c (or one of 0 rows) has null data pointers, which the contract reads as "no Q norm".
    TORCH_CHECK_VALUE(r >= 8 && r <= 4096 && r % 8 == 0, "dispatch: q_c: q_lora_rank (its width) = ", r,
                      " must be a multiple of 8 in [8, 4096], got ", describe(*a.q_c));
    p.q_lora_rank = r;
    p.q_c_stride = check_bf16_rows(*a.q_c, "dispatch: q_c", T, r, dev);
    p.q_c = static_cast<const uint16_t*>(a.q_c->data_ptr());
    check_dense(*a.q_c_out, "dispatch: q_c_out", {T, r}, at::kBFloat16, dev);
    p.q_c_out = static_cast<uint16_t*>(a.q_c_out->data_ptr());
    TORCH_CHECK_VALUE(has(a.q_norm_w), "dispatch: q_norm_w is required with q_c");
    check_vector(*a.q_norm_w, "dispatch: q_norm_w", r, at::kFloat, dev);
    p.q_norm_w = a.q_norm_w->data_ptr<float>();
  }
  if (a.has_indexer) {
    TORCH_CHECK_VALUE(has(a.index_k) && has(a.index_ln_w) && has(a.index_ln_b),
                      "dispatch: index_k, index_ln_w and index_ln_b are required when has_indexer=True");
    p.index_k_stride = check_bf16_rows(*a.index_k, "dispatch: index_k", T, 128, dev);
    p.index_k = static_cast<const uint16_t*>(a.index_k->data_ptr());
    check_vector(*a.index_ln_w, "dispatch: index_ln_w", 128, at::kFloat, dev);
    check_vector(*a.index_ln_b, "dispatch: index_ln_b", 128, at::kFloat, dev);
    p.index_ln_w = a.index_ln_w->data_ptr<float>();
    p.index_ln_b = a.index_ln_b->data_ptr<float>();
  } else {
    TORCH_CHECK_VALUE(!has(a.index_k) && !has(a.index_k_out),
                      "dispatch: index_k / index_k_out given but has_indexer=False");
  }
  if (has(a.kv_c_out)) {
    check_dense(*a.kv_c_out, "dispatch: kv_c_out", {T, 512}, at::kBFloat16, dev);
    p.kv_c_out = static_cast<uint16_t*>(a.kv_c_out->data_ptr());
  }
  if (has(a.k_pe_out)) {
    check_dense(*a.k_pe_out, "dispatch: k_pe_out", {T, 64}, at::kBFloat16, dev);
    p.k_pe_out = static_cast<uint16_t*>(a.k_pe_out->data_ptr());
  }
  if (has(a.index_k_out)) {
    check_dense(*a.index_k_out, "dispatch: index_k_out", {T, 128}, at::kBFloat16, dev);
    p.index_k_out = static_cast<uint16_t*>(a.index_k_out->data_ptr());
  }
  if (has(a.topk_fill)) {
    TORCH_CHECK_VALUE(a.topk_fill->dim() == 2 && a.topk_fill->size(0) == T,
                      "dispatch: topk_fill: expected int32 [num_tokens, topk_width], got ", describe(*a.topk_fill));
    check_dense(*a.topk_fill, "dispatch: topk_fill", {T, a.topk_fill->size(1)}, at::kInt, dev);
    p.topk_fill = a.topk_fill->data_ptr<int32_t>();
    p.topk_width = a.topk_fill->size(1);
  }
  TORCH_CHECK_VALUE(a.topk_fill_mode == "full" || a.topk_fill_mode == "tail" || a.topk_fill_mode == "none",
                    "dispatch: topk_fill_mode = '", a.topk_fill_mode, "' must be 'full', 'tail' or 'none'");
  p.topk_fill_mode = a.topk_fill_mode == "full" ? pcpkv::TopkFill::kFull
                     : a.topk_fill_mode == "tail" ? pcpkv::TopkFill::kTail
                                                  : pcpkv::TopkFill::kNone;
  TORCH_CHECK_VALUE(p.topk_fill_mode != pcpkv::TopkFill::kTail || (a.topk_indexer_rows >= 0 && a.topk_indexer_rows <= T),
                    "dispatch: topk_indexer_rows = ", a.topk_indexer_rows, " must be in [0, num_tokens = ", T,
                    "] for topk_fill_mode 'tail'");
  p.topk_indexer_rows = a.topk_indexer_rows;
  if (has(a.slot_mapping)) {
    check_vector(*a.slot_mapping, "dispatch: slot_mapping", T, at::kLong, dev);
    p.slot_mapping = a.slot_mapping->data_ptr<int64_t>();
  }
  if (has(a.indexer_slot_mapping)) {  // the indexer rows' own slots (docs/spec.md 4.2)
    TORCH_CHECK_VALUE(a.has_indexer, "dispatch: indexer_slot_mapping is set but has_indexer=False");
    check_vector(*a.indexer_slot_mapping, "dispatch: indexer_slot_mapping", T, at::kLong, dev);
    p.indexer_slot_mapping = a.indexer_slot_mapping->data_ptr<int64_t>();
  }
  check_written_devices("dispatch", a.written, "kv", dev);
  // The kernels write the outputs while they read the inputs, row by row in any order (on the GPU many blocks at
  // once): no output may share memory with an input, a table, a written tensor (the caches and staging behind the
  // tables) or another output, and no written tensor with an input or a table. Written tensors may repeat each
  // other: they are declarations (a replica can be named by `written` and by the tables' tensors).
  const Named outs = {{"q_c_out", maybe(a.q_c_out)}, {"kv_c_out", maybe(a.kv_c_out)}, {"k_pe_out", maybe(a.k_pe_out)},
                      {"index_k_out", maybe(a.index_k_out)}, {"topk_fill", maybe(a.topk_fill)}};
  Named ins = {{"kv", &a.kv},
               {"k_pe", &a.k_pe},
               {"positions", &a.positions},
               {"kv_norm_w", &a.kv_norm_w},
               {"rope_cos_sin", &a.rope_cos_sin},
               {"q_c", maybe(a.q_c)},
               {"q_norm_w", maybe(a.q_norm_w)},
               {"index_k", maybe(a.index_k)},
               {"index_ln_w", maybe(a.index_ln_w)},
               {"index_ln_b", maybe(a.index_ln_b)},
               {"slot_mapping", maybe(a.slot_mapping)},
               {"indexer_slot_mapping", maybe(a.indexer_slot_mapping)}};
  const char* const table_names[] = {"targets", "targets_host", "row_dests", "row_dests_host"};
  for (size_t i = 0; i < 4; ++i) ins.push_back({table_names[i], &a.tables[i]});
  const size_t num_ins = ins.size();
  for (size_t i = 0; i < a.written.size(); ++i) ins.push_back({"written", &a.written[i], static_cast<int64_t>(i)});
  refuse_overlap("dispatch", outs, ins, true);  // outputs against inputs, tables, written tensors and each other
  const Named written(ins.begin() + static_cast<std::ptrdiff_t>(num_ins), ins.end());
  ins.resize(num_ins);
  refuse_overlap("dispatch", written, ins, false);
  return p;
}

pcpkv::CombineParams make_combine_params(const at::Tensor& rows, const at::Tensor& slot_mapping,
                                         const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                                         c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                                         bool has_indexer, const std::optional<at::Tensor>& indexer_slot_mapping) {
  pcpkv::CombineParams p;
  p.fmt = make_format(std::string(kv_format), std::string(ds_mla_scale), k_scale, has_indexer);
  p.target = target_of(mla_cache, index_cache, p.fmt, "combine");
  const c10::Device dev = mla_cache.device();
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte && rows.dim() == 3 && rows.is_contiguous() && rows.device() == dev,
                    "combine: rows: expected contiguous uint8 [num_src_ranks, max_local_tokens, row_bytes] on ", dev,
                    ", got ", describe(rows));
  p.rows = rows.data_ptr<uint8_t>();
  p.num_src_ranks = static_cast<int32_t>(rows.size(0));
  p.max_local_tokens = rows.size(1);
  p.row_bytes = rows.size(2);
  check_vector(slot_mapping, "combine: slot_mapping", rows.size(0) * rows.size(1), at::kLong, dev);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  if (has(indexer_slot_mapping)) {
    TORCH_CHECK_VALUE(has_indexer, "combine: indexer_slot_mapping is set but has_indexer=False");
    check_vector(*indexer_slot_mapping, "combine: indexer_slot_mapping", rows.size(0) * rows.size(1), at::kLong, dev);
    p.indexer_slot_mapping = indexer_slot_mapping->data_ptr<int64_t>();
  }
  // Rows are copied in any order (on the GPU by many blocks at once): a cache overlapping the rows, the slots or
  // the other cache would read or clobber bytes another row writes.
  refuse_overlap("combine", written_caches(mla_cache, index_cache, p.fmt),
                 {{"rows", &rows},
                  {"slot_mapping", &slot_mapping},
                  {"indexer_slot_mapping", maybe(indexer_slot_mapping)}},
                 true);
  return p;
}

pcpkv::InsertParams make_insert_params(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                       const std::optional<at::Tensor>& index_k, const at::Tensor& slot_mapping,
                                       const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                                       c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                                       const std::optional<at::Tensor>& indexer_slot_mapping) {
  pcpkv::InsertParams p;
  p.fmt = make_format(std::string(kv_format), std::string(ds_mla_scale), k_scale, has(index_k));
  p.target = target_of(mla_cache, index_cache, p.fmt, "insert");
  const c10::Device dev = mla_cache.device();
  const int64_t T = kv_c.dim() == 2 ? kv_c.size(0) : -1;
  check_dense(kv_c, "insert: kv_c", {T, 512}, at::kBFloat16, dev);
  check_dense(k_pe, "insert: k_pe", {T, 64}, at::kBFloat16, dev);
  check_vector(slot_mapping, "insert: slot_mapping", T, at::kLong, dev);
  p.num_tokens = T;
  p.kv_c = static_cast<const uint16_t*>(kv_c.data_ptr());
  p.k_pe = static_cast<const uint16_t*>(k_pe.data_ptr());
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  if (has(indexer_slot_mapping)) {
    TORCH_CHECK_VALUE(has(index_k), "insert: indexer_slot_mapping is set but index_k is None (no indexer)");
    check_vector(*indexer_slot_mapping, "insert: indexer_slot_mapping", T, at::kLong, dev);
    p.indexer_slot_mapping = indexer_slot_mapping->data_ptr<int64_t>();
  }
  if (has(index_k)) {
    check_dense(*index_k, "insert: index_k", {T, 128}, at::kBFloat16, dev);
    p.index_k = static_cast<const uint16_t*>(index_k->data_ptr());
  }
  // As in combine: rows are quantized and stored in any order, so no cache may overlap an input or the other cache.
  refuse_overlap("insert", written_caches(mla_cache, index_cache, p.fmt),
                 {{"kv_c", &kv_c}, {"k_pe", &k_pe}, {"index_k", maybe(index_k)}, {"slot_mapping", &slot_mapping},
                  {"indexer_slot_mapping", maybe(indexer_slot_mapping)}},
                 true);
  return p;
}

}  // namespace pcpkv_torch
