// src/publish/checks/replica_check.h: what the replica check (replica_check.cpp) shares with its comparison across
// rank processes (drivers/replica_check_across.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pcpkv {

/// How a message names PCP rank q: rank_names[q] (its global rank) when given, else q.
std::string replica_rank_name(int32_t q, const std::vector<int32_t>& rank_names);

}  // namespace pcpkv
