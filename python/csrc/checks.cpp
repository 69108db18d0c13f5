// The tensor checks every op shares (python/csrc/checks.h).
#include "checks.h"

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

void check_token_rows(const char* op, const char* kv_name, const at::Tensor& kv, const at::Tensor& k_pe,
                      const char* ref, int64_t T) {
  if (!kv.defined() || kv.dim() != 2 || !k_pe.defined() || k_pe.dim() != 2) return;
  const int64_t a = kv.size(0), b = k_pe.size(0);
  if (a == b) return;  // agreeing with each other: `ref` is the odd one, which the op's own check of it names
  if (a != T && b != T)
    TORCH_CHECK_VALUE(false, op, ": ", kv_name, " and k_pe have ", a, " and ", b, " rows, expected ", T,
                      " (the local tokens: ", ref, " has ", T, ")");
  const bool kv_odd = a != T;
  TORCH_CHECK_VALUE(false, op, ": ", kv_odd ? kv_name : "k_pe", " has ", kv_odd ? a : b, " rows, expected ", T,
                    " (the local tokens: ", ref, " has ", T, "); ", kv_odd ? "k_pe" : kv_name, " has ",
                    kv_odd ? b : a);
}

const int64_t* indexer_slots(const std::optional<at::Tensor>& t, const char* op, const char* no_indexer, int64_t n,
                             const c10::Device& device) {
  if (!has(t)) return nullptr;
  TORCH_CHECK_VALUE(no_indexer == nullptr, op, ": indexer_slot_mapping is set but ", no_indexer);
  check_vector(*t, (std::string(op) + ": indexer_slot_mapping").c_str(), n, at::kLong, device);
  return t->data_ptr<int64_t>();
}

void check_nd(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const char* shape,
              const c10::Device& dev) {
  TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous() &&
                        t.device() == dev,
                    name, ": expected contiguous ", dtype, " ", shape, " on ", dev, ", got ", describe(t));
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

Named written_caches(const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                     const pcpkv::CacheFormat& fmt) {
  return {{"mla_cache", &mla_cache}, {"index_cache", fmt.has_indexer ? maybe(index_cache) : nullptr}};
}

pcpkv::CacheFormat make_format(const std::string& kv_format, const std::string& ds_mla_scale, double k_scale,
                               bool has_indexer) {
  return translate_errors([&] {
    pcpkv::CacheFormat f;
    f.kv_format = pcpkv::parse_kv_format(kv_format, "kv_format");
    f.ds_mla_scale = pcpkv::parse_ds_mla_scale(ds_mla_scale, "ds_mla_scale");
    // pcpkv::scale_problem, the rule pcpkv_torch.model_spec.scale_problem mirrors; checked before the float32 cast.
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

}  // namespace pcpkv_torch
