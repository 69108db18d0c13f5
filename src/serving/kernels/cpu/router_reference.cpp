// src/serving/kernels/cpu/router_reference.cpp: the fp64 oracle of the MoE router (SPEC section 7,
// pcpkv/serving/router.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/serving/router.h"

namespace pcpkv {

const char* to_string(RouterWeightDtype d) { return d == RouterWeightDtype::kBf16 ? "bf16" : "fp32"; }

const char* to_string(RouterPath p) {
  switch (p) {
    case RouterPath::kAuto: return "auto";
    case RouterPath::kSmallT: return "small";
    case RouterPath::kCublasLt: return "cublaslt";
  }
  return "?";
}

RouterPath parse_router_path(const std::string& s) {
  if (s == "auto") return RouterPath::kAuto;
  if (s == "small") return RouterPath::kSmallT;
  if (s == "cublaslt") return RouterPath::kCublasLt;
  PCPKV_FAIL("router path: '{}' is not one of auto, small, cublaslt", clip(s));
}

const char* to_string(RouterSmallKernel k) {
  switch (k) {
    case RouterSmallKernel::kAuto: return "auto";
    case RouterSmallKernel::kRowLoop: return "small";
    case RouterSmallKernel::kStaged: return "small2";
  }
  return "?";
}

RouterSmallKernel parse_router_small_kernel(const std::string& s) {
  if (s == "auto") return RouterSmallKernel::kAuto;
  if (s == "small") return RouterSmallKernel::kRowLoop;
  if (s == "small2") return RouterSmallKernel::kStaged;
  PCPKV_FAIL("router small-T kernel: '{}' is not one of auto, small, small2", clip(s));
}

void validate_router_config(const RouterConfig& c) {
  PCPKV_CHECK(c.hidden_size > 0 && c.hidden_size % 8 == 0, "router: hidden_size = {} must be a positive multiple of 8",
              c.hidden_size);
  PCPKV_CHECK(c.n_experts >= 1 && c.n_experts <= 512, "router: n_routed_experts = {} is outside [1, 512]",
              c.n_experts);
  PCPKV_CHECK(c.top_k >= 1 && c.top_k <= 32 && c.top_k <= c.n_experts,
              "router: num_experts_per_tok = {} is outside [1, min(32, n_routed_experts = {})]", c.top_k,
              c.n_experts);
  PCPKV_CHECK(c.n_group >= 1 && c.n_group <= 32 && c.n_experts % c.n_group == 0,
              "router: n_group = {} must be in [1, 32] and divide n_routed_experts = {}", c.n_group, c.n_experts);
  PCPKV_CHECK(c.n_group == 1 || c.n_experts / c.n_group >= 2,
              "router: n_group = {} leaves {} expert per group; the group score needs >= 2", c.n_group,
              c.n_experts / c.n_group);
  PCPKV_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group, "router: topk_group = {} is outside [1, n_group = {}]",
              c.topk_group, c.n_group);
  PCPKV_CHECK(c.topk_group * (c.n_experts / c.n_group) >= c.top_k,
              "router: topk_group = {} groups of {} experts cannot hold num_experts_per_tok = {}", c.topk_group,
              c.n_experts / c.n_group, c.top_k);
  PCPKV_CHECK(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0.0,
              "router: routed_scaling_factor = {} must be finite and > 0", c.routed_scaling_factor);
}

RouterConfig router_config(const ModelConfig& m) {
  RouterConfig c;
  c.hidden_size = m.hidden_size;
  c.n_experts = m.n_routed_experts;
  c.top_k = m.num_experts_per_tok;
  c.n_group = m.n_group;
  c.topk_group = m.topk_group;
  c.routed_scaling_factor = m.routed_scaling_factor;
  c.norm_topk_prob = m.norm_topk_prob;
  c.logits_bf16 = !m.router_logits_fp32;
  validate_router_config(c);
  return c;
}

double router_logit_bound_factor(RouterPath path, int64_t hidden) {
  PCPKV_CHECK(hidden > 0, "router: hidden = {} must be > 0", hidden);
  switch (path) {
    case RouterPath::kSmallT:
      // chain of 8 * ceil(hidden / (8 * 128)) FMAs per thread, butterfly over 32 lanes (5 levels), pairwise
      // over 4 warps (2 levels), one unit of slack.
      return 8.0 * static_cast<double>((hidden + 1023) / 1024) + 8.0;
    case RouterPath::kCublasLt:
    case RouterPath::kAuto:
      return 2.0 * static_cast<double>(hidden);
  }
  return 2.0 * static_cast<double>(hidden);
}

void router_logits_reference(const uint16_t* x, int64_t x_stride, const void* w, RouterWeightDtype w_dtype,
                             int64_t num_tokens, int64_t hidden, int64_t n_experts, double* logits,
                             double* abs_sum) {
  PCPKV_CHECK(num_tokens >= 0, "router: num_tokens = {} must be >= 0", num_tokens);
  PCPKV_CHECK(hidden > 0 && hidden % 8 == 0, "router: hidden = {} must be a positive multiple of 8", hidden);
  PCPKV_CHECK(n_experts >= 1, "router: n_experts = {} must be >= 1", n_experts);
  PCPKV_CHECK(x_stride >= hidden, "router: x_stride = {} is smaller than hidden = {}", x_stride, hidden);
  if (num_tokens == 0) return;
  PCPKV_CHECK(x != nullptr && w != nullptr && logits != nullptr, "router: null x, w or logits pointer");
  std::vector<double> xd(static_cast<size_t>(hidden));
  std::vector<double> wd(static_cast<size_t>(hidden));
  for (int64_t e = 0; e < n_experts; ++e) {
    for (int64_t k = 0; k < hidden; ++k) {
      wd[k] = w_dtype == RouterWeightDtype::kBf16
                  ? static_cast<double>(codec::bf16_to_float(static_cast<const uint16_t*>(w)[e * hidden + k]))
                  : static_cast<double>(static_cast<const float*>(w)[e * hidden + k]);
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t k = 0; k < hidden; ++k) xd[k] = codec::bf16_to_float(x[t * x_stride + k]);
      double s = 0.0, a = 0.0;
      for (int64_t k = 0; k < hidden; ++k) {
        const double p = xd[k] * wd[k];  // exact: 8 x 24 significant bits
        s += p;
        a += std::fabs(p);
      }
      logits[t * n_experts + e] = s;
      if (abs_sum != nullptr) abs_sum[t * n_experts + e] = a;
    }
  }
}

namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

/// The logit the routing sees: bf16-rounded (through fp32, as a kernel storing fp32 then rounding) or as is.
double routed_logit(double v, bool logits_bf16) {
  if (!logits_bf16) return v;
  return codec::bf16_to_float(codec::float_to_bf16(static_cast<float>(v)));
}

/// Per token: biased scores, the kept-group mask, and the chosen experts. Shared by the routing and the
/// gap analysis so both see the same decision.
struct TokenDecision {
  std::vector<double> score;    // [E] sigmoid
  std::vector<double> biased;   // [E]
  std::vector<double> group_score;  // [n_group]
  std::vector<int> group_order;     // groups by descending score, ties: lower index
  std::vector<int> expert_order;    // kept experts by descending biased score, ties: lower index
};

TokenDecision decide(const double* logits_row, const float* bias, const RouterConfig& c) {
  const int64_t E = c.n_experts;
  const int64_t gs = E / c.n_group;
  TokenDecision d;
  d.score.resize(E);
  d.biased.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    d.score[e] = sigmoid(routed_logit(logits_row[e], c.logits_bf16));
    d.biased[e] = d.score[e] + (bias != nullptr ? static_cast<double>(bias[e]) : 0.0);
  }
  d.group_score.assign(c.n_group, 0.0);
  for (int64_t g = 0; g < c.n_group; ++g) {
    if (c.n_group == 1) break;  // one group: always kept, its score is never compared
    double top1 = -std::numeric_limits<double>::infinity(), top2 = top1;
    for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
      const double v = d.biased[e];
      if (v > top1) {
        top2 = top1;
        top1 = v;
      } else if (v > top2) {
        top2 = v;
      }
    }
    d.group_score[g] = top1 + top2;
  }
  d.group_order.resize(c.n_group);
  std::iota(d.group_order.begin(), d.group_order.end(), 0);
  std::stable_sort(d.group_order.begin(), d.group_order.end(),
                   [&](int a, int b) { return d.group_score[a] > d.group_score[b]; });
  std::vector<char> kept(c.n_group, 0);
  for (int64_t i = 0; i < c.topk_group; ++i) kept[d.group_order[i]] = 1;
  for (int64_t e = 0; e < E; ++e)
    if (kept[e / gs]) d.expert_order.push_back(static_cast<int>(e));
  std::stable_sort(d.expert_order.begin(), d.expert_order.end(),
                   [&](int a, int b) { return d.biased[a] > d.biased[b]; });
  return d;
}

}  // namespace

void grouped_topk_reference(const double* logits, int64_t num_tokens, const float* bias, const RouterConfig& c,
                            int32_t* ids, double* weights) {
  validate_router_config(c);
  PCPKV_CHECK(num_tokens >= 0, "router: num_tokens = {} must be >= 0", num_tokens);
  if (num_tokens == 0) return;
  PCPKV_CHECK(logits != nullptr && ids != nullptr && weights != nullptr,
              "router: null logits, ids or weights pointer");
  for (int64_t t = 0; t < num_tokens; ++t) {
    const TokenDecision d = decide(logits + t * c.n_experts, bias, c);
    double sum = 0.0;
    for (int64_t i = 0; i < c.top_k; ++i) sum += d.score[d.expert_order[i]];
    const double denom = c.norm_topk_prob ? sum + 1e-20 : 1.0;
    for (int64_t i = 0; i < c.top_k; ++i) {
      const int e = d.expert_order[i];
      ids[t * c.top_k + i] = e;
      weights[t * c.top_k + i] = d.score[e] / denom * c.routed_scaling_factor;
    }
  }
}

void grouped_topk_reference(const float* logits, int64_t num_tokens, const float* bias, const RouterConfig& c,
                            int32_t* ids, double* weights) {
  PCPKV_CHECK(num_tokens >= 0, "router: num_tokens = {} must be >= 0", num_tokens);
  PCPKV_CHECK(num_tokens == 0 || logits != nullptr, "router: null logits pointer");
  std::vector<double> ld(static_cast<size_t>(num_tokens * c.n_experts));
  for (size_t i = 0; i < ld.size(); ++i) ld[i] = logits[i];
  grouped_topk_reference(ld.data(), num_tokens, bias, c, ids, weights);
}

std::vector<RoutingGaps> routing_decision_gaps(const double* logits, int64_t num_tokens, const float* bias,
                                               const RouterConfig& c) {
  validate_router_config(c);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<RoutingGaps> gaps(static_cast<size_t>(num_tokens));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const TokenDecision d = decide(logits + t * c.n_experts, bias, c);
    RoutingGaps& g = gaps[t];
    g.group_gap = c.topk_group < c.n_group
                      ? d.group_score[d.group_order[c.topk_group - 1]] - d.group_score[d.group_order[c.topk_group]]
                      : inf;
    const auto kept = static_cast<int64_t>(d.expert_order.size());
    g.expert_gap =
        kept > c.top_k ? d.biased[d.expert_order[c.top_k - 1]] - d.biased[d.expert_order[c.top_k]] : inf;
  }
  return gaps;
}

}  // namespace pcpkv
