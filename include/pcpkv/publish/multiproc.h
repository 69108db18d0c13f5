// pcpkv/publish/multiproc.h: one process per rank. TP x PCP groups of a world of processes, and the per-process
// publication driver (SPEC section 5) that runs this rank's part of a layer's publication inside its PCP
// group, over symmetric memory and the cross-process fence.
//
// Each process holds one cache replica and one staging workspace in symmetric memory; every process of the
// PCP group maps every peer's. The transports run exactly as in the single-process backends:
//   collect   dispatch materializes bf16 kv_c / k_pe / index_k into this rank's symmetric buffer, fence,
//             copy every peer's rows (the all-gather), quantize-and-insert into the local replica;
//   staging   dispatch stores packed rows into every peer's staging slot, fence, combine locally;
//   direct    dispatch stores final cache bytes into every peer's replica, fence.
// Every publication starts with a fence too, so that no peer writes into a replica before its owner has
// poisoned it (kGuardByte) for the run. The caches, the staging workspace and their guard bytes follow
// PublishSetup::alloc exactly as the single-process backends lay them out, so the bytes of every replica
// can be compared with the single-process CPU reference byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"

namespace pcpkv {

class Bootstrap;
class HostFence;

/// World of tp_size * pcp_size processes. PCP groups are contiguous: global rank g belongs to PCP group
/// g / pcp_size (its TP index) with PCP rank g % pcp_size; e.g. TP2 x PCP2 on 4 processes gives the PCP
/// groups {0, 1} and {2, 3}. Publication never leaves a PCP group.
struct GroupLayout {
  int32_t world_size = 1;
  int32_t tp_size = 1;
  int32_t pcp_size = 1;
  /// Throws pcpkv::Error("--tp 3 does not divide the world size 4") when tp_size does not divide world_size.
  static GroupLayout make(int32_t world_size, int32_t tp_size);
  int32_t pcp_group_of(int32_t global_rank) const { return global_rank / pcp_size; }
  int32_t pcp_rank_of(int32_t global_rank) const { return global_rank % pcp_size; }
  /// Global ranks of PCP group group_idx, in PCP-rank order.
  std::vector<int32_t> pcp_group_members(int32_t group_idx) const;
};

/// Splits `world` into this process's PCP group (collective over the world). The returned Bootstrap's rank
/// is the PCP rank. Throws pcpkv::Error when the layout does not match world's size.
std::unique_ptr<Bootstrap> make_pcp_group(Bootstrap& world, const GroupLayout& layout);

struct RankPublishOptions {
  /// Bound of every wait at a fence; past it, publish throws pcpkv::FenceTimeout naming the missing rank.
  int64_t fence_timeout_ms = 30000;
  int num_threads = 1;            // CPU: threads of this process's kernels
  int32_t device_idx = -1;        // CUDA: -1 = round-robin, local_rank % visible devices
  std::vector<int32_t> global_ranks;  // [pcp_world] global rank of each PCP rank, for messages (empty: same)
  std::string collect_via = "auto";   // CUDA collect all-gathers: "nccl" (one GPU per rank), "p2p" (peer reads
                                      // of symmetric memory after a fence), "auto" (nccl when possible)
  // ---- measurement (CUDA; the CPU implementation ignores them) ----
  int32_t warmup_runs = 0;        // untimed publications before the setup.repeats timed ones (first-call
                                  // setup such as NCCL's stays out of the samples)
  int64_t flush_l2_bytes = 0;     // > 0: before each run's start fence, overwrite a scratch buffer of this
                                  // many bytes so the run starts with a cold L2 like a real layer would
  // ---- test hooks (never set in production) ----
  int32_t kill_pcp_rank = -1;     // this PCP rank SIGKILLs itself after its dispatch, before the fence
  int32_t corrupt_pcp_rank = -1;  // after each publish(), this PCP rank flips one bit of its own replica (byte 7
                                  // of the MLA row of the first written slot), so the replica check must fail
};

/// The one check of RankPublishOptions::collect_via (--collect-via): auto, nccl or p2p; else throws pcpkv::Error
/// "--collect-via: '<value, clipped>' is not auto, nccl or p2p". The CLI calls it on every build (the CUDA
/// publisher that reads the option is not built without CUDA), the CUDA publisher again for library callers.
void check_collect_via(const std::string& collect_via);

/// What one process holds after a publication: its own replica (whole allocations, guard bytes included)
/// and its local outputs, laid out like one rank's entries of PublishResult.
struct RankPublishResult {
  int32_t pcp_rank = 0;
  int32_t pcp_world = 1;
  Transport transport = Transport::kDirect;
  MlaCacheGeometry mla_geometry;
  IndexerCacheGeometry index_geometry;
  int64_t mla_cache_offset = 0;
  int64_t index_cache_offset = 0;
  std::vector<uint8_t> mla_alloc;
  std::vector<uint8_t> index_alloc;
  std::vector<uint16_t> q_c_out;   // [max_local_tokens * q_lora_rank] when setup.materialize_q
  std::vector<int32_t> topk;       // [max_local_tokens * topk_width] when topk_width > 0 and an indexer layer
  StageProfile profile;            // this process's stage times (mean over setup.repeats), bytes as the
                                   // single-process backend counts them for this rank
  std::vector<std::vector<double>> stage_samples_ms;  // CUDA: [repeat][stage] this rank's CUDA-event times
                                   // of every timed run (stages as in profile); empty on the CPU
  std::vector<uint64_t> fence_epochs;  // [num_barriers] this rank's fence epochs after the run
  int32_t graph_replays = 0;       // > 0: the result of publish_graph_replays
};

/// This process's side of a PCP group's publication. Not thread-safe. Symmetric memory is set up once
/// (constructor, all-or-nothing) and reused by every publish(); teardown (destructor) is local.
class RankPublisher {
 public:
  virtual ~RankPublisher() = default;
  virtual std::string backend() const = 0;   // "cpu" | "cuda"
  virtual std::string device() const = 0;
  /// Collective over the PCP group: every process calls it with the same setup, inputs and transport
  /// (GlobalInputs in global order; this process takes its rows through the plan). Validates before
  /// writing. Throws pcpkv::FenceTimeout naming the missing rank (its PCP rank, global rank and pid) when a
  /// peer never arrives at a fence, pcpkv::Error on bad input.
  virtual RankPublishResult publish(const GlobalInputs& inputs, Transport transport) = 0;
  /// Host copies of PCP rank r's whole allocations as they are now, read through this process's mapping of
  /// r's replica (for checks by one rank of every replica). Call after the group agreed the publication
  /// finished (e.g. a bootstrap barrier).
  virtual std::vector<uint8_t> read_mla_alloc(int32_t pcp_rank) = 0;
  virtual std::vector<uint8_t> read_index_alloc(int32_t pcp_rank) = 0;
  /// The run-time replica check's hashes (pcpkv/publish/replica_hash.h) of `slots` [n] in this process's own
  /// replica as it is now, [n] uint64: the CPU oracle on the CPU, the kernel on the GPU (only the n hashes are
  /// copied to the host). Local (no exchange); call after publish() returned. index_slots: the entries' indexer
  /// slots where the plan gives the indexer cache its own blocks (written_index_slots; empty: one slot addresses
  /// both caches). Throws pcpkv::Error on a slot outside its cache.
  virtual std::vector<uint64_t> replica_slot_hashes(const std::vector<int64_t>& slots,
                                                    const std::vector<int64_t>& index_slots = {}) = 0;
  /// CUDA: captures one publication (poison, start fence, dispatch, transport) into a CUDA graph once and
  /// replays it `replays` times; the device-resident epochs advance on every replay (fence_epochs tells).
  /// Collective like publish(). The CPU implementation throws pcpkv::Error (no graphs on the host).
  virtual RankPublishResult publish_graph_replays(const GlobalInputs& inputs, Transport transport, int32_t replays);
};

/// The CPU implementation: symmetric memory over POSIX shm, the host fence (pcpkv/ranks/fence.h), the CPU kernels.
/// `group` is the PCP group (its world size must equal setup.plan->pcp_world); it must outlive the result.
/// Throws pcpkv::Error on a bad setup or when symmetric memory cannot be set up on every rank.
std::unique_ptr<RankPublisher> make_cpu_rank_publisher(Bootstrap& group, const PublishSetup& setup,
                                                       const RankPublishOptions& options = {});

/// Makes this process's RankPublisher for a PCP group: make_cpu_rank_publisher or cuda::make_rank_publisher.
using RankPublisherFactory =
    std::function<std::unique_ptr<RankPublisher>(Bootstrap&, const PublishSetup&, const RankPublishOptions&)>;

/// Waits at fence barrier_idx like HostFence::arrive_and_wait, but checks between short waits whether the
/// processes of the missing ranks still exist, so a killed peer is reported at once rather than after
/// timeout_ms. Throws pcpkv::FenceTimeout "fence: rank 2 (pid 4711) is gone (exited or killed) ..." or
/// "... rank 2 (pid 4711) never arrived ...". pids: [world] process ids of the group's ranks; global_ranks
/// (optional, [world]): their ranks in the whole job, named in the message when they differ.
void fence_wait_watching_peers(HostFence& fence, int32_t barrier_idx, int64_t timeout_ms,
                               const std::vector<int64_t>& pids, const std::string& what,
                               const std::vector<int32_t>& global_ranks = {});

/// Whether process pid exists and is not a zombie (Linux /proc).
bool process_alive(int64_t pid);

}  // namespace pcpkv
