// python/csrc/vllm_dropin.cpp: the op `pcpkv_vllm::fused_norm_rope`, the mapping of vLLM's DeepSeek-V3.2
// fused_norm_rope arguments onto pcpkv's dispatch (pcpkv_torch.vllm.fused_norm_rope: module docstring there) as one
// C++ op. It was Python (~40 us of host time per call on the 2-core CPU machine, docs/perf.md 37); here it checks
// the arguments with the same messages (tests/test_vllm_dropin.py holds them), converts the cos/sin tables and norm
// weights and reads a k_scale tensor once per source tensor, builds the one-replica cache table once per cache, and
// calls pcpkv::dispatch through the dispatcher's typed handle (its CPU or CUDA kernel: the same host code for both
// builds), its arguments by name (DispatchArgs, dispatch.h). Schema: registry.cpp. The fake kernel is registered in
// Python (pcpkv_torch/vllm.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "checks.h"
#include "dispatch.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/publish/cpu.h"

namespace pcpkv_torch {
namespace {

constexpr size_t kMaxCached = 256;  // entries per memo (one per layer and table in an engine), as before

// ---- Python-style messages: the drop-in's errors read as they did from Python --------------------------------

std::string py_dtype(at::ScalarType s) { return "torch." + c10::getDtypeNames(s).first; }

// _describe of pcpkv_torch.vllm: "torch.bfloat16 [24, 512] strides [576, 1] on cpu".
std::string py_describe(const at::Tensor& t) {
  std::ostringstream s;
  s << py_dtype(t.scalar_type()) << " " << t.sizes() << " strides " << t.strides() << " on " << t.device();
  return s.str();
}

// repr() of a Python float: the shortest round-trip digits (fmt's "{}" uses the same digits and the same switch to
// exponent form), with Python's ".0" on integral values and "nan" for every NaN.
std::string py_repr(double v) {
  if (std::isnan(v)) return "nan";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// _fail: "fused_norm_rope: <name>: <what>[, got <describe(t)>]" as a ValueError; t undefined: no "got".
[[noreturn]] void fail(const char* name, const std::string& what, const at::Tensor& t = at::Tensor()) {
  TORCH_CHECK_VALUE(false, "fused_norm_rope: ", name, ": ", what, t.defined() ? ", got " + py_describe(t) : "");
  __builtin_unreachable();
}

// ---- memos: results keyed by source tensors, valid while each source lives unmodified -----------------------

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// A tensor's in-place modification counter; -1 for an inference-mode tensor (vLLM runs under
// torch.inference_mode, whose tensors have none: its cos/sin buffers are never modified).
int64_t version_of(const at::Tensor& t) {
  const c10::VariableVersion& v = t.unsafeGetTensorImpl()->version_counter();
  return v.enabled() ? static_cast<int64_t>(v.current_version()) : -1;
}

struct Source {
  WeakImpl impl;  // weak: the memo keeps no source alive, and its address is not reused while the entry exists
  int64_t version;
  bool holds(const at::Tensor& t) const {
    return !impl.expired() && impl._unsafe_get_target() == t.unsafeGetTensorImpl() && version == version_of(t);
  }
};

// One memo of V per tuple of N source tensors: a hit needs every source to be the same live tensor at the same
// version, so a tensor changed in place is converted again and a new tensor at a freed one's address never hits.
// Entries whose sources died are dropped at the next miss (the converted copies do not outlive them by more).
template <class V, size_t N>
class Memo {
 public:
  template <class Make>
  V get(const std::array<const at::Tensor*, N>& srcs, Make&& make) {
    Key key;
    for (size_t i = 0; i < N; ++i) key[i] = srcs[i]->unsafeGetTensorImpl();
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = map_.find(key);
      if (it != map_.end() && holds(it->second, srcs)) return it->second.value;
    }
    V value = make();  // outside the lock: a conversion or a read (a host sync on CUDA)
    Entry e{{}, value};
    for (const at::Tensor* s : srcs) e.srcs.push_back(Source{WeakImpl(s->getIntrusivePtr()), version_of(*s)});
    std::lock_guard<std::mutex> lock(mu_);
    if (map_.size() >= kMaxCached) map_.clear();
    for (auto it = map_.begin(); it != map_.end();) it = dead(it->second) ? map_.erase(it) : std::next(it);
    map_.insert_or_assign(key, std::move(e));
    return value;
  }

 private:
  using Key = std::array<const void*, N>;
  struct Entry {
    std::vector<Source> srcs;  // N of them
    V value;
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      size_t h = 0;
      for (const void* p : k) h = h * 1000003u ^ std::hash<const void*>()(p);
      return h;
    }
  };
  static bool holds(const Entry& e, const std::array<const at::Tensor*, N>& srcs) {
    for (size_t i = 0; i < N; ++i)
      if (!e.srcs[i].holds(*srcs[i])) return false;
    return true;
  }
  static bool dead(const Entry& e) {
    for (const Source& s : e.srcs)
      if (s.impl.expired()) return true;
    return false;
  }
  std::mutex mu_;
  std::unordered_map<Key, Entry, Hash> map_;
};

Memo<at::Tensor, 1>& tables() {  // cos/sin cache -> contiguous float32 copy
  static Memo<at::Tensor, 1> m;
  return m;
}
Memo<bool, 2>& same_values() {  // (k table, index table) -> equal values
  static Memo<bool, 2> m;
  return m;
}
Memo<double, 1>& scales() {  // k_scale tensor -> its value (read once: a host sync on CUDA)
  static Memo<double, 1> m;
  return m;
}
Memo<at::Tensor, 1>& weights() {  // norm weight -> contiguous float32 copy
  static Memo<at::Tensor, 1> m;
  return m;
}

// ---- argument checks (the order and text of the former Python mapping) --------------------------------------

// vLLM's kv cache dtype strings -> pcpkv's kv_format, and the cache each needs (pcpkv_torch.vllm.KV_CACHE_DTYPES).
struct CacheDtype {
  pcpkv::KvFormat format;
  const char* format_name;
  bool bf16;  // "auto": a bfloat16 cache; otherwise uint8 or float8_e4m3fn
  int64_t last;
};

CacheDtype cache_dtype(c10::string_view s) {
  if (s == "auto") return {pcpkv::KvFormat::kBf16, "bf16", true, 576};
  if (s == "fp8" || s == "fp8_e4m3") return {pcpkv::KvFormat::kFp8, "fp8", false, 576};
  if (s == "fp8_ds_mla") return {pcpkv::KvFormat::kFp8DsMla, "fp8_ds_mla", false, 656};
  fail("mla_kv_cache_dtype", fmt::format("= '{}'; pcpkv maps ['auto', 'fp8', 'fp8_ds_mla', 'fp8_e4m3']", s));
}

bool is_fp8_bytes(at::ScalarType s) { return s == at::kByte || s == at::kFloat8_e4m3fn; }

// A bf16 activation [T, cols] (cols < 0: any width) with unit inner stride on `device`.
void check_rows(const at::Tensor& t, const char* name, int64_t T, int64_t cols, const c10::Device& device) {
  if (!t.defined() || t.dim() != 2 || t.scalar_type() != at::kBFloat16 || t.size(0) != T ||
      (cols >= 0 && t.size(1) != cols) || (t.size(1) > 1 && t.stride(1) != 1) || t.device() != device)
    fail(name,
         fmt::format("expected bfloat16 [{} (positions), {}] with unit inner stride on {} (positions' device)", T,
                     cols >= 0 ? std::to_string(cols) : std::string("n"), device.str()),
         t);
}

// q_c's width, refused unless pcpkv's dispatch takes it (a zero-width q_c would reach the dispatch as null pointers,
// which its contract reads as "no Q norm": the caches written, q_c_out not).
int64_t q_lora_rank(const at::Tensor& q_c) {
  const int64_t r = q_c.size(1);
  if (!(r >= 8 && r <= 4096 && r % 8 == 0))
    fail("q_c", fmt::format("width q_lora_rank = {} must be a multiple of 8 in [8, 4096] (pcpkv's dispatch)", r), q_c);
  return r;
}

void check_weight(const at::Tensor& t, const char* name, int64_t n, const c10::Device& device) {
  if (!t.defined() || !t.is_floating_point() || t.dim() != 1 || t.size(0) != n || t.device() != device)
    fail(name, fmt::format("expected a float [{}] weight on {}", n, device.str()), t);
}

// A contiguous float32 copy of a norm weight, made once per weight (not per call, nor inside a graph capture).
at::Tensor f32(const at::Tensor& w) {
  if (w.scalar_type() == at::kFloat && w.is_contiguous()) return w;
  return weights().get({&w}, [&] { return w.to(at::kFloat).contiguous(); });
}

at::Tensor rope_table(const at::Tensor& t, const char* name, const c10::Device& device) {
  if (!t.defined() || t.dim() != 2 || t.size(1) != 64 || !t.is_floating_point() || (t.size(0) > 1 && t.stride(1) != 1))
    fail(name,
         "expected a float [max_position, 64] cos/sin cache ([cos 32 | sin 32] per position; pcpkv's rotary dims "
         "are 64)",
         t);
  if (t.device() != device) fail(name, fmt::format("is on {} but positions on {}", t.device().str(), device.str()));
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  return tables().get({&t}, [&] { return t.to(at::kFloat).contiguous(); });
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.is_same(b) || (a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
                          a.scalar_type() == b.scalar_type() && a.device() == b.device());
}

// pcpkv rotates k_pe and index_k with one table: index_k_rope_cos_sin_cache must hold k_rope_cos_sin_cache's values
// (compared once per pair of tables: a host sync on CUDA the first time).
void check_index_table(const at::Tensor& k, const at::Tensor& idx, const at::Tensor& k_f32, const at::Tensor& idx_f32) {
  if (same_tensor(k, idx)) return;
  if (idx.device() != k.device())
    fail("index_k_rope_cos_sin_cache",
         fmt::format("is on {} but k_rope_cos_sin_cache on {}", idx.device().str(), k.device().str()));
  const bool same =
      same_values().get({&k, &idx}, [&] { return k_f32.sizes() == idx_f32.sizes() && at::equal(k_f32, idx_f32); });
  if (!same)
    fail("index_k_rope_cos_sin_cache",
         "holds other values than k_rope_cos_sin_cache; pcpkv rotates k_pe and index_k with one table (the rotation "
         "style is index_rope_interleave)");
}

// mla_k_scale (fp8 only): a float32 [1] tensor read once per tensor and version, or the value Python passed.
double k_scale_of(const at::Tensor& t, double value) {
  double v = value;
  if (t.defined()) {
    // .item() of a meta tensor raised RuntimeError ("cannot be called on meta tensors"): there is no value to read
    if (t.is_meta()) fail("mla_k_scale", "is a meta tensor, which holds no value to read as the fp8 k_scale", t);
    v = scales().get({&t}, [&] { return t.detach().reshape({}).item<double>(); });
  }
  // a float32 in the kernels: 1e300 would be refused there as pcpkv's k_scale = inf
  if (const auto why = pcpkv::scale_problem(v)) fail("mla_k_scale", fmt::format("= {} {}", py_repr(v), *why));
  return v;
}

// The MLA cache's bytes as a CacheTarget's MLA part, named as the caller's argument (it was named as the internal
// CacheTargets' like_mla / mla_ptrs[0]). The geometry rules of pcpkv_torch.tables (_mla_geometry): a lone row's
// stride and a lone block's stride are never used.
void mla_target(const at::Tensor& c, const pcpkv::CacheFormat& cf, pcpkv::CacheTarget& t) {
  const int64_t row = pcpkv::mla_row_bytes(cf.kv_format), es = c.element_size();
  const int64_t nb = c.size(0), bs = c.size(1);
  if (nb < 1 || bs < 1) fail("mla_kv_cache", "is empty (num_blocks and block_size must be >= 1)", c);
  const int64_t row_stride = bs > 1 ? c.stride(1) * es : row;
  const int64_t block_stride = nb > 1 ? c.stride(0) * es : bs * row_stride;
  if (row_stride < row || block_stride < bs * row_stride)
    fail("mla_kv_cache",
         fmt::format("rows or blocks overlap (row stride {} B < {} or block stride {} B < {} * {})", row_stride, row,
                     block_stride, bs, row_stride),
         c);
  if (c.data_ptr() == nullptr) fail("mla_kv_cache", "has no memory to write (a null data pointer)", c);
  t.mla_base = static_cast<uint8_t*>(c.data_ptr());
  t.mla.num_blocks = nb;
  t.mla.block_size = static_cast<int32_t>(bs);
  t.mla.row_stride = row_stride;
  t.mla.block_stride = block_stride;
  try {
    pcpkv::validate_geometry(t.mla, cf.kv_format);
  } catch (const pcpkv::Error& e) {
    fail("mla_kv_cache", e.what(), c);
  }
}

// The indexer cache's part (SPEC section 3: a block holds block_size 128-byte rows, then block_size scales).
void index_target(const at::Tensor& c, pcpkv::CacheTarget& t) {
  const int64_t nb = c.size(0), bs = c.size(1);
  if (c.stride(2) != 1 || (bs > 1 && c.stride(1) != 132))
    fail("indexer_k_cache", "expected the rows of a block contiguous (strides [block_stride, 132, 1])", c);
  const int64_t block_stride = nb > 1 ? c.stride(0) : bs * 132;
  if (c.data_ptr() == nullptr) fail("indexer_k_cache", "has no memory to write (a null data pointer)", c);
  t.index_base = static_cast<uint8_t*>(c.data_ptr());
  t.index.num_blocks = nb;
  t.index.block_size = static_cast<int32_t>(bs);
  t.index.block_stride = block_stride;
  try {
    pcpkv::validate_geometry(t.index);
  } catch (const pcpkv::Error& e) {
    fail("indexer_k_cache", e.what(), c);
  }
}

// The one-replica cache table (host copy, device copy) of these caches, built once per address and geometry:
// building copies it to the device, which must not happen per call or inside a graph capture. Validated here on every
// call (cheap), so a cache is always named as the caller's argument.
struct Targets {
  at::Tensor host, table;
};

std::pair<at::Tensor, at::Tensor> cache_targets(const at::Tensor& mla, const at::Tensor& idx,
                                                const pcpkv::CacheFormat& cf) {
  pcpkv::CacheTarget t;
  mla_target(mla, cf, t);
  if (idx.defined()) index_target(idx, t);
  const c10::Device dev = mla.device();
  using Key = std::array<int64_t, 12>;
  const Key key = {reinterpret_cast<int64_t>(t.mla_base), t.mla.num_blocks, t.mla.block_size, t.mla.row_stride,
                   t.mla.block_stride, reinterpret_cast<int64_t>(t.index_base), t.index.num_blocks,
                   t.index.block_size, t.index.block_stride, static_cast<int64_t>(cf.kv_format),
                   int64_t{cf.has_indexer}, device_space(dev)};
  struct Hash {
    size_t operator()(const Key& k) const {
      size_t h = 0;
      for (int64_t v : k) h = h * 1000003u ^ std::hash<int64_t>()(v);
      return h;
    }
  };
  static std::mutex mu;
  static std::unordered_map<Key, Targets, Hash> memo;  // a pointer table stays right while its key is equal
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = memo.find(key);
    if (it != memo.end()) return {it->second.host, it->second.table};
  }
  translate_errors([&] { pcpkv::validate_cache_target(t, cf, "fused_norm_rope: mla_kv_cache / indexer_k_cache"); });
  at::Tensor host = at::zeros({1, kTargetRecordBytes}, at::kByte);  // a record of make_cache_targets' table
  *reinterpret_cast<pcpkv::CacheTarget*>(host.data_ptr()) = t;
  at::Tensor table = dev.is_cpu() ? host : host.to(dev);
  std::lock_guard<std::mutex> lock(mu);
  if (memo.size() >= kMaxCached) memo.clear();
  memo.insert_or_assign(key, Targets{host, table});
  return {host, table};
}

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }
at::Tensor get(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// The op: every check before anything is written, then pcpkv::dispatch (its CPU or CUDA kernel).
void fused_norm_rope(const at::Tensor& positions, const at::Tensor& q_c, const at::Tensor& q_rms_norm_w,
                     double q_rms_eps,
                     const at::Tensor& kv_c, const at::Tensor& kv_rms_norm_w, double kv_rms_eps, const at::Tensor& k_pe,
                     const at::Tensor& k_rope_cos_sin_cache, const std::optional<at::Tensor>& index_k_,
                     const std::optional<at::Tensor>& index_k_layer_norm_w_,
                     const std::optional<at::Tensor>& index_k_layer_norm_bias_, double index_k_layer_norm_eps,
                     const std::optional<at::Tensor>& index_k_rope_cos_sin_cache_,
                     const at::Tensor& topk_indices_buffer, const std::optional<at::Tensor>& slot_mapping_,
                     const std::optional<at::Tensor>& indexer_k_cache_, const std::optional<at::Tensor>& mla_kv_cache_,
                     c10::string_view mla_kv_cache_dtype, const std::optional<at::Tensor>& mla_k_scale_,
                     double mla_k_scale_value, bool has_indexer, bool index_rope_interleave, const at::Tensor& q_c_out,
                     const std::optional<at::Tensor>& kv_c_out_, const std::optional<at::Tensor>& k_pe_out_,
                     const std::optional<at::Tensor>& index_k_out_,
                     const std::optional<at::Tensor>& indexer_slot_mapping_,
                     c10::string_view ds_mla_scale) {
  // The schema turns None into an undefined tensor for the required ones: named as the Python mapping named them
  // (q_c_out: Python allocates it once positions and q_c have the shapes checked below).
  const std::pair<const char*, const at::Tensor*> required[] = {
      {"positions", &positions}, {"q_c", &q_c},   {"q_rms_norm_w", &q_rms_norm_w}, {"kv_c", &kv_c},
      {"kv_rms_norm_w", &kv_rms_norm_w}, {"k_pe", &k_pe}, {"k_rope_cos_sin_cache", &k_rope_cos_sin_cache},
      {"topk_indices_buffer", &topk_indices_buffer}};
  for (const auto& [name, t] : required)
    if (!t->defined()) fail(name, "expected a tensor");
  const at::Tensor index_k = get(index_k_), index_ln_w = get(index_k_layer_norm_w_),
                   index_ln_b = get(index_k_layer_norm_bias_), index_table = get(index_k_rope_cos_sin_cache_),
                   mla_k_scale = get(mla_k_scale_), indexer_slot_mapping = get(indexer_slot_mapping_),
                   kv_c_out = get(kv_c_out_), k_pe_out = get(k_pe_out_);
  at::Tensor slot_mapping = get(slot_mapping_), indexer_k_cache = get(indexer_k_cache_),
             mla_kv_cache = get(mla_kv_cache_), index_k_out = get(index_k_out_);
  const CacheDtype cd = cache_dtype(mla_kv_cache_dtype);
  TORCH_CHECK_VALUE(ds_mla_scale == "raw" || ds_mla_scale == "pow2", "fused_norm_rope: ds_mla_scale: = '", ds_mla_scale,
                    "'; expected 'raw' (vLLM's rule) or 'pow2'");

  // the Python entry point's checks (before it allocated q_c_out)
  if (positions.dim() != 1 || q_c.dim() != 2) {
    const bool p = positions.dim() != 1;
    fail(p ? "positions" : "q_c", "expected int64 [num_tokens] positions and q_c [num_tokens, q_lora_rank]",
         p ? positions : q_c);
  }
  q_lora_rank(q_c);
  if (mla_k_scale.defined() && !(mla_k_scale.numel() == 1 && mla_k_scale.is_floating_point()))
    fail("mla_k_scale", "expected None, a float or a float [1] tensor", mla_k_scale);

  // the mapping's
  if (positions.scalar_type() != at::kLong) fail("positions", "expected int64 [num_tokens]", positions);
  const int64_t T = positions.size(0);
  const c10::Device device = positions.device();
  check_rows(q_c, "q_c", T, -1, device);
  const int64_t r = q_lora_rank(q_c);
  check_weight(q_rms_norm_w, "q_rms_norm_w", r, device);
  check_rows(kv_c, "kv_c", T, 512, device);
  check_weight(kv_rms_norm_w, "kv_rms_norm_w", 512, device);
  check_rows(k_pe, "k_pe", T, 64, device);
  const at::Tensor rope = rope_table(k_rope_cos_sin_cache, "k_rope_cos_sin_cache", device);
  if (topk_indices_buffer.dim() != 2)
    fail("topk_indices_buffer", "expected int32 [max_tokens, topk]", topk_indices_buffer);
  at::Tensor topk;
  if (has_indexer) {
    check_rows(index_k, "index_k", T, 128, device);
    check_weight(index_ln_w, "index_k_layer_norm_w", 128, device);
    check_weight(index_ln_b, "index_k_layer_norm_bias", 128, device);
    const at::Tensor idx_rope = rope_table(index_table, "index_k_rope_cos_sin_cache", device);
    check_index_table(k_rope_cos_sin_cache, index_table, rope, idx_rope);
    const bool fits = topk_indices_buffer.scalar_type() == at::kInt && topk_indices_buffer.size(0) >= T;
    if (fits) topk = topk_indices_buffer.size(0) == T ? topk_indices_buffer : topk_indices_buffer.slice(0, 0, T);
    if (!fits || !topk.is_contiguous() || topk.device() != device)
      fail("topk_indices_buffer",
           fmt::format("expected int32 [>= {}, topk] on {} whose first {} rows are contiguous", T, device.str(), T),
           topk_indices_buffer);
  } else {
    index_k_out = at::Tensor();  // a shared layer leaves it untouched, as vLLM's kernel does
  }
  if (!q_c_out.defined() || q_c_out.scalar_type() != at::kBFloat16 || q_c_out.dim() != 2 || q_c_out.size(0) != T ||
      q_c_out.size(1) != r ||
      !q_c_out.is_contiguous() || q_c_out.device() != device)
    fail("q_c_out", fmt::format("expected a contiguous bfloat16 [{}, {}] on {}", T, r, device.str()), q_c_out);

  const double k_scale = cd.format == pcpkv::KvFormat::kFp8 ? k_scale_of(mla_k_scale, mla_k_scale_value) : 1.0;
  // vLLM's indexer_slot_mapping (docs/spec.md 4.2): the indexer rows' own slots in a cache of its own block count.
  // None or slot_mapping itself is the one-slot form (no second mapping reaches the kernel).
  at::Tensor index_slots;
  if (indexer_slot_mapping.defined() && !(slot_mapping.defined() && same_tensor(slot_mapping, indexer_slot_mapping)))
    index_slots = indexer_slot_mapping;
  if (!has_indexer) indexer_k_cache = at::Tensor();  // a shared layer writes no indexer row (vLLM drops it too)
  bool writes_caches = false, writes_idx = false;
  if (slot_mapping.defined() && (mla_kv_cache.defined() || indexer_k_cache.defined())) {
    if (!mla_kv_cache.defined())
      fail("mla_kv_cache", "is None but indexer_k_cache is given: pcpkv's cache table always has the MLA row");
    if (slot_mapping.scalar_type() != at::kLong || slot_mapping.dim() != 1 || slot_mapping.size(0) != T ||
        slot_mapping.device() != device)
      fail("slot_mapping", fmt::format("expected int64 [{}] on {}", T, device.str()), slot_mapping);
    const at::Tensor& c = mla_kv_cache;
    if (c.dim() != 3 || !(cd.bf16 ? c.scalar_type() == at::kBFloat16 : is_fp8_bytes(c.scalar_type())) ||
        c.size(2) != cd.last || c.stride(2) != 1)
      fail("mla_kv_cache",
           fmt::format("expected {} [num_blocks, block_size, {}] with unit inner stride for mla_kv_cache_dtype = '{}'",
                       cd.bf16 ? "torch.bfloat16" : "torch.uint8 or torch.float8_e4m3fn", cd.last,
                       mla_kv_cache_dtype),
           c);
    if (c.device() != device)
      fail("mla_kv_cache", fmt::format("is on {} but positions on {}", c.device().str(), device.str()));
    writes_caches = true;
    writes_idx = indexer_k_cache.defined();
    if (writes_idx) {
      const at::Tensor& x = indexer_k_cache;
      if (x.dim() != 3 || !is_fp8_bytes(x.scalar_type()) || x.size(2) != 132)
        fail("indexer_k_cache", "expected uint8 or float8_e4m3fn [num_blocks, block_size, 132]", x);
      if (x.device() != c.device())
        fail("indexer_k_cache", fmt::format("is on {} but mla_kv_cache on {}", x.device().str(), c.device().str()));
      if (x.size(1) != c.size(1) || (!index_slots.defined() && x.size(0) != c.size(0)))
        // (with an indexer_slot_mapping its num_blocks may differ: spec 4.2; its block_size never does)
        fail("indexer_k_cache", fmt::format("has (num_blocks, block_size) = ({}, {}) but mla_kv_cache ({}, {}); pcpkv "
                                            "writes both caches at one slot",
                                            x.size(0), x.size(1), c.size(0), c.size(1)));
      if (index_slots.defined() && (index_slots.scalar_type() != at::kLong || index_slots.dim() != 1 ||
                                    index_slots.size(0) != T || index_slots.device() != device))
        fail("indexer_slot_mapping", fmt::format("expected None or int64 [{}] on {}", T, device.str()), index_slots);
    }
    if (!writes_idx) index_slots = at::Tensor();  // no indexer row is written: nothing to address
    if (has_indexer && !writes_idx && index_k_out.defined())
      fail("index_k_out",
           "needs indexer_k_cache when mla_kv_cache is given (pcpkv's MLA-only write has no indexer output)");
  } else {
    slot_mapping = at::Tensor();  // vLLM's profiling run: no cache is written
    index_slots = at::Tensor();
  }
  const pcpkv::CacheFormat cf = make_format(cd.format_name, std::string(ds_mla_scale), k_scale,
                                            writes_caches ? writes_idx : has_indexer);

  // What the call writes against what it reads (and the other writes), before the cache table goes to the device.
  const std::pair<const char*, const at::Tensor*> writes[] = {
      {"q_c_out", &q_c_out},       {"kv_c_out", &kv_c_out},
      {"k_pe_out", &k_pe_out},     {"index_k_out", &index_k_out},
      {"topk_indices_buffer", &topk}, {"mla_kv_cache", writes_caches ? &mla_kv_cache : nullptr},
      {"indexer_k_cache", writes_idx ? &indexer_k_cache : nullptr}};
  const at::Tensor none;
  const std::pair<const char*, const at::Tensor*> reads[] = {
      {"positions", &positions}, {"q_c", &q_c}, {"q_rms_norm_w", &q_rms_norm_w}, {"kv_c", &kv_c},
      {"kv_rms_norm_w", &kv_rms_norm_w}, {"k_pe", &k_pe}, {"k_rope_cos_sin_cache", &k_rope_cos_sin_cache},
      {"slot_mapping", &slot_mapping}, {"indexer_slot_mapping", &index_slots}, {"mla_k_scale", &mla_k_scale},
      {"index_k", cf.has_indexer ? &index_k : &none}, {"index_k_layer_norm_w", cf.has_indexer ? &index_ln_w : &none},
      {"index_k_layer_norm_bias", cf.has_indexer ? &index_ln_b : &none},
      {"index_k_rope_cos_sin_cache", cf.has_indexer ? &index_table : &none}};
  std::vector<ByteRange> w, rd;
  for (const auto& [name, t] : writes) w.push_back(t == nullptr ? ByteRange{} : byte_range(*t));
  for (const auto& [name, t] : reads) rd.push_back(byte_range(*t));
  if (const auto hit = pcpkv::first_overlap(w, rd, true)) {
    const auto& a = writes[hit->first];
    const auto& b = hit->second < std::size(writes) ? writes[hit->second] : reads[hit->second - std::size(writes)];
    fail(a.first,
         fmt::format("shares memory with {} ({}): pcpkv reads the inputs and writes the outputs row by row in any "
                     "order, so an output must not overlap an input or another output",
                     b.first, py_describe(*b.second)),
         *a.second);
  }
  std::optional<at::Tensor> targets, targets_host;
  std::vector<at::Tensor> written;
  if (writes_caches) {
    const auto [host, table] = cache_targets(mla_kv_cache, writes_idx ? indexer_k_cache : at::Tensor(), cf);
    targets_host = host;
    targets = table;
    written.push_back(mla_kv_cache);
    if (writes_idx) written.push_back(indexer_k_cache);
  }

  // pcpkv::dispatch through the dispatcher (its CPU or CUDA kernel), its arguments by name (dispatch.h).
  static const auto dispatch = typed_op(kDispatch);
  const bool idx = cf.has_indexer;
  call(dispatch, kDispatch,
       DispatchArgs{.kv = kv_c,
                    .k_pe = k_pe,
                    .positions = positions,
                    .kv_norm_w = f32(kv_rms_norm_w),
                    .rope_cos_sin = rope,
                    .q_c = q_c,
                    .q_norm_w = f32(q_rms_norm_w),
                    .index_k = idx ? opt(index_k) : std::nullopt,
                    .index_ln_w = idx ? opt(f32(index_ln_w)) : std::nullopt,
                    .index_ln_b = idx ? opt(f32(index_ln_b)) : std::nullopt,
                    .slot_mapping = opt(slot_mapping),
                    .targets = targets,
                    .targets_host = targets_host,
                    .q_c_out = q_c_out,
                    .kv_c_out = opt(kv_c_out),
                    .k_pe_out = opt(k_pe_out),
                    .index_k_out = opt(index_k_out),
                    .topk_fill = opt(topk),
                    .written = std::move(written),
                    .kv_format = cd.format_name,
                    .ds_mla_scale = std::string(ds_mla_scale),
                    .k_scale = cf.k_scale,
                    .has_indexer = cf.has_indexer,
                    .q_eps = q_rms_eps,
                    .kv_eps = kv_rms_eps,
                    .index_eps = index_k_layer_norm_eps,
                    .mla_rope_interleaved = true,
                    .index_rope_interleaved = index_rope_interleave,
                    .index_hadamard = false,
                    .topk_fill_mode = "full",
                    .topk_indexer_rows = 0,
                    .indexer_slot_mapping = opt(index_slots)});
}

}  // namespace

// Every backend (CPU and CUDA builds alike: host code; the dispatch it calls picks the kernel). The Meta kernel is
// the Python fake (pcpkv_torch/vllm.py), which sends a call mixing meta and real tensors back here to be refused.
TORCH_LIBRARY_IMPL(pcpkv_vllm, CompositeExplicitAutograd, m) { m.impl("fused_norm_rope", &fused_norm_rope); }

}  // namespace pcpkv_torch
