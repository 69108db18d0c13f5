// Names of the dispatch's top-k fill modes (pcpkv/publish/dispatch.h TopkFill), shared by the CLI, the bench and the
// torch op.
#include <string>

#include "pcpkv/publish/dispatch.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {

const char* to_string(TopkFill f) {
  switch (f) {
    case TopkFill::kFull: return "full";
    case TopkFill::kTail: return "tail";
    case TopkFill::kNone: return "none";
  }
  return "?";
}

TopkFill parse_topk_fill(const std::string& s, const std::string& what) {
  for (TopkFill f : {TopkFill::kFull, TopkFill::kTail, TopkFill::kNone})
    if (s == to_string(f)) return f;
  PCPKV_FAIL("{}: '{}' is not a top-k fill; known: full, tail, none", what, clip(s));
}

}  // namespace pcpkv
