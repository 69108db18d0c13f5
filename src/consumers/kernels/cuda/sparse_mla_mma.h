// Internal: the bf16 tensor-core sparse MLA kernel (SparseMlaKernel::kMma), launched by cuda::sparse_mla
// after its scalar checks.
#pragma once

#include <cuda_runtime.h>

#include "pcpkv/consumers/sparse_mla.h"

namespace pcpkv::cuda::detail {
void sparse_mla_mma(const SparseMlaParams& p, cudaStream_t stream);
}  // namespace pcpkv::cuda::detail
