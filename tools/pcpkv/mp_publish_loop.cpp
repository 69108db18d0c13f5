// `pcpkv mp-publish`, step 2 (mp_publish.h): the leak check, then per transport: publish, gather every
// rank's stage times (median over the timed runs), and on the group leader check every replica against
// the single-process CPU reference (pcpkv/publish/checks.h).
#include <algorithm>
#include <chrono>
#include <optional>

#include <fmt/format.h>

#include "mp_publish.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/ranks/symmetric.h"
#include "pcpkv_bench/fence.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {
namespace {


// Free bytes of this rank's device (CUDA), -1 on the CPU backend.
int64_t device_free_bytes(const std::string& backend) {
#if defined(PCPKV_HAVE_CUDA)
  if (backend == "cuda") return cuda::device_free_bytes();
#endif
  (void)backend;
  return -1;
}

}  // namespace

MpLoopResult run_mp_loop(const MpPublishFlags& f, MpJob& job) {
  const PcpPlan& plan = job.plan;
  const CacheFormat& fmt = job.fmt;
  const GlobalInputs& inputs = job.inputs;
  const PublishSetup& setup = job.setup;
  const RankPublisherFactory& factory = job.factory;
  const RankPublishOptions& opt = job.opt;
  const std::vector<Transport>& transports = job.transports;
  const std::string& backend_name = job.backend_name;
  const bool leader = job.leader;
  const auto t0 = std::chrono::steady_clock::now();
  MpLoopResult out;
  std::vector<TransportReport>& reports = out.reports;

  // --leak-check: one warm-up round (lazy initialization), then count descriptors, shared-memory mappings
  // and free device memory before a second round and after its publisher is gone.
  std::string& leak_note = out.leak_note;
  bool& leak_ok = out.leak_ok;
  if (f.leak_check) {
    for (int round = 0; round < 2; ++round) {
      job.group->barrier();
      const ResourceCounts before = count_process_resources();
      const int64_t free_before = device_free_bytes(backend_name);
      job.group->barrier();
      {
        auto p = factory(*job.group, setup, opt);
        for (Transport t : transports) p->publish(inputs, t);
        job.group->barrier();
      }
      job.group->barrier();
      const ResourceCounts after = count_process_resources();
      const int64_t free_after = device_free_bytes(backend_name);
      if (round == 1) {
        // Device memory: a leaked symmetric buffer is >= 2 MiB (the VMM granularity); the driver may keep a
        // few page-table pages, so differences below 1 MiB are not counted.
        leak_ok = after.open_fds == before.open_fds && after.shm_mappings == before.shm_mappings &&
                  free_before - free_after < (int64_t{1} << 20);
        leak_note = fmt::format("descriptors {} -> {}, shared-memory mappings {} -> {}{}", before.open_fds,
                                after.open_fds, before.shm_mappings, after.shm_mappings,
                                free_before >= 0 ? fmt::format(", free device memory {} -> {} bytes", free_before,
                                                               free_after)
                                                 : "");
      }
    }
  }

  auto pub = factory(*job.group, setup, opt);
  std::unique_ptr<Backend> ref_backend = leader && !f.no_check ? make_cpu_backend(f.threads) : nullptr;
  const std::vector<int64_t> slots = job.check_replicas ? written_slots(plan) : std::vector<int64_t>{};
  const std::vector<int64_t> index_slots = job.check_replicas ? written_index_slots(plan) : std::vector<int64_t>{};
  // The run-time replica check (--check-replicas): every rank hashes its own replica, one exchange; every rank
  // gets the same Check. Its wall time (hash + exchange, this rank) goes into the leader's line.
  auto replica_check = [&](Transport t, const std::string& iteration) {
    const auto c0 = std::chrono::steady_clock::now();
    Check c = check_replica_hashes_across(*job.group, pub->replica_slot_hashes(slots, index_slots), slots,
                                          replica_hash_bytes_per_slot(fmt), {setup.layer_idx, to_string(t), iteration},
                                          opt.global_ranks, index_slots);
    c.detail += fmt::format("; {:.2f} ms on rank {} (hash + exchange)",
                            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c0).count(),
                            opt.global_ranks[static_cast<size_t>(job.group->rank())]);
    return c;
  };
  for (Transport t : transports) {
    RankPublishResult mine = pub->publish(inputs, t);
    std::vector<Check> replica_checks;
    if (job.check_replicas) replica_checks.push_back(replica_check(t, ""));
    // The timed runs' samples (the graph replays below are not timed). CPU: one sample, the mean.
    const StageProfile timed_profile = mine.profile;
    std::vector<std::vector<double>> timed_samples = mine.stage_samples_ms;
    if (timed_samples.empty()) {
      timed_samples.emplace_back();
      for (const Stage& s : timed_profile.stages) timed_samples.back().push_back(s.ms);
    }
    int32_t replays = 0;
    std::optional<Check> epochs;
    if (f.graph_replays > 0) {
      // Capture once, replay: every replay must advance the device epochs and leave the same bytes.
      const std::vector<uint64_t> e0 = mine.fence_epochs;
      mine = pub->publish_graph_replays(inputs, t, f.graph_replays);
      replays = f.graph_replays;
      epochs = check_fence_epochs(e0, mine.fence_epochs, replays);
      if (job.check_replicas) replica_checks.push_back(replica_check(t, fmt::format("after {} graph replays", replays)));
    }
    // Every timed run's stage times of every rank: [rank][run][stage], and every rank's stage bytes.
    const size_t S = timed_profile.stages.size();
    const size_t R = timed_samples.size();
    const size_t W = static_cast<size_t>(job.group->world_size());
    std::vector<double> flat(R * S, 0.0);
    for (size_t run = 0; run < R; ++run)
      for (size_t k = 0; k < S && k < timed_samples[run].size(); ++k) flat[run * S + k] = timed_samples[run][k];
    std::vector<double> all_flat(flat.size() * W);
    std::vector<int64_t> bytes(S), all_bytes(S * W);
    for (size_t k = 0; k < S; ++k) bytes[k] = timed_profile.stages[k].bytes;
    if (!flat.empty()) {
      job.group->all_gather(flat.data(), flat.size() * sizeof(double), all_flat.data());
      job.group->all_gather(bytes.data(), bytes.size() * sizeof(int64_t), all_bytes.data());
    }
    TransportReport rep;
    rep.samples = static_cast<int32_t>(R);
    for (size_t q = 0; q < W; ++q) {
      std::vector<double> per_stage(S), totals(R, 0.0);
      for (size_t k = 0; k < S; ++k) {
        std::vector<double> v(R);
        for (size_t run = 0; run < R; ++run) {
          v[run] = all_flat[(q * R + run) * S + k];
          totals[run] += v[run];
        }
        per_stage[k] = percentile(v, 0.5);
      }
      rep.rank_stage_ms.push_back(per_stage);
      rep.rank_total_ms.push_back(percentile(totals, 0.5));
      rep.total_ms = std::max(rep.total_ms, rep.rank_total_ms.back());
    }
    rep.transport = t;
    rep.graph_replays = replays;
    // Every rank's epochs must have advanced: agree within the group.
    uint8_t eok = !epochs || epochs->pass ? 1 : 0;
    std::vector<uint8_t> all_eok(static_cast<size_t>(job.group->world_size()));
    job.group->all_gather(&eok, 1, all_eok.data());
    const bool all_epochs_ok = std::all_of(all_eok.begin(), all_eok.end(), [](uint8_t v) { return v == 1; });
    // Bytes: each rank's share of the transport table's byte model, summed (the stage names are the table's,
    // the same as the CPU reference's).
    for (size_t k = 0; k < S; ++k) {
      Stage s = timed_profile.stages[k];
      s.ms = 0;
      s.bytes = 0;
      for (size_t q = 0; q < W; ++q) {
        s.ms = std::max(s.ms, rep.rank_stage_ms[q][k]);
        s.bytes += all_bytes[q * S + k];
      }
      rep.stages.push_back(s);
    }
    if (ref_backend) {
      PublishSetup ref_setup = setup;
      ref_setup.repeats = 1;  // the reference's bytes do not depend on repeats; its time is not reported
      const PublishResult ref = ref_backend->publish(ref_setup, inputs, t);
      rep.checked = true;
      PublishResult got = ref;  // geometry from the reference, bytes from the replicas
      for (int32_t q = 0; q < job.group->world_size(); ++q) {
        got.mla_alloc[q] = pub->read_mla_alloc(q);
        got.index_alloc[q] = pub->read_index_alloc(q);
      }
      rep.replicas_hash = replicas_fingerprint(got);
      rep.checks.push_back(check_replicas_vs_reference(got, ref, fmt, opt.global_ranks));
      rep.checks.push_back(check_guards(got, plan, fmt, opt.global_ranks));
      rep.checks.push_back(check_outputs_vs_reference(setup.materialize_q ? mine.q_c_out : std::vector<uint16_t>{},
                                                      mine.topk, ref, 0));
    }
    if (epochs) {
      epochs->pass = all_epochs_ok;  // this rank's note; the verdict is every rank's
      rep.checks.push_back(*epochs);
    }
    for (Check& c : replica_checks) rep.checks.push_back(std::move(c));
    reports.push_back(std::move(rep));
    job.group->barrier();  // peers keep their replicas until the leader has read them
  }
  out.device = pub->device();
  out.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace pcpkv::cli
