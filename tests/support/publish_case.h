// tests/support/publish_case.h: one layer's publication case (model, plan, inputs, setup) and comparisons of
// published caches with messages that name the slot and field of the first differing byte.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/plan.h"

namespace pcpkv::test {

struct CaseSpec {
  std::string model = "glm-5";      // preset name
  int32_t pcp = 2;
  int32_t block_size = 16;
  std::vector<RequestSpec> requests = {{RequestKind::kPrefill, 26, 0}};
  int64_t extra_blocks = 1;         // unwritten blocks: their bytes must stay kGuardByte
  CacheFormat fmt;                  // default: fp8_ds_mla pow2 with an indexer
  AllocationOptions alloc;
  int64_t topk_width = 0;
  TopkFill topk_fill = TopkFill::kFull;  // PublishSetup::topk_fill_mode
  uint64_t seed = 1;                // plan and inputs
  LocalOrder local_order = LocalOrder::kRequest;
  DecodeOwnership decode_ownership = DecodeOwnership::kReplicated;
};

/// Owns everything a PublishSetup points to (so it is neither copied nor moved).
struct PublishCase {
  ModelConfig model;
  PcpPlan plan;
  GlobalInputs inputs;
  PublishSetup setup;
  PublishCase() = default;
  PublishCase(const PublishCase&) = delete;
  PublishCase& operator=(const PublishCase&) = delete;
};
std::unique_ptr<PublishCase> make_case(const CaseSpec& spec);

/// "slot 17 (block 1 row 1) kv_c byte 5", "guard/base offset", "padding of block 2", ... for a byte offset
/// within a replica's MLA / indexer allocation.
std::string describe_mla_offset(const PublishResult& r, const CacheFormat& fmt, int64_t alloc_offset);
std::string describe_index_offset(const PublishResult& r, int64_t alloc_offset);

/// Every replica's MLA and indexer allocation of `actual` equals that of `expected`, byte for byte
/// (same rank count and geometry).
::testing::AssertionResult same_caches(const PublishResult& expected, const PublishResult& actual,
                                       const CacheFormat& fmt, const std::string& what);
/// Every replica equals replica 0.
::testing::AssertionResult replicas_identical(const PublishResult& r, const CacheFormat& fmt);
/// For every slot the plan writes, the MLA row and indexer slot of a's replica ra equal b's replica rb
/// (a and b may have different geometries or rank counts, e.g. a PCP-1 reference of the same requests).
::testing::AssertionResult same_rows(const PublishResult& a, int32_t ra, const PublishResult& b, int32_t rb,
                                     const PcpPlan& plan, const CacheFormat& fmt, const std::string& what);
/// check_untouched() for every rank.
::testing::AssertionResult all_untouched(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt);

}  // namespace pcpkv::test
