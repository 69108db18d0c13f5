// pcpkv-test-labels: unit
// End to end on the CPU (attention_check.h): PCP-P publication, every rank serves its local tokens on its
// own replica, gathered outputs == one-rank outputs byte for byte; DCP shards + LSE merge within the
// bound. Small batches: prefill + decode mixed, uneven ranks, context already cached.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"

namespace pcpkv {
namespace {

AttentionCheckConfig small_config(int32_t pcp, KvFormat kv = KvFormat::kFp8DsMla) {
  AttentionCheckConfig c;
  c.plan.pcp_world = pcp;
  c.plan.block_size = 16;
  c.plan.seed = 5;
  c.plan.requests = {{RequestKind::kPrefill, 37, 0},   // uneven over 2P chunks
                     {RequestKind::kDecode, 1, 29},
                     {RequestKind::kPrefill, 13, 20},  // chunked prefill: 20 cached positions
                     {RequestKind::kDecode, 1, 45}};
  c.fmt.kv_format = kv;
  c.fmt.k_scale = 1.0f / 24.0f;
  c.topk = 24;  // below most lengths: the selection matters
  c.seed = 3;
  return c;
}

void expect_pass(const AttentionCheckReport& r) {
  EXPECT_TRUE(r.passed()) << r.describe();
  EXPECT_EQ(r.topk_rows_diff, 0);
  EXPECT_EQ(r.out_bytes_diff, 0);
  EXPECT_EQ(r.lse_bytes_diff, 0);
  EXPECT_EQ(r.decode_copies_diff, 0);
  EXPECT_EQ(r.padding_rows_bad, 0);
}

class ConsumersE2e : public ::testing::TestWithParam<int32_t> {};

TEST_P(ConsumersE2e, PcpEqualsOneRankByteForByte) {
  const ModelConfig model = preset("glm-5");
  auto cpu = make_cpu_backend(2);
  auto consumers = make_cpu_consumers();
  AttentionCheckConfig c = small_config(GetParam());
  c.check_reference = GetParam() == 2;  // the reference check does not depend on P: once is enough
  c.dcp_world = 1;
  const AttentionCheckReport r = run_attention_check(c, model, *cpu, *consumers);
  expect_pass(r);
  EXPECT_EQ(r.num_tokens, 37 + 1 + 13 + 1);
  EXPECT_EQ(r.num_context_rows, 29 + 20 + 45);
}

INSTANTIATE_TEST_SUITE_P(Pcp, ConsumersE2e, ::testing::Values(1, 2, 4, 8), ::testing::PrintToStringParamName());

TEST(ConsumersE2eFormats, EveryFormatAndTransport) {
  const ModelConfig model = preset("deepseek-v3.2");
  auto cpu = make_cpu_backend(2);
  auto consumers = make_cpu_consumers();
  const std::vector<std::pair<KvFormat, Transport>> cases = {{KvFormat::kBf16, Transport::kCollect},
                                                              {KvFormat::kFp8, Transport::kStaging},
                                                              {KvFormat::kFp8DsMla, Transport::kDirect}};
  for (const auto& [kv, tr] : cases) {
    AttentionCheckConfig c = small_config(4, kv);
    c.plan.requests = {{RequestKind::kPrefill, 21, 0}, {RequestKind::kDecode, 1, 17}};
    c.transport = tr;
    c.check_reference = false;
    c.dcp_world = 1;
    const AttentionCheckReport r = run_attention_check(c, model, *cpu, *consumers);
    SCOPED_TRACE(fmt::format("{} / {}", to_string(kv), to_string(tr)));
    expect_pass(r);
  }
}

TEST(ConsumersE2eDcp, ShardsPlusLseMergeMatchOneRank) {
  const ModelConfig model = preset("glm-5");
  auto cpu = make_cpu_backend(2);
  auto consumers = make_cpu_consumers();
  for (const auto& [dcp, interleave] : std::vector<std::pair<int, int>>{{2, 1}, {3, 4}, {4, 16}}) {
    AttentionCheckConfig c = small_config(2);
    c.dcp_world = dcp;
    c.dcp_interleave = interleave;
    const AttentionCheckReport r = run_attention_check(c, model, *cpu, *consumers);
    SCOPED_TRACE(fmt::format("dcp {} interleave {}", dcp, interleave));
    std::fputs(r.describe().c_str(), stdout);  // the max err / bound ratios, for the record
    expect_pass(r);
    EXPECT_TRUE(r.dcp_checked);
    EXPECT_EQ(r.dcp_over_bound, 0);
    EXPECT_LE(r.dcp_max_ratio, 1.0);
    if (interleave == 16) {
      EXPECT_GT(r.dcp_empty_shard_rows, 0);  // early tokens have keys on shard 0 only
    }
  }
}

/// Consumers that corrupt one bit of one rank's attention output: the check must catch it.
class FaultyConsumers final : public ConsumerKernels {
 public:
  explicit FaultyConsumers(int bad_call) : inner_(make_cpu_consumers()), bad_call_(bad_call) {}
  std::string name() const override { return "faulty"; }
  void indexer(const IndexerParams& p) override { inner_->indexer(p); }
  void sparse_mla(const SparseMlaParams& p) override {
    inner_->sparse_mla(p);
    if (call_++ == bad_call_) {
      for (int64_t i = 0; i < p.num_tokens * p.topk; ++i)
        if (p.indices[i] >= 0) {  // a real token's output
          const int64_t t = i / p.topk;
          uint32_t u;
          std::memcpy(&u, &p.out[t * p.num_heads * 512 + 100], 4);
          u ^= 1u;
          std::memcpy(&p.out[t * p.num_heads * 512 + 100], &u, 4);
          break;
        }
    }
  }
  void lse_merge(const LseMergeParams& p) override { inner_->lse_merge(p); }

 private:
  std::unique_ptr<ConsumerKernels> inner_;
  int bad_call_, call_ = 0;
};

TEST(ConsumersE2eNegative, OneFlippedBitOnOneRankIsCaught) {
  const ModelConfig model = preset("glm-5");
  auto cpu = make_cpu_backend(2);
  FaultyConsumers faulty(2);  // call 0: the one-rank run; 1..: the PCP ranks
  AttentionCheckConfig c = small_config(4);
  c.check_reference = false;
  c.dcp_world = 1;
  const AttentionCheckReport r = run_attention_check(c, model, *cpu, faulty);
  EXPECT_FALSE(r.passed());
  EXPECT_EQ(r.out_bytes_diff + r.decode_copies_diff, 1) << r.describe();
  EXPECT_FALSE(r.first_problem.empty());
}

TEST(ConsumersE2eNegative, BadConfigThrows) {
  const ModelConfig model = preset("glm-5");
  auto cpu = make_cpu_backend(1);
  auto consumers = make_cpu_consumers();
  AttentionCheckConfig c = small_config(2);
  c.fmt.has_indexer = false;
  EXPECT_THROW(run_attention_check(c, model, *cpu, *consumers), Error);
  c = small_config(2);
  c.topk = 0;
  EXPECT_THROW(run_attention_check(c, model, *cpu, *consumers), Error);
  c = small_config(2);
  c.dcp_interleave = 0;
  EXPECT_THROW(run_attention_check(c, model, *cpu, *consumers), Error);
}

}  // namespace
}  // namespace pcpkv
