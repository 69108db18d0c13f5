// python/csrc/plan.cpp: torch.ops.pcpkv.make_plan (schema: registry.cpp; docstring: pcpkv_torch/plan.py), host-only:
// pcpkv::make_plan (pcpkv/core/plan.h) as tensors, one row per rank; and torch.ops.pcpkv.block_size_problem, the
// CLI's --block-size rule (pcpkv/core/block_size.h) for the Python entries that take a block_size.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "pcpkv/core/block_size.h"
#include "pcpkv/core/plan.h"

namespace pcpkv_torch {
namespace {

template <class T>
at::Tensor to_tensor(const std::vector<T>& v, at::ScalarType dtype = at::kLong) {
  at::Tensor out = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<int64_t>(v[i]);
  return dtype == at::kLong ? out : out.to(dtype);
}

using PlanTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor, at::Tensor, int64_t, at::Tensor>;

PlanTuple make_plan(int64_t pcp_world, int64_t block_size, at::IntArrayRef is_decode, at::IntArrayRef num_new_tokens,
                    at::IntArrayRef context_lens, int64_t extra_blocks, bool reserve_null_block, bool shuffle_blocks,
                    int64_t seed, c10::string_view local_order, c10::string_view decode_ownership) {
  TORCH_CHECK_VALUE(is_decode.size() == num_new_tokens.size() && context_lens.size() == num_new_tokens.size(),
                    "make_plan: is_decode (", is_decode.size(), "), num_new_tokens (", num_new_tokens.size(),
                    ") and context_lens (", context_lens.size(), ") must have one entry per request");
  // PlanConfig holds them as int32: checked before the cast (2^32 + 2 ranks was a plan of 2 that said 2^32 + 2).
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"pcp_world", pcp_world}, {"block_size", block_size}})
    TORCH_CHECK_VALUE(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                      "make_plan: ", name, " = ", v, " is out of the int32 range of a plan");
  // Here, before the plan: a block_size of 1 or 2 made a plan whose caches the cache table refused later, naming
  // neither make_plan nor block_size (the library's plan does not know of the indexer-K cache's alignment). Named as
  // the plan's own refusals name it (the Python argument, then the CLI's flag).
  if (const auto why = pcpkv::block_size_problem(block_size))
    TORCH_CHECK_VALUE(false, "make_plan: block_size (--block-size) = ", block_size, " ", *why);
  pcpkv::PlanConfig cfg;
  cfg.pcp_world = static_cast<int32_t>(pcp_world);
  cfg.block_size = static_cast<int32_t>(block_size);
  cfg.extra_blocks = extra_blocks;
  cfg.reserve_null_block = reserve_null_block;
  cfg.shuffle_blocks = shuffle_blocks;
  cfg.seed = static_cast<uint64_t>(seed);
  translate_errors([&] {
    cfg.local_order = pcpkv::parse_local_order(std::string(local_order), "local_order");
    cfg.decode_ownership = pcpkv::parse_decode_ownership(std::string(decode_ownership), "decode_ownership");
  });
  for (size_t i = 0; i < num_new_tokens.size(); ++i) {
    pcpkv::RequestSpec r;
    r.kind = is_decode[i] ? pcpkv::RequestKind::kDecode : pcpkv::RequestKind::kPrefill;
    r.num_new_tokens = num_new_tokens[i];
    r.context_len = context_lens[i];
    cfg.requests.push_back(r);
  }
  const pcpkv::PcpPlan plan = translate_errors([&] { return pcpkv::make_plan(cfg); });
  const int64_t P = plan.pcp_world, M = plan.max_local_tokens;
  at::Tensor positions = at::empty({P, M}, at::kLong), slots = at::empty({P, M}, at::kLong),
             global_index = at::empty({P, M}, at::kLong), counts = at::empty({P, 3}, at::kLong);
  for (int64_t r = 0; r < P; ++r) {
    const pcpkv::RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
    std::memcpy(positions[r].data_ptr(), rp.positions.data(), static_cast<size_t>(M) * 8);
    std::memcpy(slots[r].data_ptr(), rp.slot_mapping.data(), static_cast<size_t>(M) * 8);
    std::memcpy(global_index[r].data_ptr(), rp.global_index.data(), static_cast<size_t>(M) * 8);
    int64_t* c = counts[r].data_ptr<int64_t>();
    c[0] = rp.num_local_tokens;
    c[1] = rp.num_prefill_tokens;
    c[2] = rp.num_decode_tokens;
  }
  size_t max_blocks = 0;
  for (const auto& bt : plan.block_tables) max_blocks = std::max(max_blocks, bt.size());
  at::Tensor tables = at::full({static_cast<int64_t>(plan.block_tables.size()), static_cast<int64_t>(max_blocks)}, -1,
                               at::kInt);
  for (size_t i = 0; i < plan.block_tables.size(); ++i)
    std::copy(plan.block_tables[i].begin(), plan.block_tables[i].end(),
              tables[static_cast<int64_t>(i)].data_ptr<int32_t>());
  return {positions,
          slots,
          global_index,
          counts,
          to_tensor(plan.gathered_slot_mapping),
          to_tensor(plan.global_positions),
          to_tensor(plan.global_slots),
          to_tensor(plan.global_request),
          tables,
          plan.num_blocks,
          to_tensor(plan.decode_owner)};
}

/// pcpkv::block_size_problem's text, or "" when block_size can be a paged cache's (pcpkv_torch.layout.check_block_size
/// names the caller's argument).
std::string block_size_problem(int64_t block_size) { return pcpkv::block_size_problem(block_size).value_or(""); }

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) {
  m.impl("make_plan", &make_plan);
  m.impl("block_size_problem", &block_size_problem);
}

}  // namespace pcpkv_torch
