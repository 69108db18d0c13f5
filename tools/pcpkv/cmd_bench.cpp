// `pcpkv bench`: GPU benchmarks of the publication (pcpkv/publish/cuda.h run_bench). Prints per-stage tables, the
// single-rank dispatch against docs/perf.md's vLLM numbers, and last a summary table per transport (time,
// bytes, GB/s, fraction of the device-to-device copy bandwidth of the same run, time over its byte floor,
// speedup over collect, CUDA-graph replay time). --json FILE / --markdown FILE save the same (bench_report.h).
// Flags are checked first (bad input: exit code 2, naming the flag and value); then, built without CUDA or
// run without a GPU, it says so and exits with 2. A replica-check row that fails gives exit code 1, after the
// report and its files are written (bench_exit_code).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "batch_flags.h"
#include "list_flags.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"

#if defined(PCPKV_HAVE_CUDA)
#include "bench_report.h"
#include "pcpkv/publish/cuda.h"
#endif

namespace pcpkv::cli {
namespace {

struct BenchArgs : BatchFlags {
  BenchArgs() {
    tokens = 32768;
    topk_width = 2048;
    seed = 1;
  }
  std::string models = "glm-5,deepseek-v3.2";
  std::string pcp = "2,4,8";
  std::string kv_formats = "fp8,fp8_ds_mla";
  std::string transports = "collect,staging,direct";
  std::string single = "4096,32768";
  std::string variants = "simple,prefetch,warp,warp_pf";
  std::string layer_variants = "prefetch:separate:1,warp:separate:1,warp:fused:1,warp:fused:2,warp_pf:fused:4,warp:fused:4";
  std::string pdl_tokens = "1,8,64";
  int32_t pdl_pcp = 8;
  int32_t pdl_layers = 20;
  int32_t per_gpu_pcp = 8;
  int64_t per_gpu_tokens = 32768;
  int32_t replica_check_pcp = -1;  // -1: the largest of --pcp; 0: no replica-check rows
  int iters = 20;
  int warmup = 5;
  bool no_graph = false;
  bool quick = false;
  double copy_gib = 2.0;
  int device = 0;
  std::string json_path;
  std::string markdown_path;
};

// ---- flags: every one checked before the GPU check, so a typo is named rather than reported as "needs a
// CUDA GPU" on a machine without one (and before a long run that would then fail at the end).

// --json / --markdown are written after the run: refuse a target that cannot be written before it starts.
void check_output_path(const std::string& path, const char* flag, bool given) {
  namespace fs = std::filesystem;
  if (!given) return;
  PCPKV_CHECK(!path.empty(), "{}: the path is empty", flag);
  std::error_code ec;
  PCPKV_CHECK(!fs::is_directory(path, ec), "{}: '{}' is a directory", flag, path);
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  PCPKV_CHECK(fs::is_directory(dir, ec), "{}: directory '{}' of '{}' does not exist", flag, dir.string(), path);
}

// The one-GPU bench serves 1..8 logical ranks (pcpkv/publish/cuda.h run_bench).
constexpr int64_t kMaxBenchPcp = 8;

struct CheckedBench {
  std::vector<std::string> models;
  std::vector<int32_t> pcp;
  std::vector<KvFormat> kv_formats;
  std::vector<Transport> transports;
  std::vector<int64_t> single_rank_tokens, pdl_tokens;
  std::vector<std::string> variants, layer_variants;
  TopkFill topk_fill = TopkFill::kFull;
};

CheckedBench check_flags(const BenchArgs& a, bool json_given, bool markdown_given) {
  CheckedBench c;
  for (const std::string& m : split_list(a.models, "--models")) {
    try {
      (void)preset(m);
    } catch (const Error& e) {
      // preset() names the single-model flag ("--model: unknown model ..."): name this one.
      std::string why = e.what();
      if (why.rfind("--model: ", 0) == 0) why.erase(0, 9);
      PCPKV_FAIL("--models: {} (in '{}')", why, clip(a.models));
    }
    c.models.push_back(m);
  }
  for (int64_t p : parse_int_list(a.pcp, "--pcp", 1, kMaxBenchPcp)) c.pcp.push_back(static_cast<int32_t>(p));
  for (const std::string& f : split_list(a.kv_formats, "--kv-formats"))
    c.kv_formats.push_back(parse_kv_format(f, "kv-formats"));
  for (const std::string& t : split_list(a.transports, "--transports")) {
    PCPKV_CHECK(t == "collect" || t == "staging" || t == "direct",
                "--transports: unknown transport '{}' (in '{}'); known: collect, staging, direct", clip(t),
                clip(a.transports));
    c.transports.push_back(parse_transport(t));
  }
  PCPKV_CHECK(a.layer == "indexer" || a.layer == "shared", "--layer: '{}' is not indexer or shared", clip(a.layer));
  PCPKV_CHECK(a.tokens >= 1, "--tokens: must be >= 1, got {}", a.tokens);
  PCPKV_CHECK(a.topk_width >= 0, "--topk-width: must be >= 0, got {}", a.topk_width);
  c.topk_fill = parse_topk_fill(a.topk_fill, "--topk-fill");
  check_block_size_flag(a.block_size);
  check_run_count("--iters", a.iters, 1);
  check_run_count("--warmup", a.warmup, 0);
  c.single_rank_tokens = parse_int_list(a.single, "--single-rank-tokens", 1, std::numeric_limits<int32_t>::max(),
                                        /*none=*/"none");
  c.variants = split_list(a.variants, "--variants");
  c.layer_variants = split_list(a.layer_variants, "--layer-variants");
  c.pdl_tokens = parse_int_list(a.pdl_tokens, "--pdl-tokens", 1, std::numeric_limits<int32_t>::max(),
                                /*none=*/"none");
  PCPKV_CHECK(a.pdl_pcp >= 1 && a.pdl_pcp <= kMaxBenchPcp, "--pdl-pcp: must be in [1, {}], got {}", kMaxBenchPcp,
              a.pdl_pcp);
  PCPKV_CHECK(a.pdl_layers >= 1, "--pdl-layers: must be >= 1, got {}", a.pdl_layers);
  PCPKV_CHECK(a.per_gpu_pcp >= 0 && a.per_gpu_pcp <= kMaxBenchPcp, "--per-gpu-pcp: must be in [0, {}], got {}",
              kMaxBenchPcp, a.per_gpu_pcp);
  PCPKV_CHECK(a.per_gpu_pcp == 0 || (a.per_gpu_tokens >= 2 * a.per_gpu_pcp && a.per_gpu_tokens % (2 * a.per_gpu_pcp) == 0),
              "--per-gpu-tokens: must be a positive multiple of 2 x --per-gpu-pcp = {}, got {}", 2 * a.per_gpu_pcp,
              a.per_gpu_tokens);
  PCPKV_CHECK(a.replica_check_pcp == -1 || a.replica_check_pcp == 0 ||
                  std::find(c.pcp.begin(), c.pcp.end(), a.replica_check_pcp) != c.pcp.end(),
              "--replica-check-pcp: must be -1 (the largest of --pcp), 0 (off) or one of --pcp '{}', got {}", clip(a.pcp),
              a.replica_check_pcp);
  PCPKV_CHECK(std::isfinite(a.copy_gib) && a.copy_gib > 0.0 && a.copy_gib <= 64.0,
              "--copy-gib: must be in (0, 64], got {}", a.copy_gib);
  PCPKV_CHECK(a.device >= 0, "--device: must be >= 0, got {}", a.device);
  check_output_path(a.json_path, "--json", json_given);
  check_output_path(a.markdown_path, "--markdown", markdown_given);
  return c;
}

#if defined(PCPKV_HAVE_CUDA)

void run(const BenchArgs& a, const CheckedBench& c, const std::string& command) {
  std::string why;
  if (!cuda_backend_available(&why)) throw CLI::RuntimeError(fmt::format("pcpkv bench needs a CUDA GPU: {}", why), 2);
  cuda::BenchOptions o;
  o.device_idx = a.device;
  o.models = c.models;
  o.pcp = c.pcp;
  o.kv_formats = c.kv_formats;
  o.transports = c.transports;
  o.indexer_layer = a.layer == "indexer";
  o.tokens = a.tokens;
  o.topk_width = a.topk_width;
  o.topk_fill = c.topk_fill;
  o.block_size = a.block_size;
  o.iters = a.iters;
  o.warmup = a.warmup;
  o.graph = !a.no_graph;
  o.single_rank_tokens = c.single_rank_tokens;
  o.copy_gib = a.copy_gib;
  o.seed = a.seed;
  o.single_rank_variants = c.variants;
  o.layer_variants = c.layer_variants;
  o.pdl_tokens = c.pdl_tokens;
  o.pdl_pcp = a.pdl_pcp;
  o.pdl_layers = a.pdl_layers;
  o.per_gpu_pcp = a.per_gpu_pcp;
  o.per_gpu_tokens = a.per_gpu_tokens;
  o.replica_check_pcp = a.replica_check_pcp;
  if (a.quick) {  // a smoke run for tests: small and fast, every code path once
    o.models = {"glm-5"};
    o.pcp = {2};
    o.kv_formats = {KvFormat::kFp8DsMla};
    o.tokens = 2048;
    o.iters = 3;
    o.warmup = 1;
    o.single_rank_tokens = {1024};
    o.copy_gib = 0.25;
    o.layer_variants = {"prefetch:separate:1", "warp:fused:4"};
    o.pdl_tokens = {8};
    o.pdl_pcp = 2;
    o.pdl_layers = 4;
    o.per_gpu_pcp = o.per_gpu_pcp == 0 ? 0 : 2;
    o.per_gpu_tokens = 2048;
    o.replica_check_pcp = o.replica_check_pcp == 0 ? 0 : 2;
  }
  const cuda::BenchReport rep =
      cuda::run_bench(o, [](const std::string& line) { std::fprintf(stderr, "pcpkv bench: %s\n", line.c_str()); });
  write_bench_report(rep, a.topk_fill, command, a.json_path, a.markdown_path);
  // After the tables and the files: a failed replica-check row fails the run (exit code 1).
  std::string failed;
  if (const int code = cuda::bench_exit_code(rep, &failed); code != 0)
    throw CLI::RuntimeError(fmt::format("replica check failed: {}", failed), code);
}

#else  // !PCPKV_HAVE_CUDA

void run(const BenchArgs&, const CheckedBench&, const std::string&) {
  throw CLI::RuntimeError(
      "pcpkv bench needs the CUDA backend, but this pcpkv was built without CUDA (nvcc not found at configure "
      "time); rebuild where nvcc exists and run on a machine with a GPU",
      2);
}

#endif

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "bench", "GPU benchmarks: per-stage times of collect / staging / direct, bytes, GB/s and the fraction of "
               "the copy bandwidth, graph replay, and the single-rank dispatch against vLLM (needs CUDA and a GPU)");
  auto a = std::make_shared<BenchArgs>();
  sub->add_option("--models", a->models, "comma-separated presets")->capture_default_str();
  sub->add_option("--pcp", a->pcp, "comma-separated PCP world sizes (logical ranks on one GPU, 1..8)")->capture_default_str();
  sub->add_option("--kv-formats", a->kv_formats, "comma-separated: fp8, fp8_ds_mla, bf16")->capture_default_str();
  sub->add_option("--transports", a->transports, "comma-separated: collect, staging, direct")->capture_default_str();
  using F = BatchFlag;
  add_batch_flags(sub, *a, {F::kTokens, F::kLayer, F::kTopkWidth, F::kTopkFill, F::kBlockSize},
                  {{F::kTokens, "tokens of the one prefill request"}, {F::kLayer, "indexer | shared"},
                   {F::kTopkWidth, "top-k buffer width filled with -1 on indexer layers (0: none)"},
                   {F::kTopkFill, "top-k rows staging, direct and the single-rank dispatch fill: full (every row), "
                                  "tail (only the padding rows past each rank's local tokens: pcpkv's indexer top-k "
                                  "writes the rest) or none; collect always fills every row, as engines do"}});
  sub->add_option("--iters", a->iters, "timed runs per case (median)")->capture_default_str();
  sub->add_option("--warmup", a->warmup, "untimed runs first")->capture_default_str();
  sub->add_flag("--no-graph", a->no_graph, "skip the CUDA-graph capture and replay");
  sub->add_option("--single-rank-tokens", a->single, "dispatch-only one-rank cases, comma-separated, or none")
      ->capture_default_str();
  sub->add_option("--variants", a->variants,
                  "dispatch kernels of the single-rank section, comma-separated: simple, prefetch, warp, warp_pf, "
                  "warp_token, warp_split (each with the top-k fill fused and separate)")
      ->capture_default_str();
  sub->add_option("--layer-variants", a->layer_variants,
                  "staging / direct variants, comma-separated <dispatch>:<fused|separate>:<combine rows per warp "
                  "1|2|4>[:pdl]; collect always runs its pinned engine baseline (prefetch:separate:1)")
      ->capture_default_str();
  sub->add_option("--pdl-tokens", a->pdl_tokens,
                  "PDL off/on rows (graph replay of the staging / direct chain) for these token counts, or none")
      ->capture_default_str();
  sub->add_option("--pdl-pcp", a->pdl_pcp, "PCP world of the PDL rows")->capture_default_str();
  sub->add_option("--pdl-layers", a->pdl_layers, "publications per captured graph in the PDL rows")->capture_default_str();
  sub->add_option("--per-gpu-pcp", a->per_gpu_pcp,
                  "PCP world of the per-GPU case (rank 0's dispatch alone, writing every peer; 0: skip)")
      ->capture_default_str();
  sub->add_option("--per-gpu-tokens", a->per_gpu_tokens, "tokens of the per-GPU case's prefill (local rows: / P)")
      ->capture_default_str();
  sub->add_option("--replica-check-pcp", a->replica_check_pcp,
                  "PCP world of the replica-check rows (the --check-replicas debug check after one direct publication "
                  "per model and format; not in the transport totals): -1 the largest of --pcp, 0 none")
      ->capture_default_str();
  sub->add_option("--copy-gib", a->copy_gib, "size of the copy that measures the copy bandwidth")->capture_default_str();
  sub->add_option("--device", a->device, "CUDA device index")->capture_default_str();
  add_batch_flags(sub, *a, {F::kSeed}, {{F::kSeed, "input seed"}});
  CLI::Option* json_opt = sub->add_option("--json", a->json_path, "write the results as JSON");
  CLI::Option* markdown_opt = sub->add_option("--markdown", a->markdown_path, "write the tables as markdown");
  sub->add_flag("--quick", a->quick,
                "smoke run: glm-5, PCP 2, fp8_ds_mla, 2048 tokens, 3 iterations, layer variants prefetch:separate:1 "
                "and warp:fused:4, PDL at 8 tokens");
  sub->callback([a, json_opt, markdown_opt] {
    // Flags before the GPU check (pcpkv::Error: "pcpkv: error: --flag: ...", exit code 2).
    const CheckedBench checked = check_flags(*a, json_opt->count() > 0, markdown_opt->count() > 0);
    // The equivalent full command line, for the record in the tables and the JSON.
    const std::string command =
        a->quick ? std::string("pcpkv bench --quick")
                 : fmt::format("pcpkv bench --models {} --pcp {} --kv-formats {} --transports {} --tokens {} --layer {} "
                               "--topk-width {} --topk-fill {} --block-size {} --iters {} --warmup {} --single-rank-tokens {} "
                               "--variants {} --layer-variants {} --pdl-tokens {} --pdl-pcp {} --pdl-layers {} "
                               "--per-gpu-pcp {} --per-gpu-tokens {} --replica-check-pcp {} --copy-gib {}{}",
                               a->models, a->pcp, a->kv_formats, a->transports, a->tokens, a->layer, a->topk_width,
                               a->topk_fill,
                               a->block_size, a->iters, a->warmup, a->single, a->variants, a->layer_variants,
                               a->pdl_tokens, a->pdl_pcp, a->pdl_layers, a->per_gpu_pcp, a->per_gpu_tokens,
                               a->replica_check_pcp, a->copy_gib, a->no_graph ? " --no-graph" : "");
    run(*a, checked, command);
  });
}

}  // namespace pcpkv::cli
