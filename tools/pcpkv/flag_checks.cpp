#include "pcpkv/flag_checks.h"

#include "pcpkv/error.h"
#include "pcpkv/layout.h"

namespace pcpkv::cli {

void check_block_size_flag(int64_t block_size) {
  PCPKV_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "--block-size: must be a power of two, got {}", block_size);
  PCPKV_CHECK((block_size * kIndexerSlotBytes) % 16 == 0,
              "--block-size: {} is too small: an indexer-K cache block of B slots holds B * 132 bytes, which must "
              "be a multiple of 16 (B >= 4)",
              block_size);
}

}  // namespace pcpkv::cli
