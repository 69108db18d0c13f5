// python/csrc/consumers.h: tensor -> contract translation of the consumer ops (indexer, sparse MLA, LSE merge),
// shared by the CPU implementations (consumers.cpp) and the CUDA ones (consumers_cuda.cpp).
//
// Every function checks dtypes, shapes, contiguity and devices and raises ValueError naming the argument
// (TORCH_CHECK_VALUE) before anything is written; the library's own validation (values: positions, block
// tables, indices) runs in the CPU implementations only (on CUDA those values stay on the device).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "pcpkv/consumers/indexer.h"
#include "pcpkv/consumers/lse_merge.h"
#include "pcpkv/consumers/sparse_mla.h"

namespace pcpkv_torch {

/// q bf16 [T, H, 128] -> q_fp8 uint8 [T, H, 128], q_scale float32 [T, H] (all contiguous, one device).
/// Returns H (>= 1).
int32_t check_quantize_index_q(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale);

/// The same quantizer as pcpkv::quantize_index_queries (SPEC section 3, UE8M0 per (token, head)) in ATen ops,
/// for any device (the CUDA implementation): bit-identical to the C++ oracle for every input (NaN, inf,
/// subnormals included; the tests compare them on the CPU).
void quantize_index_q_aten(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale);

/// The indexer's contract over the tensors (no max_keys yet: the caller sets it). logit: "exact" | "fp32_tree".
pcpkv::IndexerParams make_indexer_params(const at::Tensor& q_fp8, const at::Tensor& q_scale, const at::Tensor& weights,
                                         const at::Tensor& positions, const at::Tensor& request_idx,
                                         const at::Tensor& block_tables, const at::Tensor& index_cache,
                                         const at::Tensor& out, const std::optional<at::Tensor>& positions_out,
                                         int64_t topk, const std::string& logit);

/// Sparse MLA's contract over the tensors. scale_read: "fp32" | "bf16" (SparseMlaParams::scales_as_bf16).
pcpkv::SparseMlaParams make_sparse_mla_params(const at::Tensor& q, const at::Tensor& mla_cache,
                                              const at::Tensor& indices, const at::Tensor& out, const at::Tensor& lse,
                                              const std::string& kv_format, const std::string& ds_mla_scale,
                                              double k_scale, double softmax_scale, const std::string& scale_read);
/// "mma" | "simt" -> the CUDA kernel (ValueError otherwise; checked on every device).
pcpkv::SparseMlaKernel parse_sparse_mla_kernel(const std::string& kernel);

/// LSE merge's contract: outs float32 [S, T, H, D], lses [S, T, H] -> out [T, H, D], lse [T, H].
pcpkv::LseMergeParams make_lse_merge_params(const at::Tensor& outs, const at::Tensor& lses, const at::Tensor& out,
                                            const at::Tensor& lse);

}  // namespace pcpkv_torch
