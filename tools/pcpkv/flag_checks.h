// Flag checks shared by the CLI subcommands; each throws pcpkv::Error naming the flag and its value.
#pragma once

#include <cstdint>

namespace pcpkv::cli {

// --block-size: a power of two (SPEC section 3, paged caches) whose indexer-K cache block (B * 132 bytes:
// data then scales) stays 16-byte aligned, so B >= 4. Every layer kind lays out the indexer-K cache.
void check_block_size_flag(int64_t block_size);

}  // namespace pcpkv::cli
