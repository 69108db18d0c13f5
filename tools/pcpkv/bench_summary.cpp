// `pcpkv bench`'s summary tables, printed last (see bench_report.h): every run of one layer's publication, then the
// best variant per case against the goals of issue 17 and docs/perf.md.
#include <map>
#include <vector>

#include <fmt/format.h>

#include "bench_report.h"

namespace pcpkv::cli {
namespace {

std::string every_run(const cuda::BenchReport& rep, const CollectTimes& collect) {
  if (rep.runs.empty()) return "";
  std::string md;
  md += fmt::format("\n## summary: one layer's publication, {} tokens, {} layer (copy bandwidth {:.0f} GB/s)\n\n",
                    rep.runs.front().tokens, rep.runs.front().indexer_layer ? "indexer" : "shared", rep.copy_gbps);
  md += "| model | P | kv | transport | variant | layer ms | graph ms | GB | GB/s | % copy BW | floor ms | "
        "time/floor | speedup vs collect |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const cuda::BenchRun& r : rep.runs) {
    const Derived d = derive(r.total_ms, r.bytes, rep.copy_gbps);
    md += fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {} | {} | {:.0f} | {:.0f} | {:.3f} | {:.2f} | {} |\n",
                      r.model, r.pcp, to_string(r.kv_format), to_string(r.transport), shown_variant(r), r.total_ms,
                      r.graph_ms >= 0 ? fmt::format("{:.3f}", r.graph_ms) : std::string("-"), fmt_bytes_gb(r.bytes),
                      d.gbps, 100 * d.frac, d.floor_ms, d.ratio, speedup_text(collect, r));
  }
  return md;
}

std::string best_single_rank(const cuda::BenchReport& rep) {
  if (rep.singles.empty()) return "";
  std::string md;
  md += "\n## best single-rank dispatch per token count (issue 17's goals: 1.12x its floor at 32768, 1.35x at "
        "4096; graph: back-to-back in one CUDA graph)\n\n| tokens | best variant | top-k fill | time us | time / floor "
        "| graph us | graph / floor | vLLM time / floor |\n|---|---|---|---|---|---|---|---|\n";
  std::map<int64_t, const cuda::BenchSingle*> best;
  for (const cuda::BenchSingle& s : rep.singles)
    if (best.find(s.tokens) == best.end() || s.ms < best[s.tokens]->ms) best[s.tokens] = &s;
  for (const auto& [tokens, s] : best) {
    const Derived d = derive(s->ms, s->bytes, rep.copy_gbps);
    md += fmt::format("| {} | {} | {} | {:.1f} | {:.2f} | {} | {} | {} |\n", tokens, s->variant,
                      fill_label(s->fused_topk, s->topk_fill), s->ms * 1e3, d.ratio, graph_us(s->graph_ms),
                      graph_ratio(s->graph_ms, d.floor_ms), vllm_ratio_text(tokens));
  }
  return md;
}

std::string best_variant_per_case(const cuda::BenchReport& rep, const CollectTimes& collect) {
  if (rep.runs.empty()) return "";
  std::string md;
  md += "\n## best variant per case (goals at PCP 8: staging >= 1.6x, direct >= 2.4x over collect; each "
        "transport within 1.2x of its floor)\n\n";
  md += "| model | P | kv | transport | best variant | layer ms | time/floor | speedup vs collect |\n"
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
    md += fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {} |\n", r.model, r.pcp, to_string(r.kv_format),
                      to_string(r.transport), shown_variant(r), r.total_ms, d.ratio, speedup_text(collect, r));
  }
  return md;
}

}  // namespace

std::string bench_summary_markdown(const cuda::BenchReport& rep) {
  const CollectTimes collect = collect_times(rep);
  return every_run(rep, collect) + best_single_rank(rep) + best_variant_per_case(rep, collect);
}

}  // namespace pcpkv::cli
