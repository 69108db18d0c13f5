// python/csrc/kernels.h: this package's own CUDA launchers (csrc/kernels.cu). Thin and reference-style:
// one thread per token or row, the same pack.h / token_math.h helpers as the CPU reference, so their bytes
// equal pcpkv's CPU reference exactly. pcpkv's fused dispatch kernel (src/cuda/dispatch.cu) is used for
// dispatch when it is built in (PCPKV_TORCH_FAST_DISPATCH); the rest runs here.
//
// Parameters are pcpkv's contracts (pcpkv/dispatch.h) with device pointers; tables (targets, row_dests) are
// device tables. The kernels never write outside a target: a token whose slot is outside the target's
// slot range, or whose position is outside the rope table, is skipped (the host cannot read device
// values without a synchronization; pcpkv_torch.validate_* do that check on demand).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/dispatch.h"

namespace pcpkv_torch {

/// Reference dispatch (SPEC section 2), one thread per token. p.targets / p.row_dests are device tables;
/// num_slots = the smallest slot count over the targets (slots >= num_slots are skipped).
void launch_reference_dispatch(const pcpkv::DispatchParams& p, int64_t num_slots, cudaStream_t stream);
/// Staging rows -> local caches (SPEC section 5), one thread per row.
void launch_combine(const pcpkv::CombineParams& p, cudaStream_t stream);
/// Collect path: quantize-and-insert bf16 rows (SPEC section 5), one thread per token.
void launch_insert(const pcpkv::InsertParams& p, cudaStream_t stream);
/// The fence of pcpkv/device/fence_kernel.h, one block per hosted rank (first_rank + blockIdx.x).
void launch_fence(const pcpkv::FenceArgs& a, int num_blocks, cudaStream_t stream);

}  // namespace pcpkv_torch
