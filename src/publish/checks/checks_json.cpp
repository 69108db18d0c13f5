// The one JSON shape of the publication checks (pcpkv/publish/checks.h): `pcpkv run --json` and
// `pcpkv mp-publish --json` embed this array.
#include <nlohmann/json.hpp>

#include "pcpkv/publish/checks.h"

namespace pcpkv {

std::string checks_json(const std::vector<Check>& checks, int indent) {
  using json = nlohmann::ordered_json;
  json out = json::array();
  for (const Check& c : checks) {
    json cj = {{"check", c.name}, {"transport", c.transport}, {"pass", c.pass}, {"detail", c.detail}};
    if (c.num_values) {
      cj["num_values"] = c.num_values;
      cj["num_over_bound"] = c.num_over_bound;
      cj["num_saturated"] = c.num_saturated;
      cj["num_flushed"] = c.num_flushed;
      cj["max_abs_err"] = c.max_abs_err;
      cj["max_err_over_bound"] = c.max_err_over_bound;
      cj["worst"] = c.worst;
    } else {
      cj["num_bytes"] = c.num_bytes;
      cj["num_diff"] = c.num_diff;
    }
    out.push_back(cj);
  }
  return out.dump(indent);
}

}  // namespace pcpkv
