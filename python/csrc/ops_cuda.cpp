// python/csrc/ops_cuda.cpp: CUDA implementations of the pcpkv ops. Host-side checks first (shapes, dtypes,
// devices, tables; nothing is enqueued on a bad argument), then asynchronous launches on the current torch
// stream, so every op is capturable into a CUDA graph (no synchronization, no allocation, no host copy).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "common.h"
#include "kernels.h"
#include "pcpkv/cpu.h"
#if PCPKV_TORCH_FAST_DISPATCH
#include "cuda/launch.h"
#endif

namespace pcpkv_torch {
namespace {

cudaStream_t current_stream(const c10::Device& d) { return c10::cuda::getCurrentCUDAStream(d.index()).stream(); }

// "pcpkv" (the fused kernel of src/cuda/dispatch.cu) unless built without it or PCPKV_TORCH_DISPATCH=reference.
std::string dispatch_impl() {
#if PCPKV_TORCH_FAST_DISPATCH
  const char* env = std::getenv("PCPKV_TORCH_DISPATCH");
  if (env != nullptr && std::string(env) == "reference") return "reference";
  return "pcpkv";
#else
  return "reference";
#endif
}

void check_device_table(const at::Tensor& t, const char* name, const c10::Device& dev, int64_t rows,
                        int64_t row_elems) {
  TORCH_CHECK_VALUE(t.device() == dev && t.is_contiguous() && t.dim() == (row_elems > 0 ? 2 : 1) && t.size(0) == rows &&
                        (row_elems == 0 || t.size(1) == row_elems),
                    name, ": expected the device copy of its host table (", rows, " entries) on ", dev, ", got ",
                    describe(t));
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
                   at::TensorList /*written*/, c10::string_view kv_format, c10::string_view ds_mla_scale,
                   double k_scale, bool has_indexer, double q_eps, double kv_eps, double index_eps,
                   bool mla_rope_interleaved, bool index_rope_interleaved, bool index_hadamard) {
  const c10::cuda::CUDAGuard guard(kv.device());
  DispatchArgs a{kv,          k_pe,     positions, kv_norm_w, rope_cos_sin, q_c,
                 q_norm_w,    index_k,  index_ln_w, index_ln_b, slot_mapping, q_c_out,
                 kv_c_out,    k_pe_out, index_k_out, topk_fill, std::string(kv_format), std::string(ds_mla_scale),
                 k_scale,     has_indexer, q_eps,   kv_eps,    index_eps,    mla_rope_interleaved,
                 index_rope_interleaved, index_hadamard};
  pcpkv::DispatchParams p = make_dispatch_params(a);
  const c10::Device dev = kv.device();
  std::vector<pcpkv::CacheTarget> host_targets;
  std::vector<uint8_t*> host_dests;
  if (has(targets)) {
    TORCH_CHECK_VALUE(has(targets_host), "dispatch: targets on ", dev, " need targets_host, their host copy");
    host_targets = read_target_table(*targets_host, "dispatch: targets_host");
    check_device_table(*targets, "dispatch: targets", dev, static_cast<int64_t>(host_targets.size()),
                       kTargetRecordBytes);
    p.targets = reinterpret_cast<const pcpkv::CacheTarget*>(targets->data_ptr());
    p.num_targets = static_cast<int32_t>(host_targets.size());
  }
  if (has(row_dests)) {
    TORCH_CHECK_VALUE(has(row_dests_host), "dispatch: row_dests on ", dev, " need row_dests_host, their host copy");
    host_dests = read_pointer_table(*row_dests_host, "dispatch: row_dests_host");
    check_device_table(*row_dests, "dispatch: row_dests", dev, static_cast<int64_t>(host_dests.size()), 0);
    p.row_dests = reinterpret_cast<uint8_t* const*>(row_dests->data_ptr());
    p.num_row_dests = static_cast<int32_t>(host_dests.size());
    p.row_bytes = pcpkv::transport_row_layout(p.fmt).row_bytes;
  }
  // Validate with the host tables standing in for the device ones (pcpkv's checks, pcpkv's messages).
  pcpkv::DispatchParams hp = p;
  hp.targets = host_targets.empty() ? nullptr : host_targets.data();
  hp.row_dests = host_dests.empty() ? nullptr : host_dests.data();
  translate_errors([&] { pcpkv::validate_dispatch_shape(hp); });
  TORCH_CHECK_VALUE(p.num_targets == 0 || p.slot_mapping != nullptr, "dispatch: slot_mapping is required with targets");
  const cudaStream_t stream = current_stream(dev);
#if PCPKV_TORCH_FAST_DISPATCH
  if (dispatch_impl() == "pcpkv") {
    pcpkv::cuda_detail::DispatchJob job{p, host_targets, host_dests};
    translate_errors([&] { pcpkv::cuda_detail::launch_dispatch(&job, 1, stream); });
    return;
  }
#endif
  int64_t num_slots = INT64_MAX;
  for (const pcpkv::CacheTarget& t : host_targets) {
    num_slots = std::min(num_slots, t.mla.num_slots());
    if (p.fmt.has_indexer) num_slots = std::min(num_slots, t.index.num_slots());
  }
  if (p.topk_fill != nullptr && p.num_tokens > 0)
    TORCH_CHECK(cudaMemsetAsync(p.topk_fill, 0xff, static_cast<size_t>(p.num_tokens * p.topk_width) * 4, stream) ==
                    cudaSuccess,
                "dispatch: cudaMemsetAsync of topk_fill failed");
  p.topk_fill = nullptr;
  translate_errors([&] { launch_reference_dispatch(p, num_slots, stream); });
}

void combine_cuda(const at::Tensor& rows, const at::Tensor& slot_mapping, const at::Tensor& mla_cache,
                  const std::optional<at::Tensor>& index_cache, c10::string_view kv_format,
                  c10::string_view ds_mla_scale, double k_scale, bool has_indexer) {
  const c10::cuda::CUDAGuard guard(mla_cache.device());
  const pcpkv::CombineParams p = make_combine_params(rows, slot_mapping, mla_cache, index_cache, kv_format,
                                                     ds_mla_scale, k_scale, has_indexer);
  translate_errors([&] {
    pcpkv::validate_combine_shape(p);
    launch_combine(p, current_stream(mla_cache.device()));
  });
}

void insert_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe, const std::optional<at::Tensor>& index_k,
                 const at::Tensor& slot_mapping, const at::Tensor& mla_cache,
                 const std::optional<at::Tensor>& index_cache, c10::string_view kv_format,
                 c10::string_view ds_mla_scale, double k_scale) {
  const c10::cuda::CUDAGuard guard(mla_cache.device());
  const pcpkv::InsertParams p = make_insert_params(kv_c, k_pe, index_k, slot_mapping, mla_cache, index_cache,
                                                   kv_format, ds_mla_scale, k_scale);
  translate_errors([&] {
    pcpkv::validate_insert_shape(p);
    launch_insert(p, current_stream(mla_cache.device()));
  });
}

void fence_cuda(const at::Tensor& pad_table, const at::Tensor& epochs, const at::Tensor& claim,
                const at::Tensor& error, int64_t first_rank, int64_t world, int64_t num_barriers, int64_t barrier_idx,
                int64_t timeout_us, at::TensorList /*written*/) {
  const c10::Device dev = epochs.device();
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK_VALUE(pad_table.device() == dev && pad_table.scalar_type() == at::kLong && pad_table.dim() == 1 &&
                        pad_table.size(0) == world && pad_table.is_contiguous(),
                    "fence: pad_table: expected int64 [world=", world, "] peer pad pointers on ", dev, ", got ",
                    describe(pad_table));
  TORCH_CHECK_VALUE(epochs.scalar_type() == at::kLong && epochs.dim() == 2 && epochs.size(1) == num_barriers &&
                        epochs.is_contiguous(),
                    "fence: epochs: expected contiguous int64 [num_local_ranks, num_barriers=", num_barriers, "], got ",
                    describe(epochs));
  const int64_t n = epochs.size(0);
  TORCH_CHECK_VALUE(first_rank >= 0 && n >= 1 && first_rank + n <= world && world <= 1024, "fence: ranks [",
                    first_rank, ", ", first_rank + n, ") are not inside [0, world=", world, ")");
  TORCH_CHECK_VALUE(barrier_idx >= 0 && barrier_idx < num_barriers, "fence: barrier_idx = ", barrier_idx,
                    " is out of range [0, ", num_barriers, ")");
  TORCH_CHECK_VALUE(claim.device() == dev && claim.scalar_type() == at::kInt && claim.numel() == 1,
                    "fence: claim: expected int32 [1] on ", dev, ", got ", describe(claim));
  TORCH_CHECK_VALUE(error.device().is_cpu() && error.is_pinned() && error.scalar_type() == at::kByte &&
                        error.numel() == static_cast<int64_t>(sizeof(pcpkv::FenceError)) && error.is_contiguous(),
                    "fence: error: expected a pinned CPU uint8 [", sizeof(pcpkv::FenceError),
                    "] (pcpkv_torch.FenceState allocates it), got ", describe(error));
  TORCH_CHECK_VALUE(timeout_us > 0, "fence: timeout_us = ", timeout_us, " must be > 0");
  // Pinned host memory is device-addressable at its host address under unified addressing (every 64-bit
  // CUDA platform), so no runtime call is needed here (this op may run inside a graph capture).
  void* error_dev = error.data_ptr();
  pcpkv::FenceArgs a;
  a.pads = reinterpret_cast<uint64_t* const*>(pad_table.data_ptr());
  a.epochs = reinterpret_cast<uint64_t*>(epochs.data_ptr());
  a.claim = reinterpret_cast<uint32_t*>(claim.data_ptr());
  a.error = static_cast<pcpkv::FenceError*>(error_dev);
  a.first_rank = static_cast<int32_t>(first_rank);
  a.world = static_cast<int32_t>(world);
  a.barrier_idx = static_cast<int32_t>(barrier_idx);
  a.num_barriers = static_cast<int32_t>(num_barriers);
  a.timeout_ns = static_cast<uint64_t>(timeout_us) * 1000u;
  translate_errors([&] { launch_fence(a, static_cast<int>(n), current_stream(dev)); });
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
