// `pcpkv bench-fence`: fence latency per layer across rank processes. Run it as
//   pcpkv launch --nproc N -- bench-fence --backend cuda     (N processes on one GPU: round-robin devices)
// Every rank runs `--layers` fences back to back (one per layer, barrier index alternating like
// micro-batches), `--iters` times; rank 0 prints each rank's median, p10 and p90 in microseconds and, on
// CUDA, the per-layer time of a captured CUDA graph of the same fences (replayed --iters times).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "launch_cmds.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv_bench/fence.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {
namespace {

struct BenchFenceFlags {
  std::string backend = "auto";
  FenceBenchOptions opt;
  bool json = false;
  bool md_rows = false;
};

// A fence bound past a day is a typo, and one near INT64_MAX overflows the deadline into the past.
constexpr int64_t kMaxTimeoutMs = int64_t{24} * 3600 * 1000;

// Every flag, before the rendezvous (run_rank_program): a bad one is refused ("pcpkv: error: --flag: ...", exit 2;
// with peers, named by every rank right after the rendezvous) before anything is allocated or printed. A
// timeout <= 0 would otherwise make every fence wait fail at random (0: whenever a peer is a moment late;
// negative on CUDA: wraps to a huge bound).
void check_flags(const BenchFenceFlags& f) {
  const FenceBenchOptions& o = f.opt;
  check_backend_name(f.backend);
  PCPKV_CHECK(o.layers >= 1, "--layers: must be >= 1, got {}", o.layers);
  check_run_count("--iters", o.iters, 1);
  check_run_count("--warmup", o.warmup, 0);
  PCPKV_CHECK(o.num_barriers >= 1, "--barriers: must be >= 1, got {}", o.num_barriers);
  PCPKV_CHECK(o.num_barriers <= 1024, "--barriers: {} is more than pcpkv supports (1024)", o.num_barriers);
  PCPKV_CHECK(o.timeout_ms >= 1 && o.timeout_ms <= kMaxTimeoutMs, "--timeout-ms: must be in [1, {}] (one day), got {}",
              kMaxTimeoutMs, o.timeout_ms);
  PCPKV_CHECK(std::isfinite(o.time_budget_s) && o.time_budget_s >= 0,
              "--time-budget: must be >= 0 seconds and finite, got {}", o.time_budget_s);
}

// What every rank must share: the number and order of the fences and collectives (--timeout-ms, --json and
// --md-rows are one rank's own). Compared right after the rendezvous (Bootstrap::agree_on).
std::vector<std::pair<std::string, std::string>> agreed_fields(const BenchFenceFlags& f) {
  const FenceBenchOptions& o = f.opt;
  return {{"--backend", f.backend},
          {"--layers", fmt::format("{}", o.layers)},
          {"--iters", fmt::format("{}", o.iters)},
          {"--warmup", fmt::format("{}", o.warmup)},
          {"--barriers", fmt::format("{}", o.num_barriers)},
          {"--no-graph", o.graph ? "off" : "on"},
          {"--time-budget", fmt::format("{}", o.time_budget_s)}};
}

int bench_fence(const BenchFenceFlags& f, Bootstrap& world) {
  world.agree_on("", agreed_fields(f));
  std::string resolved;
  (void)rank_publisher_factory(f.backend, &resolved);  // resolves auto and explains an unavailable CUDA
  FenceBenchResult r;
  if (resolved == "cuda") {
#if defined(PCPKV_HAVE_CUDA)
    r = cuda::bench_fence(world, f.opt);
#endif
  } else {
    r = bench_host_fence(world, f.opt);
  }
  // Gather every rank's numbers on rank 0.
  const double mine[5] = {r.median_us, r.p10_us, r.p90_us, r.graph_median_us, static_cast<double>(r.final_epoch)};
  std::vector<double> all(5 * static_cast<size_t>(world.world_size()));
  world.all_gather(mine, sizeof(mine), all.data());
  if (world.rank() != 0) return 0;

  const int32_t layers = r.layers_run > 0 ? r.layers_run : f.opt.layers;
  const int32_t iters = r.iters_run > 0 ? r.iters_run : f.opt.iters;
  const int32_t warmup = r.layers_run > 0 ? r.warmup_run : f.opt.warmup;
  std::string text = fmt::format(
      "pcpkv bench-fence: {} processes, backend {} ({}); {} layers x {} iterations (+{} warm-up), {} barrier "
      "indices\n",
      world.world_size(), resolved, r.device, layers, iters, warmup, f.opt.num_barriers);
  if (layers != f.opt.layers || iters != f.opt.iters || warmup != f.opt.warmup)
    text += fmt::format("  (scaled down from {} layers x {} iterations (+{} warm-up) to fit the {:.0f} s time budget)\n",
                        f.opt.layers, f.opt.iters, f.opt.warmup, f.opt.time_budget_s);
  if (r.max_ranks_per_gpu > 1)
    text += fmt::format(
        "  note: up to {} processes share one GPU. Without MPS the GPU time-slices between processes, so a fence "
        "waits for its peers' time slices: these numbers measure context switches, not the fence (with one GPU "
        "per process it is microseconds).\n",
        r.max_ranks_per_gpu);
  text += fmt::format("  rank   median us   p10 us   p90 us{}\n",
                      resolved == "cuda" && f.opt.graph ? "   graph us/layer" : "");
  std::vector<double> medians;
  for (int32_t q = 0; q < world.world_size(); ++q) {
    const double* v = all.data() + 5 * q;
    medians.push_back(v[0]);
    text += fmt::format("  {:>4}  {:>10.2f} {:>8.2f} {:>8.2f}", q, v[0], v[1], v[2]);
    if (resolved == "cuda" && f.opt.graph) text += fmt::format("   {:>10.2f}", v[3]);
    text += "\n";
  }
  text += fmt::format("  fence latency per layer (median over ranks of each rank's median): {:.2f} us\n",
                      percentile(medians, 0.5));
  if (f.md_rows) {
    std::vector<double> graph;
    for (int32_t q = 0; q < world.world_size(); ++q) graph.push_back(all[5 * static_cast<size_t>(q) + 3]);
    text += fmt::format("md|| {} | {} | {:.2f} | {:.2f} | {:.2f} | {} x {} |{}\n", world.world_size(),
                        resolved != "cuda"         ? std::string("CPU processes")
                        : r.max_ranks_per_gpu > 1 ? fmt::format("{} per GPU", r.max_ranks_per_gpu)
                                                  : std::string("1 per GPU"),
                        percentile(medians, 0.5), *std::max_element(medians.begin(), medians.end()),
                        resolved == "cuda" && f.opt.graph ? percentile(graph, 0.5) : 0.0, layers, iters,
                        r.max_ranks_per_gpu > 1 ? " time-slicing (no MPS): context switches, not the fence |" : " |");
  }

  if (f.json) {
    nlohmann::json j;
    j["world_size"] = world.world_size();
    j["backend"] = resolved;
    j["device"] = r.device;
    j["layers"] = layers;
    j["iters"] = iters;
    j["max_ranks_per_gpu"] = r.max_ranks_per_gpu;
    for (int32_t q = 0; q < world.world_size(); ++q) {
      const double* v = all.data() + 5 * q;
      j["ranks"].push_back({{"rank", q}, {"median_us", v[0]}, {"p10_us", v[1]}, {"p90_us", v[2]},
                            {"graph_per_layer_us", v[3]}, {"final_epoch", v[4]}});
    }
    j["median_us"] = percentile(medians, 0.5);
    std::fputs(j.dump(2).c_str(), stdout);
    std::fputs("\n", stdout);
    std::fputs(text.c_str(), stderr);
  } else {
    std::fputs(text.c_str(), stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_bench_fence_command(CLI::App& app) {
  auto f = std::make_shared<BenchFenceFlags>();
  CLI::App* sub = app.add_subcommand(
      "bench-fence", "Fence latency per layer across rank processes: pcpkv launch --nproc N -- bench-fence");
  sub->add_option("--backend", f->backend, "auto | cpu | cuda")->capture_default_str();
  sub->add_option("--layers", f->opt.layers, "Fences per iteration (one per layer)")->capture_default_str();
  sub->add_option("--iters", f->opt.iters, "Timed iterations")->capture_default_str();
  sub->add_option("--warmup", f->opt.warmup, "Untimed iterations first")->capture_default_str();
  sub->add_option("--barriers", f->opt.num_barriers, "Barrier indices (micro-batches), used round-robin")
      ->capture_default_str();
  sub->add_option("--timeout-ms", f->opt.timeout_ms, "Bound of every fence wait")->capture_default_str();
  sub->add_flag("--no-graph", [f](int64_t) { f->opt.graph = false; }, "CUDA: skip the graph-replay timing");
  sub->add_option("--time-budget", f->opt.time_budget_s,
                  "CUDA: seconds the whole measurement may take; iterations (>= 3) and if needed layers are scaled "
                  "down to fit (processes sharing a GPU time-slice: a fence then costs milliseconds); 0: no limit")
      ->capture_default_str();
  sub->add_flag("--json", f->json, "JSON on stdout from rank 0 (the table goes to stderr)");
  sub->add_flag("--md-rows", f->md_rows, "Also print a markdown table row prefixed 'md|' (for docs/perf.md)");
  sub->callback([f] {
    const int code = run_rank_program(
        "bench-fence", [&] { check_flags(*f); }, [&](Bootstrap& world) { return bench_fence(*f, world); });
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
