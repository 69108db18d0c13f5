// `pcpkv bench`: GPU benchmarks of the publication (pcpkv/publish/cuda.h run_bench). Prints per-stage tables, the
// single-rank dispatch against docs/perf.md's vLLM numbers, and last a summary table per transport (time,
// bytes, GB/s, fraction of the device-to-device copy bandwidth of the same run, time over its byte floor,
// speedup over collect, CUDA-graph replay time). --json FILE / --markdown FILE save the same.
// Flags are checked first (bad input: exit code 2, naming the flag and value); then, built without CUDA or
// run without a GPU, it says so and exits with 2. A replica-check row that fails gives exit code 1, after the
// report and its files are written (bench_exit_code).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "batch_flags.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"

#include "pcpkv_bench/publish.h"
#if defined(PCPKV_HAVE_CUDA)
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

// "a,b" -> {"a", "b"}; an empty entry ("2,,4", "2,") is refused, not dropped, and so is an empty list.
std::vector<std::string> split_list(const std::string& s, const char* flag) {
  PCPKV_CHECK(!s.empty(), "{}: the list is empty", flag);
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    out.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    PCPKV_CHECK(!out.back().empty(), "{}: '{}' has an empty entry", flag, clip(s));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// A comma list of integers, each >= lo (and <= hi); "none" -> {} when allow_none.
std::vector<int64_t> parse_int_list(const std::string& s, const char* flag, int64_t lo, int64_t hi,
                                    bool allow_none = false) {
  std::vector<int64_t> out;
  if (allow_none && s == "none") return out;
  for (const std::string& item : split_list(s, flag)) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    PCPKV_CHECK(ec == std::errc() && end == item.data() + item.size(), "{}: '{}' is not an integer (in '{}')", flag,
                clip(item), clip(s));
    PCPKV_CHECK(v >= lo && v <= hi, "{}: {} is not in [{}, {}] (in '{}')", flag, v, lo, hi, clip(s));
    out.push_back(v);
  }
  return out;
}

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
                                        /*allow_none=*/true);
  c.variants = split_list(a.variants, "--variants");
  c.layer_variants = split_list(a.layer_variants, "--layer-variants");
  c.pdl_tokens = parse_int_list(a.pdl_tokens, "--pdl-tokens", 1, std::numeric_limits<int32_t>::max(),
                                /*allow_none=*/true);
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

// docs/perf.md: vLLM's Triton fused_norm_rope on one H200, GLM-5, fp8_ds_mla, indexer layer, top-k fill.
struct VllmRef {
  double us, floor_us, ratio;
};
const std::map<int64_t, VllmRef> kVllm = {{4096, {33.9, 17.8, 1.90}}, {32768, {232.0, 143.0, 1.63}}};

std::string fmt_bytes_gb(int64_t b) { return fmt::format("{:.3f}", static_cast<double>(b) / 1e9); }

struct Derived {
  double gbps = 0, frac = 0, floor_ms = 0, ratio = 0;
};
Derived derive(double ms, int64_t bytes, double copy_gbps) {
  Derived d;
  if (ms > 0) d.gbps = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  d.frac = copy_gbps > 0 ? d.gbps / copy_gbps : 0;
  d.floor_ms = copy_gbps > 0 ? static_cast<double>(bytes) / (copy_gbps * 1e9) * 1e3 : 0;
  d.ratio = d.floor_ms > 0 ? ms / d.floor_ms : 0;
  return d;
}

// A graph time (ms, < 0: not measured) as the tables and the JSON show it.
std::string graph_us(double ms) { return ms < 0 ? std::string("-") : fmt::format("{:.1f}", ms * 1e3); }
std::string graph_ratio(double ms, double floor_ms) {
  return ms < 0 || floor_ms <= 0 ? std::string("-") : fmt::format("{:.2f}", ms / floor_ms);
}
nlohmann::json graph_json(double ms) { return ms < 0 ? nlohmann::json(nullptr) : nlohmann::json(ms); }
nlohmann::json graph_json(double ms, double floor_ms) {
  return ms < 0 || floor_ms <= 0 ? nlohmann::json(nullptr) : nlohmann::json(ms / floor_ms);
}

std::string run_key(const cuda::BenchRun& r) {
  return fmt::format("{}|{}|{}", r.model, r.pcp, static_cast<int>(r.kv_format));
}

// "fused" / "separate", with the fill mode when it is not the engines' full fill.
std::string fill_label(bool fused, TopkFill f) {
  const std::string where = fused ? "fused" : "separate";
  return f == TopkFill::kFull ? where : fmt::format("{}, {}", where, to_string(f));
}
// The variant column: the variant, and the fill mode when it is not full (collect always runs full).
std::string shown_variant(const cuda::BenchRun& r) {
  return r.topk_fill == TopkFill::kFull ? r.variant : fmt::format("{} (fill {})", r.variant, to_string(r.topk_fill));
}

void report(const cuda::BenchReport& rep, const BenchArgs& a, const std::string& command) {
  using nlohmann::json;
  std::map<std::string, double> collect_ms, collect_graph_ms;
  for (const cuda::BenchRun& r : rep.runs)
    if (r.transport == Transport::kCollect) {
      collect_ms[run_key(r)] = r.total_ms;
      collect_graph_ms[run_key(r)] = r.graph_ms;
    }

  std::string md;
  md += fmt::format("# pcpkv bench\n\ndevice: {} ({} SMs, {} MB L2); copy bandwidth {:.0f} GB/s (device-to-device "
                    "copy of {:.2f} GiB, read + write, same run)\n\ncommand: `{}`\n\n",
                    rep.device, rep.num_sms, rep.l2_bytes >> 20, rep.copy_gbps,
                    static_cast<double>(rep.copy_bytes) / (1 << 30), command);
  md += fmt::format("top-k fill: staging, direct and the single-rank dispatch `{}`; collect `full` (as engines do)\n\n",
                    a.topk_fill);
  md += "## dispatch kernels (registers, shared memory, spills, occupancy)\n\n";
  for (const std::string& k : rep.kernels) md += "- " + k + "\n";

  json j;
  j["command"] = command;
  j["device"] = {{"name", rep.device}, {"num_sms", rep.num_sms}, {"l2_bytes", rep.l2_bytes}};
  j["copy_bandwidth_gbps"] = rep.copy_gbps;
  j["copy_bytes"] = rep.copy_bytes;
  j["kernels"] = rep.kernels;

  // ---- single rank
  if (!rep.singles.empty()) {
    md += "\n## dispatch alone, one rank (GLM-5, fp8_ds_mla, indexer layer, top-k fill; docs/perf.md's vLLM case)\n\n";
    md += "Time: one launch on an idle GPU (the host's launch path included, as the vLLM column was measured); graph: "
          "per call of back-to-back dispatches in one CUDA graph (the kernel on a busy GPU).\n\n";
    md += "| tokens | variant | top-k fill | time us | graph us | bytes MB | floor us | time / floor | graph / floor | "
          "vLLM time / floor |\n";
    md += "|---|---|---|---|---|---|---|---|---|---|\n";
    json js = json::array();
    for (const cuda::BenchSingle& s : rep.singles) {
      const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
      const auto v = kVllm.find(s.tokens);
      md += fmt::format("| {} | {} | {} | {:.1f} | {} | {:.1f} | {:.1f} | {:.2f} | {} | {} |\n", s.tokens, s.variant,
                        fill_label(s.fused_topk, s.topk_fill), s.ms * 1e3, graph_us(s.graph_ms), s.bytes / 1e6,
                        d.floor_ms * 1e3, d.ratio, graph_ratio(s.graph_ms, d.floor_ms),
                        v == kVllm.end() ? std::string("-") : fmt::format("{:.2f}", v->second.ratio));
      js.push_back({{"model", s.model},
                    {"kv_format", to_string(s.kv_format)},
                    {"tokens", s.tokens},
                    {"variant", s.variant},
                    {"fused_topk", s.fused_topk},
                    {"topk_fill", to_string(s.topk_fill)},
                    {"ms", s.ms},
                    {"bytes", s.bytes},
                    {"gbps", d.gbps},
                    {"fraction_of_copy", d.frac},
                    {"floor_ms", d.floor_ms},
                    {"time_over_floor", d.ratio},
                    {"graph_ms", graph_json(s.graph_ms)},
                    {"graph_over_floor", graph_json(s.graph_ms, d.floor_ms)},
                    {"vllm_time_over_floor", v == kVllm.end() ? json(nullptr) : json(v->second.ratio)}});
    }
    j["single_rank"] = js;
  }

  // ---- per GPU: rank 0's dispatch alone in a PCP group
  if (!rep.per_gpu.empty()) {
    md += fmt::format("\n## per GPU: rank 0's dispatch alone, PCP {} ({} local rows of one prefill, fp8_ds_mla, indexer "
                      "layer, top-k fill), writing {} staging slots / replicas\n\n",
                      rep.per_gpu.front().pcp, rep.per_gpu.front().local_tokens, rep.per_gpu.front().pcp);
    md += "| model | transport | variant | time us | graph us | bytes MB | floor us | time / floor | graph / floor |\n"
          "|---|---|---|---|---|---|---|---|---|\n";
    json jg = json::array();
    for (const cuda::BenchPerGpu& g : rep.per_gpu) {
      const Derived d = derive(g.ms, g.bytes, rep.copy_gbps);
      md += fmt::format("| {} | {} | {} | {:.1f} | {} | {:.1f} | {:.1f} | {:.2f} | {} |\n", g.model,
                        to_string(g.transport), g.variant, g.ms * 1e3, graph_us(g.graph_ms), g.bytes / 1e6,
                        d.floor_ms * 1e3, d.ratio, graph_ratio(g.graph_ms, d.floor_ms));
      jg.push_back({{"model", g.model},
                    {"pcp", g.pcp},
                    {"local_tokens", g.local_tokens},
                    {"transport", to_string(g.transport)},
                    {"variant", g.variant},
                    {"ms", g.ms},
                    {"bytes", g.bytes},
                    {"gbps", d.gbps},
                    {"fraction_of_copy", d.frac},
                    {"floor_ms", d.floor_ms},
                    {"time_over_floor", d.ratio},
                    {"graph_ms", graph_json(g.graph_ms)},
                    {"graph_over_floor", graph_json(g.graph_ms, d.floor_ms)}});
    }
    j["per_gpu"] = jg;
  }

  // ---- stages
  json jr = json::array();
  if (!rep.runs.empty()) {
    md += "\n## stages (median of the timed runs)\n\n";
    md += "| model | P | kv | transport | variant | stage | ms | MB | GB/s | % copy BW |\n|---|---|---|---|---|---|---|---|---|---|\n";
  }
  for (const cuda::BenchRun& r : rep.runs) {
    json stages = json::array();
    for (const cuda::BenchStage& s : r.stages) {
      const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
      md += fmt::format("| {} | {} | {} | {} | {} | {} | {:.4f} | {:.1f} | {:.0f} | {:.0f} |\n", r.model, r.pcp,
                        to_string(r.kv_format), to_string(r.transport), shown_variant(r), s.name, s.ms, s.bytes / 1e6,
                        d.gbps, 100 * d.frac);
      stages.push_back({{"name", s.name}, {"ms", s.ms}, {"bytes", s.bytes}, {"gbps", d.gbps}, {"fraction_of_copy", d.frac}});
    }
    const Derived d = derive(r.total_ms, r.bytes, rep.copy_gbps);
    const auto c = collect_ms.find(run_key(r));
    const auto cg = collect_graph_ms.find(run_key(r));
    json jrun = {{"model", r.model},
                 {"pcp", r.pcp},
                 {"kv_format", to_string(r.kv_format)},
                 {"layer", r.indexer_layer ? "indexer" : "shared"},
                 {"tokens", r.tokens},
                 {"transport", to_string(r.transport)},
                 {"variant", r.variant},
                 {"topk_fill", to_string(r.topk_fill)},
                 {"stages", stages},
                 {"total_ms", r.total_ms},
                 {"bytes", r.bytes},
                 {"gbps", d.gbps},
                 {"fraction_of_copy", d.frac},
                 {"floor_ms", d.floor_ms},
                 {"time_over_floor", d.ratio},
                 {"graph_ms", r.graph_ms >= 0 ? json(r.graph_ms) : json(nullptr)}};
    if (c != collect_ms.end() && r.total_ms > 0) jrun["speedup_vs_collect"] = c->second / r.total_ms;
    if (cg != collect_graph_ms.end() && r.graph_ms > 0 && cg->second > 0)
      jrun["graph_speedup_vs_collect"] = cg->second / r.graph_ms;
    jr.push_back(jrun);
  }
  j["runs"] = jr;

  // ---- the replica check (a debug mode): rows beside the stages, never in a transport's total
  json jc = json::array();
  std::string check_notes;
  for (const cuda::BenchReplicaCheck& c : rep.replica_checks) {
    const Derived d = derive(c.ms, c.bytes, rep.copy_gbps);
    double direct_ms = 0;  // for scale: the fastest direct publication of the same case
    for (const cuda::BenchRun& r : rep.runs)
      if (r.transport == Transport::kDirect && r.model == c.model && r.pcp == c.pcp && r.kv_format == c.kv_format &&
          (direct_ms == 0 || r.total_ms < direct_ms))
        direct_ms = r.total_ms;
    md += fmt::format("| {} | {} | {} | replica-check | - | hashes of {} replicas x {} slots + compare ({}) | {:.4f} | "
                      "{:.1f} | {:.0f} | {:.0f} |\n",
                      c.model, c.pcp, to_string(c.kv_format), c.pcp, c.slots, c.pass ? "pass" : "FAIL", c.ms,
                      c.bytes / 1e6, d.gbps, 100 * d.frac);
    check_notes += fmt::format("{}{} {}: {:.1f} MB of cache rows read{}", check_notes.empty() ? "" : "; ", c.model,
                               to_string(c.kv_format), c.cache_bytes_read / 1e6,
                               direct_ms > 0 ? fmt::format(", {:.2f}x the direct publication", c.ms / direct_ms) : "");
    jc.push_back({{"model", c.model},
                  {"pcp", c.pcp},
                  {"kv_format", to_string(c.kv_format)},
                  {"layer", c.indexer_layer ? "indexer" : "shared"},
                  {"tokens", c.tokens},
                  {"slots", c.slots},
                  {"ms", c.ms},
                  {"cache_bytes_read", c.cache_bytes_read},
                  {"bytes", c.bytes},
                  {"gbps", d.gbps},
                  {"fraction_of_copy", d.frac},
                  {"direct_ms", direct_ms > 0 ? json(direct_ms) : json(nullptr)},
                  {"pass", c.pass},
                  {"detail", c.detail}});
  }
  if (!rep.replica_checks.empty())
    md += fmt::format("\nreplica-check rows: the run-time replica check (`--check-replicas`, a debug mode) of one "
                      "layer's publication, timed on its own after a direct publication and counted in no transport "
                      "total; MB = rows hashed + slot lists + hashes written and compared ({})\n",
                      check_notes);
  j["replica_check"] = jc;

  // ---- PDL off / on
  if (!rep.pdl.empty()) {
    md += fmt::format("\n## PDL: dispatch -> fence (-> combine) with programmatic stream serialization, CUDA-graph replay of "
                      "{} layers, time per layer\n\n", rep.pdl.front().layers);
    md += "| model | P | tokens | transport | kernels | PDL off us | PDL on us | on / off |\n|---|---|---|---|---|---|---|---|\n";
    json jp = json::array();
    for (const cuda::BenchPdl& p : rep.pdl) {
      md += fmt::format("| {} | {} | {} | {} | {} | {:.2f} | {:.2f} | {:.3f} |\n", p.model, p.pcp, p.tokens,
                        to_string(p.transport), p.variant, p.us_off, p.us_on, p.us_off > 0 ? p.us_on / p.us_off : 0.0);
      jp.push_back({{"model", p.model},
                    {"pcp", p.pcp},
                    {"tokens", p.tokens},
                    {"transport", to_string(p.transport)},
                    {"variant", p.variant},
                    {"layers", p.layers},
                    {"us_off", p.us_off},
                    {"us_on", p.us_on}});
    }
    j["pdl"] = jp;
  }

  // ---- summary (printed last)
  std::string summary;
  if (!rep.runs.empty()) {
    summary += fmt::format("\n## summary: one layer's publication, {} tokens, {} layer (copy bandwidth {:.0f} GB/s)\n\n",
                           rep.runs.front().tokens, rep.runs.front().indexer_layer ? "indexer" : "shared", rep.copy_gbps);
    summary += "| model | P | kv | transport | variant | layer ms | graph ms | GB | GB/s | % copy BW | floor ms | "
               "time/floor | speedup vs collect |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const cuda::BenchRun& r : rep.runs) {
      const Derived d = derive(r.total_ms, r.bytes, rep.copy_gbps);
      const auto c = collect_ms.find(run_key(r));
      summary += fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {} | {} | {:.0f} | {:.0f} | {:.3f} | {:.2f} | {} |\n",
                             r.model, r.pcp, to_string(r.kv_format), to_string(r.transport), shown_variant(r), r.total_ms,
                             r.graph_ms >= 0 ? fmt::format("{:.3f}", r.graph_ms) : std::string("-"), fmt_bytes_gb(r.bytes),
                             d.gbps, 100 * d.frac, d.floor_ms, d.ratio,
                             c != collect_ms.end() && r.total_ms > 0 ? fmt::format("{:.2f}x", c->second / r.total_ms)
                                                                     : std::string("-"));
    }
  }
  // ---- best variant per case and transport, against the goals (printed last)
  if (!rep.singles.empty()) {
    summary += "\n## best single-rank dispatch per token count (issue 17's goals: 1.12x its floor at 32768, 1.35x at "
               "4096; graph: back-to-back in one CUDA graph)\n\n| tokens | best variant | top-k fill | time us | time / floor "
               "| graph us | graph / floor | vLLM time / floor |\n|---|---|---|---|---|---|---|---|\n";
    std::map<int64_t, const cuda::BenchSingle*> best;
    for (const cuda::BenchSingle& s : rep.singles)
      if (best.find(s.tokens) == best.end() || s.ms < best[s.tokens]->ms) best[s.tokens] = &s;
    for (const auto& [tokens, s] : best) {
      const Derived d = derive(s->ms, s->bytes, rep.copy_gbps);
      const auto v = kVllm.find(tokens);
      summary += fmt::format("| {} | {} | {} | {:.1f} | {:.2f} | {} | {} | {} |\n", tokens, s->variant,
                             fill_label(s->fused_topk, s->topk_fill), s->ms * 1e3, d.ratio, graph_us(s->graph_ms),
                             graph_ratio(s->graph_ms, d.floor_ms),
                             v == kVllm.end() ? std::string("-") : fmt::format("{:.2f}", v->second.ratio));
    }
  }
  if (!rep.runs.empty()) {
    summary += "\n## best variant per case (goals at PCP 8: staging >= 1.6x, direct >= 2.4x over collect; each "
               "transport within 1.2x of its floor)\n\n";
    summary += "| model | P | kv | transport | best variant | layer ms | time/floor | speedup vs collect |\n"
               "|---|---|---|---|---|---|---|---|\n";
    std::map<std::string, const cuda::BenchRun*> best;  // key|transport -> fastest run
    std::vector<std::string> order;
    for (const cuda::BenchRun& r : rep.runs) {
      const std::string k = run_key(r) + "|" + to_string(r.transport);
      auto it = best.find(k);
      if (it == best.end()) {
        best[k] = &r;
        order.push_back(k);
      } else if (r.total_ms < it->second->total_ms) {
        it->second = &r;
      }
    }
    for (const std::string& k : order) {
      const cuda::BenchRun& r = *best[k];
      const Derived d = derive(r.total_ms, r.bytes, rep.copy_gbps);
      const auto c = collect_ms.find(run_key(r));
      summary += fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {} |\n", r.model, r.pcp, to_string(r.kv_format),
                             to_string(r.transport), shown_variant(r), r.total_ms, d.ratio,
                             c != collect_ms.end() && r.total_ms > 0 ? fmt::format("{:.2f}x", c->second / r.total_ms)
                                                                     : std::string("-"));
    }
  }
  md += summary;
  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  if (!a.json_path.empty()) {
    std::ofstream f(a.json_path);
    PCPKV_CHECK(f.good(), "--json: cannot write '{}'", a.json_path);
    f << j.dump(2) << "\n";
  }
  if (!a.markdown_path.empty()) {
    std::ofstream f(a.markdown_path);
    PCPKV_CHECK(f.good(), "--markdown: cannot write '{}'", a.markdown_path);
    f << md;
  }
}

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
  report(rep, a, command);
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
