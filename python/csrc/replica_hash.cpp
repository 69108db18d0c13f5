// python/csrc/replica_hash.cpp: torch.ops.pcpkv.replica_hash_weights (schema: registry.cpp), host-only, for
// pcpkv_torch.models.replica_check.
#include <ATen/Functions.h>
#include <torch/library.h>

#include "pcpkv/device/replica_hash.h"

namespace pcpkv_torch {
namespace {

// w(0..n) of the replica hash (docs/spec.md 5.2) as int64 (two's complement of the uint64 weights): the one
// definition, pcpkv/device/replica_hash.h, for pcpkv_torch.models.replica_check.
at::Tensor replica_hash_weights(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= pcpkv::hash::kMaxHashedBytes, "replica_hash_weights: n = ", n, " must be in [0, ",
                    pcpkv::hash::kMaxHashedBytes, "]");
  at::Tensor w = at::empty({n}, at::kLong);
  int64_t* p = w.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<int64_t>(pcpkv::hash::replica_hash_weight(static_cast<uint64_t>(j)));
  return w;
}

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) { m.impl("replica_hash_weights", &replica_hash_weights); }

}  // namespace pcpkv_torch
