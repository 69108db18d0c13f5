// examples/publish_one_layer.cpp: one layer's KV publication through pcpkv's public API, on the CPU
// reference backend. Plan a batch over PCP ranks, draw seeded random inputs, publish with the direct and
// the staging transport, and check the result: every rank's replica byte-identical to rank 0's, both
// transports byte-identical, guard and padding bytes untouched, every FP8 value within its bound.
//
//   publish_one_layer [--pcp P] [--tokens N] [--model glm-5|deepseek-v3.2]
// Exit code 0 when every check passes, 1 when one fails, 2 on bad arguments (pcpkv::Error).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"

namespace {

struct Args {
  int32_t pcp = 4;
  int64_t tokens = 256;
  std::string model = "glm-5";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    PCPKV_CHECK(i + 1 < argc, "{}: needs a value", flag);
    const std::string value = argv[++i];
    if (flag == "--pcp") {
      a.pcp = std::atoi(value.c_str());
      PCPKV_CHECK(a.pcp >= 1 && a.pcp <= 64, "--pcp: must be in [1, 64], got '{}'", value);
    } else if (flag == "--tokens") {
      a.tokens = std::atoll(value.c_str());
      PCPKV_CHECK(a.tokens >= 1 && a.tokens <= 1 << 20, "--tokens: must be in [1, 1048576], got '{}'", value);
    } else if (flag == "--model") {
      a.model = value;
    } else {
      PCPKV_FAIL("unknown flag '{}' (known: --pcp, --tokens, --model)", flag);
    }
  }
  return a;
}

int run(const Args& args) {
  // The model's dims (a shipped preset) and the batch: one long prefill split over the ranks by
  // DualChunkSwap, plus a decode token of an earlier request.
  const pcpkv::ModelConfig model = pcpkv::preset(args.model);
  pcpkv::PlanConfig pc;
  pc.pcp_world = args.pcp;
  pc.block_size = 64;
  pc.requests = {{pcpkv::RequestKind::kPrefill, args.tokens, 0}, {pcpkv::RequestKind::kDecode, 1, 100}};
  pc.seed = 7;
  const pcpkv::PcpPlan plan = pcpkv::make_plan(pc);

  // The layer: fp8_ds_mla cache rows with an indexer (a DSA layer that owns its indexer).
  pcpkv::PublishSetup setup;
  setup.model = &model;
  setup.plan = &plan;
  setup.fmt.kv_format = pcpkv::KvFormat::kFp8DsMla;
  setup.fmt.has_indexer = true;
  setup.topk_width = model.index_topk;
  const pcpkv::GlobalInputs inputs = pcpkv::generate_inputs(model, plan, setup.fmt.has_indexer, /*seed=*/42);

  auto backend = pcpkv::make_cpu_backend(2);
  const pcpkv::PublishResult direct = backend->publish(setup, inputs, pcpkv::Transport::kDirect);
  const pcpkv::PublishResult staging = backend->publish(setup, inputs, pcpkv::Transport::kStaging);

  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("%-6s %s\n", ok ? "ok" : "FAILED", what.c_str());
    failures += ok ? 0 : 1;
  };
  for (int32_t r = 0; r < args.pcp; ++r) {
    const size_t i = static_cast<size_t>(r);
    expect(pcpkv::compare_bytes(direct.mla_alloc[0], direct.mla_alloc[i]).equal() &&
               pcpkv::compare_bytes(direct.index_alloc[0], direct.index_alloc[i]).equal(),
           fmt::format("rank {}: replica equal to rank 0's", r));
    expect(pcpkv::compare_bytes(direct.mla_alloc[i], staging.mla_alloc[i]).equal() &&
               pcpkv::compare_bytes(direct.index_alloc[i], staging.index_alloc[i]).equal(),
           fmt::format("rank {}: staging equal to direct", r));
    const pcpkv::GuardReport g = pcpkv::check_untouched(direct, r, plan, setup.fmt);
    expect(g.num_bad == 0, fmt::format("rank {}: bytes outside the written rows untouched{}", r,
                                       g.num_bad ? " (first: " + g.first + ")" : std::string()));
  }
  const pcpkv::Fp8Report f = pcpkv::check_fp8_bound(direct, 0, inputs, plan, model, setup.fmt, /*bf16_first=*/false);
  expect(f.num_values > 0 && f.num_over_bound == 0,
         fmt::format("rank 0: {} values within the FP8 bound (max err/bound {:.3f})", f.num_values,
                     f.max_err_over_bound));

  std::printf("%s: %s, PCP %d, %lld + 1 tokens, %lld slots written, direct %.2f ms, staging %.2f ms\n",
              failures ? "FAILED" : "passed", model.name.c_str(), args.pcp, static_cast<long long>(args.tokens),
              static_cast<long long>(plan.num_written_slots()), direct.profile.total_ms(), staging.profile.total_ms());
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const pcpkv::Error& e) {
    std::fprintf(stderr, "publish_one_layer: error: %s\n", e.what());
    return 2;
  }
}
