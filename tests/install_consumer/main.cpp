// tests/install_consumer/main.cpp: a program outside the pcpkv tree, linked against the installed
// package (pcpkv::pcpkv). It checks what an engine relies on: the public headers compile on their own, the
// installed presets load from their config files, and one small layer published on the CPU backend has
// every replica identical with its guard bytes untouched. Exit 0 when all hold.
#include <cstdio>
#include <string>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"

int main(int argc, char** argv) {
  // argv[1]: the directory the configs are expected in (the install prefix's share/pcpkv/configs).
  const std::string want_dir = argc > 1 ? argv[1] : "";
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("%-6s %s\n", ok ? "ok" : "FAILED", what.c_str());
    failures += ok ? 0 : 1;
  };
  try {
    const std::string dir = pcpkv::config_dir();
    expect(want_dir.empty() || dir == want_dir,
           "config_dir() = " + dir + (want_dir.empty() ? "" : ", want " + want_dir));
    const pcpkv::ModelConfig model = pcpkv::preset("glm-5");
    expect(model.q_lora_rank == 2048 && model.kv_lora_rank == 512, "preset glm-5 loads");
    expect(pcpkv::find_env_var("PCPKV_CONFIG_DIR") != nullptr, "the environment registry is linked");

    pcpkv::PlanConfig pc;
    pc.pcp_world = 2;
    pc.requests = {{pcpkv::RequestKind::kPrefill, 37, 0}};
    pc.seed = 3;
    const pcpkv::PcpPlan plan = pcpkv::make_plan(pc);
    pcpkv::PublishSetup setup;
    setup.model = &model;
    setup.plan = &plan;
    const pcpkv::GlobalInputs in = pcpkv::generate_inputs(model, plan, setup.fmt.has_indexer, 11);
    const pcpkv::PublishResult r = pcpkv::make_backend("cpu")->publish(setup, in, pcpkv::Transport::kDirect);
    expect(r.mla_alloc.size() == 2 && pcpkv::compare_bytes(r.mla_alloc[0], r.mla_alloc[1]).equal(),
           "direct publication: replicas identical");
    for (int32_t rank = 0; rank < 2; ++rank)
      expect(pcpkv::check_untouched(r, rank, plan, setup.fmt).num_bad == 0,
             "rank " + std::to_string(rank) + ": guard bytes untouched");
  } catch (const pcpkv::Error& e) {
    std::fprintf(stderr, "pcpkv_install_consumer: error: %s\n", e.what());
    return 2;
  }
  std::printf("%s\n", failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
