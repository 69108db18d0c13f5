// `pcpkv mp-publish`: one process's rank of a layer's publication, one process per rank.
// Run it under `pcpkv launch --nproc N` (or torchrun): the world of N processes is split into --tp PCP
// groups of N / tp ranks ({0..P-1}, {P..2P-1}, ...); each group publishes its own batch (seed + group
// index, so a write that crossed groups would show) with each requested transport, and each group's
// rank 0 checks every replica of its group byte for byte against the single-process CPU reference and
// prints the group's stage table and verdict. Stage times (CUDA): each rank's median over --repeats timed
// runs after --warmup untimed ones (CUDA events per stage), every rank's column, and the max over ranks;
// the total is each rank's median run total, max over ranks; the speedup over collect of the same run;
// for staging and direct the bytes each GPU receives through the dispatch's P2P stores and the bandwidth
// that achieves (with --link-gbps also the floor received bytes / link bandwidth); staging == direct over
// every replica (FNV-64 of all bytes).
//
// The job runs in three steps (mp_publish.h): setup, loop, report.
//
// Exit code (every rank agrees): 0 all checks passed, 1 a check failed, 2 bad input,
// 4 a peer failed (killed, stuck past the fence timeout, or gone from the rendezvous).
#include <algorithm>
#include <cmath>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "mp_publish.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv::cli {

namespace {

// A fence bound past a day is a typo, and one near INT64_MAX overflows the deadline into the past.
constexpr int64_t kMaxFenceTimeoutMs = int64_t{24} * 3600 * 1000;

// Every flag that needs no world, cheapest first; run before the rendezvous (run_rank_program): alone, a typo is
// refused at once ("pcpkv: error: --flag: ...", exit 2); with peers, every rank names it right after the
// rendezvous, before anything is allocated or printed.
}  // namespace

void check_flags(const MpPublishFlags& f) {
  // `run` and `attention` take --pcp; here the launcher decides the world (CLI11 alone would say "The
  // following arguments were not expected: 0 --pcp").
  PCPKV_CHECK(!f.pcp_given,
              "--pcp {}: mp-publish has no --pcp flag: its PCP world size is the number of ranks the launcher starts "
              "divided by --tp, e.g. pcpkv launch --nproc 4 -- mp-publish --tp 1 publishes with PCP 4",
              f.pcp);
  PCPKV_CHECK(f.tokens >= 0, "--tokens: must be >= 0, got {}", f.tokens);
  PCPKV_CHECK(f.decodes >= 0, "--decodes: must be >= 0, got {}", f.decodes);
  PCPKV_CHECK(f.tokens > 0 || f.decodes > 0, "--tokens 0 --decodes 0: the batch is empty");
  check_block_size_flag(f.block_size);
  PCPKV_CHECK(f.tp >= 1, "--tp: must be >= 1, got {}", f.tp);
  check_run_count("--repeats", f.repeats, 1);
  check_run_count("--warmup", f.warmup, 0);
  PCPKV_CHECK(f.threads >= 1, "--threads: must be >= 1, got {}", f.threads);
  PCPKV_CHECK(f.threads <= 1024, "--threads: {} is more than pcpkv supports (1024)", f.threads);
  PCPKV_CHECK(f.topk_width >= 0, "--topk-width: must be >= 0, got {}", f.topk_width);
  (void)parse_topk_fill(f.topk_fill, "--topk-fill");
  PCPKV_CHECK(f.guard_bytes >= 0, "--guard-bytes: must be >= 0, got {}", f.guard_bytes);
  PCPKV_CHECK(f.base_offset >= 0, "--base-offset: must be >= 0, got {}", f.base_offset);
  PCPKV_CHECK((f.guard_bytes + f.base_offset) % 16 == 0,
              "--guard-bytes {} --base-offset {}: their sum must be a multiple of 16 (the cache's alignment)",
              f.guard_bytes, f.base_offset);
  PCPKV_CHECK(f.fence_timeout_ms >= 1 && f.fence_timeout_ms <= kMaxFenceTimeoutMs,
              "--fence-timeout-ms: must be in [1, {}] (one day), got {}", kMaxFenceTimeoutMs, f.fence_timeout_ms);
  PCPKV_CHECK(f.graph_replays >= 0, "--graph-replays: must be >= 0, got {}", f.graph_replays);
  PCPKV_CHECK(f.kill_rank >= -1, "--kill-rank: must be a rank (>= 0) or -1 (off), got {}", f.kill_rank);
  PCPKV_CHECK(f.corrupt_rank >= -1, "--corrupt-rank: must be a rank (>= 0) or -1 (off), got {}", f.corrupt_rank);
  (void)replica_check_from_env();  // a bad PCPKV_CHECK_REPLICAS is refused here, by every rank on its own
  PCPKV_CHECK(std::isfinite(f.flush_l2_mb) && f.flush_l2_mb >= 0, "--flush-l2-mb: must be >= 0 and finite, got {}",
              f.flush_l2_mb);
  PCPKV_CHECK(std::isfinite(f.link_gbps) && f.link_gbps >= 0, "--link-gbps: must be >= 0 and finite, got {}",
              f.link_gbps);
  check_backend_name(f.backend);
  check_collect_via(f.collect_via);
  (void)parse_format_flags(f);
  (void)parse_local_order(f.local_order, "--local-order");
  (void)parse_decode_ownership(f.decode_ownership, "--decode-ownership");
  (void)candidate_transports(f.transport);
  if (f.config.empty()) (void)preset(f.model);
}

std::vector<std::pair<std::string, std::string>> mp_publish_agreed_fields(const MpPublishFlags& f) {
  // Everything that shapes the plan, the inputs, the shared buffers, the number and order of the collectives or
  // the verdict. Not: --threads, --fence-timeout-ms, --flush-l2-mb, --json, --md-rows, --link-gbps (how one rank
  // works or prints). --config travels by its path and its bytes: the same path may hold another file elsewhere.
  auto num = [](auto v) { return fmt::format("{}", v); };
  return {{"--model", f.model},
          {"--config", f.config.empty() ? "(none)" : fmt::format("'{}' ({})", f.config, file_fingerprint(f.config))},
          {"--tokens", num(f.tokens)},
          {"--decodes", num(f.decodes)},
          {"--block-size", num(f.block_size)},
          {"--local-order", f.local_order},
          {"--decode-ownership", f.decode_ownership},
          {"--kv-format", f.kv_format},
          {"--ds-mla-scale", f.ds_mla_scale},
          {"--k-scale", num(f.k_scale)},
          {"--layer", f.layer},
          {"--transport", f.transport},
          {"--backend", f.backend},
          {"--tp", num(f.tp)},
          {"--seed", num(f.seed)},
          {"--repeats", num(f.repeats)},
          {"--warmup", num(f.warmup)},
          {"--topk-width", num(f.topk_width)},
          {"--topk-fill", f.topk_fill},
          {"--guard-bytes", num(f.guard_bytes)},
          {"--base-offset", num(f.base_offset)},
          {"--no-check", f.no_check ? "on" : "off"},
          {"--check-replicas (or PCPKV_CHECK_REPLICAS)", f.check_replicas || replica_check_from_env() ? "on" : "off"},
          {"--collect-via", f.collect_via},
          {"--graph-replays", num(f.graph_replays)},
          {"--leak-check", f.leak_check ? "on" : "off"},
          {"--kill-rank", num(f.kill_rank)},
          {"--corrupt-rank", num(f.corrupt_rank)}};
}

namespace {

int mp_publish(const MpPublishFlags& f, Bootstrap& world) {
  // Before anything is planned, allocated or written: ranks started with other flags are refused on every rank,
  // naming the flag and both values (their symmetric buffers would otherwise differ in size at best).
  world.agree_on("", mp_publish_agreed_fields(f));
  MpJob job;
  setup_mp_job(f, world, job);
  const MpLoopResult loop = run_mp_loop(f, job);
  const bool ok = report_mp(f, world, job, loop);
  // Every rank exits with the same code: agree on the verdict of every group.
  uint8_t mine_ok = ok ? 1 : 0;
  std::vector<uint8_t> all_ok(static_cast<size_t>(world.world_size()));
  world.all_gather(&mine_ok, 1, all_ok.data());
  return std::all_of(all_ok.begin(), all_ok.end(), [](uint8_t v) { return v == 1; }) ? 0 : 1;
}

}  // namespace

void add_mp_publish_command(CLI::App& app) {
  auto f = std::make_shared<MpPublishFlags>();
  CLI::App* sub = app.add_subcommand(
      "mp-publish",
      "One rank of a multi-process publication; run it as: pcpkv launch --nproc N -- mp-publish [flags] (each PCP "
      "group's rank 0 checks every replica against the single-process CPU reference)");
  using F = BatchFlag;
  add_batch_flags(sub, *f,
                  {F::kModel, F::kConfig, F::kTokens, F::kDecodes, F::kBlockSize, F::kLocalOrder,
                   F::kDecodeOwnership, F::kKvFormat, F::kDsMlaScale, F::kKScale, F::kLayer, F::kTransport,
                   F::kBackend},
                  {{F::kDecodes, "Decode requests (see --decode-ownership)"},
                   {F::kTransport, "all | comma list of collect, staging, direct | auto (direct when every peer is "
                                   "reachable by peer stores, else collect over NCCL; says why)"},
                   {F::kBackend, "auto | cpu | cuda (GPU: local rank % visible GPUs, or PCPKV_DEVICE)"}});
  sub->add_option("--tp", f->tp, "TP size: the world splits into this many PCP groups of contiguous ranks")
      ->capture_default_str();
  add_batch_flags(sub, *f, {F::kSeed, F::kRepeats},
                  {{F::kSeed, "Input and block-table seed (PCP group g uses seed + 1000003 g)"},
                   {F::kRepeats,
                    "Timed publications per transport (CUDA: each rank's median per stage is printed; CPU: the mean)"}});
  sub->add_option("--warmup", f->warmup, "CUDA: untimed publications per transport before the timed ones")
      ->capture_default_str();
  sub->add_option("--flush-l2-mb", f->flush_l2_mb,
                  "CUDA: before each run, overwrite a scratch buffer of this many MiB (cold L2; 0: off)")
      ->capture_default_str();
  sub->add_option("--link-gbps", f->link_gbps,
                  "Per-GPU receive bandwidth of the links in GB/s (e.g. pcpkv bench-link's all-pairs figure): "
                  "prints the floor received bytes / link bandwidth of the P2P stores")
      ->capture_default_str();
  sub->add_flag("--md-rows", f->md_rows, "Also print markdown table rows prefixed 'md|' (for docs/perf.md)");
  add_batch_flags(sub, *f, {F::kThreads, F::kTopkWidth, F::kTopkFill}, {{F::kThreads, "CPU threads per rank process"}});
  sub->add_option("--guard-bytes", f->guard_bytes, "Guard bytes (0xA5) before and after each cache")
      ->capture_default_str();
  sub->add_option("--base-offset", f->base_offset, "Offset of the cache inside its allocation")->capture_default_str();
  sub->add_option("--fence-timeout-ms", f->fence_timeout_ms, "Bound of every fence wait; past it the missing rank "
                                                             "is named and the rank exits 4")
      ->capture_default_str();
  sub->add_flag("--no-check", f->no_check, "Skip the byte check against the single-process CPU reference");
  sub->add_flag("--json", f->json, "Each group leader prints JSON on stdout (the table goes to stderr)");
  sub->add_option("--collect-via", f->collect_via,
                  "CUDA collect all-gathers: auto (NCCL when every rank has its own GPU, else p2p) | nccl | p2p")
      ->capture_default_str();
  sub->add_option("--graph-replays", f->graph_replays,
                  "CUDA: after each transport's run, capture one publication into a CUDA graph and replay it this "
                  "many times; the check then applies to the bytes after the last replay, and the fence epochs "
                  "must have advanced on every replay")
      ->capture_default_str();
  sub->add_flag("--leak-check", f->leak_check,
                "Before the checked run: two rounds of set-up, publish and teardown; descriptors, shared-memory "
                "mappings and free device memory after the second must equal those before it");
  sub->add_option("--kill-rank", f->kill_rank,
                  "Testing: this global rank SIGKILLs itself after its dispatch, before the fence");
  sub->add_flag("--check-replicas", f->check_replicas,
                "Debug mode: after each publication every rank hashes the written slots of its own replica and the "
                "ranks compare the hashes (one small exchange; also PCPKV_CHECK_REPLICAS=1); a mismatch fails the "
                "verdict, naming the layer, the ranks and the first differing slot");
  // Hidden (empty group), like run's --inject-fault: proves a corrupted replica fails the replica check.
  sub->add_option("--corrupt-rank", f->corrupt_rank,
                  "Testing: this global rank flips one bit of its own replica after each publication")
      ->group("");
  sub->add_option("--pcp", f->pcp, "Not a flag of mp-publish: the PCP world is launch --nproc / --tp")->group("");
  sub->callback([f, sub] {
    f->pcp_given = sub->count("--pcp") > 0;
    f->ds_mla_scale_given = sub->count("--ds-mla-scale") > 0;
    f->k_scale_given = sub->count("--k-scale") > 0;
    // The host-memory check, too, is one rank's verdict: another rank's other --tokens may pass it.
    const int code = run_rank_program(
        "mp-publish",
        [&] {
          check_flags(*f);
          check_mp_host_memory(*f);
        },
        [&](Bootstrap& world) { return mp_publish(*f, world); });
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
