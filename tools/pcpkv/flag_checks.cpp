#include "pcpkv/flag_checks.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "pcpkv/core/block_size.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"

namespace pcpkv::cli {

void check_block_size_flag(int64_t block_size) {
  if (const auto why = block_size_problem(block_size)) PCPKV_FAIL("--block-size: {} {}", block_size, *why);
}

namespace {

// First number of a one-line file ("max" and missing files give nothing).
bool read_number(const std::string& path, long double* out) {
  std::ifstream in(path);
  long double v = 0;
  if (!(in >> v) || v < 0) return false;
  *out = v;
  return true;
}

// The cgroup v2 directory of this process ("0::/user.slice/x" -> /sys/fs/cgroup/user.slice/x), or "".
std::string cgroup_v2_dir() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) return "/sys/fs/cgroup" + line.substr(3);
  }
  return "";
}

}  // namespace

void check_run_count(const char* flag, int64_t value, int64_t min) {
  PCPKV_CHECK(value >= min && value <= kMaxRunCount, "{}: must be in [{}, {}], got {}", flag, min, kMaxRunCount, value);
}

std::vector<std::string> unused_format_flag_notes(KvFormat kv_format, bool ds_mla_scale_given, bool k_scale_given) {
  std::vector<std::string> notes;
  if (ds_mla_scale_given && kv_format != KvFormat::kFp8DsMla) {
    notes.push_back(fmt::format("--ds-mla-scale: not used: it applies to --kv-format fp8_ds_mla, not {}",
                                to_string(kv_format)));
  }
  if (k_scale_given && kv_format != KvFormat::kFp8) {
    notes.push_back(fmt::format("--k-scale: not used: it applies to --kv-format fp8, not {}", to_string(kv_format)));
  }
  return notes;
}

HostMemory available_host_memory() {
  HostMemory m;
  m.bytes = std::numeric_limits<long double>::infinity();
  m.source = "no memory figure readable";
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    long double kb = 0;
    std::string unit;
    while (in >> key >> kb) {
      std::getline(in, unit);
      if (key == "MemAvailable:") {
        m.bytes = kb * 1024.0L;
        m.source = "MemAvailable";
        break;
      }
    }
  }
  // cgroup v2: this process's group and every ancestor may carry a limit; v1: the memory controller's.
  auto consider = [&m](const std::string& limit_file, const std::string& usage_file, const char* what) {
    long double limit = 0, usage = 0;
    if (!read_number(limit_file, &limit) || limit >= 1e18L) return;  // "max" or v1's "no limit"
    if (!read_number(usage_file, &usage)) usage = 0;
    const long double left = std::max<long double>(0, limit - usage);
    if (left < m.bytes) {
      m.bytes = left;
      m.source = fmt::format("{} {} minus its usage", what, limit_file);
    }
  };
  std::string dir = cgroup_v2_dir();
  while (!dir.empty() && dir.size() >= std::string("/sys/fs/cgroup").size()) {
    consider(dir + "/memory.max", dir + "/memory.current", "cgroup limit");
    if (dir == "/sys/fs/cgroup" || dir == "/sys/fs/cgroup/") break;
    const size_t slash = dir.find_last_of('/');
    if (slash == std::string::npos) break;
    dir = dir.substr(0, slash);
  }
  consider("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
           "cgroup limit");
  return m;
}

std::string format_bytes(long double bytes) {
  if (!std::isfinite(static_cast<double>(bytes))) return "an unbounded amount";
  if (bytes >= 1e15L) return fmt::format("{:.3g} TB", static_cast<double>(bytes / 1e12L));
  if (bytes >= 1e12L) return fmt::format("{:.1f} TB", static_cast<double>(bytes / 1e12L));
  if (bytes >= 1e9L) return fmt::format("{:.1f} GB", static_cast<double>(bytes / 1e9L));
  return fmt::format("{:.1f} MB", static_cast<double>(bytes / 1e6L));
}

void MemoryEstimate::add(const std::string& name, long double bytes) {
  if (bytes <= 0) return;
  for (auto& [n, b] : parts_) {
    if (n == name) {
      b += bytes;
      return;
    }
  }
  parts_.emplace_back(name, bytes);
}

long double MemoryEstimate::total() const {
  long double t = 0;
  for (const auto& p : parts_) t += p.second;
  return t;
}

std::string MemoryEstimate::describe(size_t max_parts) const {
  auto sorted = parts_;
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string s;
  long double rest = 0;
  size_t num_rest = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i < max_parts) {
      s += fmt::format("{}{} {}", s.empty() ? "" : ", ", sorted[i].first, format_bytes(sorted[i].second));
    } else {
      rest += sorted[i].second;
      ++num_rest;
    }
  }
  if (num_rest > 0) s += fmt::format(", {} more {}", num_rest, format_bytes(rest));
  return s;
}

void check_memory_fits(const std::string& flags, const std::string& what, const std::string& kind,
                       const MemoryEstimate& need, long double available, const std::string& source,
                       const std::string& hint) {
  const long double total = need.total();
  PCPKV_CHECK(total <= available, "{}: {} needs about {} of {} memory ({}), more than the {} available ({}){}", flags,
              what, format_bytes(total), kind, need.describe(), format_bytes(available), source, hint);
}

}  // namespace pcpkv::cli
