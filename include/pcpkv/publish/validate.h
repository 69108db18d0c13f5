// pcpkv/publish/validate.h: the checks of the parameter structs of pcpkv/publish/dispatch.h (DispatchParams,
// CombineParams, InsertParams, CacheTarget, CacheFormat), declared beside the contract they check: the CPU oracle
// and every CUDA launcher run them before writing a byte (defined in src/publish/contract/validate_params.cpp,
// in pcpkv_core, so CPU builds have them too).
#pragma once

#include "pcpkv/publish/dispatch.h"

namespace pcpkv {

/// The checks the CPU reference kernels (pcpkv/publish/cpu.h) and the CUDA launchers (pcpkv/publish/kernels.h)
/// run first, without writing. The *_shape variants read no memory behind the pointers (usable on device
/// parameters before a launch); the full variants also read slot_mapping and positions (host pointers). Each
/// throws pcpkv::Error naming the field and the value.
/// The *_shape variants also refuse an output sharing a byte with an input or another output (first_overlap of
/// pcpkv/core/byte_range.h over the pointers' extents), naming both fields: "combine: target.index_base (bytes
/// [0x..., 0x...)) overlaps target.mla_base (...)". Outputs: a target's MLA cache (up to the end of its last slot)
/// and indexer cache, a dispatch's every target, row destination (num_tokens * row_bytes) and materialized output.
void validate_dispatch_shape(const DispatchParams& p);
void validate_dispatch(const DispatchParams& p);
void validate_combine_shape(const CombineParams& p);
void validate_combine(const CombineParams& p);
void validate_insert_shape(const InsertParams& p);
void validate_insert(const InsertParams& p);
/// The same overlap rule across the jobs of one launch of the CUDA combine / insert (the jobs run at once): no job's
/// caches may share a byte with another job's caches or with any job's inputs; throws naming both
/// ("combine: jobs[1].target.mla_base (...) overlaps jobs[0].target.mla_base (...)"). Jobs are checked one by one
/// by the *_shape variants; num_jobs < 2 checks nothing more. (A dispatch's jobs share their targets by design.)
void validate_combine_jobs(const CombineParams* jobs, int num_jobs);
void validate_insert_jobs(const InsertParams* jobs, int num_jobs);
/// A cache target of format fmt: non-null bases, valid geometries (indexer only when fmt.has_indexer). Errors name
/// the target `name` ("combine: target"), or `name[index]` when index >= 0 (formatted only for the error), then
/// the field ("dispatch: targets[3].mla_base is null", "combine: target: mla cache: row_stride = ...").
void validate_cache_target(const CacheTarget& t, const CacheFormat& fmt, const char* name, int index = -1);
/// k_scale finite and > 0, enums in range.
void validate_cache_format(const CacheFormat& fmt);

}  // namespace pcpkv
