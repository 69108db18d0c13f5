// `pcpkv mp-publish`, step 3 (mp_publish.h): the group leader's report: a stage table per transport (every
// rank's median, the max over ranks, the P2P bytes of the dispatch), the checks, staging == direct, the
// verdict; --json prints the same as JSON on stdout and the table on stderr; --md-rows adds markdown rows.
#include <algorithm>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "mp_publish.h"
#include "pcpkv/flag_checks.h"
#include "publish/publish_layout.h"

namespace pcpkv::cli {
namespace {

const char* pass_fail(const Check& c) { return c.pass ? "PASS" : "FAIL"; }

// Bytes the dispatch's P2P stores move between GPUs (the transport tables' byte model, publish/transport_table.h): direct stores
// every written row's final cache bytes into every replica; staging stores all M packed rows into every
// peer's staging slot. Own-replica stores are local, not counted.
struct P2pBytes {
  int64_t max_received = 0;  // the GPU that receives the most
  int64_t max_sent = 0;
};
P2pBytes p2p_bytes(const PublishSetup& s, Transport t) {
  const PcpPlan& plan = *s.plan;
  const mp::PublishLayout l = mp::make_publish_layout(s);
  const int32_t W = plan.pcp_world;
  const int64_t cache_row_bytes = l.row.mla_bytes + (s.fmt.has_indexer ? kIndexerSlotBytes : 0);
  std::vector<int64_t> sent_per_peer(static_cast<size_t>(W));
  for (int32_t q = 0; q < W; ++q) {
    const RankPlan& rp = plan.ranks[static_cast<size_t>(q)];
    const int64_t written =
        std::count_if(rp.slot_mapping.begin(), rp.slot_mapping.end(), [](int64_t x) { return x >= 0; });
    sent_per_peer[static_cast<size_t>(q)] =
        t == Transport::kDirect ? written * cache_row_bytes : plan.max_local_tokens * l.row.row_bytes;
  }
  P2pBytes b;
  int64_t total = 0;
  for (int64_t v : sent_per_peer) total += v;
  for (int32_t r = 0; r < W; ++r) {
    b.max_received = std::max(b.max_received, total - sent_per_peer[static_cast<size_t>(r)]);
    b.max_sent = std::max(b.max_sent, sent_per_peer[static_cast<size_t>(r)] * (W - 1));
  }
  return b;
}

}  // namespace

bool report_mp(const MpPublishFlags& f, const Bootstrap& world, const MpJob& job, const MpLoopResult& loop) {
  const GroupLayout& layout = job.layout;
  const int32_t group_idx = job.group_idx;
  const ModelConfig& model = job.model;
  const PcpPlan& plan = job.plan;
  const CacheFormat& fmt = job.fmt;
  const PublishSetup& setup = job.setup;
  const RankPublishOptions& opt = job.opt;
  const std::string& backend_name = job.backend_name;
  const uint64_t group_seed = job.group_seed;
  const bool leader = job.leader;
  const std::vector<TransportReport>& reports = loop.reports;
  const bool leak_ok = loop.leak_ok;
  const std::string& leak_note = loop.leak_note;
  const double total_s = loop.total_s;

  bool ok = leak_ok;
  for (const auto& r : reports) ok = ok && r.ok();
  bool same_staging_direct = true;
  if (leader) {
    std::string text = fmt::format(
        "pcpkv mp-publish: {} processes, TP {} x PCP {}; PCP group {} = global ranks {}..{}; backend {} ({})\n",
        world.world_size(), layout.tp_size, layout.pcp_size, group_idx, opt.global_ranks.front(),
        opt.global_ranks.back(), backend_name, loop.device);
    text += fmt::format("  model {}, {} tokens over {} ranks (max {} per rank), {} {}, block size {}, seed {}\n",
                        model.name, plan.num_global_tokens(), plan.pcp_world, plan.max_local_tokens,
                        to_string(fmt.kv_format), fmt.has_indexer ? "indexer layer" : "shared layer", plan.block_size,
                        group_seed);
    for (const std::string& n : unused_format_flag_notes(fmt.kv_format, f.ds_mla_scale_given, f.k_scale_given))
      text += fmt::format("  note: {}\n", n);
    const double collect_ms = [&] {
      for (const auto& r : reports)
        if (r.transport == Transport::kCollect) return r.total_ms;
      return 0.0;
    }();
    const int32_t G = job.group->world_size();
    for (const auto& r : reports) {
      // Per stage: each rank's median over the timed runs, and the max over ranks.
      text += fmt::format("  {:<8} stage           ms: median of {} run(s) per rank{}\n", to_string(r.transport),
                          r.samples, f.warmup > 0 ? fmt::format(" after {} warm-up", f.warmup) : "");
      std::string head = fmt::format("           {:<14}", "");
      for (int32_t q = 0; q < G; ++q) head += fmt::format(" {:>8}", fmt::format("rank {}", q));
      text += head + fmt::format(" {:>9}   {:>10}\n", "max", "MB (all)");
      for (size_t k = 0; k < r.stages.size(); ++k) {
        std::string line = fmt::format("           {:<14}", r.stages[k].name);
        for (int32_t q = 0; q < G; ++q) line += fmt::format(" {:>8.3f}", r.rank_stage_ms[q][k]);
        text += line + fmt::format(" {:>9.3f}   {:>10.2f}\n", r.stages[k].ms, r.stages[k].bytes / 1e6);
      }
      std::string line = fmt::format("           {:<14}", "total");
      for (int32_t q = 0; q < G; ++q) line += fmt::format(" {:>8.3f}", r.rank_total_ms[q]);
      text += line + fmt::format(" {:>9.3f}", r.total_ms);
      if (collect_ms > 0 && r.transport != Transport::kCollect && r.total_ms > 0)
        text += fmt::format("   {:.2f}x faster than collect", collect_ms / r.total_ms);
      text += "\n";
      if (r.transport != Transport::kCollect && G > 1) {
        // NVLink: what the P2P stores of the dispatch deliver to each GPU from its peers.
        const P2pBytes b = p2p_bytes(setup, r.transport);
        const double dispatch_ms = r.stage_ms("dispatch");
        text += fmt::format(
            "           P2P stores: up to {:.2f} MB received and {:.2f} MB sent per GPU during dispatch ({:.3f} ms): "
            "{:.1f} GB/s received per GPU",
            b.max_received / 1e6, b.max_sent / 1e6, dispatch_ms,
            dispatch_ms > 0 ? b.max_received / (dispatch_ms * 1e6) : 0.0);
        if (f.link_gbps > 0)
          text += fmt::format("; floor received / link ({:.0f} GB/s) = {:.3f} ms, dispatch = {:.2f}x that floor",
                              f.link_gbps, b.max_received / (f.link_gbps * 1e6),
                              dispatch_ms / (b.max_received / (f.link_gbps * 1e6)));
        text += "\n";
      }
      // The wording mp-publish has always printed (tests/cli/launch_*.cpp count these lines).
      if (r.checked) {
        if (const Check* c = r.find("replicas == single-process CPU reference"))
          text += fmt::format("           replicas == single-process CPU reference: {} ({} bytes compared{})\n",
                              pass_fail(*c), c->num_bytes, c->pass ? "" : "; " + c->detail);
        if (const Check* c = r.find("guard/untouched bytes intact"))
          text += fmt::format("           guard bytes untouched: {}{}\n", pass_fail(*c),
                              c->pass ? "" : fmt::format(" ({} bad; first: {})", c->num_diff, c->detail));
        if (const Check* c = r.find("rank 0 q_c_out / top-k == reference"))
          text += fmt::format("           rank 0 q_c_out / top-k == reference: {}\n", pass_fail(*c));
      }
      if (const Check* c = r.find("fence epochs advanced every replay"))
        text += fmt::format("           CUDA graph: captured once, replayed {} times (bytes above are after the "
                            "last replay); epochs advanced every replay: {} ({})\n",
                            r.graph_replays, pass_fail(*c), c->detail);
      for (const Check& c : r.checks)  // --check-replicas: after the run, and after the graph replays
        if (c.name == "replica hashes agree")
          text += fmt::format("           replica check: {} ({})\n", pass_fail(c), c.detail);
      if (!r.checked) text += "           (not checked: --no-check)\n";
    }
    // staging and direct must leave the same bytes in every replica (both also equal the reference).
    const TransportReport* staging = nullptr;
    const TransportReport* direct = nullptr;
    for (const auto& r : reports) {
      if (r.checked && r.transport == Transport::kStaging) staging = &r;
      if (r.checked && r.transport == Transport::kDirect) direct = &r;
    }
    if (staging && direct) {
      const Check c = check_same_fingerprint("staging == direct", staging->replicas_hash, direct->replicas_hash);
      same_staging_direct = c.pass;
      text += fmt::format("  staging == direct ({}): {}\n", c.detail, pass_fail(c));
    }
    if (f.md_rows) {
      // Markdown rows for docs/perf.md (scripts/multigpu_run.sh collects the lines starting with "md|").
      for (const auto& r : reports) {
        std::string stages;
        for (const Stage& s : r.stages) stages += fmt::format("{}{} {:.3f}", stages.empty() ? "" : " + ", s.name, s.ms);
        std::string ranks;
        for (int32_t q = 0; q < G; ++q) ranks += fmt::format("{}{:.3f}", q ? " / " : "", r.rank_total_ms[q]);
        std::string p2p = "-";
        const double dispatch_ms = r.stage_ms("dispatch");
        if (r.transport != Transport::kCollect && G > 1 && dispatch_ms > 0) {
          const P2pBytes b = p2p_bytes(setup, r.transport);
          p2p = fmt::format("{:.0f} GB/s ({:.1f} MB)", b.max_received / (dispatch_ms * 1e6), b.max_received / 1e6);
          if (f.link_gbps > 0)
            p2p += fmt::format(", {:.2f}x floor", dispatch_ms / (b.max_received / (f.link_gbps * 1e6)));
        }
        text += fmt::format("md|| {} | {} | {} | {} | **{:.3f}** | {} | {} | {} | {} |\n", G, to_string(fmt.kv_format),
                            to_string(r.transport), stages, r.total_ms, ranks,
                            r.transport == Transport::kCollect || collect_ms <= 0
                                ? std::string("1.00x")
                                : fmt::format("{:.2f}x", collect_ms / r.total_ms),
                            p2p, !r.checked ? "not checked" : r.ok() ? "PASS" : "FAIL");
      }
    }
    if (f.leak_check)
      text += fmt::format("  leak check (rank {}): {} ({})\n", world.rank(), leak_ok ? "PASS" : "FAIL", leak_note);
    ok = ok && same_staging_direct;
    text += fmt::format("  verdict: {} ({:.2f} s)\n", ok ? "PASS" : "FAIL", total_s);
    if (f.json) {
      nlohmann::json j;
      j["world_size"] = world.world_size();
      j["tp"] = layout.tp_size;
      j["pcp"] = layout.pcp_size;
      j["pcp_group"] = group_idx;
      if (!job.transport_reason.empty())
        j["transport_choice"] = {{"transport", to_string(job.transports.front())}, {"reason", job.transport_reason}};
      j["local_order"] = to_string(plan.local_order);
      j["decode_ownership"] = to_string(plan.decode_ownership);
      j["backend"] = backend_name;
      j["device"] = loop.device;
      j["ok"] = ok;
      if (f.leak_check) j["leak_check"] = {{"ok", leak_ok}, {"detail", leak_note}};
      for (const auto& r : reports) {
        nlohmann::json t;
        t["transport"] = to_string(r.transport);
        for (const Stage& s : r.stages) t["stages"].push_back({{"name", s.name}, {"ms", s.ms}, {"bytes", s.bytes}});
        t["rank_total_ms"] = r.rank_total_ms;
        t["rank_stage_ms"] = r.rank_stage_ms;
        t["total_ms"] = r.total_ms;
        t["samples"] = r.samples;
        t["checked"] = r.checked;
        const Check* same = r.find("replicas == single-process CPU reference");
        const Check* guards = r.find("guard/untouched bytes intact");
        const Check* epochs = r.find("fence epochs advanced every replay");
        t["identical"] = same == nullptr || same->pass;
        t["bytes_compared"] = same ? same->num_bytes : 0;
        t["guard_bad"] = guards ? guards->num_diff : 0;
        t["graph_replays"] = r.graph_replays;
        t["epochs_ok"] = epochs == nullptr || epochs->pass;
        t["checks"] = nlohmann::json::parse(checks_json(r.checks));
        j["transports"].push_back(t);
      }
      std::fputs(j.dump(2).c_str(), stdout);
      std::fputs("\n", stdout);
      std::fputs(text.c_str(), stderr);
    } else {
      std::fputs(text.c_str(), stdout);
    }
    std::fflush(stdout);
    std::fflush(stderr);
  }
  return ok;
}

}  // namespace pcpkv::cli
