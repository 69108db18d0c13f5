// pcpkv/publish/save_run.h: writes a publication to a safetensors file (`pcpkv run --save`); the tensor list
// is the one of pcpkv/core/inputs_io.h.
#pragma once

#include <map>
#include <string>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/backend.h"

namespace pcpkv {

/// What save_run records besides the tensors.
struct SaveInfo {
  std::string transport;                        // whose rank-0 caches are saved
  std::map<std::string, std::string> metadata;  // extra __metadata__ entries
};

/// Writes the inputs, the batch (requests, slot mapping, positions, block tables, gathered mapping) and
/// rank 0's MLA and indexer-K caches of `result` (the cache region of each allocation, guards excluded) to
/// `path` (see the tensor list above). The file appears atomically (temporary + rename). Throws
/// pcpkv::Error when the file cannot be written.
void save_run(const std::string& path, const ModelConfig& model, const PcpPlan& plan, const CacheFormat& fmt,
              const GlobalInputs& in, const PublishResult& result, const SaveInfo& info);

}  // namespace pcpkv
