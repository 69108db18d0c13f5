// python/csrc/dispatch.cpp: torch.ops.pcpkv.dispatch (dispatch.h): its tensor checks, the CPU implementation on
// pcpkv's CPU reference (pcpkv/publish/cpu.h) and, in CUDA builds, the CUDA one on pcpkv's launcher
// (pcpkv/publish/kernels.h: launch_dispatch): the torch op and the C++ library run the same kernels. Each
// implementation reads the pointer tables its way, then calls the library, which validates the whole job first.
#include "dispatch.h"

#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"
#include "pcpkv/publish/cpu.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#include "pcpkv/publish/kernels.h"
#endif

namespace pcpkv_torch {

pcpkv::DispatchParams make_dispatch_params(const DispatchArgs& a) {
  const c10::Device dev = a.kv.device();
  // positions counts the local tokens: kv and k_pe are measured against it, so a short kv is not blamed on k_pe.
  if (a.positions.defined() && a.positions.dim() == 1)
    check_token_rows("dispatch", "kv", a.kv, a.k_pe, "positions", a.positions.size(0));
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
  TORCH_CHECK_VALUE(p.topk_fill_mode != pcpkv::TopkFill::kTail ||
                        (a.topk_indexer_rows >= 0 && a.topk_indexer_rows <= T),
                    "dispatch: topk_indexer_rows = ", a.topk_indexer_rows, " must be in [0, num_tokens = ", T,
                    "] for topk_fill_mode 'tail'");
  p.topk_indexer_rows = a.topk_indexer_rows;
  if (has(a.slot_mapping)) {
    check_vector(*a.slot_mapping, "dispatch: slot_mapping", T, at::kLong, dev);
    p.slot_mapping = a.slot_mapping->data_ptr<int64_t>();
  }
  p.indexer_slot_mapping =
      indexer_slots(a.indexer_slot_mapping, "dispatch", a.has_indexer ? nullptr : "has_indexer=False", T, dev);
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
  ins.insert(ins.end(), {{"targets", maybe(a.targets)},
                         {"targets_host", maybe(a.targets_host)},
                         {"row_dests", maybe(a.row_dests)},
                         {"row_dests_host", maybe(a.row_dests_host)}});
  const size_t num_ins = ins.size();
  for (size_t i = 0; i < a.written.size(); ++i) ins.push_back({"written", &a.written[i], static_cast<int64_t>(i)});
  refuse_overlap("dispatch", outs, ins, true);  // outputs against inputs, tables, written tensors and each other
  const Named written(ins.begin() + static_cast<std::ptrdiff_t>(num_ins), ins.end());
  ins.resize(num_ins);
  refuse_overlap("dispatch", written, ins, false);
  return p;
}

namespace {

template <class T>
bool same_records(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void dispatch_cpu(const DispatchArgs& a) {
  pcpkv::DispatchParams p = make_dispatch_params(a);
  std::vector<pcpkv::CacheTarget> tv;
  std::vector<uint8_t*> dv;
  // On the CPU the "device" table is a host table; its host copy, when given, must hold the same entries
  // (the CUDA op validates the host copy and launches on the device one).
  if (has(a.targets)) {
    tv = read_target_table(*a.targets, "dispatch: targets");
    check_uniform_targets(tv, a.has_indexer, "dispatch: targets");
    if (has(a.targets_host))
      TORCH_CHECK_VALUE(same_records(read_target_table(*a.targets_host, "dispatch: targets_host"), tv),
                        "dispatch: targets (", describe(*a.targets), ") differs from targets_host (",
                        describe(*a.targets_host), ")");
    p.targets = tv.data();
    p.num_targets = static_cast<int32_t>(tv.size());
  }
  if (has(a.row_dests)) {
    dv = read_pointer_table(*a.row_dests, "dispatch: row_dests");
    if (has(a.row_dests_host))
      TORCH_CHECK_VALUE(same_records(read_pointer_table(*a.row_dests_host, "dispatch: row_dests_host"), dv),
                        "dispatch: row_dests (", describe(*a.row_dests), ") differs from row_dests_host (",
                        describe(*a.row_dests_host), ")");
    p.row_dests = dv.data();
    p.num_row_dests = static_cast<int32_t>(dv.size());
    p.row_bytes = pcpkv::transport_row_layout(p.fmt).row_bytes;
  }
  translate_errors([&] { pcpkv::dispatch_reference(p, cpu_threads()); });
}

#ifdef PCPKV_TORCH_CUDA
/// The device copy of a host table: same entry count, contiguous, on `dev`, of the table's dtype, 8-byte
/// aligned (the kernels read 8-byte pointers / CacheTarget records from it). A table that is smaller than
/// its host copy would let the kernel read past its end, so this is checked exactly.
void check_device_table(const at::Tensor& t, const char* name, const c10::Device& dev, int64_t rows,
                        int64_t row_bytes) {
  const bool records = row_bytes > 0;  // CacheTarget records (uint8 [rows, row_bytes]) or pointers (int64 [rows])
  const bool dtype_ok = records ? t.scalar_type() == at::kByte
                                : (t.scalar_type() == at::kLong || t.scalar_type() == at::kUInt64);
  TORCH_CHECK_VALUE(t.defined() && dtype_ok && t.device() == dev && t.is_contiguous() &&
                        t.dim() == (records ? 2 : 1) && t.size(0) == rows && (!records || t.size(1) == row_bytes),
                    name, ": expected the device copy of its host table (", records ? "uint8 [" : "int64 [", rows,
                    records ? ", " + std::to_string(row_bytes) + "]" : std::string("]"), " on ", dev, "), got ",
                    describe(t));
  TORCH_CHECK_VALUE(rows == 0 || addr(t.data_ptr()) % 8 == 0, name, ": must be 8-byte aligned");
}

void dispatch_cuda(const DispatchArgs& a) {
  require_cuda(a.kv, "dispatch: kv");
  const c10::Device dev = a.kv.device();
  const c10::cuda::CUDAGuard guard(dev);
  pcpkv::cuda::DispatchJob job;
  job.params = make_dispatch_params(a);
  pcpkv::DispatchParams& p = job.params;
  // Pointer tables: the kernel reads the device copy; validation reads the host copy (same records).
  TORCH_CHECK_VALUE(has(a.targets) == has(a.targets_host), "dispatch: targets and targets_host go together");
  TORCH_CHECK_VALUE(has(a.row_dests) == has(a.row_dests_host), "dispatch: row_dests and row_dests_host go together");
  if (has(a.targets)) {
    job.host_targets = read_target_table(*a.targets_host, "dispatch: targets_host");
    check_uniform_targets(job.host_targets, a.has_indexer, "dispatch: targets_host");
    check_device_table(*a.targets, "dispatch: targets", dev, static_cast<int64_t>(job.host_targets.size()),
                       kTargetRecordBytes);
    p.targets = reinterpret_cast<const pcpkv::CacheTarget*>(a.targets->data_ptr());
    p.num_targets = static_cast<int32_t>(job.host_targets.size());
  }
  if (has(a.row_dests)) {
    job.host_row_dests = read_pointer_table(*a.row_dests_host, "dispatch: row_dests_host");
    check_device_table(*a.row_dests, "dispatch: row_dests", dev, static_cast<int64_t>(job.host_row_dests.size()), 0);
    p.row_dests = reinterpret_cast<uint8_t* const*>(a.row_dests->data_ptr());
    p.num_row_dests = static_cast<int32_t>(job.host_row_dests.size());
    p.row_bytes = pcpkv::transport_row_layout(p.fmt).row_bytes;
  }
  TORCH_CHECK_VALUE(p.num_targets == 0 || p.slot_mapping != nullptr, "dispatch: slot_mapping is required with targets");
  // launch_dispatch validates the whole job (host tables standing in for the device ones) and throws
  // before it enqueues anything.
  translate_errors([&] { pcpkv::cuda::launch_dispatch(&job, 1, current_stream(dev)); });
}

std::string cuda_dispatch_impl() { return "pcpkv"; }
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("dispatch", kernel<kDispatch, &dispatch_cpu>()); }

#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("dispatch", kernel<kDispatch, &dispatch_cuda>()); }
TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) { m.impl("cuda_dispatch_impl", &cuda_dispatch_impl); }
#endif

}  // namespace pcpkv_torch
