// python/csrc/dispatch.h: the arguments of torch.ops.pcpkv.dispatch (schema: registry.cpp; docstring:
// pcpkv_torch/ops.py dispatch) as one struct, filled by name from the schema (kDispatch), and their translation to
// pcpkv::DispatchParams (pcpkv/publish/dispatch.h). The CPU and CUDA implementations (dispatch.cpp) and the vLLM
// drop-in (vllm_dropin.cpp, which calls the op with a DispatchArgs) share both.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "binding.h"
#include "pcpkv/publish/dispatch.h"

namespace pcpkv_torch {

/// One member per schema argument, named as it, in schema order (shapes: pcpkv_torch.ops.dispatch).
struct DispatchArgs {
  at::Tensor kv, k_pe, positions, kv_norm_w, rope_cos_sin;                              // inputs
  std::optional<at::Tensor> q_c, q_norm_w, index_k, index_ln_w, index_ln_b, slot_mapping;  // optional inputs
  std::optional<at::Tensor> targets, targets_host, row_dests, row_dests_host;  // tables (device copy, host copy)
  std::optional<at::Tensor> q_c_out, kv_c_out, k_pe_out, index_k_out, topk_fill;  // outputs
  std::vector<at::Tensor> written;  // the tensors behind the tables (may repeat each other)
  std::string kv_format, ds_mla_scale;
  double k_scale = 1.0;
  bool has_indexer = true;
  double q_eps = 1e-6, kv_eps = 1e-6, index_eps = 1e-6;
  bool mla_rope_interleaved = true, index_rope_interleaved = false, index_hadamard = false;
  std::string topk_fill_mode = "full";  // pcpkv::TopkFill: full | tail | none
  int64_t topk_indexer_rows = 0;        // tail: rows [0, n) the indexer top-k writes
  std::optional<at::Tensor> indexer_slot_mapping;  // the indexer rows' own slots (docs/spec.md 4.2); none: slot_mapping
};

/// The schema's arguments onto DispatchArgs, by name (binding.h): the one place they meet.
inline constexpr Binding kDispatch{
    "pcpkv::dispatch",
    PCPKV_ARG(DispatchArgs, kv),
    PCPKV_ARG(DispatchArgs, k_pe),
    PCPKV_ARG(DispatchArgs, positions),
    PCPKV_ARG(DispatchArgs, kv_norm_w),
    PCPKV_ARG(DispatchArgs, rope_cos_sin),
    PCPKV_ARG(DispatchArgs, q_c),
    PCPKV_ARG(DispatchArgs, q_norm_w),
    PCPKV_ARG(DispatchArgs, index_k),
    PCPKV_ARG(DispatchArgs, index_ln_w),
    PCPKV_ARG(DispatchArgs, index_ln_b),
    PCPKV_ARG(DispatchArgs, slot_mapping),
    PCPKV_ARG(DispatchArgs, targets),
    PCPKV_ARG(DispatchArgs, targets_host),
    PCPKV_ARG(DispatchArgs, row_dests),
    PCPKV_ARG(DispatchArgs, row_dests_host),
    PCPKV_ARG(DispatchArgs, q_c_out),
    PCPKV_ARG(DispatchArgs, kv_c_out),
    PCPKV_ARG(DispatchArgs, k_pe_out),
    PCPKV_ARG(DispatchArgs, index_k_out),
    PCPKV_ARG(DispatchArgs, topk_fill),
    PCPKV_ARG(DispatchArgs, written),
    PCPKV_ARG(DispatchArgs, kv_format),
    PCPKV_ARG(DispatchArgs, ds_mla_scale),
    PCPKV_ARG(DispatchArgs, k_scale),
    PCPKV_ARG(DispatchArgs, has_indexer),
    PCPKV_ARG(DispatchArgs, q_eps),
    PCPKV_ARG(DispatchArgs, kv_eps),
    PCPKV_ARG(DispatchArgs, index_eps),
    PCPKV_ARG(DispatchArgs, mla_rope_interleaved),
    PCPKV_ARG(DispatchArgs, index_rope_interleaved),
    PCPKV_ARG(DispatchArgs, index_hadamard),
    PCPKV_ARG(DispatchArgs, topk_fill_mode),
    PCPKV_ARG(DispatchArgs, topk_indexer_rows),
    PCPKV_ARG(DispatchArgs, indexer_slot_mapping),
};

/// Checks every tensor of a dispatch (dtype, shape, device; no output sharing memory with an input, a table, a
/// written tensor or another output; no written tensor with an input or a table) and fills the contract (no
/// tables yet: each implementation reads its own).
pcpkv::DispatchParams make_dispatch_params(const DispatchArgs& a);

}  // namespace pcpkv_torch
