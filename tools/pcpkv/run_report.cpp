#include "run_report.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "pcpkv/core/layout.h"

namespace pcpkv::cli {
namespace {

// 1234567 -> "1,234,567".
std::string grouped(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string human_bytes(int64_t b) {
  if (b >= 1'000'000'000) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1'000'000) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1'000) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", b);
}

double gbps(int64_t bytes, double ms) { return ms > 0 ? static_cast<double>(bytes) / (ms * 1e6) : 0.0; }

struct RequestSummary {
  int64_t num_prefill = 0, prefill_tokens = 0, num_decode = 0, min_ctx = -1, max_ctx = -1;
};
RequestSummary summarize(const PcpPlan& plan) {
  RequestSummary s;
  for (const RequestSpec& r : plan.requests) {
    if (r.kind == RequestKind::kPrefill) {
      ++s.num_prefill;
      s.prefill_tokens += r.num_new_tokens;
    } else {
      ++s.num_decode;
      s.min_ctx = s.min_ctx < 0 ? r.context_len : std::min(s.min_ctx, r.context_len);
      s.max_ctx = std::max(s.max_ctx, r.context_len);
    }
  }
  return s;
}

}  // namespace

std::string format_plan(const PreparedRun& prep) {
  const PcpPlan& plan = prep.plan;
  const CacheFormat& f = prep.fmt;
  const TransportRowLayout row = transport_row_layout(f);
  const RequestSummary s = summarize(plan);
  std::string out;
  auto line = [&](const char* key, const std::string& value) { out += fmt::format("  {:<17} {}\n", key, value); };

  out += fmt::format("model {} ({}), q_lora_rank {}, kv_lora_rank {}, {}{}\n", prep.model.name, prep.model.model_type,
                     prep.model.q_lora_rank, prep.model.kv_lora_rank, to_string(f.kv_format),
                     f.kv_format == KvFormat::kFp8DsMla ? fmt::format(" ({} tile scales)", to_string(f.ds_mla_scale))
                     : f.kv_format == KvFormat::kFp8    ? fmt::format(" (k_scale {})", f.k_scale)
                                                        : std::string());
  out += fmt::format("layer: {}\n", f.has_indexer ? "with an indexer (writes indexer K)" : "shared (no indexer K)");
  for (const auto& n : prep.notes_text) out += "note: " + n + "\n";
  out += "\nplan\n";
  std::string req = fmt::format("{} prefill ({} tokens)", s.num_prefill, s.prefill_tokens);
  if (s.num_decode) {
    req += fmt::format(", {} decode{} (context {}{})", s.num_decode, s.num_decode > 1 ? "s" : "", s.min_ctx,
                       s.max_ctx != s.min_ctx ? fmt::format("..{}", s.max_ctx) : "");
  }
  line("requests", req + fmt::format(" [{}]", prep.batch_source));
  line("PCP world", fmt::format("{} ranks, {} new tokens", plan.pcp_world, plan.num_global_tokens()));
  std::string per_rank;
  for (int32_t r = 0; r < plan.pcp_world; ++r) {
    const RankPlan& rp = plan.ranks[r];
    per_rank += fmt::format("{}{}", r ? " " : "", rp.num_prefill_tokens);
    if (rp.num_decode_tokens) per_rank += fmt::format("+{}", rp.num_decode_tokens);
  }
  line("tokens per rank", per_rank + (s.num_decode ? "  (prefill+decode)" : "  (prefill)"));
  line("plan modes", fmt::format("local order {}, decodes {}", to_string(plan.local_order),
                                 to_string(plan.decode_ownership)));
  line("max_local_tokens", fmt::format("{} (shorter ranks padded with slot -1)", plan.max_local_tokens));
  line("blocks", fmt::format("{} x {} slots{}; {} slots written", plan.num_blocks, plan.block_size,
                             plan.reserve_null_block ? " (block 0 = null block)" : "", plan.num_written_slots()));
  line("bytes per row", fmt::format("transport {} B, MLA {} B{}", row.row_bytes, mla_row_bytes(f.kv_format),
                                    f.has_indexer ? fmt::format(", indexer slot {} B", kIndexerSlotBytes) : ""));
  StagingGeometry sg;
  sg.pcp_world = plan.pcp_world;
  sg.max_local_tokens = plan.max_local_tokens;
  sg.row_bytes = row.row_bytes;
  line("staging", fmt::format("2 x 1 x {} x {} x {} B = {} per rank", plan.pcp_world, plan.max_local_tokens,
                              row.row_bytes, human_bytes(sg.bytes())));
  line("caches",
       fmt::format("MLA {}{} per replica", human_bytes(plan.num_blocks * plan.block_size * mla_row_bytes(f.kv_format)),
                   f.has_indexer
                       ? fmt::format(", indexer {}", human_bytes(plan.num_blocks * plan.block_size * kIndexerSlotBytes))
                       : ""));
  const bool limit_known = std::isfinite(static_cast<double>(prep.memory_limit));
  line("host memory", fmt::format("estimated peak {} (limit {})",
                                  human_bytes(static_cast<int64_t>(prep.memory_estimate)),
                                  limit_known ? human_bytes(static_cast<int64_t>(prep.memory_limit)) : "unknown"));
  line("inputs", fmt::format("{}, {}", prep.inputs_source,
                             prep.nonfinite.total() ? fmt::format("{} non-finite", prep.nonfinite.total())
                                                    : std::string("all finite")));
  return out;
}

std::string format_stage_table(const TransportRun& run, const std::string& backend_name, int32_t repeats) {
  const StageProfile& p = run.result.profile;
  size_t w = 5;
  for (const Stage& s : p.stages) w = std::max(w, s.name.size());
  std::string out = fmt::format("{} ({} backend{})\n", to_string(run.transport), backend_name,
                                repeats > 1 ? fmt::format(", {} repeats", repeats) : "");
  out += fmt::format("  {:<{}} | {:>10} | {:>15} | {:>8}\n", "stage", w, "ms", "bytes", "GB/s");
  out += fmt::format("  {:-<{}}-+-{:->10}-+-{:->15}-+-{:->8}\n", "", w, "", "", "");
  for (const Stage& s : p.stages) {
    out += fmt::format("  {:<{}} | {:>10.3f} | {:>15} | {:>8.2f}\n", s.name, w, s.ms, grouped(s.bytes),
                       gbps(s.bytes, s.ms));
  }
  out += fmt::format("  {:-<{}}-+-{:->10}-+-{:->15}-+-{:->8}\n", "", w, "", "", "");
  out += fmt::format("  {:<{}} | {:>10.3f} | {:>15} | {:>8.2f}\n", "total", w, p.total_ms(), grouped(p.total_bytes()),
                     gbps(p.total_bytes(), p.total_ms()));
  return out;
}

std::string format_verdict(const RunOutcome& out, double elapsed_s) {
  size_t name_w = 0, t_w = 0;
  for (const Check& c : out.checks) {
    name_w = std::max(name_w, c.name.size());
    t_w = std::max(t_w, c.transport.size());
  }
  std::string s = "verification\n";
  int64_t num_pass = 0;
  for (const Check& c : out.checks) {
    num_pass += c.pass;
    s +=
        fmt::format("  {}  {:<{}}  {:<{}}  {}\n", c.pass ? "PASS" : "FAIL", c.transport, t_w, c.name, name_w, c.detail);
    if (!c.pass && !c.worst.empty()) s += fmt::format("  {:<{}}worst: {}\n", "", 8 + t_w + name_w, c.worst);
  }
  for (const std::string& n : out.notes) s += "note: " + n + "\n";
  s += fmt::format("verdict: {} ({} of {} checks passed) in {:.1f} s\n", out.ok() ? "PASS" : "FAIL", num_pass,
                   out.checks.size(), elapsed_s);
  return s;
}

nlohmann::ordered_json run_json(const PreparedRun& prep, const RunOutcome& out, double elapsed_s,
                                const std::string& saved, const std::string& save_error) {
  using json = nlohmann::ordered_json;
  const PcpPlan& plan = prep.plan;
  const TransportRowLayout row = transport_row_layout(prep.fmt);
  json j;
  // ok: the whole command succeeded (a failed --save exits 3); checks_ok: the verdict alone.
  j["ok"] = out.ok() && save_error.empty();
  j["checks_ok"] = out.ok();
  j["elapsed_s"] = elapsed_s;
  j["backend"] = {{"name", out.backend_name}, {"device", out.backend_device}, {"note", out.backend_note}};
  j["model"] = {{"name", prep.model.name},
                {"model_type", prep.model.model_type},
                {"q_lora_rank", prep.model.q_lora_rank},
                {"kv_lora_rank", prep.model.kv_lora_rank},
                {"index_n_heads", prep.model.index_n_heads},
                {"rope_theta", prep.model.rope.theta}};
  j["format"] = {{"kv_format", to_string(prep.fmt.kv_format)},
                 {"ds_mla_scale", to_string(prep.fmt.ds_mla_scale)},
                 {"k_scale", prep.fmt.k_scale},
                 {"has_indexer", prep.fmt.has_indexer}};
  json requests = json::array();
  for (const RequestSpec& r : plan.requests) {
    requests.push_back({{"kind", r.kind == RequestKind::kPrefill ? "prefill" : "decode"},
                        {"num_new_tokens", r.num_new_tokens},
                        {"context_len", r.context_len}});
  }
  json prefill = json::array(), decode = json::array();
  for (const RankPlan& rp : plan.ranks) {
    prefill.push_back(rp.num_prefill_tokens);
    decode.push_back(rp.num_decode_tokens);
  }
  j["plan"] = {{"pcp_world", plan.pcp_world},
               {"block_size", plan.block_size},
               {"num_blocks", plan.num_blocks},
               {"num_tokens", plan.num_global_tokens()},
               {"num_written_slots", plan.num_written_slots()},
               {"requests", requests},
               {"prefill_tokens_per_rank", prefill},
               {"decode_tokens_per_rank", decode},
               {"local_order", to_string(plan.local_order)},
               {"decode_ownership", to_string(plan.decode_ownership)},
               {"max_local_tokens", plan.max_local_tokens},
               {"transport_row_bytes", row.row_bytes},
               {"mla_row_bytes", mla_row_bytes(prep.fmt.kv_format)},
               {"indexer_slot_bytes", prep.fmt.has_indexer ? kIndexerSlotBytes : 0}};
  j["inputs"] = {{"source", prep.inputs_source},
                 {"nonfinite",
                  {{"q_c", prep.nonfinite.q_c},
                   {"kv", prep.nonfinite.kv},
                   {"k_pe", prep.nonfinite.k_pe},
                   {"index_k", prep.nonfinite.index_k},
                   {"weights", prep.nonfinite.weights},
                   {"total", prep.nonfinite.total()}}}};
  json notes = prep.notes_text;
  for (const std::string& n : out.notes) notes.push_back(n);
  j["notes"] = notes;
  j["memory"] = {{"estimate_bytes", static_cast<double>(prep.memory_estimate)},
                 {"limit_bytes", static_cast<double>(prep.memory_limit)}};
  json transports = json::array();
  for (const TransportRun& run : out.runs) {
    json stages = json::array();
    for (const Stage& s : run.result.profile.stages) {
      stages.push_back({{"stage", s.name}, {"ms", s.ms}, {"bytes", s.bytes}, {"gb_per_s", gbps(s.bytes, s.ms)}});
    }
    transports.push_back({{"transport", to_string(run.transport)},
                          {"stages", stages},
                          {"total_ms", run.result.profile.total_ms()},
                          {"total_bytes", run.result.profile.total_bytes()}});
  }
  j["transports"] = transports;
  if (!prep.transport_reason.empty())
    j["transport_choice"] = {{"transport", to_string(prep.transports.front())}, {"reason", prep.transport_reason}};
  j["checks"] = json::parse(checks_json(out.checks));
  j["saved"] = saved.empty() ? json(nullptr) : json(saved);
  j["save_error"] = save_error.empty() ? json(nullptr) : json(save_error);
  return j;
}

}  // namespace pcpkv::cli
