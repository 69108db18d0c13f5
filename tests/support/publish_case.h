// tests/support/publish_case.h: one layer's publication case (model, plan, inputs, setup), and the checks of
// pcpkv/publish/checks.h (the ones `pcpkv run` and `pcpkv mp-publish` apply) as gtest assertions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/plan.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"

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
  bool own_index_blocks = false;    // PlanConfig: the indexer cache at its own slots (docs/spec.md 4.2)
  int64_t index_extra_blocks = 0;
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

/// A check of pcpkv/publish/checks.h as a gtest assertion: success when it passed, else
/// "<what>: <check name> [<transport>]: <detail>", the detail naming the first differing byte (rank or
/// replica, slot, field, both values) and how many differ. Every comparison below is one of those checks.
::testing::AssertionResult passed(const Check& c, const std::string& what = {});

/// Every replica's MLA and indexer allocation of `actual` equals that of `expected`, byte for byte (same rank
/// count and geometry): check_replicas_vs_reference(actual, expected, fmt).
::testing::AssertionResult same_caches(const PublishResult& expected, const PublishResult& actual,
                                       const CacheFormat& fmt, const std::string& what);
/// same_caches, and every rank's q_c_out and top-k rows of `actual` equal `expected`'s (both hold the same
/// ranks of them, each of the same size): check_outputs_vs_reference per rank.
::testing::AssertionResult same_outputs(const PublishResult& expected, const PublishResult& actual,
                                        const CacheFormat& fmt, const std::string& what);
/// Every replica equals replica 0: check_replicas_identical.
::testing::AssertionResult replicas_identical(const PublishResult& r, const CacheFormat& fmt);
/// Every rank's bytes outside written rows are kGuardByte: check_guards.
::testing::AssertionResult all_untouched(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt);

}  // namespace pcpkv::test
