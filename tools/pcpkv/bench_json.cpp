// `pcpkv bench --json`: every row with its derived numbers (see bench_report.h).
#include "bench_report.h"

namespace pcpkv::cli {
namespace {

using nlohmann::json;

json single_rank(const cuda::BenchReport& rep) {
  json js = json::array();
  for (const cuda::BenchSingle& s : rep.singles) {
    const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
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
                  {"vllm_time_over_floor", vllm_ratio_json(s.tokens)}});
  }
  return js;
}

json per_gpu(const cuda::BenchReport& rep) {
  json jg = json::array();
  for (const cuda::BenchPerGpu& g : rep.per_gpu) {
    const Derived d = derive(g.ms, g.bytes, rep.copy_gbps);
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
  return jg;
}

json runs(const cuda::BenchReport& rep) {
  const CollectTimes collect = collect_times(rep);
  json jr = json::array();
  for (const cuda::BenchRun& r : rep.runs) {
    json stages = json::array();
    for (const cuda::BenchStage& s : r.stages) {
      const Derived d = derive(s.ms, s.bytes, rep.copy_gbps);
      stages.push_back({{"name", s.name}, {"ms", s.ms}, {"bytes", s.bytes}, {"gbps", d.gbps}, {"fraction_of_copy", d.frac}});
    }
    const Derived d = derive(r.total_ms, r.bytes, rep.copy_gbps);
    const auto c = collect.ms.find(run_key(r));
    const auto cg = collect.graph_ms.find(run_key(r));
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
    if (c != collect.ms.end() && r.total_ms > 0) jrun["speedup_vs_collect"] = c->second / r.total_ms;
    if (cg != collect.graph_ms.end() && r.graph_ms > 0 && cg->second > 0)
      jrun["graph_speedup_vs_collect"] = cg->second / r.graph_ms;
    jr.push_back(jrun);
  }
  return jr;
}

json replica_checks(const cuda::BenchReport& rep) {
  json jc = json::array();
  for (const cuda::BenchReplicaCheck& c : rep.replica_checks) {
    const Derived d = derive(c.ms, c.bytes, rep.copy_gbps);
    const double direct_ms = fastest_direct_ms(rep, c);
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
  return jc;
}

json pdl(const cuda::BenchReport& rep) {
  json jp = json::array();
  for (const cuda::BenchPdl& p : rep.pdl) {
    jp.push_back({{"model", p.model},
                  {"pcp", p.pcp},
                  {"tokens", p.tokens},
                  {"transport", to_string(p.transport)},
                  {"variant", p.variant},
                  {"layers", p.layers},
                  {"us_off", p.us_off},
                  {"us_on", p.us_on}});
  }
  return jp;
}

}  // namespace

json bench_json(const cuda::BenchReport& rep, const std::string& command) {
  json j;
  j["command"] = command;
  j["device"] = {{"name", rep.device}, {"num_sms", rep.num_sms}, {"l2_bytes", rep.l2_bytes}};
  j["copy_bandwidth_gbps"] = rep.copy_gbps;
  j["copy_bytes"] = rep.copy_bytes;
  j["kernels"] = rep.kernels;
  // Sections without rows are left out, except the runs and the replica check (always there, maybe empty).
  if (!rep.singles.empty()) j["single_rank"] = single_rank(rep);
  if (!rep.per_gpu.empty()) j["per_gpu"] = per_gpu(rep);
  j["runs"] = runs(rep);
  j["replica_check"] = replica_checks(rep);
  if (!rep.pdl.empty()) j["pdl"] = pdl(rep);
  return j;
}

}  // namespace pcpkv::cli
