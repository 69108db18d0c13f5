// pcpkv/publish/backend.h: one layer's KV publication on a backend (CPU reference or CUDA), for W PCP ranks.
//
// Data flows config -> plan -> dispatch -> transport -> combine -> verify. A Backend owns the per-rank
// replicas and staging buffers, runs one transport, and hands back host copies of every replica's whole
// allocation (guard bytes included) and a stage profile.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/dispatch.h"

namespace pcpkv {

/// SPEC section 5.
enum class Transport : uint8_t {
  kCollect,  // bf16 materialize, 3 all-gathers, quantize-and-insert on every rank
  kStaging,  // packed rows into every peer's staging slot, fence, combine
  kDirect,   // final bytes into every replica, fence
};
const char* to_string(Transport t);
Transport parse_transport(const std::string& s);  // "collect" | "staging" | "direct"

constexpr uint8_t kGuardByte = 0xA5;

/// How each rank's cache allocation is laid out (tests vary these; engines' caches have real strides).
/// Allocation = [guard_bytes][base_offset bytes][cache: num_blocks * block_stride][guard_bytes], every byte
/// initialized to kGuardByte; bytes no written row covers must still equal it afterwards.
struct AllocationOptions {
  int64_t guard_bytes = 256;
  int64_t base_offset = 0;        // cache starts this far into a shared allocation (after the guard)
  int64_t mla_row_pad = 0;        // extra bytes per MLA row (row_stride = row_bytes + pad)
  int64_t mla_block_pad = 0;      // extra bytes per MLA block
  int64_t index_block_pad = 0;    // extra bytes per indexer block (padded block stride)
};

struct PublishSetup {
  const ModelConfig* model = nullptr;
  const PcpPlan* plan = nullptr;
  CacheFormat fmt;
  AllocationOptions alloc;
  int64_t topk_width = 0;         // > 0: dispatch fills topk [T, topk_width] with -1 (indexer layers)
  TopkFill topk_fill_mode = TopkFill::kFull;  // kTail: only each rank's padding rows [num_local_tokens, T)
                                              // (the indexer top-k runs on its real tokens and writes the
                                              // rest: pcpkv/publish/dispatch.h TopkFill); kNone: no fill. The rows
                                              // not filled keep kGuardByte.
  bool materialize_q = true;      // produce q_c_out on every rank
  int32_t num_ubatches = 1;       // staging workspace micro-batches
  int32_t layer_idx = 0;          // selects the staging double-buffer half (layer_idx & 1)
  int32_t repeats = 1;            // run the publication this many times (timing); results from the last
};

/// One timed stage: name ("dispatch", "all-gather", "fence", ...), milliseconds (CPU: wall clock of the stage
/// while the rank threads run it concurrently between host barriers, mean over repeats; CUDA: measured per
/// launch), bytes moved (read + written, summed over ranks; docs/perf.md's byte model).
struct Stage {
  std::string name;
  double ms = 0.0;
  int64_t bytes = 0;
};
struct StageProfile {
  std::vector<Stage> stages;
  double total_ms() const;
  int64_t total_bytes() const;
};

struct PublishResult {
  Transport transport = Transport::kDirect;
  MlaCacheGeometry mla_geometry;
  IndexerCacheGeometry index_geometry;
  int64_t mla_cache_offset = 0;     // byte offset of block 0 within each mla_alloc
  int64_t index_cache_offset = 0;
  std::vector<std::vector<uint8_t>> mla_alloc;    // [W] whole allocations, host copies
  std::vector<std::vector<uint8_t>> index_alloc;  // [W] (guard-only bytes when !fmt.has_indexer)
  std::vector<std::vector<uint16_t>> q_c_out;     // [W][max_local_tokens * q_lora_rank] when materialize_q
  std::vector<std::vector<int32_t>> topk;         // [W][max_local_tokens * topk_width] when topk_width > 0
  StageProfile profile;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;     // "cpu" | "cuda"
  virtual std::string device() const = 0;   // "CPU (2 threads)", "NVIDIA H200"
  /// Runs one layer's publication with `transport` for every rank of setup.plan. Validates everything
  /// (plan, inputs' shapes, slots, geometry) before writing; throws pcpkv::Error on bad input and
  /// pcpkv::FenceTimeout when a rank never arrives.
  virtual PublishResult publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) = 0;
};

/// "cpu", "cuda" or "auto" (CUDA when built with it and a GPU is visible, else CPU).
/// Throws pcpkv::Error("backend 'cuda': <reason>") when the requested backend is unavailable.
std::unique_ptr<Backend> make_backend(const std::string& name);

/// The one check of a backend name (--backend of every command): auto, cpu or cuda; else throws pcpkv::Error
/// "--backend: unknown backend '<name, clipped>'; known: auto, cpu, cuda". Says nothing of availability.
void check_backend_name(const std::string& name);

/// Whether the CUDA backend can run here; *why_not says why not (not built with CUDA, no device, ...).
bool cuda_backend_available(std::string* why_not = nullptr);

/// The CPU reference backend. num_threads 0 = hardware concurrency.
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0);

}  // namespace pcpkv
