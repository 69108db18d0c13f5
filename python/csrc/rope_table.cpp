// python/csrc/rope_table.cpp: torch.ops.pcpkv.rope_table (schema: registry.cpp; docstring: pcpkv_torch/ops.py
// rope_table), host-only: pcpkv::make_rope_table's [cos | sin] rows as a float32 tensor.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <cstring>
#include <new>
#include <string>

#include "checks.h"
#include "pcpkv/core/rope.h"

namespace pcpkv_torch {
namespace {

// A rope table holds one 256-byte row per position. Real models use <= 2^20 positions; 2^28 (64 GiB) is a
// bound that refuses a mistyped count with a message instead of std::bad_alloc.
constexpr int64_t kMaxRopeTablePositions = int64_t{1} << 28;
constexpr int64_t kRopeTableRowBytes = pcpkv::kRopeDim * static_cast<int64_t>(sizeof(float));

at::Tensor rope_table(int64_t num_positions, c10::string_view scaling, double theta, double factor,
                      int64_t original_max_position_embeddings, double beta_fast, double beta_slow, double mscale,
                      double mscale_all_dim) {
  pcpkv::RopeConfig c;
  const std::string s(scaling);
  TORCH_CHECK_VALUE(s == "default" || s == "deepseek_yarn" || s == "yarn",
                    "rope_table: scaling = '", s, "'; expected 'default' or 'deepseek_yarn'");
  c.scaling = s == "default" ? pcpkv::RopeScaling::kDefault : pcpkv::RopeScaling::kDeepseekYarn;
  c.theta = theta;
  c.factor = factor;
  c.original_max_position_embeddings = original_max_position_embeddings;
  c.beta_fast = beta_fast;
  c.beta_slow = beta_slow;
  c.mscale = mscale;
  c.mscale_all_dim = mscale_all_dim;
  // (num_positions < 1 is refused by make_rope_table: test_errors.py checks that pcpkv::Error path.)
  TORCH_CHECK_VALUE(num_positions <= kMaxRopeTablePositions, "rope_table: num_positions = ", num_positions,
                    " exceeds 2^28 (", kRopeTableRowBytes, " B of host memory per position)");
  // theta <= 0 or a NaN factor would give NaN rows, not an error (pcpkv::validate_rope names the value).
  translate_errors([&] { pcpkv::validate_rope(c, "rope_table", ""); });
  const pcpkv::RopeTable t = translate_errors([&] {
    try {
      return pcpkv::make_rope_table(c, num_positions);
    } catch (const std::bad_alloc&) {
      PCPKV_FAIL("rope_table: num_positions = {} needs {} B of host memory, which could not be allocated", num_positions,
                 num_positions * kRopeTableRowBytes);
    }
  });
  at::Tensor out = at::empty({t.num_positions, pcpkv::kRopeDim}, at::kFloat);
  std::memcpy(out.data_ptr(), t.cos_sin.data(), t.cos_sin.size() * sizeof(float));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) { m.impl("rope_table", &rope_table); }

}  // namespace pcpkv_torch
