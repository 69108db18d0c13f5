// pcpkv/publish/checks.h: the checks that prove a published cache right.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"

namespace pcpkv {

/// Byte comparison of two buffers of equal size. first_diff = -1 when equal.
struct ByteDiff {
  int64_t num_diff = 0;
  int64_t first_diff = -1;
  bool equal() const { return num_diff == 0; }
};
/// Throws pcpkv::Error when the sizes differ.
ByteDiff compare_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);
/// The n bytes at a and b (raw host buffers, e.g. a kernel's output against the oracle's); n < 0: pcpkv::Error.
ByteDiff compare_bytes(const void* a, const void* b, int64_t n);
/// The n bytes at p (host) against kGuardByte: num_diff bytes changed, the first at first_diff; n < 0: pcpkv::Error.
ByteDiff compare_to_guard(const void* p, int64_t n);

/// Where byte `offset` of one of r's MLA allocations lies, for first-difference messages, e.g.
///   "byte 4711 (slot 17, byte 5 of its row: kv_c[5], tile 0; block 1 row 1)",
///   "byte 9000 (slot 20, byte 700 of its row: row padding)", "byte 12 (before the cache)",
///   "byte 70000 (block 4 padding)", "byte 80000 (after the cache)".
/// fmt.kv_format names the row's fields (SPEC section 3 layouts).
std::string describe_mla_byte(const PublishResult& r, const CacheFormat& fmt, int64_t offset);
/// The same for an indexer allocation: "byte 300 (slot 2 data, byte 44)", "(slot 2 scale, byte 1)", ....
std::string describe_index_byte(const PublishResult& r, int64_t offset);

/// Every byte of rank r's allocations not covered by a row the plan writes (guards, the base offset,
/// row and block padding, unwritten slots, the indexer cache of a layer without one) must equal
/// kGuardByte. Returns the number of bytes that do not, and a description of the first.
struct GuardReport {
  int64_t num_bad = 0;
  std::string first;
};
GuardReport check_untouched(const PublishResult& r, int32_t rank, const PcpPlan& plan, const CacheFormat& fmt);

/// FP8 bound check of rank r's cache against fp64 math of the SPEC section 2 formulas on the same
/// inputs (RMSNorm, RoPE, LayerNorm in double), for every slot the plan writes. Per value:
///   E4M3 values (scale s = tile scale, k_scale or indexer scale):
///     |dequant - exact| <= 2^-4 * |exact| + 2^-10 * s    (3 mantissa bits; half the subnormal step 2^-9 s)
///     plus 2^-8 * |exact| when the path rounds to bf16 first (collect);
///   bf16 values (k_pe of fp8_ds_mla rows, all of bf16 rows; rounding to bf16 first changes nothing):
///     |dequant - exact| <= 2^-8 * |exact| + 2^-16 * amax  (amax = max |exact| of the token's 512 kv_c / 64 k_pe;
///     the absolute term covers fp32 RoPE cancellation, which a purely relative bound would flag).
/// Saturated values (|exact| > 448 * s, static fp8 only) are counted apart and not against the bound.
/// Scales are checked too (a wrong scale widens the bound): power-of-two scales (ds_mla pow2, indexer UE8M0)
/// must lie in [l, 2l] for l = the SPEC lower bound from the exact amax (max(amax/448, 1e-4), resp.
/// max(amax, 1e-4)/448), raw scales within 2^-7 of max(amax/448, FLT_MIN), both widened by 2^-7; a scale
/// outside counts as one value over the bound. Why the bound holds: src/publish/checks/checks.cpp.
struct Fp8Report {
  int64_t num_values = 0;
  int64_t num_over_bound = 0;
  int64_t num_saturated = 0;
  int64_t num_flushed = 0;  // static fp8: nonzero values below 2^-10 * k_scale, which encode as 0 (still checked)
  double max_abs_err = 0.0;
  double max_err_over_bound = 0.0;  // max |err| / bound (<= 1 passes)
  std::string worst;                // where the worst value lies
};
Fp8Report check_fp8_bound(const PublishResult& r, int32_t rank, const GlobalInputs& in, const PcpPlan& plan,
                          const ModelConfig& model, const CacheFormat& fmt, bool bf16_first);

/// Decoded cache contents of one slot (for tools and tests).
struct DecodedRow {
  float kv_c[512];
  float k_pe[64];
  float index_k[128];
  float tile_scales[4];
  float index_scale;
};
DecodedRow decode_slot(const uint8_t* mla_cache, const MlaCacheGeometry& mg, const uint8_t* index_cache,
                       const IndexerCacheGeometry& ig, const CacheFormat& fmt, int64_t slot);


// ---- the publication checks: one result type, one function per check, one JSON shape ----------------
//
// Used by `pcpkv run` (check_publication), `pcpkv mp-publish` (check_replicas_vs_reference, check_guards,
// check_outputs_vs_reference) and the tests alike (tests/support/publish_case.h turns a Check into a gtest
// assertion). Each check returns pass = false with a detail naming the first difference; none throws on a
// mismatch (only on results of the wrong shape: pcpkv::Error). A byte comparison's detail reads
//   "<what is compared>: <n> bytes differ, first at <describe_mla_byte / ...>: 0x3d vs 0x3c"
// (the rank or replica in <what is compared>, the two byte values in its order: this result's first).

/// One verification result. The counts say what was compared: byte checks fill num_bytes / num_diff,
/// the bound check fills the num_values ... worst fields (num_values > 0 tells them apart in JSON).
struct Check {
  std::string name;       // "replicas identical", "staging == direct", ...
  std::string transport;  // "collect" | "staging" | "direct"; "" when it spans transports
  bool pass = false;
  std::string detail;  // one line: sizes when it passes, the first difference or the max error when not
  std::string worst;   // bound check: where the worst value lies (printed when the check fails)
  // bound check
  double max_abs_err = 0, max_err_over_bound = 0;
  int64_t num_values = 0, num_over_bound = 0, num_saturated = 0, num_flushed = 0;
  // byte comparisons: bytes compared and bytes that differ (guards: bytes changed)
  int64_t num_bytes = 0, num_diff = 0;
};

/// The PCP-1 plan over the same requests, block tables and slots as `plan` (global token g on rank 0's
/// row g): the single-rank reference check_vs_single_rank compares against. Validated (validate_plan).
PcpPlan single_rank_plan(const PcpPlan& plan);

/// true when `checks` is not empty and every check passed.
bool all_pass(const std::vector<Check>& checks);

/// Every rank's MLA and indexer allocation (the indexer's guard-only one of a layer without an indexer too)
/// equals rank 0's, byte for byte. Check "replicas identical".
Check check_replicas_identical(const PublishResult& r, const CacheFormat& fmt);

/// Rank 0's MLA and indexer allocations of a and b are byte-identical (e.g. staging == direct). `name` and
/// `transport` label it.
Check check_same_caches(const PublishResult& a, const PublishResult& b, const CacheFormat& fmt, std::string name,
                        std::string transport);

/// Rank 0's caches equal those of `single` (the same requests, blocks and slots published with PCP 1,
/// global order on rank 0), and every rank's q_c_out rows (when both results hold them) equal the PCP-1 rows of
/// the same global tokens. q_lora_rank: elements per q_c_out row. Check "== single-rank reference".
Check check_vs_single_rank(const PublishResult& r, const PublishResult& single, const PcpPlan& plan,
                           const CacheFormat& fmt, int64_t q_lora_rank);

/// Every replica of `got` equals the same rank's replica of `ref` (the same plan published by another
/// backend or process layout; both hold the same number of ranks, else pcpkv::Error). fmt names the fields
/// in messages; rank_names[q] names rank q ("global rank 5"); empty: "rank q".
/// Check "replicas == single-process CPU reference".
Check check_replicas_vs_reference(const PublishResult& got, const PublishResult& ref, const CacheFormat& fmt,
                                  const std::vector<int32_t>& rank_names = {});

/// Every rank's bytes outside written rows are kGuardByte (check_untouched on each rank). rank_names as above.
/// Check "guard/untouched bytes intact".
Check check_guards(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt,
                   const std::vector<int32_t>& rank_names = {});

/// One rank's q_c_out and top-k rows (from a one-process-per-rank publisher) equal rank `rank` of `ref`'s:
/// q_c_out only when `q_c_out` is not empty, top-k only when `topk` is not empty. Check "rank 0 q_c_out /
/// top-k == reference" (the rank in the name is `rank`); passes with nothing to compare.
Check check_outputs_vs_reference(const std::vector<uint16_t>& q_c_out, const std::vector<int32_t>& topk,
                                 const PublishResult& ref, int32_t rank);

/// CUDA graph replays of a one-process-per-rank publication: the fence epochs (start fence, then the
/// publication fence, see RankPublishResult::fence_epochs) after `replays` replays, `before` those before the
/// eager run that preceded the capture. Per run the start fence advances once, the publication fence once
/// or not at all (collect over NCCL has none). Check "fence epochs advanced every replay".
Check check_fence_epochs(const std::vector<uint64_t>& before, const std::vector<uint64_t>& after, int32_t replays);

/// FNV-1a over every replica's MLA then indexer bytes, rank by rank: compares whole publications of two
/// transports without keeping both (one-process-per-rank publishers read the replicas back one at a time).
uint64_t replicas_fingerprint(const PublishResult& r);

/// Two fingerprints (replicas_fingerprint) agree. `name` labels it ("staging == direct").
Check check_same_fingerprint(std::string name, uint64_t a, uint64_t b);

/// Rank 0's dequantized cache against fp64 math (check_fp8_bound; the collect transport rounds to bf16
/// first). Check "dequantized vs fp64 within the FP8 bound" (bf16 formats name their bound).
Check check_bound(const PublishResult& r, const GlobalInputs& in, const PcpPlan& plan, const ModelConfig& model,
                  const CacheFormat& fmt);

/// Every row of every rank's top-k buffer [max_local_tokens, width] (padding rows too): int32 -1 from
/// topk_fill_first_row(mode, the rank's num_local_tokens, M) on, the backend's poison kGuardByte before it
/// (the rows `mode` must not write). Check "top-k buffer filled with -1 (full)" / "... (tail)" / "... (none)".
Check check_topk_filled(const PublishResult& r, const PcpPlan& plan, int64_t width, TopkFill mode = TopkFill::kFull);

/// What a publication is checked against in `pcpkv run`.
struct PublicationCase {
  const ModelConfig* model = nullptr;
  const PcpPlan* plan = nullptr;  // the plan `result` was published with
  const GlobalInputs* inputs = nullptr;
  CacheFormat fmt;
  int64_t topk_width = 0;  // > 0: the top-k buffer must be filled
  TopkFill topk_fill = TopkFill::kFull;  // which of its rows (PublishSetup::topk_fill_mode)
  bool check_replicas = false;  // also the run-time replica check (pcpkv/publish/replica_hash.h), a debug mode
  int32_t layer_idx = 0;        // the layer it names
};

/// The checks of one transport's publication, in this order: replicas identical, == single-rank reference,
/// guard bytes, the bound, (topk_width > 0) the top-k buffer and (check_replicas) "replica hashes agree"
/// (check_replica_hashes). step, when set, is called before each with what is checked ("replicas", "single-rank
/// reference", "guard bytes", "dequantized cache vs fp64", "replica hashes").
std::vector<Check> check_publication(const PublishResult& result, const PublishResult& single_rank,
                                     const PublicationCase& c,
                                     const std::function<void(const std::string&)>& step = {});

/// Remarks on a set of checks: when more than 1% of a bound check's values saturate (not held to the
/// bound) or flush to 0 (held only to its absolute term), the check says little; k_scale names the flag.
std::vector<std::string> check_notes(const std::vector<Check>& checks, float k_scale);

/// The checks as one JSON array (text, indent as nlohmann's dump: -1 compact): per check
///   {"check", "transport", "pass", "detail"} then either
///   {"num_values", "num_over_bound", "num_saturated", "num_flushed", "max_abs_err", "max_err_over_bound",
///    "worst"} (bound checks, num_values > 0) or {"num_bytes", "num_diff"}.
std::string checks_json(const std::vector<Check>& checks, int indent = -1);

}  // namespace pcpkv
