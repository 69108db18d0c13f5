// tools/pcpkv/run_job.h: the main job behind `pcpkv run`: plan, inputs, publish with each transport,
// single-rank references, verification. No printing here (run_report.h prints).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"

namespace pcpkv::cli {

class Progress;

/// Flags of `pcpkv run`, as given (validated by prepare_run).
struct RunOptions {
  std::string model = "glm-5";
  bool model_given = false;  // --model on the command line (else --config picks by model_type)
  std::vector<std::string> flags_given;  // long flags on the command line ("--k-scale"), for ignored-flag notes
  std::string config;        // --config PATH (HF config.json)
  int32_t pcp = 8;
  int64_t tokens = 32768;       // one prefill request of this many tokens (0: none)
  int32_t decodes = 4;          // decode requests, each with its own context
  int64_t decode_context = -1;  // context of decode i: this value, or (-1) 1000 * (i + 1) + 7 * i
  int32_t block_size = 64;
  std::string kv_format = "fp8_ds_mla";
  std::string ds_mla_scale = "pow2";
  double k_scale = 1.0;           // static fp8 per-tensor scale
  std::string k_scale_text;       // --k-scale as typed (for messages), "" when not given
  std::string layer = "indexer";  // indexer | shared
  std::string transport = "all";  // all | comma list of collect, staging, direct
  std::string backend = "auto";
  int32_t threads = 0;  // CPU backend threads (0: all cores)
  uint64_t seed = 0;
  std::string inputs;  // --inputs FILE.safetensors
  std::string save;    // --save FILE.safetensors
  bool json = false;
  std::string topk_fill;  // --topk-fill [full|tail|none]: "" = no top-k buffer; the flag alone = full
  bool allow_nonfinite = false;
  int32_t repeats = 1;
  double memory_limit_gb = 0;  // refuse runs whose estimated peak exceeds this (0: available memory only)
  std::string inject_fault;  // testing aid (hidden flag): "row" or "guard" flips a byte of the last
                             // rank's MLA replica after each publication, so the checks must fail
};

/// Everything decided before the first byte is published.
struct PreparedRun {
  RunOptions opts;
  TopkFill topk_fill = TopkFill::kFull;  // parsed --topk-fill (when given)
  ModelConfig model;
  ConfigNotes notes;
  CacheFormat fmt;
  std::vector<Transport> transports;
  PcpPlan plan;      // PCP-P plan
  PcpPlan ref_plan;  // PCP-1 plan: same requests, block tables and slots
  GlobalInputs inputs;
  std::string inputs_source;  // "generated (seed 0)" or the file path
  std::string batch_source;   // where the requests came from
  NonFiniteReport nonfinite;
  std::vector<std::string> notes_text;  // remarks to print (config notes, ignored flags)
  long double memory_estimate = 0;      // estimated peak resident bytes of the run (see run_job.cpp)
  long double memory_limit = 0;         // what the pre-check allowed (available memory or --memory-limit-gb)
};

/// Validates the flags, loads the model, builds the plan, generates or loads the inputs, and refuses
/// non-finite inputs unless --allow-nonfinite. Throws pcpkv::Error naming the flag / field and value.
/// Writes nothing.
PreparedRun prepare_run(const RunOptions& opts, Progress* progress);

/// One verification line.
struct Check {
  std::string name;       // "replicas identical", "staging == direct", ...
  std::string transport;  // "" when it spans transports
  bool pass = false;
  std::string detail;  // human detail: sizes, first difference, max error / bound
  std::string worst;   // fp8 bound: where the worst value lies (printed when the check fails)
  // fp8 bound numbers (only for the "fp8 bound" check)
  double max_abs_err = 0, max_err_over_bound = 0;
  int64_t num_values = 0, num_over_bound = 0, num_saturated = 0, num_flushed = 0;
  // byte comparisons
  int64_t num_bytes = 0, num_diff = 0;
};

struct TransportRun {
  Transport transport;
  PublishResult result;
  PublishResult reference;  // CPU backend, PCP-1
};

struct RunOutcome {
  std::string backend_name, backend_device, backend_note;
  std::vector<TransportRun> runs;
  std::vector<Check> checks;
  std::vector<std::string> notes;  // remarks about the results (e.g. many saturated fp8 values)
  bool ok() const;
};

/// Publishes with every requested transport on the chosen backend, runs the single-rank references on
/// the CPU backend, and performs every check (all through verify.h).
RunOutcome execute_run(const PreparedRun& prep, Progress* progress);

/// The PCP-1 plan over the same requests, block tables and slots as `plan` (global order on rank 0).
PcpPlan single_rank_plan(const PcpPlan& plan);

/// Parses --transport: "all" or a comma list. Throws pcpkv::Error naming the flag and the value.
std::vector<Transport> parse_transport_list(const std::string& s);

}  // namespace pcpkv::cli
