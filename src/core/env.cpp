// src/core/env.cpp: the registry of pcpkv/core/env.h. Add a variable here before reading it anywhere.
#include "pcpkv/core/env.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {
namespace {

std::vector<EnvVar> sorted(std::vector<EnvVar> v) {
  std::sort(v.begin(), v.end(), [](const EnvVar& a, const EnvVar& b) { return std::string_view(a.name) < b.name; });
  return v;
}

}  // namespace

const std::vector<EnvVar>& env_registry() {
  static const std::vector<EnvVar> kRegistry = sorted({
      {"PCPKV_ALLOW_NONLOCAL_MASTER", "1: accept a torchrun MASTER_ADDR that does not look like this host; 0 or empty: "
       "off; any other value is refused",
       "unset: MASTER_ADDR must be a loopback address, localhost or this host's name",
       "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_BOOTSTRAP", "path of rank 0's rendezvous socket (set by `pcpkv launch` for each rank)",
       "unset: not a `pcpkv launch` rank", "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_BOOTSTRAP_DIR", "directory of the rendezvous socket of torchrun-style jobs",
       "$TMPDIR, else /tmp", "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_BOOTSTRAP_TIMEOUT_S", "bound of every blocking bootstrap step, seconds (> 0)", "60",
       "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_CHECK_REPLICAS",
       "1: the run-time replica check after every publication (`pcpkv run`, `pcpkv mp-publish`: like "
       "--check-replicas; pcpkv_torch: check_replicas=None); 0 or empty: off; any other value is refused",
       "off", "publish (src/publish/replica_check.cpp); pcpkv_torch (models/replica_check.py)"},
      {"PCPKV_CONFIG_DIR", "directory of the presets' HF config.json files (<preset>.json)",
       "the configs/ directory the library was built (or installed) with", "core (src/core/model_presets.cpp)"},
      {"PCPKV_DEBUG", "set: the CLI also prints where an error was raised", "unset: the message only",
       "CLI (tools/pcpkv/main.cpp)"},
      {"PCPKV_DEVICE", "GPU index every rank process uses, in [0, visible devices)",
       "unset: local rank % visible devices", "ranks (src/ranks/launcher.cpp)"},
      {"PCPKV_DISPATCH_VARIANT",
       "dispatch kernel for DispatchVariant::kAuto: simple | prefetch | warp | warp_pf | warp_token | warp_split; any "
       "other non-empty value is refused",
       "unset or empty: warp", "publish/cuda (src/publish/cuda/dispatch.cu, src/publish/dispatch_variant.cpp)"},
      {"PCPKV_JOB_ID", "names a torchrun-style job (its token is derived from it)",
       "unset: the run id and the command line name the job", "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_JOB_TOKEN", "per-job token every rank presents (set by `pcpkv launch`; torchrun jobs may set it)",
       "unset: derived from PCPKV_JOB_ID or the command line", "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_LOCAL_RANK", "rank among the processes of this host (set by `pcpkv launch`)", "PCPKV_RANK",
       "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_LOCAL_WORLD_SIZE", "processes on this host (set by `pcpkv launch`)", "PCPKV_WORLD_SIZE",
       "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_PDL",
       "1: launch kernels with programmatic dependent launch (pcpkv/core/pdl.h); 0 or empty: off; any other value is "
       "refused",
       "off",
       "core/cuda (src/core/cuda/pdl_switch.cpp)"},
      {"PCPKV_RANK", "this process's rank (set by `pcpkv launch`)", "unset: not a `pcpkv launch` rank",
       "ranks (src/ranks/bootstrap_env.cpp)"},
      {"PCPKV_WORLD_SIZE", "number of rank processes (set by `pcpkv launch`)", "unset: not a `pcpkv launch` rank",
       "ranks (src/ranks/bootstrap_env.cpp)"},
  });
  return kRegistry;
}

const EnvVar* find_env_var(std::string_view name) {
  for (const EnvVar& v : env_registry())
    if (name == v.name) return &v;
  return nullptr;
}

const char* read_env(const char* name) {
  PCPKV_CHECK(name != nullptr, "read_env: name is null");
  PCPKV_CHECK(!std::string_view(name).starts_with("PCPKV_") || find_env_var(name) != nullptr,
              "read_env: {} is not in the registry of environment variables (src/core/env.cpp)", name);
  return std::getenv(name);
}

bool read_env_switch(const char* name) {
  const char* v = read_env(name);
  if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "0") == 0) return false;
  PCPKV_CHECK(std::strcmp(v, "1") == 0, "{}: must be 1 (on) or 0 / empty / unset (off), got '{}'", name, clip(v));
  return true;
}

std::optional<int64_t> read_env_int(const char* name, int64_t lo, int64_t hi, std::string_view who) {
  const char* v = read_env(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  PCPKV_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi, "{}: {}='{}' is not an integer in [{}, {}]",
              who, name, clip(v), lo, hi);
  return static_cast<int64_t>(x);
}

}  // namespace pcpkv
