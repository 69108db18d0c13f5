// `pcpkv bench`'s markdown tables (see bench_report.h): the device and kernels, then one section per kind of row.
#include <fmt/format.h>

#include "bench_report.h"

namespace pcpkv::cli {
namespace {

std::string header(const cuda::BenchReport& rep, const std::string& topk_fill, const std::string& command) {
  std::string md;
  md += fmt::format("# pcpkv bench\n\ndevice: {} ({} SMs, {} MB L2); copy bandwidth {:.0f} GB/s (device-to-device "
                    "copy of {:.2f} GiB, read + write, same run)\n\ncommand: `{}`\n\n",
                    rep.device, rep.num_sms, rep.l2_bytes >> 20, rep.copy_gbps,
                    static_cast<double>(rep.copy_bytes) / (1 << 30), command);
  md += fmt::format("top-k fill: staging, direct and the single-rank dispatch `{}`; collect `full` (as engines do)\n\n",
                    topk_fill);
  md += "## dispatch kernels (registers, shared memory, spills, occupancy)\n\n";
  for (const std::string& k : rep.kernels) md += "- " + k + "\n";
  return md;
}

std::string single_rank(const cuda::BenchReport& rep) {
  if (rep.singles.empty()) return "";
  std::string md;
  md += "\n## dispatch alone, one rank (GLM-5, fp8_ds_mla, indexer layer, top-k fill; docs/perf.md's vLLM case)\n\n";
  md += "Time: one launch on an idle GPU (the host's launch path included, as the vLLM column was measured); graph: "
        "per call of back-to-back dispatches in one CUDA graph (the kernel on a busy GPU).\n\n";
  md += "| tokens | variant | top-k fill | time us | graph us | bytes MB | floor us | time / floor | graph / floor | "
        "vLLM time / floor |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const cuda::BenchSingle& s : rep.singles) {
    const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
    md += fmt::format("| {} | {} | {} | {:.1f} | {} | {:.1f} | {:.1f} | {:.2f} | {} | {} |\n", s.tokens, s.variant,
                      fill_label(s.fused_topk, s.topk_fill), s.ms * 1e3, graph_us(s.graph_ms), s.bytes / 1e6,
                      d.floor_ms * 1e3, d.ratio, graph_ratio(s.graph_ms, d.floor_ms), vllm_ratio_text(s.tokens));
  }
  return md;
}

// Rank 0's dispatch alone in a PCP group.
std::string per_gpu(const cuda::BenchReport& rep) {
  if (rep.per_gpu.empty()) return "";
  std::string md;
  md += fmt::format("\n## per GPU: rank 0's dispatch alone, PCP {} ({} local rows of one prefill, fp8_ds_mla, indexer "
                    "layer, top-k fill), writing {} staging slots / replicas\n\n",
                    rep.per_gpu.front().pcp, rep.per_gpu.front().local_tokens, rep.per_gpu.front().pcp);
  md += "| model | transport | variant | time us | graph us | bytes MB | floor us | time / floor | graph / floor |\n"
        "|---|---|---|---|---|---|---|---|---|\n";
  for (const cuda::BenchPerGpu& g : rep.per_gpu) {
    const Derived d = derive(g.ms, g.bytes, rep.copy_gbps);
    md += fmt::format("| {} | {} | {} | {:.1f} | {} | {:.1f} | {:.1f} | {:.2f} | {} |\n", g.model,
                      to_string(g.transport), g.variant, g.ms * 1e3, graph_us(g.graph_ms), g.bytes / 1e6,
                      d.floor_ms * 1e3, d.ratio, graph_ratio(g.graph_ms, d.floor_ms));
  }
  return md;
}

std::string stages(const cuda::BenchReport& rep) {
  std::string md;
  if (!rep.runs.empty()) {
    md += "\n## stages (median of the timed runs)\n\n";
    md += "| model | P | kv | transport | variant | stage | ms | MB | GB/s | % copy BW |\n|---|---|---|---|---|---|---|---|---|---|\n";
  }
  for (const cuda::BenchRun& r : rep.runs) {
    for (const cuda::BenchStage& s : r.stages) {
      const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
      md += fmt::format("| {} | {} | {} | {} | {} | {} | {:.4f} | {:.1f} | {:.0f} | {:.0f} |\n", r.model, r.pcp,
                        to_string(r.kv_format), to_string(r.transport), shown_variant(r), s.name, s.ms, s.bytes / 1e6,
                        d.gbps, 100 * d.frac);
    }
  }
  return md;
}

// The replica check (a debug mode): rows under the stages, never in a transport's total, and a note on their cost.
std::string replica_checks(const cuda::BenchReport& rep) {
  std::string md, notes;
  for (const cuda::BenchReplicaCheck& c : rep.replica_checks) {
    const Derived d = derive(c.ms, c.bytes, rep.copy_gbps);
    const double direct_ms = fastest_direct_ms(rep, c);
    md += fmt::format("| {} | {} | {} | replica-check | - | hashes of {} replicas x {} slots + compare ({}) | {:.4f} | "
                      "{:.1f} | {:.0f} | {:.0f} |\n",
                      c.model, c.pcp, to_string(c.kv_format), c.pcp, c.slots, c.pass ? "pass" : "FAIL", c.ms,
                      c.bytes / 1e6, d.gbps, 100 * d.frac);
    notes += fmt::format("{}{} {}: {:.1f} MB of cache rows read{}", notes.empty() ? "" : "; ", c.model,
                         to_string(c.kv_format), c.cache_bytes_read / 1e6,
                         direct_ms > 0 ? fmt::format(", {:.2f}x the direct publication", c.ms / direct_ms) : "");
  }
  if (!rep.replica_checks.empty())
    md += fmt::format("\nreplica-check rows: the run-time replica check (`--check-replicas`, a debug mode) of one "
                      "layer's publication, timed on its own after a direct publication and counted in no transport "
                      "total; MB = rows hashed + slot lists + hashes written and compared ({})\n",
                      notes);
  return md;
}

std::string pdl(const cuda::BenchReport& rep) {
  if (rep.pdl.empty()) return "";
  std::string md;
  md += fmt::format("\n## PDL: dispatch -> fence (-> combine) with programmatic stream serialization, CUDA-graph replay of "
                    "{} layers, time per layer\n\n", rep.pdl.front().layers);
  md += "| model | P | tokens | transport | kernels | PDL off us | PDL on us | on / off |\n|---|---|---|---|---|---|---|---|\n";
  for (const cuda::BenchPdl& p : rep.pdl) {
    md += fmt::format("| {} | {} | {} | {} | {} | {:.2f} | {:.2f} | {:.3f} |\n", p.model, p.pcp, p.tokens,
                      to_string(p.transport), p.variant, p.us_off, p.us_on, p.us_off > 0 ? p.us_on / p.us_off : 0.0);
  }
  return md;
}

}  // namespace

std::string bench_tables_markdown(const cuda::BenchReport& rep, const std::string& topk_fill,
                                  const std::string& command) {
  return header(rep, topk_fill, command) + single_rank(rep) + per_gpu(rep) + stages(rep) + replica_checks(rep) +
         pdl(rep);
}

}  // namespace pcpkv::cli
