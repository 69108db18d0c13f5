// CPU reference of the staging combine and the collect insert (SPEC section 5).
#include "core/parallel.h"
#include "publish/kernels/cpu/rows.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/device/codec.h"

namespace pcpkv {

void combine_reference(const CombineParams& p, int num_threads) {
  validate_combine(p);
  const TransportRowLayout layout = transport_row_layout(p.fmt);
  const int64_t n = int64_t{p.num_src_ranks} * p.max_local_tokens;
  // Rank-major rows: row i = (src rank i / max_local_tokens, local token i % max_local_tokens); a pure copy,
  // so staging produces exactly the bytes direct does.
  cpu_detail::parallel_for(n, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = p.slot_mapping[i];
      const int64_t index_slot = p.indexer_slot_mapping ? p.indexer_slot_mapping[i] : slot;
      if (slot >= 0 || index_slot >= 0)
        cpu_detail::write_cache_row(p.target, layout, slot, index_slot, p.rows + i * p.row_bytes);
    }
  });
}

void insert_reference(const InsertParams& p, int num_threads) {
  validate_insert(p);
  const TransportRowLayout layout = transport_row_layout(p.fmt);
  cpu_detail::parallel_for(p.num_tokens, num_threads, [&](int64_t begin, int64_t end) {
    float kv_c[512], k_pe[64], index_k[128];
    alignas(16) uint8_t row[cpu_detail::kMaxRowBytes];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      const int64_t index_slot = p.indexer_slot_mapping ? p.indexer_slot_mapping[t] : slot;
      if (slot < 0 && index_slot < 0) continue;
      // Quantize from the bf16 values (collect baseline): exact widening, then the same encoders.
      for (int i = 0; i < 512; ++i) kv_c[i] = codec::bf16_to_float(p.kv_c[t * 512 + i]);
      for (int i = 0; i < 64; ++i) k_pe[i] = codec::bf16_to_float(p.k_pe[t * 64 + i]);
      if (p.fmt.has_indexer)
        for (int i = 0; i < 128; ++i) index_k[i] = codec::bf16_to_float(p.index_k[t * 128 + i]);
      cpu_detail::encode_transport_row(kv_c, k_pe, index_k, p.fmt, layout, row);
      cpu_detail::write_cache_row(p.target, layout, slot, index_slot, row);
    }
  });
}

}  // namespace pcpkv
