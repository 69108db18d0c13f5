// src/publish/drivers/cuda/publisher.h: one layer's publication for W logical PCP ranks on one GPU (SPEC section 5),
// the engine behind cuda::make_backend and `pcpkv bench`.
//
// Each rank owns, in device memory: its local inputs (rank_inputs of the plan), its cache replica laid out
// exactly like the CPU backend's (transport/publish_layout.h: [guard][base_offset][cache][guard], 0xA5),
// its staging workspace [2][ubatches][W][M][row_bytes], its collect buffers (bf16 rows and their
// all-gathered copies) and its outputs (q_c_out, top-k). enqueue() puts one publication on a stream with no
// host synchronization, so it can be timed with events or captured into a CUDA graph and replayed.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "core/cuda/buffers.h"
#include "pcpkv/publish/kernels.h"
#include "publish/drivers/cuda/local_fence.h"
#include "pcpkv/publish/backend.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"

namespace pcpkv::cuda {

/// How a publication runs: kernel variants, where the top-k fill happens, PDL. Every variant writes the same
/// bytes; a Publisher can switch between runs (set_variant). Written "<dispatch>:<fill>:<rows>[:pdl]", e.g.
/// "warp:fused:4" (dispatch kernel auto | simple | prefetch | warp | warp_pf | warp_token | warp_split; top-k fill fused into the dispatch or
/// separate (its own byte-fill stage); combine rows per warp 1 | 2 | 4; pdl: staging / direct chain
/// dispatch -> fence -> combine launched with programmatic stream serialization).
struct PublishVariant {
  DispatchVariant dispatch = DispatchVariant::kAuto;
  bool fuse_topk = false;
  int combine_rows_per_warp = 0;  // 0: launch_combine's default
  bool pdl = false;               // PublisherOptions sets it from pdl::enabled() (PCPKV_PDL=1)

  std::string name() const;
  /// Parses name(); throws pcpkv::Error naming the bad part.
  static PublishVariant parse(const std::string& s);
};

/// The collect path as engines run it (the honest baseline of `pcpkv bench`): the CTA dispatch kernel that
/// was the default before the warp kernel, materializing bf16 at vLLM-like speed, and the top-k fill as a
/// separate byte fill; no PDL. The bench pins collect to it whatever the staging / direct variants are.
PublishVariant collect_baseline_variant();

struct PublisherOptions {
  int num_sets = 1;          // copies of the inputs (and of q_c_out / top-k) rotated between runs, so that
                             // repeated runs do not find their inputs in L2
  PublishVariant variant = default_variant();
  double fence_timeout_ms = 10000.0;

  /// kAuto kernels, separate top-k fill, default combine, PDL from pdl::enabled().
  static PublishVariant default_variant();
};

/// CUDA events around the stages of one enqueued publication.
class StageTimer {
 public:
  void start(cudaStream_t stream);                        // opens the first stage
  void mark(const std::string& name, cudaStream_t stream);  // closes the current stage, opens the next
  /// (name, ms) per stage, in order. Call after the stream synchronized.
  std::vector<std::pair<std::string, double>> read() const;

 private:
  std::vector<Event> events_;
  std::vector<std::string> names_;
  size_t used_ = 0;
};

class Publisher {
 public:
  /// Validates setup and inputs (pcpkv::Error naming the field), allocates and poisons everything, uploads
  /// the inputs. The current CUDA device is used.
  Publisher(const PublishSetup& setup, const GlobalInputs& inputs, const PublisherOptions& options = {});
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  /// Enqueues one publication with `transport` on `stream` (no host synchronization; graph-capturable when
  /// timer is null). Rotates to the next input set. With variant().pdl the staging / direct kernels are
  /// PDL launches (a timer's events between them then also separate them).
  void enqueue(Transport transport, cudaStream_t stream, StageTimer* timer = nullptr);
  /// Enqueues rank `rank`'s share of the dispatch stage alone (its top-k fill unless fused, then its dispatch
  /// kernel writing every peer's staging slot / replica): what one GPU of a PCP group runs before the fence,
  /// the bench's per-GPU case. Rotates the input set like enqueue(); no fence, no combine.
  void enqueue_rank_dispatch(int32_t rank, Transport transport, cudaStream_t stream);
  /// Switches kernels / fill / PDL for the following runs (no reallocation).
  void set_variant(const PublishVariant& v) { options_.variant = v; }
  const PublishVariant& variant() const { return options_.variant; }
  /// Switches the top-k fill mode (PublishSetup::topk_fill_mode) for the following runs; the bench runs
  /// collect with kFull (as engines do) and staging / direct with its --topk-fill.
  void set_topk_fill(TopkFill f) { setup_.topk_fill_mode = f; }
  TopkFill topk_fill() const { return setup_.topk_fill_mode; }
  /// Restores every cache, output and workspace byte to kGuardByte (synchronous).
  void poison();
  /// After the stream synchronized: throws pcpkv::FenceTimeout when a fence timed out.
  void check_fence() const { fence_.check(); }
  /// Host copies of every replica and of the outputs of the last enqueued run (synchronous).
  PublishResult download(Transport transport) const;

  /// The stages enqueue() runs for `transport`, in order, with the bytes each moves (ms = 0): the transport
  /// table's steps and byte model (publish/drivers/transport_table.h), the top-k fill its own step unless fused.
  std::vector<Stage> stage_model(Transport transport) const;

  LocalFence& fence() { return fence_; }
  /// Every rank's replica (device pointers, [world]): what the replica check hashes (DeviceReplicaCheck).
  const std::vector<CacheTarget>& targets() const { return host_targets_; }
  int32_t world() const { return world_; }
  int64_t max_local_tokens() const { return max_local_tokens_; }
  const PublishLayout& layout() const { return layout_; }
  /// Bytes of one input set (what rotation must exceed the L2 with).
  int64_t input_set_bytes() const;

 private:
  struct InputSet;
  struct RankState;
  DispatchJob dispatch_job(int32_t rank, Op op, const InputSet& set) const;
  // The transport table's ops for all W ranks on `stream` (input set `set`).
  void run_step(Op op, int set, cudaStream_t stream, bool pdl);
  void enqueue_dispatch(Op op, int set, cudaStream_t stream, bool pdl);
  void enqueue_gather(cudaStream_t stream);
  void enqueue_insert(cudaStream_t stream);
  void enqueue_combine(cudaStream_t stream, bool pdl);

  PublishSetup setup_;
  PublisherOptions options_;
  PublishLayout layout_;
  int32_t world_ = 1;
  int64_t max_local_tokens_ = 0;
  int64_t q_lora_rank_ = 0;
  int next_set_ = 0;
  int last_set_ = 0;
  DeviceBuffer q_norm_w_, kv_norm_w_, index_ln_w_, index_ln_b_, rope_;
  int64_t rope_num_positions_ = 0;
  DeviceBuffer gathered_slots_;  // [W * M]
  DeviceBuffer gathered_index_slots_;  // [W * M] when the plan has its own indexer blocks (docs/spec.md 4.2)
  bool has_index_slots_ = false;
  const int64_t* gathered_index_slots() const {
    return has_index_slots_ ? gathered_index_slots_.as<const int64_t>() : nullptr;
  }
  std::vector<DeviceBuffer> topk_sets_;  // [num_sets] all ranks' top-k buffers [W][M][topk_width]
  DeviceBuffer targets_;         // [W] CacheTarget: every replica
  std::vector<CacheTarget> host_targets_;
  std::vector<std::unique_ptr<RankState>> ranks_;
  LocalFence fence_;
};

}  // namespace pcpkv::cuda
