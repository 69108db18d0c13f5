// pcpkv_bench/consumers.h: the indexer and sparse MLA attention benchmark (`pcpkv attention --bench`;
// bench/cuda/sparse_mla_bench.cu, its table in bench/consumer_bench_table.cpp). Part of pcpkv_bench, not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/consumers/attention_check.h"

namespace pcpkv {

struct ConsumerBenchConfig {
  int64_t num_tokens = 32768;          // one prefill request of this length (causal)
  KvFormat kv_format = KvFormat::kFp8DsMla;
  int32_t topk = 2048;
  int32_t repeats = 3;                 // timed runs (after one warm-up); the median is reported
  uint64_t seed = 1;
  std::vector<IndexerLogit> indexers = {IndexerLogit::kExact, IndexerLogit::kFp32Tree};  // kernels timed
  std::vector<SparseMlaKernel> attentions = {SparseMlaKernel::kMma, SparseMlaKernel::kSimt};
};
/// One timed kernel of the bench.
struct ConsumerBenchRow {
  std::string name;                    // e.g. "indexer exact (fp64 DMMA scores + top-k)"
  double ms = 0.0;
  double tflops = 0.0;                 // useful FLOP / time (see the fields below)
  double peak_tflops = 0.0;            // the ceiling it is compared with (measured or datasheet, see note)
  std::string peak_name;               // which ceiling
  double tbps = 0.0;                   // unique bytes / time
};
struct ConsumerBenchResult {
  std::string device;
  double copy_tbps = 0.0;              // measured: 2 GiB device-to-device copy, read + written bytes
  double fp32_tflops = 0.0;            // measured: FMA-bound kernel, 2 FLOP per FMA
  // indexer FLOP: 2 * sum_t len_t * H_index * 128; unique bytes: q, weights, cache, top-k out
  // attention FLOP: 2 * sum_t K_t * H * (576 + 512); unique bytes: q, cache rows, indices, out, lse
  std::vector<ConsumerBenchRow> rows;  // every timed kernel: indexers (full, scores only), top-k, attentions
  double indexer_ms = 0.0;             // the first indexer of the config (scores + top-k), one layer
  double indexer_tflops = 0.0;
  double indexer_tbps = 0.0;
  double attention_ms = 0.0;           // the first attention kernel of the config
  double attention_tflops = 0.0;
  double attention_tbps = 0.0;
  double attention_gathered_tbps = 0.0;// first attention: rows read per (token, head group) / time (L2 traffic)
  std::string describe() const;        // a markdown table
};
namespace cuda {
/// Times the CUDA indexer and sparse MLA attention for one layer of `model`. Throws without a device.
ConsumerBenchResult bench_consumers(const ConsumerBenchConfig& cfg, const ModelConfig& model);
}  // namespace cuda

}  // namespace pcpkv
