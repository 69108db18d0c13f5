// pcpkv-test-labels: multiproc
// One process per PCP rank on the CPU backend: every transport with 2, 4 and 8 processes, byte for byte
// against the single-process CPU reference (uneven ranks, guard bytes, padded strides, a nonzero offset),
// TP2 x PCP2 subgroups, a rank killed or stuck mid-run, and no leaked descriptor or mapping.
#include <gtest/gtest.h>

#include <cstring>

#include "support/fork_ranks.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/ranks/symmetric.h"
#include "pcpkv/publish/checks.h"

namespace pcpkv {
namespace {

using test::run_ranks;

// A batch with uneven local counts: a prefill of 13 * P + 3 tokens (13 or 14 per rank), a short prefill that
// leaves some ranks empty, and two decodes (rank 0 writes them).
PcpPlan make_test_plan(int32_t pcp, LocalOrder order = LocalOrder::kRequest,
                       DecodeOwnership own = DecodeOwnership::kReplicated) {
  PlanConfig c;
  c.pcp_world = pcp;
  c.local_order = order;
  c.decode_ownership = own;
  c.block_size = 16;
  c.requests = {{RequestKind::kPrefill, 13 * pcp + 3, 0},
                {RequestKind::kPrefill, 5, 100},
                {RequestKind::kDecode, 1, 50},
                {RequestKind::kDecode, 1, 7}};
  c.extra_blocks = 3;
  c.seed = 11;
  return make_plan(c);
}

struct Job {
  ModelConfig model;
  PcpPlan plan;
  GlobalInputs inputs;
  PublishSetup setup;
};

// `variant` 0: glm-5 fp8_ds_mla indexer layer with padded strides; 1: deepseek-v3.2 static fp8, shared
// layer (no indexer); 2: glm-5 bf16.
std::unique_ptr<Job> make_job(int32_t pcp, int variant, uint64_t seed, LocalOrder order = LocalOrder::kRequest,
                              DecodeOwnership own = DecodeOwnership::kReplicated) {
  auto j = std::make_unique<Job>();
  j->model = preset(variant == 1 ? "deepseek-v3.2" : "glm-5");
  j->plan = make_test_plan(pcp, order, own);
  j->setup.model = &j->model;
  j->setup.plan = &j->plan;
  j->setup.fmt.kv_format = variant == 0 ? KvFormat::kFp8DsMla : (variant == 1 ? KvFormat::kFp8 : KvFormat::kBf16);
  j->setup.fmt.k_scale = 0.0625f;
  j->setup.fmt.has_indexer = variant != 1;
  j->setup.alloc.guard_bytes = 256;
  j->setup.alloc.base_offset = 48;
  j->setup.alloc.mla_row_pad = variant == 0 ? 16 : 0;
  j->setup.alloc.mla_block_pad = variant == 0 ? 64 : 0;
  j->setup.alloc.index_block_pad = variant == 0 ? 32 : 0;
  j->setup.topk_width = 64;
  j->setup.layer_idx = static_cast<int32_t>(seed & 1);
  j->inputs = generate_inputs(j->model, j->plan, j->setup.fmt.has_indexer, seed);
  return j;
}

// Publishes in this process's PCP group and checks against the single-process CPU reference: every rank
// its own replica and local outputs; PCP rank 0 also every peer's replica, read through its mappings.
int publish_and_check(Bootstrap& group, const Job& job, Transport transport, const RankPublishOptions& opt) {
  auto pub = make_cpu_rank_publisher(group, job.setup, opt);
  const RankPublishResult mine = pub->publish(job.inputs, transport);
  group.barrier();
  const PublishResult ref = make_cpu_backend(1)->publish(job.setup, job.inputs, transport);
  const int32_t me = group.rank();
  RANK_CHECK(mine.mla_cache_offset == ref.mla_cache_offset && mine.index_cache_offset == ref.index_cache_offset,
             "offsets");
  ByteDiff d = compare_bytes(mine.mla_alloc, ref.mla_alloc[me]);
  RANK_CHECK(d.equal(), "rank {} MLA replica: {} bytes differ, first at {}", me, d.num_diff,
             describe_mla_byte(ref, job.setup.fmt, d.first_diff));
  d = compare_bytes(mine.index_alloc, ref.index_alloc[me]);
  RANK_CHECK(d.equal(), "rank {} indexer replica: {} bytes differ, first at {}", me, d.num_diff,
             describe_index_byte(ref, d.first_diff));
  if (job.setup.materialize_q) RANK_CHECK(mine.q_c_out == ref.q_c_out[me], "q_c_out of rank {}", me);
  RANK_CHECK(mine.topk == (ref.topk.empty() ? std::vector<int32_t>{} : ref.topk[me]), "topk of rank {}", me);
  // The reference wrote something: guard bytes alone would also compare equal.
  int64_t written = 0;
  for (size_t i = 0; i < mine.mla_alloc.size(); ++i) written += mine.mla_alloc[i] != kGuardByte;
  RANK_CHECK(written > job.plan.num_written_slots() * 100, "only {} bytes written", written);
  if (me == 0) {
    PublishResult got = ref;  // geometry and offsets as the reference; bytes from the replicas
    for (int32_t r = 0; r < group.world_size(); ++r) {
      got.mla_alloc[r] = pub->read_mla_alloc(r);
      got.index_alloc[r] = pub->read_index_alloc(r);
    }
    // The checks `pcpkv mp-publish` applies to the replicas it reads, and replicas identical.
    const CacheFormat& fmt = job.setup.fmt;
    for (const Check& c : {check_replicas_vs_reference(got, ref, fmt), check_replicas_identical(got, fmt),
                           check_guards(got, job.plan, fmt)})
      RANK_CHECK(c.pass, "replicas read by rank 0: {}: {}", c.name, c.detail);
  }
  // Stage profile: the transport table's stages, named as the single-process backend names them, with bytes.
  RANK_CHECK(mine.profile.stages.size() == ref.profile.stages.size(), "rank {}: {} stages, the reference {}", me,
             mine.profile.stages.size(), ref.profile.stages.size());
  for (size_t k = 0; k < ref.profile.stages.size(); ++k) {
    RANK_CHECK(mine.profile.stages[k].name == ref.profile.stages[k].name, "rank {} stage {}: '{}', the reference '{}'",
               me, k, mine.profile.stages[k].name, ref.profile.stages[k].name);
    RANK_CHECK(mine.profile.stages[k].bytes > 0, "rank {} stage {}: no bytes", me, mine.profile.stages[k].name);
  }
  // Each rank reports its share of the byte model: the shares sum to the single-process backend's bytes.
  const size_t S = ref.profile.stages.size();
  std::vector<int64_t> my_bytes(S), all_bytes(S * static_cast<size_t>(group.world_size()));
  for (size_t k = 0; k < S; ++k) my_bytes[k] = mine.profile.stages[k].bytes;
  group.all_gather(my_bytes.data(), S * sizeof(int64_t), all_bytes.data());
  for (size_t k = 0; k < S; ++k) {
    int64_t sum = 0;
    for (int32_t r = 0; r < group.world_size(); ++r) sum += all_bytes[static_cast<size_t>(r) * S + k];
    RANK_CHECK(sum == ref.profile.stages[k].bytes, "stage {}: ranks' bytes sum to {}, the reference counts {}",
               ref.profile.stages[k].name, sum, ref.profile.stages[k].bytes);
  }
  group.barrier();  // peers keep their mappings until rank 0 has read them
  return 0;
}

struct Case {
  int nproc;
  Transport transport;
  int variant;
};
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return fmt::format("P{}_{}_v{}", i.param.nproc, to_string(i.param.transport), i.param.variant);
}

class PublishCpu : public ::testing::TestWithParam<Case> {};

TEST_P(PublishCpu, ByteIdenticalToSingleProcessReference) {
  const Case c = GetParam();
  const auto out = run_ranks(c.nproc, [c](const BootstrapConfig& bc) {
    auto boot = Bootstrap::connect(bc);
    auto job = make_job(bc.world_size, c.variant, 1234 + c.variant);
    return publish_and_check(*boot, *job, c.transport, {});
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, PublishCpu,
    ::testing::Values(Case{2, Transport::kCollect, 0}, Case{2, Transport::kStaging, 0}, Case{2, Transport::kDirect, 0},
                      Case{4, Transport::kCollect, 0}, Case{4, Transport::kStaging, 0}, Case{4, Transport::kDirect, 0},
                      Case{8, Transport::kCollect, 0}, Case{8, Transport::kStaging, 0}, Case{8, Transport::kDirect, 0},
                      Case{4, Transport::kStaging, 1}, Case{4, Transport::kDirect, 1}, Case{4, Transport::kCollect, 1},
                      Case{2, Transport::kDirect, 2}, Case{2, Transport::kStaging, 2}),
    case_name);

// Plan modes (SPEC section 4.1) with one process per rank: vLLM's local order and round-robin decode owners
// (3 ranks, 2 decodes: rank 2 owns none) publish the bytes of the single-process reference of the same plan,
// which tests/core/test_plan_modes.cpp shows equal to the default modes' bytes.
TEST(PublishCpuMultiproc, LocalOrderAndRoundRobinDecodes) {
  for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) {
    const auto out = run_ranks(3, [t](const BootstrapConfig& bc) {
      auto boot = Bootstrap::connect(bc);
      auto job = make_job(bc.world_size, 0, 77, LocalOrder::kLocal, DecodeOwnership::kRoundRobin);
      RANK_CHECK(job->plan.ranks[2].num_decode_tokens == 0 && job->plan.ranks[1].num_decode_tokens == 1,
                 "round robin: decode counts per rank");
      return publish_and_check(*boot, *job, t, {});
    });
    EXPECT_TRUE(test::all_ok(out)) << to_string(t) << ": " << test::describe(out);
  }
}

TEST(PublishCpuMultiproc, RepeatedPublicationsReuseSymmetricMemory) {
  // Several publications (every transport, then again, with repeats) on one publisher: each starts from
  // poisoned replicas and ends byte-identical to the reference.
  const auto out = run_ranks(4, [](const BootstrapConfig& bc) {
    auto boot = Bootstrap::connect(bc);
    auto job = make_job(4, 0, 99);
    job->setup.repeats = 3;
    auto pub = make_cpu_rank_publisher(*boot, job->setup);
    auto ref_backend = make_cpu_backend(1);
    for (Transport t : {Transport::kDirect, Transport::kStaging, Transport::kCollect, Transport::kDirect}) {
      const RankPublishResult r = pub->publish(job->inputs, t);
      const PublishResult ref = ref_backend->publish(job->setup, job->inputs, t);
      RANK_CHECK(r.mla_alloc == ref.mla_alloc[bc.rank], "{}: MLA replica differs", to_string(t));
      RANK_CHECK(r.index_alloc == ref.index_alloc[bc.rank], "{}: indexer replica differs", to_string(t));
    }
    boot->barrier();
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

TEST(PublishCpuMultiproc, Tp2Pcp2PublicationStaysInsideEachPcpGroup) {
  // Groups {0,1} and {2,3} publish different inputs (seed per group) at the same time. Each group's
  // replicas equal its own reference byte for byte (a write from the other group would break that), and
  // the two groups' replicas differ.
  const auto out = run_ranks(4, [](const BootstrapConfig& bc) {
    auto world = Bootstrap::connect(bc);
    const GroupLayout layout = GroupLayout::make(4, 2);
    RANK_CHECK(layout.pcp_size == 2 && layout.pcp_group_members(1) == (std::vector<int32_t>{2, 3}), "layout");
    auto group = make_pcp_group(*world, layout);
    const int32_t g = layout.pcp_group_of(bc.rank);
    RANK_CHECK(group->rank() == layout.pcp_rank_of(bc.rank) && group->world_size() == 2, "group rank");
    auto job = make_job(2, 0, 500 + g);
    RankPublishOptions opt;
    opt.global_ranks = layout.pcp_group_members(g);
    for (Transport t : {Transport::kDirect, Transport::kStaging, Transport::kCollect})
      if (int rc = publish_and_check(*group, *job, t, opt); rc != 0) return rc;
    // Cross-group: replicas of the two groups differ (different inputs), so the byte checks above would
    // have seen a write that crossed groups.
    auto pub = make_cpu_rank_publisher(*group, job->setup, opt);
    const RankPublishResult r = pub->publish(job->inputs, Transport::kDirect);
    std::vector<uint8_t> all(2 * r.mla_alloc.size());
    if (group->rank() == 0) {
      auto pair = world->split(0, g);  // ranks 0 and 2
      pair->all_gather(r.mla_alloc.data(), r.mla_alloc.size(), all.data());
      RANK_CHECK(std::memcmp(all.data(), all.data() + r.mla_alloc.size(), r.mla_alloc.size()) != 0,
                 "the two PCP groups hold identical replicas");
    } else {
      world->split(-1, 0);
    }
    world->barrier();
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

TEST(PublishCpuMultiproc, KilledRankIsReportedByEveryOtherRank) {
  // Rank 2 SIGKILLs itself after its dispatch, before the fence. The others must report rank 2 and fail
  // well within the fence timeout (they notice the process is gone).
  constexpr int64_t kTimeoutMs = 20000;
  const auto out = run_ranks(
      4,
      [](const BootstrapConfig& bc) {
        auto boot = Bootstrap::connect(bc);
        auto job = make_job(4, 0, 7);
        RankPublishOptions opt;
        opt.kill_pcp_rank = 2;
        opt.fence_timeout_ms = kTimeoutMs;
        auto pub = make_cpu_rank_publisher(*boot, job->setup, opt);
        try {
          pub->publish(job->inputs, Transport::kDirect);
        } catch (const FenceTimeout& e) {
          std::printf("FenceTimeout missing_rank=%d: %s\n", e.missing_rank(), e.what());
          return 4;
        }
        return 0;
      },
      60.0, 60.0);
  EXPECT_EQ(out[2].signal, SIGKILL) << test::describe(out);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(out[r].exit_code, 4) << test::describe(out);
    EXPECT_NE(out[r].output.find("missing_rank=2"), std::string::npos) << out[r].output;
    EXPECT_NE(out[r].output.find("rank 2 (pid"), std::string::npos) << out[r].output;
    EXPECT_NE(out[r].output.find("is gone (exited or killed)"), std::string::npos) << out[r].output;
    EXPECT_LT(out[r].seconds, kTimeoutMs / 1000.0) << out[r].output;
  }
}

TEST(PublishCpuMultiproc, StuckRankTimesOutNamingIt) {
  // Rank 1 is alive but never arrives (it sleeps instead of publishing): the others give up after the
  // fence timeout and name it.
  const auto out = run_ranks(
      3,
      [](const BootstrapConfig& bc) {
        auto boot = Bootstrap::connect(bc);
        auto job = make_job(3, 0, 8);
        RankPublishOptions opt;
        opt.fence_timeout_ms = 1000;
        auto pub = make_cpu_rank_publisher(*boot, job->setup, opt);
        if (bc.rank == 1) {
          ::sleep(5);
          return 0;
        }
        try {
          pub->publish(job->inputs, Transport::kDirect);  // direct: no collective allocation on first use
        } catch (const FenceTimeout& e) {
          std::printf("FenceTimeout missing_rank=%d: %s\n", e.missing_rank(), e.what());
          return 4;
        }
        return 0;
      },
      30.0, 60.0);
  for (int r : {0, 2}) {
    EXPECT_EQ(out[r].exit_code, 4) << test::describe(out);
    EXPECT_NE(out[r].output.find("missing_rank=1"), std::string::npos) << out[r].output;
    EXPECT_NE(out[r].output.find("never arrived"), std::string::npos) << out[r].output;
    EXPECT_LT(out[r].seconds, 4.5) << out[r].output;
  }
}

TEST(PublishCpuMultiproc, NoLeakedDescriptorsOrMappings) {
  const auto out = run_ranks(4, [](const BootstrapConfig& bc) {
    const ResourceCounts before = count_process_resources();
    {
      auto boot = Bootstrap::connect(bc);
      auto job = make_job(4, 0, 3);
      const ResourceCounts connected = count_process_resources();
      for (int round = 0; round < 2; ++round) {
        auto pub = make_cpu_rank_publisher(*boot, job->setup);
        for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) pub->publish(job->inputs, t);
        boot->barrier();
      }
      const ResourceCounts after_pubs = count_process_resources();
      RANK_CHECK(after_pubs.open_fds == connected.open_fds && after_pubs.shm_mappings == connected.shm_mappings,
                 "after publishers: fds {} -> {}, mappings {} -> {}", connected.open_fds, after_pubs.open_fds,
                 connected.shm_mappings, after_pubs.shm_mappings);
    }
    const ResourceCounts after = count_process_resources();
    RANK_CHECK(after.open_fds == before.open_fds && after.shm_mappings == before.shm_mappings,
               "fds {} -> {}, mappings {} -> {}", before.open_fds, after.open_fds, before.shm_mappings,
               after.shm_mappings);
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

TEST(PublishCpuMultiproc, PlanWorldMustMatchGroup) {
  const auto out = run_ranks(2, [](const BootstrapConfig& bc) {
    auto boot = Bootstrap::connect(bc);
    auto job = make_job(4, 0, 3);
    auto pub = make_cpu_rank_publisher(*boot, job->setup);
    return 0;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].exit_code, 3);
    EXPECT_NE(out[r].output.find("the plan's PCP world is 4, but this process group has 2 processes"),
              std::string::npos)
        << out[r].output;
  }
}

}  // namespace
}  // namespace pcpkv
