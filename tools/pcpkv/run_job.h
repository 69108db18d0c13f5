// tools/pcpkv/run_job.h: the main job behind `pcpkv run`: plan, inputs, publish with each transport,
// single-rank references, verification. No printing here (run_report.h prints).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "batch_flags.h"
#include "pcpkv/publish/transport_choice.h"

namespace pcpkv::cli {

class Progress;

/// Flags of `pcpkv run`, as given (validated by prepare_run); the batch flags: batch_flags.h.
struct RunOptions : BatchFlags {
  RunOptions() {
    tokens = 32768;  // one prefill request of this many tokens (0: none)
    decodes = 4;     // decode requests, each with its own context
    // decode_context: context of decode i: this value, or (-1) 1000 * (i + 1) + 7 * i
    // threads: CPU backend threads (0: all cores)
    topk_fill = "";  // --topk-fill [full|tail|none]: "" = no top-k buffer; the flag alone = full
  }
  bool model_given = false;  // --model on the command line (else --config picks by model_type)
  std::vector<std::string> flags_given;  // long flags on the command line ("--k-scale"), for ignored-flag notes
  int32_t pcp = 8;
  std::string inputs;  // --inputs FILE.safetensors
  std::string save;    // --save FILE.safetensors
  bool json = false;
  bool allow_nonfinite = false;
  double memory_limit_gb = 0;  // refuse runs whose estimated peak exceeds this (0: available memory only)
  std::string inject_fault;  // testing aid (hidden flag): "row" or "guard" flips a byte of the last
                             // rank's MLA replica after each publication, so the checks must fail
  bool check_replicas = false;  // --check-replicas (or PCPKV_CHECK_REPLICAS=1): the run-time replica check
};

/// Everything decided before the first byte is published.
struct PreparedRun {
  RunOptions opts;
  TopkFill topk_fill = TopkFill::kFull;  // parsed --topk-fill (when given)
  bool check_replicas = false;           // --check-replicas or PCPKV_CHECK_REPLICAS=1
  ModelConfig model;
  ConfigNotes notes;
  CacheFormat fmt;
  std::vector<Transport> transports;
  std::string transport_reason;  // --transport auto: "--transport auto: direct: ..." (what it chose and why)
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

struct TransportRun {
  Transport transport;
  PublishResult result;
  PublishResult reference;  // CPU backend, PCP-1
};

struct RunOutcome {
  std::string backend_name, backend_device, backend_note;
  std::vector<TransportRun> runs;
  std::vector<Check> checks;  // pcpkv/publish/checks.h
  std::vector<std::string> notes;  // remarks about the results (e.g. many saturated fp8 values)
  bool ok() const;
};

/// Publishes with every requested transport on the chosen backend, runs the single-rank references on
/// the CPU backend, and performs every check (check_publication, pcpkv/publish/checks.h).
RunOutcome execute_run(const PreparedRun& prep, Progress* progress);

/// The topology of `pcpkv run`'s pcp logical ranks (one process, one device, this host), for --transport auto.
Topology one_process_topology(int32_t pcp);

}  // namespace pcpkv::cli
