#include "support/publish_case.h"

#include <algorithm>

#include <fmt/format.h>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"

namespace pcpkv::test {

std::unique_ptr<PublishCase> make_case(const CaseSpec& spec) {
  auto c = std::make_unique<PublishCase>();
  c->model = preset(spec.model);
  PlanConfig pc;
  pc.pcp_world = spec.pcp;
  pc.block_size = spec.block_size;
  pc.requests = spec.requests;
  pc.extra_blocks = spec.extra_blocks;
  pc.seed = spec.seed;
  pc.local_order = spec.local_order;
  pc.decode_ownership = spec.decode_ownership;
  pc.own_index_blocks = spec.own_index_blocks;
  pc.index_extra_blocks = spec.index_extra_blocks;
  c->plan = make_plan(pc);
  c->inputs = generate_inputs(c->model, c->plan, spec.fmt.has_indexer, spec.seed);
  c->setup.model = &c->model;
  c->setup.plan = &c->plan;
  c->setup.fmt = spec.fmt;
  c->setup.alloc = spec.alloc;
  c->setup.topk_width = spec.topk_width;
  c->setup.topk_fill_mode = spec.topk_fill;
  return c;
}

::testing::AssertionResult passed(const Check& c, const std::string& what) {
  if (c.pass) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << fmt::format("{}{}{}: {}", what.empty() ? "" : what + ": ", c.name,
                                                      c.transport.empty() ? "" : " [" + c.transport + "]", c.detail);
}

::testing::AssertionResult same_caches(const PublishResult& expected, const PublishResult& actual,
                                       const CacheFormat& fmt, const std::string& what) {
  if (expected.mla_alloc.size() != actual.mla_alloc.size())
    return ::testing::AssertionFailure() << what << ": " << expected.mla_alloc.size() << " vs "
                                         << actual.mla_alloc.size() << " replicas";
  return passed(check_replicas_vs_reference(actual, expected, fmt), what);
}

::testing::AssertionResult same_outputs(const PublishResult& expected, const PublishResult& actual,
                                        const CacheFormat& fmt, const std::string& what) {
  auto caches = same_caches(expected, actual, fmt, what);
  if (!caches) return caches;
  if (actual.q_c_out.size() != expected.q_c_out.size() || actual.topk.size() != expected.topk.size())
    return ::testing::AssertionFailure() << fmt::format("{}: q_c_out / top-k of {} / {} ranks, expected {} / {}", what,
                                                        actual.q_c_out.size(), actual.topk.size(),
                                                        expected.q_c_out.size(), expected.topk.size());
  const std::vector<uint16_t> no_q;
  const std::vector<int32_t> no_k;
  for (size_t r = 0; r < std::max(expected.q_c_out.size(), expected.topk.size()); ++r) {
    const auto& q = r < actual.q_c_out.size() ? actual.q_c_out[r] : no_q;
    const auto& k = r < actual.topk.size() ? actual.topk[r] : no_k;
    const auto& want_q = r < expected.q_c_out.size() ? expected.q_c_out[r] : no_q;
    const auto& want_k = r < expected.topk.size() ? expected.topk[r] : no_k;
    // check_outputs_vs_reference skips an empty side (mp-publish without q_c_out), so a missing one fails here.
    if (q.size() != want_q.size() || k.size() != want_k.size())
      return ::testing::AssertionFailure() << fmt::format("{}: rank {} q_c_out / top-k of {} / {} values, expected "
                                                          "{} / {}", what, r, q.size(), k.size(), want_q.size(),
                                                          want_k.size());
    auto out = passed(check_outputs_vs_reference(q, k, expected, static_cast<int32_t>(r)), what);
    if (!out) return out;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult replicas_identical(const PublishResult& r, const CacheFormat& fmt) {
  return passed(check_replicas_identical(r, fmt));
}

::testing::AssertionResult all_untouched(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt) {
  return passed(check_guards(r, plan, fmt));
}

}  // namespace pcpkv::test
