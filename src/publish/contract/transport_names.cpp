// Small value types of pcpkv/publish/backend.h: transport names and the stage profile; the collect_via check.
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {

const char* to_string(Transport t) {
  switch (t) {
    case Transport::kCollect: return "collect";
    case Transport::kStaging: return "staging";
    case Transport::kDirect: return "direct";
  }
  return "?";
}

Transport parse_transport(const std::string& s) {
  if (s == "collect") return Transport::kCollect;
  if (s == "staging") return Transport::kStaging;
  if (s == "direct") return Transport::kDirect;
  PCPKV_FAIL("--transport: unknown transport '{}'; known: collect, staging, direct", clip(s));
}

void check_collect_via(const std::string& collect_via) {
  PCPKV_CHECK(collect_via == "auto" || collect_via == "nccl" || collect_via == "p2p",
              "--collect-via: '{}' is not auto, nccl or p2p", clip(collect_via));
}

double StageProfile::total_ms() const {
  double ms = 0.0;
  for (const Stage& s : stages) ms += s.ms;
  return ms;
}

int64_t StageProfile::total_bytes() const {
  int64_t bytes = 0;
  for (const Stage& s : stages) bytes += s.bytes;
  return bytes;
}

}  // namespace pcpkv
