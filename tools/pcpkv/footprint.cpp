// The batch shape and row sizes behind every memory pre-check (footprint.h).
#include "footprint.h"

#include <algorithm>
#include <cmath>

namespace pcpkv::cli {

void BatchShape::add(const RequestSpec& r, long double count) {
  const long double len = static_cast<long double>(r.context_len) + r.num_new_tokens;
  blocks += count * std::ceil(len / block_size);
  tokens += count * r.num_new_tokens;
  requests += count;
  positions += count * len;
  max_keys = std::max(max_keys, len);
  if (r.kind == RequestKind::kPrefill) {
    prefills.emplace_back(static_cast<long double>(r.num_new_tokens), count);
  } else {
    decodes += count;
  }
}

void BatchShape::add_decodes(long double n, long double first, long double step) {
  if (n <= 0) return;
  // sum_i ceil((first + step i + 1) / B) <= sum_i ((first + 1) / B + 1) + step / B * n (n - 1) / 2
  blocks += n * ((first + 1) / block_size + 1) + step * n * (n - 1) / (2 * block_size);
  tokens += n;
  decodes += n;
  requests += n;
  positions += n * (first + 1) + step * n * (n - 1) / 2;
  max_keys = std::max(max_keys, first + step * (n - 1) + 1);
}

long double BatchShape::max_local_tokens(long double pcp) const {
  long double m = decodes;
  for (const auto& [len, count] : prefills) m += count * std::min(len, 2 * std::ceil(len / (2.0L * pcp)));
  return m;
}

RowBytes RowBytes::of(const CacheFormat& fmt, long double q_lora_rank) {
  RowBytes r;
  r.mla = static_cast<long double>(mla_row_bytes(fmt.kv_format));
  r.transport = static_cast<long double>(transport_row_layout(fmt).row_bytes);
  r.bf16 = 2.0L * (kKvLoraRank + kRopeDims + (fmt.has_indexer ? kIndexHeadDim : 0));
  r.input = 2.0L * q_lora_rank + r.bf16;
  return r;
}

}  // namespace pcpkv::cli
