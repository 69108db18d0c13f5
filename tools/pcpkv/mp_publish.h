// tools/pcpkv/mp_publish.h: `pcpkv mp-publish` in three steps, one file each: setup (mp_publish_setup.cpp:
// memory pre-checks, plan, inputs, the rank's group and publisher options), loop (mp_publish_loop.cpp: the
// leak check, then per transport publish, gather every rank's stage times, check against the CPU
// reference) and report (mp_publish_report.cpp: the stage tables, verdict and JSON). The flags and the
// subcommand: cmd_mp_publish.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "batch_flags.h"
#include "launch_cmds.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/checks.h"
#include "pcpkv/ranks/bootstrap.h"

namespace pcpkv::cli {

/// Flags of `pcpkv mp-publish`; the batch flags: batch_flags.h.
struct MpPublishFlags : BatchFlags {
  MpPublishFlags() {
    tokens = 4096;
    decodes = 2;
    threads = 1;  // per rank process
  }
  int32_t tp = 1;
  int64_t guard_bytes = 256;
  int64_t base_offset = 0;
  int64_t fence_timeout_ms = 30000;
  bool no_check = false;
  bool json = false;
  int32_t kill_rank = -1;
  bool check_replicas = false;  // --check-replicas (PCPKV_CHECK_REPLICAS=1 too): the run-time replica check
  int32_t corrupt_rank = -1;    // hidden testing aid: this global rank flips a bit of its replica after each publish
  std::string collect_via = "auto";
  int32_t graph_replays = 0;
  bool leak_check = false;
  int32_t warmup = 0;
  double flush_l2_mb = 0;
  double link_gbps = 0;
  bool md_rows = false;
  std::string pcp;  // hidden: refused with a pointer to launch --nproc (mp-publish's world comes from the launcher)
  bool pcp_given = false;
  bool ds_mla_scale_given = false, k_scale_given = false;  // for the notes on flags the format ignores
};

/// --transport as the flag checks and the memory estimate see it: parse_transport_list, and for "auto" what
/// it may pick (collect or direct; setup_mp_job decides after the rendezvous). mp_publish_setup.cpp.
std::vector<Transport> candidate_transports(const std::string& transport);

/// Every flag that needs no world, cheapest first (cmd_mp_publish.cpp).
void check_flags(const MpPublishFlags& f);

/// What every rank of an mp-publish job must share, as (flag, value) pairs for Bootstrap::agree_on, which
/// compares them right after the rendezvous (cmd_mp_publish.cpp).
std::vector<std::pair<std::string, std::string>> mp_publish_agreed_fields(const MpPublishFlags& f);

/// Refuses (throws pcpkv::Error), checked by every rank before the rendezvous and carried into it
/// (run_rank_program), a job whose ranks on this host need more host memory than it has (mp_publish_setup.cpp).
void check_mp_host_memory(const MpPublishFlags& f);

/// What one rank publishes and with whom: built by setup_mp_job, in place (setup points into plan, model).
struct MpJob {
  GroupLayout layout;
  int32_t group_idx = 0;
  ModelConfig model;
  PcpPlan plan;
  CacheFormat fmt;
  std::vector<Transport> transports;  // --transport auto: the one chosen after the rendezvous (auto_transport)
  std::string transport_reason;       // --transport auto: "--transport auto: direct: ..." ("" otherwise)
  uint64_t group_seed = 0;  // each PCP group publishes its own inputs
  GlobalInputs inputs;
  PublishSetup setup;
  std::string backend_name;
  RankPublisherFactory factory;
  std::unique_ptr<Bootstrap> group;  // this rank's PCP group
  RankPublishOptions opt;
  bool leader = false;  // rank 0 of its PCP group: checks, prints
  bool check_replicas = false;  // --check-replicas or PCPKV_CHECK_REPLICAS=1
};

/// Validates what needs the world, builds plan, inputs and the group (mp_publish_setup.cpp).
void setup_mp_job(const MpPublishFlags& f, Bootstrap& world, MpJob& job);

/// One transport's timings over the group and (leader, unless --no-check) its checks.
struct TransportReport {
  Transport transport;
  std::vector<Stage> stages;        // per stage the max over ranks of each rank's median; bytes summed over ranks
  std::vector<std::vector<double>> rank_stage_ms;  // [rank][stage] each rank's median over the timed runs
  std::vector<double> rank_total_ms;               // [rank] median over runs of the run's stage sum
  double total_ms = 0;              // max over ranks of rank_total_ms
  int32_t samples = 0;              // timed runs per rank
  uint64_t replicas_hash = 0;       // replicas_fingerprint of the group (checked runs)
  double stage_ms(const std::string& name) const {
    for (const Stage& s : stages)
      if (s.name == name) return s.ms;
    return 0.0;
  }
  bool checked = false;
  int32_t graph_replays = 0;        // > 0: the bytes checked are those after this many CUDA graph replays
  // pcpkv/publish/checks.h: replicas == reference, guard bytes, rank 0's q_c_out / top-k (checked runs),
  // the fence epochs (graph replays; every rank's must have advanced), and with --check-replicas the run-time
  // replica check (every rank holds the same result)
  std::vector<Check> checks;
  const Check* find(const std::string& name) const {
    for (const Check& c : checks)
      if (c.name == name) return &c;
    return nullptr;
  }
  bool ok() const {
    for (const Check& c : checks)
      if (!c.pass) return false;
    return true;
  }
};

struct MpLoopResult {
  std::vector<TransportReport> reports;
  bool leak_ok = true;
  std::string leak_note;
  std::string device;  // the publisher's device
  double total_s = 0;
};

/// --leak-check, then every transport: publish, gather, check (mp_publish_loop.cpp).
MpLoopResult run_mp_loop(const MpPublishFlags& f, MpJob& job);

/// The group leader prints the tables and the verdict (text, or JSON on stdout with --json); returns this
/// group's verdict (every rank computes it; only the leader prints). mp_publish_report.cpp.
bool report_mp(const MpPublishFlags& f, const Bootstrap& world, const MpJob& job, const MpLoopResult& loop);

}  // namespace pcpkv::cli
