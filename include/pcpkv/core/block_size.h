// pcpkv/core/block_size.h: the one rule for a paged cache's block_size (SPEC section 3), of the CLI's --block-size
// and pcpkv_torch's first entries (make_plan, allocate_mla_cache / allocate_indexer_cache, SymmetricCaches,
// BlockTables). Its own header, so that what checks it needs nothing else of layout.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace pcpkv {

/// Why `block_size` (tokens per cache block) cannot be a paged cache's, or nullopt when it can: a power of two
/// (slot = block_id * block_size + offset) whose indexer-K cache block, block_size rows of 132 bytes (128 e4m3 and a
/// fp32 scale), is a multiple of 16 bytes as the cache targets require: so >= 4. Every layer kind lays out the
/// indexer-K cache, so the rule holds for them all; 1 and 2 were refused only later, by the cache table, without the
/// argument's name. The text starts with "must be"; callers name the field and the value:
/// "--block-size: 2 must be ...", "make_plan: block_size = 2 must be ...".
std::optional<std::string> block_size_problem(int64_t block_size);

}  // namespace pcpkv
