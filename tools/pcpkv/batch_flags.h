// tools/pcpkv/batch_flags.h: the flags that describe a batch and its publication (model, requests, cache
// format, transport, backend, seed), registered once for every subcommand that takes them (run,
// mp-publish, attention, bench). A command's options struct derives from BatchFlags, sets its own
// defaults in its constructor, and lists the flags it takes:
//   add_batch_flags(sub, *o, {BatchFlag::kModel, BatchFlag::kTokens, ...});
// Adding a flag: a field here, a row in batch_flags.cpp's table, and its name in the commands' lists.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"

namespace CLI {
class App;
}

namespace pcpkv::cli {

/// The fields behind the batch flags, as typed (each command validates them).
struct BatchFlags {
  std::string model = "glm-5";       // --model: preset name
  std::string config;                // --config: HF config.json
  int64_t tokens = 0;                // --tokens: the prefill request's length (attention --bench: its prefill)
  int32_t decodes = 0;               // --decodes: decode requests
  int64_t decode_context = -1;       // --decode-context (meaning per command: its help)
  int32_t block_size = 64;           // --block-size: tokens per cache block
  std::string local_order = "request";         // --local-order: request | local (SPEC section 4.1)
  std::string decode_ownership = "replicated";  // --decode-ownership: replicated | round_robin
  std::string kv_format = "fp8_ds_mla";
  std::string ds_mla_scale = "pow2";
  double k_scale = 1.0;              // --k-scale: static fp8 per-tensor scale
  std::string k_scale_text;          // --k-scale as typed (for messages), "" when not given
  std::string layer = "indexer";     // --layer: indexer | shared
  std::string transport = "all";     // --transport (run, mp-publish: also auto)
  std::string backend = "auto";      // --backend
  int32_t threads = 0;               // --threads: CPU threads
  uint64_t seed = 0;                 // --seed
  int32_t repeats = 1;               // --repeats
  int64_t topk_width = 0;            // --topk-width: top-k buffer width filled with -1
  std::string topk_fill = "full";    // --topk-fill: full | tail | none (pcpkv/publish/dispatch.h TopkFill)
};

enum class BatchFlag {
  kModel, kConfig, kTokens, kDecodes, kDecodeContext, kBlockSize, kLocalOrder, kDecodeOwnership, kKvFormat, kDsMlaScale, kKScale, kLayer,
  kTransport, kBackend, kThreads, kSeed, kRepeats, kTopkWidth, kTopkFill,
};

/// A command's own help text for a flag, where it means something narrower than the shared text.
struct FlagHelp {
  BatchFlag flag;
  const char* help;
};

/// --transport: "all" or a comma list of collect, staging, direct, each at most once ("auto" is decided by
/// the command before: transport_choice.h). Throws pcpkv::Error naming the flag and the value.
std::vector<Transport> parse_transport_list(const std::string& s);

/// --kv-format, --ds-mla-scale, --k-scale (positive, finite, and a float32: the cache stores it as fp32)
/// and --layer as one CacheFormat. Throws pcpkv::Error naming the flag and the value as typed.
CacheFormat parse_format_flags(const BatchFlags& f);

/// Registers `flags` on `sub` (in that order), bound to f's fields; help shows f's current values as the
/// defaults, so set the command's defaults first. Integers typed out of range are refused by name for every
/// command's flags at once (number_flags.h).
void add_batch_flags(CLI::App* sub, BatchFlags& f, std::initializer_list<BatchFlag> flags,
                     std::initializer_list<FlagHelp> help = {});

}  // namespace pcpkv::cli
