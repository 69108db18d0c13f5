// `pcpkv bench`'s report of a cuda::BenchReport, one function per output: the markdown tables (stdout and
// --markdown), the summary tables that close them, and the JSON (--json); the derived numbers all three show (GB/s,
// the copy-bandwidth floor, speedups over collect) are computed once, here.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "pcpkv/publish/cuda.h"

namespace pcpkv::cli {

/// Prints the tables then the summary to stdout, and writes the JSON to json_path and the markdown to markdown_path
/// when they are not empty (pcpkv::Error naming --json / --markdown when a file cannot be written).
/// topk_fill: the --topk-fill flag as given; command: the equivalent full command line, for the record.
void write_bench_report(const cuda::BenchReport& rep, const std::string& topk_fill, const std::string& command,
                        const std::string& json_path, const std::string& markdown_path);

/// The tables (bench_markdown.cpp): the device, the kernels, then one section per kind of row.
std::string bench_tables_markdown(const cuda::BenchReport& rep, const std::string& topk_fill,
                                  const std::string& command);
/// The summary tables printed last (bench_summary.cpp): every run, and the best variant per case.
std::string bench_summary_markdown(const cuda::BenchReport& rep);
/// Every row with its derived numbers (bench_json.cpp).
nlohmann::json bench_json(const cuda::BenchReport& rep, const std::string& command);

// ---- derived numbers, shared by the three outputs (bench_report.cpp) ----------------------------------------

/// A time against the bytes moved and the copy bandwidth of the same run.
struct Derived {
  double gbps = 0, frac = 0, floor_ms = 0, ratio = 0;  // GB/s, fraction of the copy's, byte floor, time / floor
};
Derived derive(double ms, int64_t bytes, double copy_gbps);

/// docs/perf.md: vLLM's Triton fused_norm_rope on one H200, GLM-5, fp8_ds_mla, indexer layer, top-k fill; its
/// time / floor for `tokens` as the tables show it ("-" when not measured) and as JSON (null).
std::string vllm_ratio_text(int64_t tokens);
nlohmann::json vllm_ratio_json(int64_t tokens);

/// Bytes as GB with three decimals.
std::string fmt_bytes_gb(int64_t b);

/// A graph time (ms, < 0: not measured) as the tables and the JSON show it.
std::string graph_us(double ms);
std::string graph_ratio(double ms, double floor_ms);
nlohmann::json graph_json(double ms);
nlohmann::json graph_json(double ms, double floor_ms);

/// The case of a run (model, PCP, format): the key of its collect baseline.
std::string run_key(const cuda::BenchRun& r);

/// The collect run of each case: its time and its graph time, by run_key.
struct CollectTimes {
  std::map<std::string, double> ms, graph_ms;
};
CollectTimes collect_times(const cuda::BenchReport& rep);

/// "1.85x" over the case's collect run, "-" when there is none.
std::string speedup_text(const CollectTimes& collect, const cuda::BenchRun& r);

/// "fused" / "separate", with the fill mode when it is not the engines' full fill.
std::string fill_label(bool fused, TopkFill f);
/// The variant column: the variant, and the fill mode when it is not full (collect always runs full).
std::string shown_variant(const cuda::BenchRun& r);

/// For scale: the fastest direct publication of the replica check's case (ms), 0 when none ran.
double fastest_direct_ms(const cuda::BenchReport& rep, const cuda::BenchReplicaCheck& c);

}  // namespace pcpkv::cli
