// pcpkv-test-labels: unit
// transport "auto" (SPEC section 5.1) on faked topologies: direct within a host with peer access, collect over
// NCCL otherwise, a clear error when nothing reaches every replica.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/publish/transport_choice.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

Topology one_host(int P, bool nccl) {
  Topology t;
  t.hosts.assign(static_cast<size_t>(P), "node-a");
  t.peer_access.assign(static_cast<size_t>(P), std::vector<bool>(static_cast<size_t>(P), true));
  t.nccl_available = nccl;
  return t;
}

std::string error_of(const Topology& t) {
  return test::error_of([&] { choose_transport(t); });
}

TEST(TransportChoice, SameHostAllPeerAccessIsDirect) {
  for (bool nccl : {false, true}) {
    const TransportChoice c = choose_transport(one_host(4, nccl));
    EXPECT_EQ(c.transport, Transport::kDirect);
    EXPECT_EQ(c.reason, "direct: all 4 ranks on host node-a with peer access between every pair");
  }
  Topology t = one_host(3, false);
  t.peer_access[1][1] = false;  // the diagonal is not read
  EXPECT_EQ(choose_transport(t).transport, Transport::kDirect);
  EXPECT_EQ(choose_transport(one_host(1, false)).reason, "direct: one rank on host node-a");
}

TEST(TransportChoice, OnePairWithoutPeerAccessIsCollect) {
  Topology t = one_host(4, true);
  t.peer_access[2][1] = false;  // one direction is enough to rule out peer stores
  const TransportChoice c = choose_transport(t);
  EXPECT_EQ(c.transport, Transport::kCollect);
  EXPECT_EQ(c.reason, "collect over NCCL: rank 2 cannot store into rank 1's memory (no peer access)");
}

TEST(TransportChoice, TwoHostsIsCollect) {
  Topology t = one_host(4, true);
  t.hosts = {"node-a", "node-a", "node-b", "node-b"};
  const TransportChoice c = choose_transport(t);
  EXPECT_EQ(c.transport, Transport::kCollect);
  EXPECT_EQ(c.reason,
            "collect over NCCL: the ranks are on 2 hosts (node-a: ranks 0, 1; node-b: ranks 2, 3), and peer stores "
            "stay within a host");
}

TEST(TransportChoice, UnreachableWithoutNcclIsAClearError) {
  Topology t = one_host(2, false);
  t.peer_access[0][1] = false;
  EXPECT_EQ(error_of(t),
            "transport auto: rank 0 cannot store into rank 1's memory (no peer access), and NCCL is not available: "
            "no transport reaches every replica (run the ranks on one host with peer access, or build with NCCL)");
  Topology h = one_host(3, false);
  h.hosts[2] = "node-c";
  EXPECT_NE(error_of(h).find("the ranks are on 2 hosts (node-a: ranks 0, 1; node-c: rank 2)"), std::string::npos)
      << error_of(h);
}

TEST(TransportChoice, MalformedTopologyNamesTheField) {
  EXPECT_EQ(error_of(Topology{}), "topology: hosts is empty (one entry per PCP rank expected)");
  Topology t = one_host(3, true);
  t.hosts[1] = "";
  EXPECT_EQ(error_of(t), "topology: hosts[1] is empty");
  t = one_host(3, true);
  t.peer_access.pop_back();
  EXPECT_EQ(error_of(t), "topology: peer_access has 2 rows for 3 ranks");
  t = one_host(3, true);
  t.peer_access[2].push_back(true);
  EXPECT_EQ(error_of(t), "topology: peer_access[2] has 4 entries for 3 ranks");
}

}  // namespace
}  // namespace pcpkv
