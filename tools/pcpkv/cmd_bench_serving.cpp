// tools/pcpkv/cmd_bench_serving.cpp: `pcpkv bench-serving`, the serving kernels of SPEC section 7 on the GPU:
//   router   router GEMM (both small-T kernels per experts-per-CTA, with and without PDL, cuBLASLt
//            bf16 -> fp32, the dispatch) for each preset and token count, with the suggested dispatch table
//            (fastest variant per token count, also printed as table rows);
//   allreduce  all-reduce latency by size, W logical ranks on one GPU (one-shot, two-shot, fused);
//   pdl      chains of pcpkv kernels with PDL off and on, CUDA-graph replay.
// Timings: CUDA events, median of >= 20 graph replays after warm-up. Output: markdown on stdout (and --md),
// JSON with every row (--json).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "pcpkv/commands.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/model.h"
#include "pcpkv/serving/router.h"

#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv_bench/allreduce.h"
#include "pcpkv_bench/pdl.h"
#include "pcpkv_bench/router.h"
#endif

namespace pcpkv::cli {
namespace {

struct ServeBenchOptions {
  std::vector<std::string> what = {"router", "allreduce", "pdl"};
  std::vector<std::string> presets = {"glm-5", "deepseek-v3.2"};
  std::vector<int64_t> tokens = {1, 2, 4, 8, 16, 32};
  std::vector<int32_t> worlds = {2, 4, 8};
  std::vector<int64_t> bytes = {4096, 12288, 65536, 98304, 262144, 393216, 786432, 1048576, 4194304, 16777216};
  std::vector<int64_t> pdl_tokens = {1, 8, 64};
  int64_t hidden = 6144;
  int32_t iters = 50;
  int32_t warmup = 10;
  bool hot = false;
  bool router_pdl = true;
  std::string json_path;
  std::string md_path;
};

#if defined(PCPKV_HAVE_CUDA)

/// Variant names in column order: small/e*, small2/e*, then the same with +pdl.
std::vector<std::string> router_variant_columns(const std::vector<cuda::RouterBenchRow>& rows) {
  std::vector<std::string> names;
  for (const char* pdl : {"", "+pdl"})
    for (const char* prefix : {"small/", "small2/"})
      for (const int e : {1, 2, 4, 8}) {
        const std::string n = fmt::format("{}e{}{}", prefix, e, pdl);
        for (const auto& r : rows)
          if (r.variant == n) {
            names.push_back(n);
            break;
          }
      }
  return names;
}

bool is_pdl_variant(const std::string& v) { return v.size() > 4 && v.compare(v.size() - 4, 4, "+pdl") == 0; }

/// The RouterDispatchEntry initializer of a variant name ("cublaslt", "small/e1", "small2/e2").
std::string dispatch_row(const std::string& variant, const std::string& max_tokens) {
  if (variant == "cublaslt") return fmt::format("{{{}, RouterPath::kCublasLt, 0, RouterSmallKernel::kRowLoop}}", max_tokens);
  const bool staged = variant.rfind("small2/", 0) == 0;
  const std::string e = variant.substr(variant.find("/e") + 2);
  return fmt::format("{{{}, RouterPath::kSmallT, {}, RouterSmallKernel::{}}}", max_tokens, e,
                     staged ? "kStaged" : "kRowLoop");
}

std::string router_markdown(const std::vector<cuda::RouterBenchRow>& rows, bool cold) {
  std::string md;
  std::map<std::string, std::map<int64_t, std::map<std::string, double>>> t;  // preset -> T -> variant -> us
  std::vector<std::string> presets;
  std::map<std::string, std::map<std::string, double>> floors;  // preset -> "floor/..." -> us (num_tokens 0)
  for (const auto& r : rows) {
    if (r.cold != cold) continue;
    if (std::find(presets.begin(), presets.end(), r.preset) == presets.end()) presets.push_back(r.preset);
    if (r.num_tokens == 0) floors[r.preset][r.variant] = r.us;
    else t[r.preset][r.num_tokens][r.variant] = r.us;
  }
  const std::vector<std::string> cols = router_variant_columns(rows);
  for (const auto& p : presets) {
    md += fmt::format("\n**Router GEMM, {} ({} L2), microseconds per call**\n\n", p, cold ? "cold" : "hot");
    md += "| T | cuBLASLt | best small-T | auto (dispatch) | cuBLASLt / auto |";
    for (const auto& c : cols) md += fmt::format(" {} |", c);
    md += "\n|---|---|---|---|---|";
    for (size_t i = 0; i < cols.size(); ++i) md += "---|";
    md += "\n";
    for (const auto& [T, v] : t[p]) {
      auto get = [&](const std::string& k) { return v.count(k) ? fmt::format("{:.2f}", v.at(k)) : std::string("-"); };
      std::string best = "-";
      double best_us = 1e30;
      for (const auto& [name, us] : v)
        if (name.rfind("small", 0) == 0 && !is_pdl_variant(name) && us < best_us) {
          best_us = us;
          best = fmt::format("{:.2f} ({})", us, name);
        }
      const double ratio = v.count("cublaslt") && v.count("auto") ? v.at("cublaslt") / v.at("auto") : 0.0;
      md += fmt::format("| {} | {} | {} | {} | {:.2f}x |", T, get("cublaslt"), best, get("auto"), ratio);
      for (const auto& c : cols) md += fmt::format(" {} |", get(c));
      md += "\n";
    }
    if (floors.count(p) && floors[p].count("floor/empty-kernel") && floors[p].count("floor/read-W")) {
      const double e = floors[p]["floor/empty-kernel"], rw = floors[p]["floor/read-W"];
      md += fmt::format("\nFloors, timed the same way: an empty kernel {:.2f} us per call; a kernel that only reads W "
                        "(cold, one CTA of 128 threads per expert) {:.2f} us.", e, rw);
      if (t[p].count(1) && t[p][1].count("cublaslt"))
        md += fmt::format(" At T = 1, cuBLASLt / read-W = {:.2f}x: about the most a kernel that reads W once can gain "
                          "without PDL.",
                          t[p][1]["cublaslt"] / rw);
      md += "\n";
    }
    // PDL: the same calls back to back with PDL on, against cuBLASLt without it.
    bool any_pdl = false;
    for (const auto& c : cols) any_pdl = any_pdl || is_pdl_variant(c);
    if (any_pdl) {
      md += fmt::format("\nPDL ({}): cuBLASLt / variant, calls back to back in one graph\n\n| T |", p);
      for (const auto& c : cols)
        if (is_pdl_variant(c)) md += fmt::format(" {} |", c);
      md += "\n|---|";
      for (const auto& c : cols)
        if (is_pdl_variant(c)) md += "---|";
      md += "\n";
      for (const auto& [T, v] : t[p]) {
        md += fmt::format("| {} |", T);
        for (const auto& c : cols)
          if (is_pdl_variant(c))
            md += v.count(c) && v.count("cublaslt") ? fmt::format(" {:.2f} us ({:.2f}x) |", v.at(c), v.at("cublaslt") / v.at(c))
                                                   : std::string(" - |");
        md += "\n";
      }
    }
  }
  // Suggested dispatch: the fastest variant per token count (without PDL), summed over presets.
  md += "\n**Suggested dispatch (fastest variant per T without PDL, summed over presets; compare with "
        "src/serving/drivers/router_dispatch.cpp)**\n\n";
  md += "| T | fastest | us (sum over presets) | cuBLASLt (sum) |\n|---|---|---|---|\n";
  std::map<int64_t, std::map<std::string, double>> sum;
  std::map<int64_t, std::map<std::string, int>> seen;
  for (const auto& r : rows)
    if (r.cold == cold && r.num_tokens > 0 && r.variant != "auto" && !is_pdl_variant(r.variant)) {
      sum[r.num_tokens][r.variant] += r.us;
      ++seen[r.num_tokens][r.variant];
    }
  std::vector<std::pair<int64_t, std::string>> fastest;
  for (const auto& [T, v] : sum) {
    std::string best;
    double best_us = 1e30;
    for (const auto& [name, us] : v)  // only variants measured on every preset
      if (seen[T][name] == static_cast<int>(presets.size()) && us < best_us) {
        best_us = us;
        best = name;
      }
    fastest.emplace_back(T, best);
    md += fmt::format("| {} | {} | {:.2f} | {} |\n", T, best, best_us,
                      v.count("cublaslt") ? fmt::format("{:.2f}", v.at("cublaslt")) : std::string("-"));
  }
  // The same as table rows: consecutive token counts with one winner merge; the last row covers the rest.
  md += "\nAs rows of router_dispatch_table():\n\n```\n";
  for (size_t i = 0; i < fastest.size(); ++i) {
    if (i + 1 < fastest.size() && fastest[i + 1].second == fastest[i].second) continue;
    const bool last = i + 1 == fastest.size();
    const bool small_last = last && fastest[i].second != "cublaslt";
    md += dispatch_row(fastest[i].second, last && !small_last ? "INT32_MAX" : std::to_string(fastest[i].first)) + ",\n";
    if (small_last) md += dispatch_row("cublaslt", "INT32_MAX") + ",\n";
  }
  md += "```\n";
  return md;
}

std::string allreduce_markdown(const std::vector<cuda::AllReduceBenchRow>& rows) {
  std::string md = "\n**All-reduce, W logical ranks on one GPU, microseconds per call (bytes per rank)**\n\n";
  std::map<std::pair<int32_t, int64_t>, std::map<std::string, double>> t;
  for (const auto& r : rows) t[{r.world_size, r.bytes}][r.variant] = r.us;
  md += "| W | bytes | oneshot | twoshot | auto | fused-oneshot | fused-twoshot | fused-auto |\n"
        "|---|---|---|---|---|---|---|---|\n";
  for (const auto& [key, v] : t) {
    auto get = [&](const std::string& k) { return v.count(k) ? fmt::format("{:.2f}", v.at(k)) : std::string("-"); };
    md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", key.first, key.second, get("oneshot"),
                      get("twoshot"), get("auto"), get("fused-oneshot"), get("fused-twoshot"), get("fused-auto"));
  }
  return md;
}

std::string pdl_markdown(const std::vector<cuda::PdlBenchRow>& rows) {
  std::string md = "\n**PDL, microseconds per chain (CUDA-graph replay)**\n\n";
  md += "| chain | T | kernels | PDL off | PDL on | saved | saved per kernel |\n|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows)
    md += fmt::format("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} ({:.1f}%) | {:.2f} |\n", r.chain, r.num_tokens,
                      r.num_kernels, r.us_off, r.us_on, r.us_off - r.us_on, 100.0 * (r.us_off - r.us_on) / r.us_off,
                      (r.us_off - r.us_on) / r.num_kernels);
  return md;
}

void run_serving_bench(const ServeBenchOptions& o) {
  auto wants = [&](const char* w) { return std::find(o.what.begin(), o.what.end(), w) != o.what.end(); };
  for (const auto& w : o.what)
    PCPKV_CHECK(w == "router" || w == "allreduce" || w == "pdl", "--what: '{}' is not one of router, allreduce, pdl",
                clip(w));
  check_run_count("--iters", o.iters, 20);
  check_run_count("--warmup", o.warmup, 0);
  for (const auto& p : o.presets) router_config(preset(p));  // unknown presets fail before any GPU work
  std::string why;
  PCPKV_CHECK(cuda::device_count(&why) > 0, "bench-serving: needs a CUDA device ({})", why);
  nlohmann::json j;
  j["command"] = "pcpkv bench-serving";
  j["iters"] = o.iters;
  j["warmup"] = o.warmup;
  std::string md = "# pcpkv bench-serving\n";
  if (wants("router")) {
    std::vector<cuda::RouterBenchRow> rows;
    for (const auto& p : o.presets) {
      cuda::RouterBenchOptions ro;
      ro.tokens = o.tokens;
      ro.iters = o.iters;
      ro.warmup = o.warmup;
      ro.cold = !o.hot;
      ro.pdl_variants = o.router_pdl;
      const auto r = cuda::bench_router_gemm(p, router_config(preset(p)), ro);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    md += router_markdown(rows, true);
    if (o.hot) md += router_markdown(rows, false);
    for (const auto& r : rows)
      j["router"].push_back({{"preset", r.preset}, {"tokens", r.num_tokens}, {"variant", r.variant}, {"cold", r.cold},
                             {"us", r.us}, {"weight_gbps", r.weight_gbps}});
    nlohmann::json table;
    for (const auto& e : router_dispatch_table())
      table.push_back({{"max_tokens", e.max_tokens}, {"path", to_string(e.path)}, {"experts_per_cta", e.experts_per_cta},
                       {"kernel", to_string(e.kernel)}});
    j["router_dispatch_table"] = table;
  }
  if (wants("allreduce")) {
    cuda::AllReduceBenchOptions ao;
    ao.world_sizes = o.worlds;
    ao.bytes = o.bytes;
    ao.hidden = o.hidden;
    ao.iters = o.iters;
    ao.warmup = o.warmup;
    const auto rows = cuda::bench_allreduce(ao);
    md += allreduce_markdown(rows);
    for (const auto& r : rows)
      j["allreduce"].push_back({{"world_size", r.world_size}, {"bytes", r.bytes}, {"variant", r.variant},
                                {"num_blocks", r.num_blocks}, {"us", r.us}, {"algbw_gbps", r.algbw_gbps}});
  }
  if (wants("pdl")) {
    cuda::PdlBenchOptions po;
    po.tokens = o.pdl_tokens;
    po.iters = o.iters;
    po.warmup = o.warmup;
    const auto rows = cuda::bench_pdl(po);
    md += pdl_markdown(rows);
    for (const auto& r : rows)
      j["pdl"].push_back({{"chain", r.chain}, {"tokens", r.num_tokens}, {"kernels", r.num_kernels}, {"us_off", r.us_off},
                          {"us_on", r.us_on}});
  }
  std::fputs(md.c_str(), stdout);
  if (!o.md_path.empty()) {
    std::ofstream f(o.md_path);
    PCPKV_CHECK(f.good(), "--md: cannot write '{}'", o.md_path);
    f << md;
  }
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    PCPKV_CHECK(f.good(), "--json: cannot write '{}'", o.json_path);
    f << j.dump(2) << "\n";
  }
}

#endif  // PCPKV_HAVE_CUDA

}  // namespace

void add_serving_command(CLI::App& app) {
  auto o = std::make_shared<ServeBenchOptions>();
  auto* sub = app.add_subcommand(
      "bench-serving",
      "Benchmark the serving kernels (SPEC section 7) on the GPU: router GEMM vs cuBLASLt, all-reduce latency "
      "by size (W logical ranks on one GPU), PDL on/off; markdown and JSON");
  sub->add_option("--what", o->what, "Which benchmarks: router, allreduce, pdl (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--preset", o->presets, "Router presets (comma-separated)")->delimiter(',')->capture_default_str();
  sub->add_option("--tokens", o->tokens, "Router token counts")->delimiter(',')->capture_default_str();
  sub->add_option("--worlds", o->worlds, "All-reduce world sizes (logical ranks)")->delimiter(',')->capture_default_str();
  sub->add_option("--bytes", o->bytes, "All-reduce sizes in bytes per rank (multiples of 16)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--hidden", o->hidden, "Row length of the fused all-reduce")->capture_default_str();
  sub->add_option("--pdl-tokens", o->pdl_tokens, "Token counts of the PDL chains")->delimiter(',')->capture_default_str();
  sub->add_option("--iters", o->iters, "Timed graph replays per measurement (>= 20)")->capture_default_str();
  sub->add_option("--warmup", o->warmup, "Untimed replays first")->capture_default_str();
  sub->add_flag("--hot", o->hot, "Also time the router with W resident in L2");
  sub->add_flag("!--no-router-pdl", o->router_pdl, "Skip the router's +pdl variants (calls back to back with PDL)");
  sub->add_option("--json", o->json_path, "Write every row as JSON here");
  sub->add_option("--md", o->md_path, "Write the markdown tables here");
  sub->callback([o] {
#if defined(PCPKV_HAVE_CUDA)
    run_serving_bench(*o);
#else
    throw CLI::RuntimeError("pcpkv bench-serving: this build has no CUDA (nvcc was not found at configure time)", 2);
#endif
  });
}

}  // namespace pcpkv::cli
