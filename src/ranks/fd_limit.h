// The open-file limit (RLIMIT_NOFILE) against what a step of a job needs: the bootstrap (a connection and a shared
// descriptor per rank) and the launcher (two relayed pipes per rank) check it before they start anything.
#pragma once

#include <cstdint>
#include <string>

namespace pcpkv::fd_limit {

/// Descriptors this process has open now (0 when /proc/self/fd cannot be read).
int64_t open_now();

/// The limit as messages name it: "1024 (soft; hard limit 4096)".
std::string describe();

/// Makes room for `need` open descriptors in all. A soft limit below it is raised to the hard limit (as NCCL and
/// many servers do; any process may). Returns "" when `need` fits, else "the open-file limit (RLIMIT_NOFILE) is S
/// with a hard limit of H, the most it can be raised to" (S: the soft limit before the attempt).
std::string fit(int64_t need);

}  // namespace pcpkv::fd_limit
