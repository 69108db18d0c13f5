// python/csrc/consumers.cpp: the consumer ops of the `pcpkv` torch library (the DSA indexer, sparse MLA
// attention, the LSE merge): schemas, the tensor checks shared with the CUDA implementations
// (consumers.h) and the CPU implementations, which call pcpkv's CPU references (the oracle: indexer_reference,
// sparse_mla_reference, lse_merge_reference) after the library's full host validation. CUDA: consumers_cuda.cpp.
// Docstrings: pcpkv_torch/consumers.py.
#include "consumers.h"

#include <ATen/Functions.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common.h"

namespace pcpkv_torch {

namespace {

/// t is defined, has `dtype`, `dim` dimensions, is contiguous and on `dev`; message names the expected shape.
void check_nd(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const char* shape,
              const c10::Device& dev) {
  TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous() &&
                        t.device() == dev,
                    name, ": expected contiguous ", dtype, " ", shape, " on ", dev, ", got ", describe(t));
}

}  // namespace

int32_t check_quantize_index_q(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale) {
  TORCH_CHECK_VALUE(q.defined(), "quantize_index_q: q: missing");
  check_nd(q, "quantize_index_q: q", at::kBFloat16, 3, "[num_tokens, num_heads, 128]", q.device());
  TORCH_CHECK_VALUE(q.size(2) == 128 && q.size(1) >= 1, "quantize_index_q: q: expected bfloat16 [num_tokens, ",
                    "num_heads >= 1, 128], got ", describe(q));
  const int64_t T = q.size(0), H = q.size(1);
  check_dense(q_fp8, "quantize_index_q: q_fp8", {T, H, 128}, at::kByte, q.device());
  check_dense(q_scale, "quantize_index_q: q_scale", {T, H}, at::kFloat, q.device());
  TORCH_CHECK_VALUE(H <= std::numeric_limits<int32_t>::max(), "quantize_index_q: num_heads = ", H, " is too large");
  refuse_overlap("quantize_index_q", {{"q_fp8", &q_fp8}, {"q_scale", &q_scale}}, {{"q", &q}}, true);
  return static_cast<int32_t>(H);
}

void quantize_index_q_aten(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale) {
  check_quantize_index_q(q, q_fp8, q_scale);
  if (q.numel() == 0) return;
  // codec::indexer_scale / quantize_e4m3 step by step. Divisions are tensor / tensor: ATen divides by a
  // scalar through its reciprocal on CUDA, which is not the contract's correctly rounded x / s.
  const at::Tensor x = q.to(at::kFloat);
  at::Tensor a = x.abs();
  a = at::where(at::isnan(a), at::zeros_like(a), a);  // fp32::amax skips NaN lanes (from 0)
  const at::Tensor amax = std::get<0>(a.max(-1));
  const at::Tensor r = at::div(at::maximum(amax, at::full_like(amax, 1e-4f)), at::full_like(amax, 448.0f));
  // ceil_log2 and exp2i on the bits (r > 0): 2^(e + (mantissa != 0)); r = inf (or >= 2^127) gives inf.
  const at::Tensor u = r.view(at::kInt);
  const at::Tensor e = at::bitwise_and(at::bitwise_right_shift(u, 23), 0xff);
  const at::Tensor k = at::add(e, at::ne(at::bitwise_and(u, 0x7fffff), 0).to(at::kInt));  // biased exponent of s
  const at::Tensor s = at::bitwise_left_shift(k, 23).view(at::kFloat);
  const at::Tensor y = at::div(x, s.unsqueeze(-1));
  // codec::float_to_e4m3: saturate to +-448 (ATen's e4m3fn cast would give NaN above 464), NaN -> 0x7f.
  at::Tensor b = at::clamp(y, -448.0, 448.0).to(at::kFloat8_e4m3fn).view(at::kByte);
  b = at::where(at::isnan(y), at::full_like(b, 0x7f), b);
  q_scale.copy_(s);
  q_fp8.copy_(b);
}

pcpkv::IndexerParams make_indexer_params(const at::Tensor& q_fp8, const at::Tensor& q_scale, const at::Tensor& weights,
                                         const at::Tensor& positions, const at::Tensor& request_idx,
                                         const at::Tensor& block_tables, const at::Tensor& index_cache,
                                         const at::Tensor& out, const std::optional<at::Tensor>& positions_out,
                                         int64_t topk, const std::string& logit) {
  TORCH_CHECK_VALUE(q_fp8.defined(), "indexer_topk: q_fp8: missing");
  const c10::Device dev = q_fp8.device();
  check_nd(q_fp8, "indexer_topk: q_fp8", at::kByte, 3, "[num_tokens, num_heads, 128]", dev);
  const int64_t T = q_fp8.size(0), H = q_fp8.size(1);
  TORCH_CHECK_VALUE(q_fp8.size(2) == 128, "indexer_topk: q_fp8: expected uint8 [num_tokens, num_heads, 128], got ",
                    describe(q_fp8));
  TORCH_CHECK_VALUE(H >= 1 && H <= 128, "indexer_topk: q_fp8: num_heads = ", H, " must be in [1, 128]");
  check_dense(q_scale, "indexer_topk: q_scale", {T, H}, at::kFloat, dev);
  check_dense(weights, "indexer_topk: weights", {T, H}, at::kFloat, dev);
  check_vector(positions, "indexer_topk: positions", T, at::kLong, dev);
  check_vector(request_idx, "indexer_topk: request_idx", T, at::kInt, dev);
  check_nd(block_tables, "indexer_topk: block_tables", at::kInt, 2, "[num_requests, max_blocks]", dev);
  TORCH_CHECK_VALUE(index_cache.defined() && index_cache.device() == dev, "indexer_topk: index_cache: expected a ",
                    "tensor on ", dev, ", got ", describe(index_cache));
  TORCH_CHECK_VALUE(topk >= 1 && topk <= 8192, "indexer_topk: topk = ", topk, " must be in [1, 8192]");
  check_dense(out, "indexer_topk: out", {T, topk}, at::kInt, dev);
  if (has(positions_out)) check_dense(*positions_out, "indexer_topk: positions_out", {T, topk}, at::kInt, dev);
  // Rows are scored and written in any order (on the GPU by many blocks at once): an output holding an input (out =
  // request_idx.view(T, 1), out = block_tables) or the other output would be read after it was overwritten.
  refuse_overlap("indexer_topk", {{"out", &out}, {"positions_out", maybe(positions_out)}},
                 {{"q_fp8", &q_fp8}, {"q_scale", &q_scale}, {"weights", &weights}, {"positions", &positions},
                  {"request_idx", &request_idx}, {"block_tables", &block_tables}, {"index_cache", &index_cache}},
                 true);
  pcpkv::IndexerParams p;
  TORCH_CHECK_VALUE(logit == "exact" || logit == "fp32_tree", "indexer_topk: logit = '", logit,
                    "'; expected 'exact' or 'fp32_tree'");
  p.logit = logit == "exact" ? pcpkv::IndexerLogit::kExact : pcpkv::IndexerLogit::kFp32Tree;
  p.geometry = index_geometry_of(index_cache, "indexer_topk: index_cache");
  p.num_tokens = T;
  p.num_heads = static_cast<int32_t>(H);
  p.q_fp8 = q_fp8.data_ptr<uint8_t>();
  p.q_scale = q_scale.data_ptr<float>();
  p.weights = weights.data_ptr<float>();
  p.positions = positions.data_ptr<int64_t>();
  p.request_idx = request_idx.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(block_tables.size(0) <= std::numeric_limits<int32_t>::max(),
                    "indexer_topk: block_tables: ", block_tables.size(0), " requests is too many");
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.num_requests = static_cast<int32_t>(block_tables.size(0));
  p.block_table_stride = block_tables.size(1);
  p.index_cache = static_cast<const uint8_t*>(index_cache.data_ptr());
  p.topk = static_cast<int32_t>(topk);
  p.topk_slots = out.data_ptr<int32_t>();
  p.topk_positions = ptr_or_null<int32_t>(positions_out);
  translate_errors([&] { pcpkv::validate_indexer_scalars(p); });
  return p;
}

pcpkv::SparseMlaParams make_sparse_mla_params(const at::Tensor& q, const at::Tensor& mla_cache,
                                              const at::Tensor& indices, const at::Tensor& out, const at::Tensor& lse,
                                              const std::string& kv_format, const std::string& ds_mla_scale,
                                              double k_scale, double softmax_scale, const std::string& scale_read) {
  TORCH_CHECK_VALUE(q.defined(), "sparse_mla: q: missing");
  const c10::Device dev = q.device();
  check_nd(q, "sparse_mla: q", at::kBFloat16, 3, "[num_tokens, num_heads, 576]", dev);
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK_VALUE(q.size(2) == 576 && H >= 1 && H <= std::numeric_limits<int32_t>::max(),
                    "sparse_mla: q: expected bfloat16 [num_tokens, num_heads >= 1, 576], got ", describe(q));
  check_nd(indices, "sparse_mla: indices", at::kInt, 2, "[num_tokens, topk]", dev);
  TORCH_CHECK_VALUE(indices.size(0) == T && indices.size(1) >= 1 &&
                        indices.size(1) <= std::numeric_limits<int32_t>::max(),
                    "sparse_mla: indices: expected int32 [num_tokens=", T, ", topk >= 1], got ", describe(indices));
  check_dense(out, "sparse_mla: out", {T, H, 512}, at::kFloat, dev);
  check_dense(lse, "sparse_mla: lse", {T, H}, at::kFloat, dev);
  TORCH_CHECK_VALUE(mla_cache.defined() && mla_cache.device() == dev, "sparse_mla: mla_cache: expected a tensor on ",
                    dev, ", got ", describe(mla_cache));
  // As the indexer: out and lse are written per (token, head) in any order, so neither may hold an input or the
  // other (lse a view into out).
  refuse_overlap("sparse_mla", {{"out", &out}, {"lse", &lse}},
                 {{"q", &q}, {"mla_cache", &mla_cache}, {"indices", &indices}}, true);
  // The float32 the kernels read, checked as given (1e300 would become inf, 1e-50 zero).
  const float scale = translate_errors([&] { return pcpkv::sparse_mla_softmax_scale(softmax_scale); });
  TORCH_CHECK_VALUE(scale_read == "fp32" || scale_read == "bf16", "sparse_mla: scale_read = '", scale_read,
                    "'; expected 'fp32' or 'bf16'");
  pcpkv::SparseMlaParams p;
  p.fmt = make_format(kv_format, ds_mla_scale, k_scale, false);
  p.geometry = mla_geometry_of(mla_cache, p.fmt.kv_format, "sparse_mla: mla_cache");
  p.num_tokens = T;
  p.num_heads = static_cast<int32_t>(H);
  p.q = static_cast<const uint16_t*>(q.data_ptr());
  p.mla_cache = static_cast<const uint8_t*>(mla_cache.data_ptr());
  p.indices = indices.data_ptr<int32_t>();
  p.topk = static_cast<int32_t>(indices.size(1));
  p.softmax_scale = scale;
  p.scales_as_bf16 = scale_read == "bf16";
  p.out = out.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  return p;
}

pcpkv::SparseMlaKernel parse_sparse_mla_kernel(const std::string& kernel) {
  TORCH_CHECK_VALUE(kernel == "mma" || kernel == "simt", "sparse_mla: kernel = '", kernel,
                    "'; expected 'mma' or 'simt'");
  return kernel == "mma" ? pcpkv::SparseMlaKernel::kMma : pcpkv::SparseMlaKernel::kSimt;
}

pcpkv::LseMergeParams make_lse_merge_params(const at::Tensor& outs, const at::Tensor& lses, const at::Tensor& out,
                                            const at::Tensor& lse) {
  TORCH_CHECK_VALUE(outs.defined(), "lse_merge: outs: missing");
  const c10::Device dev = outs.device();
  check_nd(outs, "lse_merge: outs", at::kFloat, 4, "[num_shards, num_tokens, num_heads, head_dim]", dev);
  const int64_t S = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  TORCH_CHECK_VALUE(S >= 1 && S <= std::numeric_limits<int32_t>::max(), "lse_merge: outs: num_shards = ", S,
                    " must be >= 1");
  TORCH_CHECK_VALUE(D >= 1 && D <= std::numeric_limits<int32_t>::max(), "lse_merge: outs: head_dim = ", D,
                    " must be >= 1");
  check_dense(lses, "lse_merge: lses", {S, T, H}, at::kFloat, dev);
  check_dense(out, "lse_merge: out", {T, H, D}, at::kFloat, dev);
  check_dense(lse, "lse_merge: lse", {T, H}, at::kFloat, dev);
  refuse_overlap("lse_merge", {{"out", &out}, {"lse", &lse}}, {{"outs", &outs}, {"lses", &lses}}, true);
  pcpkv::LseMergeParams p;
  p.num_shards = static_cast<int32_t>(S);
  p.num_rows = T * H;
  p.head_dim = static_cast<int32_t>(D);
  p.outs = outs.data_ptr<float>();
  p.lses = lses.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  return p;
}

namespace {

// ---- CPU implementations -------------------------------------------------------------------------------

void quantize_index_q_cpu(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale) {
  const int32_t H = check_quantize_index_q(q, q_fp8, q_scale);
  translate_errors([&] {
    pcpkv::quantize_index_queries(static_cast<const uint16_t*>(q.data_ptr()), q.size(0), H,
                                  q_fp8.data_ptr<uint8_t>(), q_scale.data_ptr<float>());
  });
}

void indexer_topk_cpu(const at::Tensor& q_fp8, const at::Tensor& q_scale, const at::Tensor& weights,
                      const at::Tensor& positions, const at::Tensor& request_idx, const at::Tensor& block_tables,
                      const at::Tensor& index_cache, const at::Tensor& out, const std::optional<at::Tensor>& positions_out,
                      int64_t topk, std::optional<int64_t> max_keys, c10::string_view logit) {
  pcpkv::IndexerParams p = make_indexer_params(q_fp8, q_scale, weights, positions, request_idx, block_tables,
                                               index_cache, out, positions_out, topk, std::string(logit));
  if (max_keys.has_value()) {
    p.max_keys = *max_keys;
  } else {  // max(positions of real tokens) + 1 (a bad position is then reported by validate_indexer)
    int64_t m = 0;
    for (int64_t t = 0; t < p.num_tokens; ++t)
      if (p.request_idx[t] != -1) m = std::max(m, p.positions[t]);
    p.max_keys = std::min<int64_t>(m, (int64_t{1} << 31) - 2) + 1;
  }
  translate_errors([&] { pcpkv::indexer_reference(p); });  // validates everything first
}

void sparse_mla_cpu_op(const at::Tensor& q, const at::Tensor& mla_cache, const at::Tensor& indices, const at::Tensor& out,
                       const at::Tensor& lse, c10::string_view kv_format, c10::string_view ds_mla_scale,
                       double k_scale, double softmax_scale, c10::string_view scale_read, c10::string_view kernel) {
  parse_sparse_mla_kernel(std::string(kernel));  // checked here too; the CPU reference is one kernel
  const pcpkv::SparseMlaParams p =
      make_sparse_mla_params(q, mla_cache, indices, out, lse, std::string(kv_format), std::string(ds_mla_scale),
                             k_scale, softmax_scale, std::string(scale_read));
  translate_errors([&] { pcpkv::sparse_mla_reference(p); });  // validates every index first
}

void lse_merge_cpu_op(const at::Tensor& outs, const at::Tensor& lses, const at::Tensor& out, const at::Tensor& lse) {
  const pcpkv::LseMergeParams p = make_lse_merge_params(outs, lses, out, lse);
  translate_errors([&] { pcpkv::lse_merge_reference(p); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pcpkv, m) {
  m.def("quantize_index_q(Tensor q, Tensor(a!) q_fp8, Tensor(b!) q_scale) -> ()");
  // The ATen form of the same quantizer (the CUDA implementation), on any device: tests hold it to the oracle.
  m.def("quantize_index_q_aten(Tensor q, Tensor(a!) q_fp8, Tensor(b!) q_scale) -> ()");
  m.def("indexer_topk(Tensor q_fp8, Tensor q_scale, Tensor weights, Tensor positions, Tensor request_idx, "
        "Tensor block_tables, Tensor index_cache, Tensor(a!) out, Tensor(b!)? positions_out, int topk, "
        "int? max_keys, str logit) -> ()");
  m.def("sparse_mla(Tensor q, Tensor mla_cache, Tensor indices, Tensor(a!) out, Tensor(b!) lse, str kv_format, "
        "str ds_mla_scale, float k_scale, float softmax_scale, str scale_read, str kernel) -> ()");
  m.def("lse_merge(Tensor outs, Tensor lses, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) {
  m.impl("quantize_index_q", &quantize_index_q_cpu);
  m.impl("indexer_topk", &indexer_topk_cpu);
  m.impl("sparse_mla", &sparse_mla_cpu_op);
  m.impl("lse_merge", &lse_merge_cpu_op);
}

TORCH_LIBRARY_IMPL(pcpkv, CompositeExplicitAutograd, m) { m.impl("quantize_index_q_aten", &quantize_index_q_aten); }

}  // namespace pcpkv_torch
