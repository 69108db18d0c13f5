// src/serving/kernels/cpu/allreduce_reference.cpp: the oracle of the all-reduce and its fused residual-add + RMSNorm
// (pcpkv/serving/allreduce.h, SPEC section 7), validation and the work split (the capability agreement across
// ranks: src/serving/drivers/allreduce_agreement.cpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/device/token_math.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {

const char* to_string(AllReduceAlgo a) {
  switch (a) {
    case AllReduceAlgo::kAuto: return "auto";
    case AllReduceAlgo::kOneShot: return "oneshot";
    case AllReduceAlgo::kTwoShot: return "twoshot";
  }
  return "?";
}

AllReduceAlgo parse_allreduce_algo(const std::string& s) {
  if (s == "auto") return AllReduceAlgo::kAuto;
  if (s == "oneshot") return AllReduceAlgo::kOneShot;
  if (s == "twoshot") return AllReduceAlgo::kTwoShot;
  PCPKV_FAIL("all-reduce algorithm: '{}' is not one of auto, oneshot, twoshot", clip(s));
}

int32_t allreduce_num_blocks(const AllReducePartition& p, int32_t max_blocks) {
  PCPKV_CHECK(max_blocks >= 1, "all-reduce: max_blocks = {} must be >= 1", max_blocks);
  int64_t most = 1;
  for (int32_t q = 0; q < p.num_segments; ++q) most = std::max(most, p.num_chunks(q));
  return static_cast<int32_t>(std::min<int64_t>({most, max_blocks, kAllReduceMaxBlocks}));
}

void validate_allreduce(int32_t world_size, int32_t rank, const AllReduceLayout& layout, int64_t num_elems,
                        bool fused, const AllReduceNorm& norm) {
  PCPKV_CHECK(world_size >= 1 && world_size <= kAllReduceMaxRanks, "all-reduce: world_size = {} is outside [1, {}]",
              world_size, kAllReduceMaxRanks);
  PCPKV_CHECK(rank >= 0 && rank < world_size, "all-reduce: rank = {} is outside [0, world_size = {})", rank,
              world_size);
  PCPKV_CHECK(num_elems >= 0 && num_elems % 8 == 0, "all-reduce: num_elems = {} must be a multiple of 8 (16 bytes)",
              num_elems);
  PCPKV_CHECK(num_elems <= layout.max_elems, "all-reduce: num_elems = {} exceeds the workspace's max_elems = {}",
              num_elems, layout.max_elems);
  if (fused) {
    PCPKV_CHECK(norm.hidden > 0 && norm.hidden % 8 == 0 && norm.hidden <= kAllReduceMaxHidden,
                "all-reduce: hidden = {} must be a positive multiple of 8, <= {}", norm.hidden, kAllReduceMaxHidden);
    PCPKV_CHECK(num_elems % norm.hidden == 0, "all-reduce: num_elems = {} is not a whole number of rows of hidden = {}",
                num_elems, norm.hidden);
    PCPKV_CHECK(norm.weight != nullptr, "all-reduce: null norm weight");
    PCPKV_CHECK(norm.eps > 0.0f, "all-reduce: eps = {} must be > 0", norm.eps);
  }
}

void allreduce_reference(const std::vector<const uint16_t*>& inputs, int64_t n, uint16_t* out) {
  PCPKV_CHECK(!inputs.empty(), "all-reduce: no inputs");
  for (int64_t i = 0; i < n; ++i) {
    float acc = codec::bf16_to_float(inputs[0][i]);
    for (size_t r = 1; r < inputs.size(); ++r) acc = fp32::add(acc, codec::bf16_to_float(inputs[r][i]));
    out[i] = codec::float_to_bf16(acc);
  }
}

void allreduce_rmsnorm_reference(const std::vector<const uint16_t*>& inputs, int64_t num_tokens,
                                 const AllReduceNorm& norm, const uint16_t* residual_in, uint16_t* residual_out,
                                 uint16_t* y) {
  PCPKV_CHECK(norm.hidden > 0 && norm.hidden % 8 == 0 && norm.hidden <= kAllReduceMaxHidden,
              "all-reduce: hidden = {} must be a positive multiple of 8, <= {}", norm.hidden, kAllReduceMaxHidden);
  const int64_t H = norm.hidden;
  std::vector<uint16_t> reduced(static_cast<size_t>(H));
  std::vector<float> r(static_cast<size_t>(H));
  std::vector<float> leaves(1024);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<const uint16_t*> row_in;
    for (const uint16_t* p : inputs) row_in.push_back(p + t * H);
    allreduce_reference(row_in, H, reduced.data());
    for (int64_t k = 0; k < H; ++k) {
      const uint16_t res =
          codec::float_to_bf16(fp32::add(codec::bf16_to_float(reduced[k]), codec::bf16_to_float(residual_in[t * H + k])));
      residual_out[t * H + k] = res;
      r[k] = codec::bf16_to_float(res);
    }
    const int m = static_cast<int>(H / math::kLeaf);
    for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sumsq(r.data() + j * math::kLeaf);
    const float inv = math::rms_inv(math::pairwise_sum(leaves.data(), m), static_cast<int>(H), norm.eps);
    for (int64_t k = 0; k < H; ++k) y[t * H + k] = codec::float_to_bf16(math::rms_apply(r[k], inv, norm.weight[k]));
  }
}

}  // namespace pcpkv
