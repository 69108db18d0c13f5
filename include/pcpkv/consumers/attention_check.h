// pcpkv/consumers/attention_check.h: end-to-end proof that the published replicas serve attention (SPEC section 6):
// after a PCP-P publication every rank runs the indexer and sparse MLA attention for its local query
// tokens on its own replica; the gathered outputs must equal, byte for byte, those of the same batch
// published and served on one rank. DCP mode: the one-rank cache sharded over D ranks (positions
// interleaved in groups of `dcp_interleave`), partial attention per shard + LSE merge must match the
// one-rank output within SparseMlaBound. Consumers other than the CPU reference are also checked
// against it (indexer: identical scores and top-k; attention: SparseMlaBound).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "pcpkv/consumers/indexer.h"
#include "pcpkv/consumers/lse_merge.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/consumers/sparse_mla.h"

namespace pcpkv {

/// The consumers on host buffers: every pointer in the params is a host pointer; a device
/// implementation uploads what the params address (cache: geometry.bytes() from the base pointer),
/// runs its kernels and downloads the outputs. Each call validates on the host first.
class ConsumerKernels {
 public:
  virtual ~ConsumerKernels() = default;
  virtual std::string name() const = 0;   // "cpu" | "cuda"
  virtual void indexer(const IndexerParams& p) = 0;
  virtual void sparse_mla(const SparseMlaParams& p) = 0;
  virtual void lse_merge(const LseMergeParams& p) = 0;
  /// Arithmetic of sparse_mla's results (sets SparseMlaBound for the reference and DCP checks).
  virtual SparseMlaArith attention_arith() const { return SparseMlaArith::kFp32; }
};

/// The CPU reference consumers (indexer_reference, sparse_mla_reference, lse_merge_reference).
std::unique_ptr<ConsumerKernels> make_cpu_consumers();

namespace cuda {
/// The CUDA consumers on device device_idx, attention by `attention` (SparseMlaKernel::kMma: bf16 tensor
/// cores; kSimt: the fp32 CUDA-core kernel); the indexer kernel follows IndexerParams::logit. Throws
/// pcpkv::Error when no device is usable.
std::unique_ptr<ConsumerKernels> make_consumers(int device_idx = 0, SparseMlaKernel attention = SparseMlaKernel::kMma);
}  // namespace cuda

/// Queries of the batch's tokens in global order (seeded; per-token log-normal magnitude and a few
/// outlier channels, never all zeros).
struct ConsumerQueries {
  int64_t num_tokens = 0;            // N
  int32_t index_heads = 0;           // Hi
  int32_t heads = 0;                 // Hq
  std::vector<uint8_t> index_q_fp8;  // [N, Hi, 128] E4M3 (quantize_index_queries of a bf16 draw)
  std::vector<float> index_q_scale;  // [N, Hi]
  std::vector<float> index_weights;  // [N, Hi] weights_proj output
  std::vector<uint16_t> q;           // [N, Hq, 576] bf16 absorbed queries
};
ConsumerQueries generate_queries(int64_t num_tokens, int32_t index_heads, int32_t heads, uint64_t seed);

struct AttentionCheckConfig {
  PlanConfig plan;                   // requests, block size, seed; plan.pcp_world = P of the PCP run
  CacheFormat fmt;                   // has_indexer must be true
  Transport transport = Transport::kDirect;
  int32_t topk = 2048;               // index_topk
  int32_t dcp_world = 1;             // > 1: also run the DCP check with this many shards
  int32_t dcp_interleave = 1;        // DCP: position j lives on shard (j / interleave) % dcp_world
  uint64_t seed = 1;                 // inputs, queries and context rows
  bool check_reference = true;       // run the CPU reference and compare (needed for the DCP bound)
};

/// Outcome of one check. Counts are of mismatching values (0 passes).
struct AttentionCheckReport {
  int32_t pcp_world = 1;
  int64_t num_tokens = 0;              // global query tokens
  int64_t num_context_rows = 0;        // context slots filled before the consumers ran
  // PCP-P gathered vs one rank (byte identity)
  int64_t topk_rows_diff = 0;          // rows whose top-k positions differ
  int64_t out_bytes_diff = 0;          // fp32 outputs whose bits differ
  int64_t lse_bytes_diff = 0;
  int64_t decode_copies_diff = 0;      // replicated decode tokens whose ranks disagree (any output)
  int64_t padding_rows_bad = 0;        // padded local rows that are not (-1 top-k, zeros, -inf)
  // consumers vs the CPU reference (check_reference, consumers != cpu)
  bool reference_checked = false;
  int64_t ref_topk_rows_diff = 0;
  int64_t ref_scores_diff = 0;         // indexer scores whose bits differ
  int64_t ref_over_bound = 0;          // attention values outside SparseMlaBound
  double ref_max_ratio = 0.0;          // max |err| / bound
  // DCP (dcp_world > 1)
  bool dcp_checked = false;
  int64_t dcp_over_bound = 0;
  double dcp_max_ratio = 0.0;
  int64_t dcp_empty_shard_rows = 0;    // (token, shard) pairs with no key: merged as empty shards
  // wall time of the consumers, summed over ranks (ms)
  double indexer_ms = 0.0, attention_ms = 0.0, merge_ms = 0.0;
  std::string first_problem;           // where the first mismatch lies, empty when none

  bool passed() const;
  std::string describe() const;        // multi-line human summary
};

/// Runs the PCP-P publication (and a one-rank publication of the same batch) on `publisher`, fills
/// context slots (positions < context_len) of every replica with the same seeded rows, serves every
/// rank's local tokens with `consumers`, and compares. Throws pcpkv::Error on bad configuration.
AttentionCheckReport run_attention_check(const AttentionCheckConfig& cfg, const ModelConfig& model,
                                         Backend& publisher, ConsumerKernels& consumers);

}  // namespace pcpkv
