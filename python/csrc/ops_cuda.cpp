// python/csrc/ops_cuda.cpp: CUDA implementations of the pcpkv ops, on pcpkv's own launchers (pcpkv/publish/kernels.h:
// launch_dispatch, launch_combine, launch_insert_mla / launch_insert_indexer, launch_fence), so the torch ops
// and the C++ library run the same kernels (one kernel contract per job; the CPU reference is the oracle).
//
// Order in every op: all host-side checks first (tensor dtypes, shapes, devices, host tables, alignment the
// kernels need), then the launches, asynchronous on the current torch stream. A bad argument raises
// ValueError before anything is enqueued; no op synchronizes, allocates or copies to the host, so every op
// is capturable into a CUDA graph. Slot and position *values* live on the device and are not read here.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/cpu.h"

namespace pcpkv_torch {
namespace {

cudaStream_t current_stream(const c10::Device& d) { return c10::cuda::getCurrentCUDAStream(d.index()).stream(); }

std::string dispatch_impl() { return "pcpkv"; }

uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

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

void dispatch_cuda(const at::Tensor& kv, const at::Tensor& k_pe, const at::Tensor& positions,
                   const at::Tensor& kv_norm_w, const at::Tensor& rope_cos_sin, const std::optional<at::Tensor>& q_c,
                   const std::optional<at::Tensor>& q_norm_w, const std::optional<at::Tensor>& index_k,
                   const std::optional<at::Tensor>& index_ln_w, const std::optional<at::Tensor>& index_ln_b,
                   const std::optional<at::Tensor>& slot_mapping, const std::optional<at::Tensor>& targets,
                   const std::optional<at::Tensor>& targets_host, const std::optional<at::Tensor>& row_dests,
                   const std::optional<at::Tensor>& row_dests_host, const std::optional<at::Tensor>& q_c_out,
                   const std::optional<at::Tensor>& kv_c_out, const std::optional<at::Tensor>& k_pe_out,
                   const std::optional<at::Tensor>& index_k_out, const std::optional<at::Tensor>& topk_fill,
                   at::TensorList written, c10::string_view kv_format, c10::string_view ds_mla_scale,
                   double k_scale, bool has_indexer, double q_eps, double kv_eps, double index_eps,
                   bool mla_rope_interleaved, bool index_rope_interleaved, bool index_hadamard,
                   c10::string_view topk_fill_mode, int64_t topk_indexer_rows,
                  const std::optional<at::Tensor>& indexer_slot_mapping) {
  TORCH_CHECK_VALUE(kv.defined() && kv.is_cuda(), "dispatch: kv: expected a CUDA tensor, got ", describe(kv));
  const c10::Device dev = kv.device();
  const c10::cuda::CUDAGuard guard(dev);
  DispatchArgs a{kv,          k_pe,     positions, kv_norm_w, rope_cos_sin, q_c,
                 q_norm_w,    index_k,  index_ln_w, index_ln_b, slot_mapping, q_c_out,
                 kv_c_out,    k_pe_out, index_k_out, topk_fill, std::string(kv_format), std::string(ds_mla_scale),
                 k_scale,     has_indexer, q_eps,   kv_eps,    index_eps,    mla_rope_interleaved,
                 index_rope_interleaved, index_hadamard};
  a.topk_fill_mode = std::string(topk_fill_mode);
  a.topk_indexer_rows = topk_indexer_rows;
  a.indexer_slot_mapping = indexer_slot_mapping;
  a.tables = {targets.value_or(at::Tensor()), targets_host.value_or(at::Tensor()), row_dests.value_or(at::Tensor()),
              row_dests_host.value_or(at::Tensor())};
  a.written = written.vec();
  pcpkv::cuda_detail::DispatchJob job;
  job.params = make_dispatch_params(a);
  pcpkv::DispatchParams& p = job.params;
  // Pointer tables: the kernel reads the device copy; validation reads the host copy (same records).
  TORCH_CHECK_VALUE(has(targets) == has(targets_host), "dispatch: targets and targets_host go together");
  TORCH_CHECK_VALUE(has(row_dests) == has(row_dests_host), "dispatch: row_dests and row_dests_host go together");
  if (has(targets)) {
    job.host_targets = read_target_table(*targets_host, "dispatch: targets_host");
    check_uniform_targets(job.host_targets, has_indexer, "dispatch: targets_host");
    check_device_table(*targets, "dispatch: targets", dev, static_cast<int64_t>(job.host_targets.size()),
                       kTargetRecordBytes);
    p.targets = reinterpret_cast<const pcpkv::CacheTarget*>(targets->data_ptr());
    p.num_targets = static_cast<int32_t>(job.host_targets.size());
  }
  if (has(row_dests)) {
    job.host_row_dests = read_pointer_table(*row_dests_host, "dispatch: row_dests_host");
    check_device_table(*row_dests, "dispatch: row_dests", dev, static_cast<int64_t>(job.host_row_dests.size()), 0);
    p.row_dests = reinterpret_cast<uint8_t* const*>(row_dests->data_ptr());
    p.num_row_dests = static_cast<int32_t>(job.host_row_dests.size());
    p.row_bytes = pcpkv::transport_row_layout(p.fmt).row_bytes;
  }
  TORCH_CHECK_VALUE(p.num_targets == 0 || p.slot_mapping != nullptr, "dispatch: slot_mapping is required with targets");
  // launch_dispatch validates the whole job (host tables standing in for the device ones) and throws
  // before it enqueues anything.
  translate_errors([&] { pcpkv::cuda_detail::launch_dispatch(&job, 1, current_stream(dev)); });
}

void combine_cuda(const at::Tensor& rows, const at::Tensor& slot_mapping, const at::Tensor& mla_cache,
                  const std::optional<at::Tensor>& index_cache, c10::string_view kv_format,
                  c10::string_view ds_mla_scale, double k_scale, bool has_indexer,
                  const std::optional<at::Tensor>& indexer_slot_mapping) {
  TORCH_CHECK_VALUE(mla_cache.defined() && mla_cache.is_cuda(), "combine: mla_cache: expected a CUDA tensor, got ",
                    describe(mla_cache));
  const c10::cuda::CUDAGuard guard(mla_cache.device());
  const pcpkv::CombineParams p = make_combine_params(rows, slot_mapping, mla_cache, index_cache, kv_format,
                                                     ds_mla_scale, k_scale, has_indexer, indexer_slot_mapping);
  TORCH_CHECK_VALUE(addr(p.rows) % 16 == 0, "combine: rows must be 16-byte aligned, got ", describe(rows),
                    " at offset ", rows.storage_offset());
  translate_errors([&] { pcpkv::cuda_detail::launch_combine(&p, 1, current_stream(mla_cache.device())); });
}

void insert_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe, const std::optional<at::Tensor>& index_k,
                 const at::Tensor& slot_mapping, const at::Tensor& mla_cache,
                 const std::optional<at::Tensor>& index_cache, c10::string_view kv_format,
                 c10::string_view ds_mla_scale, double k_scale,
                 const std::optional<at::Tensor>& indexer_slot_mapping) {
  TORCH_CHECK_VALUE(mla_cache.defined() && mla_cache.is_cuda(), "insert: mla_cache: expected a CUDA tensor, got ",
                    describe(mla_cache));
  const c10::cuda::CUDAGuard guard(mla_cache.device());
  const pcpkv::InsertParams p = make_insert_params(kv_c, k_pe, index_k, slot_mapping, mla_cache, index_cache,
                                                   kv_format, ds_mla_scale, k_scale, indexer_slot_mapping);
  // Two launches (MLA rows, then indexer slots): everything either launcher checks is checked here first,
  // so the second can not fail after the first was enqueued.
  TORCH_CHECK_VALUE(addr(p.kv_c) % 16 == 0, "insert: kv_c must be 16-byte aligned");
  TORCH_CHECK_VALUE(addr(p.k_pe) % 16 == 0, "insert: k_pe must be 16-byte aligned");
  TORCH_CHECK_VALUE(addr(p.index_k) % 16 == 0, "insert: index_k must be 16-byte aligned");
  translate_errors([&] { pcpkv::validate_insert_shape(p); });
  const cudaStream_t stream = current_stream(mla_cache.device());
  translate_errors([&] {
    pcpkv::cuda_detail::launch_insert_mla(&p, 1, stream);
    if (p.fmt.has_indexer) pcpkv::cuda_detail::launch_insert_indexer(&p, 1, stream);
  });
}

void fence_cuda(const at::Tensor& pad_table, const at::Tensor& epochs, const at::Tensor& claim,
                const at::Tensor& error, int64_t first_rank, int64_t world, int64_t num_barriers, int64_t barrier_idx,
                int64_t timeout_us, at::TensorList written) {
  TORCH_CHECK_VALUE(epochs.defined() && epochs.is_cuda(), "fence: epochs: expected a CUDA tensor, got ",
                    describe(epochs));
  const c10::Device dev = epochs.device();
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK_VALUE(world >= 1 && world <= 1024, "fence: world = ", world, " must be in [1, 1024]");
  TORCH_CHECK_VALUE(pad_table.device() == dev &&
                        (pad_table.scalar_type() == at::kLong || pad_table.scalar_type() == at::kUInt64) &&
                        pad_table.dim() == 1 && pad_table.size(0) == world && pad_table.is_contiguous(),
                    "fence: pad_table: expected int64 [world=", world, "] peer pad pointers on ", dev, ", got ",
                    describe(pad_table));
  TORCH_CHECK_VALUE(epochs.scalar_type() == at::kLong && epochs.dim() == 2 && epochs.size(1) == num_barriers &&
                        epochs.is_contiguous(),
                    "fence: epochs: expected contiguous int64 [num_local_ranks, num_barriers=", num_barriers, "], got ",
                    describe(epochs));
  const int64_t n = epochs.size(0);
  TORCH_CHECK_VALUE(first_rank >= 0 && n >= 1 && first_rank + n <= world, "fence: ranks [", first_rank, ", ",
                    first_rank + n, ") are not inside [0, world=", world, ")");
  TORCH_CHECK_VALUE(barrier_idx >= 0 && barrier_idx < num_barriers, "fence: barrier_idx = ", barrier_idx,
                    " is out of range [0, ", num_barriers, ")");
  TORCH_CHECK_VALUE(claim.device() == dev && claim.scalar_type() == at::kInt && claim.numel() == 1,
                    "fence: claim: expected int32 [1] on ", dev, ", got ", describe(claim));
  TORCH_CHECK_VALUE(error.device().is_cpu() && error.is_pinned() && error.scalar_type() == at::kByte &&
                        error.numel() == static_cast<int64_t>(sizeof(pcpkv::FenceError)) && error.is_contiguous(),
                    "fence: error: expected a pinned CPU uint8 [", sizeof(pcpkv::FenceError),
                    "] (pcpkv_torch.FenceState allocates it), got ", describe(error));
  TORCH_CHECK_VALUE(timeout_us > 0 && timeout_us <= kMaxFenceTimeoutUs, "fence: timeout_us = ", timeout_us,
                    " must be in [1, ", kMaxFenceTimeoutUs, "] (one day)");
  check_written_devices("fence", written.vec(), "epochs", dev);
  pcpkv::FenceArgs a;
  a.pads = reinterpret_cast<uint64_t* const*>(pad_table.data_ptr());
  a.epochs = reinterpret_cast<uint64_t*>(epochs.data_ptr());
  a.claim = reinterpret_cast<uint32_t*>(claim.data_ptr());
  // Pinned host memory is device-addressable at its host address under unified addressing (every 64-bit
  // CUDA platform), so no runtime call is needed here (this op may run inside a graph capture).
  a.error = static_cast<pcpkv::FenceError*>(error.data_ptr());
  a.first_rank = static_cast<int32_t>(first_rank);
  a.world = static_cast<int32_t>(world);
  a.barrier_idx = static_cast<int32_t>(barrier_idx);
  a.num_barriers = static_cast<int32_t>(num_barriers);
  a.timeout_ns = static_cast<uint64_t>(timeout_us) * 1000u;
  translate_errors([&] { pcpkv::cuda_detail::launch_fence(a, static_cast<int>(n), current_stream(dev)); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pcpkv, m) { m.def("cuda_dispatch_impl() -> str", &dispatch_impl); }

TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) {
  m.impl("dispatch", &dispatch_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("insert", &insert_cuda);
  m.impl("fence", &fence_cuda);
}

}  // namespace pcpkv_torch
