// src/publish/kernels/cpu/rows.h: writing one encoded row into a paged cache target (CPU reference internals).
#pragma once

#include <cstdint>
#include <cstring>

#include "pcpkv/device/pack.h"
#include "pcpkv/publish/dispatch.h"
#include "pcpkv/core/layout.h"

namespace pcpkv::cpu_detail {

/// Largest transport row (bf16 + indexer): 1152 + 128 + 4 + 12.
constexpr int64_t kMaxRowBytes = 1296;

/// Copies a transport-layout row (MLA bytes, then indexer data and scale) into target t: the MLA bytes to slot
/// `slot` of its MLA cache, the indexer data and scale to slot `index_slot` of its indexer cache (the same slot
/// unless the caller has an indexer slot mapping); a slot of -1 skips that cache. Offsets in 64 bits (SPEC section 3).
inline void write_cache_row(const CacheTarget& t, const TransportRowLayout& layout, int64_t slot, int64_t index_slot,
                            const uint8_t* row) {
  if (slot >= 0) std::memcpy(t.mla_base + t.mla.row_offset(slot), row, static_cast<size_t>(layout.mla_bytes));
  if (layout.index_data_offset >= 0 && index_slot >= 0) {
    std::memcpy(t.index_base + t.index.data_offset(index_slot), row + layout.index_data_offset,
                static_cast<size_t>(kIndexHeadDim));
    std::memcpy(t.index_base + t.index.scale_offset(index_slot), row + layout.index_scale_offset, 4);
  }
}

/// Transport row of one token (SPEC section 3) from its fp32 values: MLA row | indexer data | indexer
/// scale | zero pad. index_k is read only on indexer layers.
inline void encode_transport_row(const float* kv_c, const float* k_pe, const float* index_k,
                                 const CacheFormat& fmt, const TransportRowLayout& layout, uint8_t* row) {
  pack::encode_mla_row(kv_c, k_pe, fmt, row);
  if (fmt.has_indexer) {
    pack::encode_index_k(index_k, row + layout.index_data_offset, row + layout.index_scale_offset);
    const int64_t pad = layout.index_scale_offset + 4;
    std::memset(row + pad, 0, static_cast<size_t>(layout.row_bytes - pad));
  }
}

}  // namespace pcpkv::cpu_detail
