// pcpkv/core/env.h: the one registry of the PCPKV_* environment variables the library and the CLI read
// (name, meaning, default, reader), and the accessor every reader goes through. `pcpkv info` lists the
// registry (text and --json); tests/core/test_env_registry.cpp fails when a source reads a PCPKV_* name
// that is not registered. Build-time variables of the scripts (PCPKV_JOBS, PCPKV_BUILD_DIR, ...) and of
// python/setup.py (PCPKV_TORCH_CUDA, ...) are not read by the library and are documented with them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace pcpkv {

struct EnvVar {
  const char* name;           // "PCPKV_..."
  const char* meaning;        // what a value does, with the accepted values
  const char* default_value;  // what happens when it is unset
  const char* reader;         // the product and file that read it, e.g. "ranks (src/ranks/launcher.cpp)"
};

/// Every registered variable, sorted by name.
const std::vector<EnvVar>& env_registry();

/// The entry of `name`, or nullptr when it is not registered.
const EnvVar* find_env_var(std::string_view name);

/// std::getenv for the library's readers: the raw value, nullptr when unset (an empty value is returned
/// as is; the reader decides what it means). A PCPKV_* name that is not in the registry throws
/// pcpkv::Error naming it (a reader was added without its entry); other names (RANK, TMPDIR, ...) are
/// read unchecked.
const char* read_env(const char* name);

/// A PCPKV_* on/off switch, read through read_env: true for "1", false when unset, empty or "0". Any other value
/// throws pcpkv::Error naming the variable and the value ("PCPKV_PDL: must be 1 (on) or 0 / empty / unset (off),
/// got 'yes'"): a typo must not turn a switch off silently. The one rule of every switch (PCPKV_CHECK_REPLICAS,
/// PCPKV_PDL, PCPKV_ALLOW_NONLOCAL_MASTER).
bool read_env_switch(const char* name);

/// An integer variable, read through read_env: nullopt when unset or empty. A value that is not a whole base-10
/// integer (strtol's spelling) in [lo, hi] throws pcpkv::Error "<who>: NAME='value' is not an integer in [lo, hi]"
/// (the value clipped); `who` names the reader, as its other messages do ("bootstrap").
std::optional<int64_t> read_env_int(const char* name, int64_t lo, int64_t hi, std::string_view who);

}  // namespace pcpkv
