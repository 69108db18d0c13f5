// src/serving/drivers/allreduce_agreement.cpp: the all-reduce's capability agreement (pcpkv/serving/allreduce.h):
// every rank learns whether every rank can use symmetric memory, so all take the same path.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/serving/allreduce.h"

namespace pcpkv {

AllRanksAnd all_ranks_and(Bootstrap& group) {
  return [&group](bool local_ok) {
    const uint8_t mine = local_ok ? 1 : 0;
    std::vector<uint8_t> all(static_cast<size_t>(group.world_size()));
    group.all_gather(&mine, 1, all.data());
    return std::all_of(all.begin(), all.end(), [](uint8_t v) { return v == 1; });
  };
}

bool agree_capability(bool local_ok, const AllRanksAnd& all_ranks) {
  PCPKV_CHECK(static_cast<bool>(all_ranks), "all-reduce: no all-ranks agreement function");
  return all_ranks(local_ok);
}

}  // namespace pcpkv
