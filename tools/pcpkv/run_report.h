// tools/pcpkv/run_report.h: what `pcpkv run` prints: the plan, a stage table per transport, the
// verification verdict (text), and the same as one JSON document (--json).
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "run_job.h"

namespace pcpkv::cli {

/// The plan block: requests, tokens per rank, max_local_tokens, blocks, bytes per row, inputs.
std::string format_plan(const PreparedRun& prep);
/// "stage | ms | bytes | GB/s" for one transport's profile, with a total row.
std::string format_stage_table(const TransportRun& run, const std::string& backend_name, int32_t repeats);
/// One line per check and the verdict line.
std::string format_verdict(const RunOutcome& out, double elapsed_s);

/// saved: the --save path when written, else ""; save_error: why --save failed, else "".
nlohmann::ordered_json run_json(const PreparedRun& prep, const RunOutcome& out, double elapsed_s,
                                const std::string& saved, const std::string& save_error = {});

}  // namespace pcpkv::cli
