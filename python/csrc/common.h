// python/csrc/common.h: tensor -> pcpkv contract helpers shared by the CPU and CUDA op implementations.
//
// Every check raises a Python ValueError (TORCH_CHECK_VALUE) naming the argument, its expected and its
// actual dtype/shape/device, before anything is launched or written. pcpkv::Error from the library is
// translated the same way (translate_errors).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pcpkv/publish/dispatch.h"
#include "pcpkv/core/byte_range.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/layout.h"

namespace pcpkv_torch {

/// Runs fn; pcpkv::FenceTimeout becomes RuntimeError, any other pcpkv::Error a ValueError (same message).
template <class Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const pcpkv::FenceTimeout& e) {
    TORCH_CHECK(false, "pcpkv: ", e.what());
  } catch (const pcpkv::Error& e) {
    TORCH_CHECK_VALUE(false, "pcpkv: ", e.what());
  }
}

std::string describe(const at::Tensor& t);

/// A [rows, cols] bf16 tensor with unit inner stride on `device`; returns its row stride in elements.
int64_t check_bf16_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const c10::Device& device);
/// A contiguous tensor of exactly `sizes` and `dtype` on `device` (an output the kernel writes densely).
void check_dense(const at::Tensor& t, const char* name, at::IntArrayRef sizes, at::ScalarType dtype,
                 const c10::Device& device);
/// A 1-d contiguous tensor of n elements of `dtype` on `device`.
void check_vector(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype, const c10::Device& device);

/// The one overlap contract of the ops, the Python tables (torch.ops.pcpkv.first_overlap / first_range_overlap) and
/// the library's own parameter checks: pcpkv::ByteRange and pcpkv::first_overlap (pcpkv/core/byte_range.h).
using pcpkv::ByteRange;
/// A tensor's extent [data_ptr, data_ptr + (1 + sum((size - 1) * stride)) * itemsize) in the address space of its
/// device (device_space): two interleaved views of one buffer overlap, tensors on two devices never do. Undefined,
/// empty and storage-less (meta) tensors: no memory.
ByteRange byte_range(const at::Tensor& t);
/// pcpkv::ByteRange::space of a device: one per (type, index); the CPU's is 0, the library's default.
int64_t device_space(const c10::Device& d);

/// pcpkv::first_overlap over the tensors' byte_range: compares addresses, not storages (from_blob views of one buffer
/// are two storages).
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<at::Tensor>& writes,
                                                       const std::vector<at::Tensor>& reads, bool writes_pairwise);

/// Longest fence wait an op takes (one day, as `mp-publish --fence-timeout-ms`): timeout_us = 2**62 overflowed the
/// deadline (now + 2**62 us in ns) and the wait ended at once.
constexpr int64_t kMaxFenceTimeoutUs = int64_t{24} * 3600 * 1000 * 1000;

/// A tensor of an op's overlap check, by reference (null or undefined: no memory); its name reads "name[index]" when
/// index >= 0. Nothing is copied or formatted unless the check fails: a dispatch checks ~35 tensors on every call.
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
  int64_t index = -1;
};
using Named = std::vector<NamedTensor>;
/// &*t, or null for an empty optional (a NamedTensor of an optional argument).
inline const at::Tensor* maybe(const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; }
/// ValueError naming the first tensor of `writes` that shares memory with another of `writes` (writes_pairwise) or
/// one of `reads`, and that tensor (first_overlap): "op: a (...) shares memory with b (...): an output must not
/// overlap an input or another output ...". Every op checks its outputs with it before anything is written.
void refuse_overlap(const char* op, const Named& writes, const Named& reads, bool writes_pairwise);

/// Every tensor of `written` (an op's list of tensors declared as mutated) on the device type of `dev`, the device of
/// the op's argument `ref` (another index is fine: a peer's replica): ValueError naming written[i] and its device.
/// (The fake kernels of pcpkv_torch/_fake.py apply the same rule under torch.compile tracing.)
void check_written_devices(const char* op, const std::vector<at::Tensor>& written, const char* ref,
                           const c10::Device& dev);

/// Parses the format arguments of an op into a CacheFormat (ValueError on a bad name or k_scale).
pcpkv::CacheFormat make_format(const std::string& kv_format, const std::string& ds_mla_scale, double k_scale,
                               bool has_indexer);

/// Geometry of a paged MLA cache tensor: uint8 [num_blocks, block_size, row_bytes(fmt)], inner stride 1,
/// any row stride >= row_bytes and block stride >= block_size * row stride (padding allowed).
pcpkv::MlaCacheGeometry mla_geometry_of(const at::Tensor& cache, pcpkv::KvFormat fmt, const char* name);
/// Geometry of an indexer-K cache tensor: uint8 [num_blocks, block_size, 132] whose block stride (stride 0)
/// is >= block_size * 132; bytes follow SPEC section 3 within each block (not interleaved per token).
pcpkv::IndexerCacheGeometry index_geometry_of(const at::Tensor& cache, const char* name);

/// A CacheTarget over local cache tensors (index cache only when fmt.has_indexer).
pcpkv::CacheTarget target_of(const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                             const pcpkv::CacheFormat& fmt, const char* op);

/// Bytes of one CacheTarget record in a target table (uint8 [num_targets, kTargetRecordBytes]).
constexpr int64_t kTargetRecordBytes = static_cast<int64_t>(sizeof(pcpkv::CacheTarget));

/// Host-side view of a target table tensor (CPU, uint8 [D, kTargetRecordBytes]): a copy of the records.
std::vector<pcpkv::CacheTarget> read_target_table(const at::Tensor& host_table, const char* name);
/// Refuses a target table whose records disagree: every record must have record 0's MLA geometry (and,
/// on a layer with an indexer, indexer geometry). A table records the replicas of one cache (CacheTargets);
/// the CUDA kernels trust slot values, so a record smaller than the rest would be written past its end.
void check_uniform_targets(const std::vector<pcpkv::CacheTarget>& targets, bool has_indexer, const char* name);
/// Host-side view of a pointer table (CPU, int64/uint64 [D]): the pointers.
std::vector<uint8_t*> read_pointer_table(const at::Tensor& host_table, const char* name);

template <class T>
T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? static_cast<T*>(t->data_ptr()) : nullptr;
}
inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

/// The dispatch parameters the CPU and CUDA implementations share; tables are filled by the caller.
struct DispatchArgs {
  at::Tensor kv, k_pe, positions, kv_norm_w, rope_cos_sin;
  std::optional<at::Tensor> q_c, q_norm_w, index_k, index_ln_w, index_ln_b, slot_mapping;
  std::optional<at::Tensor> q_c_out, kv_c_out, k_pe_out, index_k_out, topk_fill;
  std::string kv_format, ds_mla_scale;
  double k_scale = 1.0;
  bool has_indexer = true;
  double q_eps = 1e-6, kv_eps = 1e-6, index_eps = 1e-6;
  bool mla_rope_interleaved = true, index_rope_interleaved = false, index_hadamard = false;
  std::string topk_fill_mode = "full";  // pcpkv::TopkFill: full | tail | none
  int64_t topk_indexer_rows = 0;        // tail: rows [0, n) the indexer top-k writes
  std::array<at::Tensor, 4> tables;     // targets, targets_host, row_dests, row_dests_host (undefined: not given)
  std::vector<at::Tensor> written;      // the op's `written`: the tensors behind the tables (may repeat each other)
  std::optional<at::Tensor> indexer_slot_mapping;  // the indexer rows' own slots (docs/spec.md 4.2); none: slot_mapping
};
/// Checks every tensor of a dispatch (dtype, shape, device; no output sharing memory with an input, a table, a
/// written tensor or another output; no written tensor with an input or a table) and fills the contract (no
/// tables yet).
pcpkv::DispatchParams make_dispatch_params(const DispatchArgs& a);

/// Checks the tensors of a combine (staging rows -> local caches) and fills the contract.
/// indexer_slot_mapping (combine and insert): the indexer rows' own gathered slots, or none (docs/spec.md 4.2).
pcpkv::CombineParams make_combine_params(const at::Tensor& rows, const at::Tensor& slot_mapping,
                                         const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                                         c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                                         bool has_indexer, const std::optional<at::Tensor>& indexer_slot_mapping = {});
/// Checks the tensors of an insert (collect path) and fills the contract; has_indexer = index_k given.
pcpkv::InsertParams make_insert_params(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                       const std::optional<at::Tensor>& index_k, const at::Tensor& slot_mapping,
                                       const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                                       c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                                       const std::optional<at::Tensor>& indexer_slot_mapping = {});

}  // namespace pcpkv_torch
