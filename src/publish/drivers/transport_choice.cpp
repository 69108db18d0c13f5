// transport "auto" (SPEC section 5.1): direct when peer stores reach every replica, collect over NCCL otherwise.
#include "pcpkv/publish/transport_choice.h"

#include <fmt/format.h>

#include "pcpkv/core/error.h"

namespace pcpkv {
namespace {

// "2 hosts (a: ranks 0, 1; b: ranks 2, 3)", hosts in order of their first rank.
std::string describe_hosts(const std::vector<std::string>& hosts) {
  std::vector<std::string> names;
  std::vector<std::string> ranks;
  for (size_t r = 0; r < hosts.size(); ++r) {
    size_t h = 0;
    while (h < names.size() && names[h] != hosts[r]) ++h;
    if (h == names.size()) {
      names.push_back(hosts[r]);
      ranks.emplace_back();
    }
    ranks[h] += fmt::format("{}{}", ranks[h].empty() ? "" : ", ", r);
  }
  std::string out = fmt::format("{} hosts (", names.size());
  for (size_t h = 0; h < names.size(); ++h)
    out += fmt::format("{}{}: rank{} {}", h ? "; " : "", names[h], ranks[h].find(',') == std::string::npos ? "" : "s",
                       ranks[h]);
  return out + ")";
}

}  // namespace

TransportChoice choose_transport(const Topology& t) {
  const size_t P = t.hosts.size();
  PCPKV_CHECK(P >= 1, "topology: hosts is empty (one entry per PCP rank expected)");
  for (size_t r = 0; r < P; ++r) PCPKV_CHECK(!t.hosts[r].empty(), "topology: hosts[{}] is empty", r);
  PCPKV_CHECK(t.peer_access.size() == P, "topology: peer_access has {} rows for {} ranks", t.peer_access.size(), P);
  for (size_t r = 0; r < P; ++r)
    PCPKV_CHECK(t.peer_access[r].size() == P, "topology: peer_access[{}] has {} entries for {} ranks", r,
                t.peer_access[r].size(), P);

  std::string why;  // why peer stores do not reach every replica ("" when they do)
  for (size_t r = 1; r < P && why.empty(); ++r)
    if (t.hosts[r] != t.hosts[0]) why = fmt::format("the ranks are on {}, and peer stores stay within a host",
                                                    describe_hosts(t.hosts));
  for (size_t a = 0; a < P && why.empty(); ++a)
    for (size_t b = 0; b < P && why.empty(); ++b)
      if (a != b && !t.peer_access[a][b])
        why = fmt::format("rank {} cannot store into rank {}'s memory (no peer access)", a, b);

  if (why.empty()) {
    return {Transport::kDirect,
            P == 1 ? fmt::format("direct: one rank on host {}", t.hosts[0])
                   : fmt::format("direct: all {} ranks on host {} with peer access between every pair", P, t.hosts[0])};
  }
  PCPKV_CHECK(t.nccl_available,
              "transport auto: {}, and NCCL is not available: no transport reaches every replica (run the ranks "
              "on one host with peer access, or build with NCCL)",
              why);
  return {Transport::kCollect, fmt::format("collect over NCCL: {}", why)};
}

}  // namespace pcpkv
