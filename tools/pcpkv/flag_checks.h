// Flag checks shared by the CLI subcommands; each throws pcpkv::Error naming the flag and its value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/core/layout.h"

namespace pcpkv::cli {

// --block-size: pcpkv::block_size_problem (pcpkv/core/block_size.h), the rule pcpkv_torch's entries share.
void check_block_size_flag(int64_t block_size);

/// Most timed or repeated runs a count flag (--repeats, --iters, --warmup) asks for: a median needs tens, and a
/// typo such as --repeats 2000000000 would otherwise run for days before printing anything.
constexpr int64_t kMaxRunCount = 1'000'000;

/// Refuses a count flag outside [min, kMaxRunCount]: "--repeats: must be in [1, 1000000], got 0".
void check_run_count(const char* flag, int64_t value, int64_t min);

/// "note: ..." texts for format flags given on the command line that the format ignores: --ds-mla-scale
/// applies to fp8_ds_mla only, --k-scale to fp8 only (the same wording as `pcpkv run`).
std::vector<std::string> unused_format_flag_notes(KvFormat kv_format, bool ds_mla_scale_given, bool k_scale_given);

// ---- memory pre-checks: estimated from the flags, refused before anything is allocated ------------------

/// Memory this process may still take: /proc/meminfo MemAvailable, or the cgroup's limit minus its usage
/// when lower (a container's OOM killer would end the run with no message). bytes is +inf when neither is
/// readable; source says where the number came from ("MemAvailable", "cgroup memory.max - memory.current").
struct HostMemory {
  long double bytes = 0;
  std::string source;
};
HostMemory available_host_memory();

/// "812.3 MB", "4.1 GB", "3.2 TB" (decimal units).
std::string format_bytes(long double bytes);

/// A sum of named parts, in long double: flags like --tokens 99999999999 must give a message, not an
/// overflow. Parts with the same name add up.
class MemoryEstimate {
 public:
  void add(const std::string& name, long double bytes);
  long double total() const;
  /// The largest parts first: "caches 8.0 GB, outputs 4.1 GB, 3 more 0.2 GB".
  std::string describe(size_t max_parts = 4) const;

 private:
  std::vector<std::pair<std::string, long double>> parts_;
};

/// Refuses an estimate above `available` bytes: "<flags>: <what> needs about X of <kind> memory (parts),
/// more than the Y available (<source>)<hint>". kind: "host" | "device". Throws pcpkv::Error.
void check_memory_fits(const std::string& flags, const std::string& what, const std::string& kind,
                       const MemoryEstimate& need, long double available, const std::string& source,
                       const std::string& hint = "");

}  // namespace pcpkv::cli
