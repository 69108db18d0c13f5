// python/csrc/checks.h: the tensor checks every op shares (its file maps the op's arguments onto pcpkv's
// parameter structs with them), on the CPU and CUDA alike.
//
// Every check raises a Python ValueError (TORCH_CHECK_VALUE) naming the argument, its expected and its
// actual dtype/shape/device, before anything is launched or written. pcpkv::Error from the library is
// translated the same way (translate_errors).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
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

/// Threads of the CPU reference kernels: torch's intra-op count, at most 16.
inline int cpu_threads() { return std::max(1, std::min(at::get_num_threads(), 16)); }

/// A [rows, cols] bf16 tensor with unit inner stride on `device`; returns its row stride in elements.
int64_t check_bf16_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const c10::Device& device);
/// A contiguous tensor of exactly `sizes` and `dtype` on `device` (an output the kernel writes densely).
void check_dense(const at::Tensor& t, const char* name, at::IntArrayRef sizes, at::ScalarType dtype,
                 const c10::Device& device);
/// A 1-d contiguous tensor of n elements of `dtype` on `device`.
void check_vector(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype, const c10::Device& device);
/// The rows of an op's two MLA inputs (kv or kv_c, and k_pe) against the number of local tokens T, which `ref`
/// (positions or slot_mapping, a 1-d tensor) counts: a mismatch names both tensors with their row counts, T and
/// `ref`, blaming the one(s) whose rows differ from T (not k_pe when kv is the odd one). When the two agree with each
/// other, `ref` is the odd one and the op's check of it names it; tensors that are not 2-d are left to the ops' shape
/// checks.
void check_token_rows(const char* op, const char* kv_name, const at::Tensor& kv, const at::Tensor& k_pe,
                      const char* ref, int64_t T);
/// The indexer rows' own slots (docs/spec.md 4.2) of `op` (dispatch, combine, insert): int64 [n] on device, or null
/// when not given (slot_mapping then addresses both caches). `no_indexer`: null on an indexer layer, else why the op
/// has no indexer row (the refusal's end, e.g. "has_indexer=False").
const int64_t* indexer_slots(const std::optional<at::Tensor>& t, const char* op, const char* no_indexer, int64_t n,
                             const c10::Device& device);
/// A contiguous tensor of `dtype` with `dim` dimensions on `dev`; the message names the expected shape (e.g.
/// "[num_tokens, num_heads, 128]").
void check_nd(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const char* shape,
              const c10::Device& dev);

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
/// The caches a combine / insert writes, for refuse_overlap (target_of checked them; the index cache only on a layer
/// with an indexer).
Named written_caches(const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                     const pcpkv::CacheFormat& fmt);

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

}  // namespace pcpkv_torch
