// pcpkv/publish/transport_choice.h: what transport "auto" picks for a PCP group (SPEC section 5.1). A pure
// function of a topology description, so tests can fake any topology; the callers (CLI, Python) describe the
// real one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"

namespace pcpkv {

/// The PCP group as the transports see it.
struct Topology {
  /// [P] host of each PCP rank: any name, equal for ranks of one host (a hostname, a boot id).
  std::vector<std::string> hosts;
  /// [P][P] peer_access[a][b]: rank a can store into rank b's memory (the same device, CUDA P2P access between
  /// the two GPUs, or shared memory on the CPU). The diagonal is not read.
  std::vector<std::vector<bool>> peer_access;
  /// The collect transport's all-gathers can run over NCCL between these ranks.
  bool nccl_available = false;
};

struct TransportChoice {
  Transport transport = Transport::kDirect;
  std::string reason;  // one line: what was found and why this transport
};

/// direct when every rank can store into every other rank's memory (one host, peer access between every
/// pair); otherwise collect over NCCL. Throws pcpkv::Error naming the field for a malformed topology (no
/// ranks, an empty host name, a peer_access matrix that is not P x P), and when the peers are unreachable
/// and NCCL is not available ("transport auto: rank 0 cannot store into rank 3's memory (no peer access),
/// and NCCL is not available: no transport reaches every replica").
TransportChoice choose_transport(const Topology& topology);

}  // namespace pcpkv
