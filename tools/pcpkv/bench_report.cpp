// `pcpkv bench`'s report: the derived numbers every output shows, and where the outputs go (see bench_report.h).
#include "bench_report.h"

#include <cstdio>
#include <fstream>

#include <fmt/format.h>

#include "pcpkv/core/error.h"

namespace pcpkv::cli {
namespace {

struct VllmRef {
  double us, floor_us, ratio;
};
const std::map<int64_t, VllmRef> kVllm = {{4096, {33.9, 17.8, 1.90}}, {32768, {232.0, 143.0, 1.63}}};

}  // namespace

Derived derive(double ms, int64_t bytes, double copy_gbps) {
  Derived d;
  if (ms > 0) d.gbps = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  d.frac = copy_gbps > 0 ? d.gbps / copy_gbps : 0;
  d.floor_ms = copy_gbps > 0 ? static_cast<double>(bytes) / (copy_gbps * 1e9) * 1e3 : 0;
  d.ratio = d.floor_ms > 0 ? ms / d.floor_ms : 0;
  return d;
}

std::string vllm_ratio_text(int64_t tokens) {
  const auto v = kVllm.find(tokens);
  return v == kVllm.end() ? std::string("-") : fmt::format("{:.2f}", v->second.ratio);
}

nlohmann::json vllm_ratio_json(int64_t tokens) {
  const auto v = kVllm.find(tokens);
  return v == kVllm.end() ? nlohmann::json(nullptr) : nlohmann::json(v->second.ratio);
}

std::string fmt_bytes_gb(int64_t b) { return fmt::format("{:.3f}", static_cast<double>(b) / 1e9); }

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

CollectTimes collect_times(const cuda::BenchReport& rep) {
  CollectTimes c;
  for (const cuda::BenchRun& r : rep.runs)
    if (r.transport == Transport::kCollect) {
      c.ms[run_key(r)] = r.total_ms;
      c.graph_ms[run_key(r)] = r.graph_ms;
    }
  return c;
}

std::string speedup_text(const CollectTimes& collect, const cuda::BenchRun& r) {
  const auto c = collect.ms.find(run_key(r));
  return c != collect.ms.end() && r.total_ms > 0 ? fmt::format("{:.2f}x", c->second / r.total_ms) : std::string("-");
}

std::string fill_label(bool fused, TopkFill f) {
  const std::string where = fused ? "fused" : "separate";
  return f == TopkFill::kFull ? where : fmt::format("{}, {}", where, to_string(f));
}

std::string shown_variant(const cuda::BenchRun& r) {
  return r.topk_fill == TopkFill::kFull ? r.variant : fmt::format("{} (fill {})", r.variant, to_string(r.topk_fill));
}

double fastest_direct_ms(const cuda::BenchReport& rep, const cuda::BenchReplicaCheck& c) {
  double direct_ms = 0;
  for (const cuda::BenchRun& r : rep.runs)
    if (r.transport == Transport::kDirect && r.model == c.model && r.pcp == c.pcp && r.kv_format == c.kv_format &&
        (direct_ms == 0 || r.total_ms < direct_ms))
      direct_ms = r.total_ms;
  return direct_ms;
}

void write_bench_report(const cuda::BenchReport& rep, const std::string& topk_fill, const std::string& command,
                        const std::string& json_path, const std::string& markdown_path) {
  const std::string md = bench_tables_markdown(rep, topk_fill, command) + bench_summary_markdown(rep);
  std::fputs(md.c_str(), stdout);
  std::fflush(stdout);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    PCPKV_CHECK(f.good(), "--json: cannot write '{}'", json_path);
    f << bench_json(rep, command).dump(2) << "\n";
  }
  if (!markdown_path.empty()) {
    std::ofstream f(markdown_path);
    PCPKV_CHECK(f.good(), "--markdown: cannot write '{}'", markdown_path);
    f << md;
  }
}

}  // namespace pcpkv::cli
