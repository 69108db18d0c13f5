// tools/pcpkv/footprint.h: the memory-footprint estimator's common ground: the shape of a batch as the plan
// will lay it out (blocks, tokens, each rank's local tokens under DualChunkSwap, keys) counted from its
// requests before any is stored, and the bytes per row from the cache layout. Each command adds up its own
// parts from these (run_job.cpp, mp_publish_setup.cpp, cmd_attention.cpp), with the measurements that
// calibrate them next to its parts. In long double: flags like --tokens 99999999999 must give a message,
// not an overflow.
#pragma once

#include <utility>
#include <vector>

#include "pcpkv/core/layout.h"
#include "pcpkv/core/plan.h"

namespace pcpkv::cli {

struct BatchShape {
  long double block_size = 64;
  long double blocks = 1;  // the null block
  long double tokens = 0, decodes = 0, requests = 0;
  long double positions = 0;  // cached positions over all requests (context + new tokens)
  long double max_keys = 0;   // largest context + new tokens: the keys of the last token, the RoPE table's rows
  std::vector<std::pair<long double, long double>> prefills;  // (new tokens, how many such requests)

  explicit BatchShape(long double block = 64) : block_size(block) {}
  /// `count` requests like r, each counted exactly (its blocks: ceil((context + new) / block_size)).
  void add(const RequestSpec& r, long double count = 1);
  /// n decodes, decode i with context first + step * i then its token, in closed form (blocks bounded above
  /// by one extra per decode): --decodes 2000000000 is sized, not looped over.
  void add_decodes(long double n, long double first, long double step);
  /// Local tokens of the fullest rank at PCP `pcp`: DualChunkSwap gives a rank two chunks of
  /// ceil(L / 2P) of each prefill; every rank holds every decode.
  long double max_local_tokens(long double pcp) const;
  long double slots() const { return blocks * block_size; }
};

/// Bytes per token row, from the layout (pcpkv/core/layout.h).
struct RowBytes {
  long double mla = 0;        // one MLA cache row (mla_row_bytes)
  long double transport = 0;  // one packed transport row (transport_row_layout)
  long double bf16 = 0;       // kv_c, k_pe (and index_k on an indexer layer) in bf16: collect's rows
  long double input = 0;      // one token's activations: q_c + the bf16 row
  static RowBytes of(const CacheFormat& fmt, long double q_lora_rank);
  /// One replica of a cache of `slots` slots: the MLA cache and the indexer-K cache (every layer kind lays
  /// one out).
  long double replica(long double slots) const { return slots * (mla + kIndexerSlotBytes); }
};

}  // namespace pcpkv::cli
