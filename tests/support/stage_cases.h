// tests/support/stage_cases.h: the layers on which every publication driver's stage names and bytes are checked
// against the transport tables (indexer layer with and without a top-k buffer, shared layer), for the CPU and
// CUDA tiers alike.
#pragma once

#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "support/publish_case.h"

namespace pcpkv::test {

struct LayerCase {
  const char* what;
  bool indexer;
  int64_t topk_width;
};

inline auto layer_cases() {
  return ::testing::Values(LayerCase{"indexer+topk", true, 16}, LayerCase{"indexer", true, 0},
                           LayerCase{"shared", false, 16});
}
inline std::string layer_case_name(const ::testing::TestParamInfo<LayerCase>& i) {
  return std::string(i.param.indexer ? "Indexer" : "Shared") + (i.param.topk_width > 0 ? "Topk" : "");
}

/// PCP 3 with uneven ranks (padding rows) and a decode, on the layer of `lc`.
inline CaseSpec stage_case_spec(const LayerCase& lc) {
  CaseSpec spec;
  spec.pcp = 3;
  spec.requests = {{RequestKind::kPrefill, 31, 0}, {RequestKind::kDecode, 1, 9}};
  spec.fmt.has_indexer = lc.indexer;
  spec.topk_width = lc.topk_width;
  return spec;
}

}  // namespace pcpkv::test
