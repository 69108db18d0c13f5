// pcpkv-test-labels: unit
// The transport tables (src/publish/drivers/transport_table.h): each transport's steps and stage names, which steps a
// publication runs, and that the CPU backend reports exactly the table's stage names and byte model for every
// transport on indexer layers (with and without a top-k buffer) and shared layers. The per-process CPU
// publisher is checked against the same names in tests/publish/publish_cpu.cpp, the CUDA drivers in
// tests/publish/test_publish_stage_names.cpp.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/publish/backend.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"
#include "support/publish_case.h"
#include "support/stage_cases.h"

namespace pcpkv {
namespace {

using test::CaseSpec;
using test::make_case;
using Names = std::vector<std::string>;

constexpr Transport kTransports[] = {Transport::kCollect, Transport::kStaging, Transport::kDirect};

Names table_names(Transport t) {
  Names out;
  for (const Step& s : transport_table(t)) out.emplace_back(s.name);
  return out;
}

TEST(TransportTable, StepsAndNamesPerTransport) {
  EXPECT_EQ(table_names(Transport::kCollect), (Names{"topk-fill", "dispatch", "all-gather", "insert"}));
  EXPECT_EQ(table_names(Transport::kStaging), (Names{"topk-fill", "dispatch", "fence", "combine"}));
  EXPECT_EQ(table_names(Transport::kDirect), (Names{"topk-fill", "dispatch", "fence"}));
  // Each transport has exactly one dispatch, and it is the one that fills its destinations.
  const Op dispatch_of[] = {Op::kDispatchMaterialize, Op::kDispatchStage, Op::kDispatchDirect};
  for (int i = 0; i < 3; ++i) EXPECT_EQ(transport_table(kTransports[i])[1].op, dispatch_of[i]);
  EXPECT_THROW(transport_table(static_cast<Transport>(7)), Error);
}

TEST(TransportTable, TopkFillStepOnlyWhenItIsItsOwnStep) {
  CaseSpec spec;
  spec.topk_width = 16;
  auto with_topk = make_case(spec);
  const PublishLayout l = make_publish_layout(with_topk->setup);
  ASSERT_TRUE(l.fill_topk);
  EXPECT_EQ(stage_names(Transport::kDirect, l, false), (Names{"topk-fill", "dispatch", "fence"}));
  EXPECT_EQ(stage_names(Transport::kDirect, l, true), (Names{"dispatch", "fence"}));
  spec.topk_width = 0;
  auto no_topk = make_case(spec);
  EXPECT_EQ(stage_names(Transport::kCollect, make_publish_layout(no_topk->setup), false),
            (Names{"dispatch", "all-gather", "insert"}));
  EXPECT_TRUE(uses(steps(Transport::kStaging, l, false), Op::kCombine));
  EXPECT_FALSE(uses(steps(Transport::kDirect, l, false), Op::kCombine));
}

TEST(TransportTable, FusedFillMovesItsBytesIntoTheDispatch) {
  CaseSpec spec;
  spec.pcp = 3;
  spec.topk_width = 32;
  auto c = make_case(spec);
  const PublishLayout l = make_publish_layout(c->setup);
  for (Transport t : kTransports) {
    int64_t separate = 0, fused = 0;
    const ByteModel ms = make_byte_model(c->setup, l, false), mf = make_byte_model(c->setup, l, true);
    for (const Step& s : steps(t, l, false)) separate += step_bytes_all_ranks(s, ms);
    for (const Step& s : steps(t, l, true)) fused += step_bytes_all_ranks(s, mf);
    EXPECT_EQ(separate, fused) << to_string(t);
    EXPECT_EQ(step_bytes_all_ranks(transport_table(t)[0], ms), 3 * c->plan.max_local_tokens * 32 * 4)
        << to_string(t);
  }
}

using test::LayerCase;

class CpuBackendStages : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CpuBackendStages, ReportExactlyTheTablesNamesAndBytes) {
  const LayerCase lc = GetParam();
  auto c = make_case(test::stage_case_spec(lc));
  const PublishLayout l = make_publish_layout(c->setup);
  const ByteModel model = make_byte_model(c->setup, l, false);
  auto backend = make_cpu_backend(2);
  for (Transport t : kTransports) {
    const PublishResult r = backend->publish(c->setup, c->inputs, t);
    const std::vector<Step> steps = pcpkv::steps(t, l, false);
    ASSERT_EQ(r.profile.stages.size(), steps.size()) << lc.what << " " << to_string(t);
    for (size_t k = 0; k < steps.size(); ++k) {
      EXPECT_EQ(r.profile.stages[k].name, steps[k].name) << lc.what << " " << to_string(t) << " stage " << k;
      EXPECT_EQ(r.profile.stages[k].bytes, step_bytes_all_ranks(steps[k], model))
          << lc.what << " " << to_string(t) << " " << steps[k].name;
      EXPECT_GT(r.profile.stages[k].bytes, 0) << lc.what << " " << to_string(t) << " " << steps[k].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, CpuBackendStages, test::layer_cases(), test::layer_case_name);

}  // namespace
}  // namespace pcpkv
