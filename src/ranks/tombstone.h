// Rank 0's reason for giving up a rendezvous, left next to its socket for ranks that never reached it.
//
// When rank 0 fails the rendezvous (a rank missing after the timeout, a world-size mismatch), ranks that had
// not connected yet would only see a missing socket until their own timeout. Rank 0 leaves
// "<address>.failed": the job token, the boot it was written in, when, and the reason. A rank fails at once
// with that reason only when the tombstone belongs to its own attempt: same token, written in this boot after
// this process started, and not already reported by this process. A retried job (a torchrun-style job started
// again on the same MASTER_PORT has the same token) starts new processes after the old tombstone, so it waits
// for its own rank 0 instead of failing with the dead job's reason.
#pragma once

#include <cstdint>
#include <string>

namespace pcpkv::bootstrap_tombstone {

/// "<address>.failed".
std::string path_of(const std::string& address);

/// Writes the tombstone atomically (a temporary file, then rename); best effort, silent on failure: it only
/// speeds up the other ranks' errors. keep_s: how long a rank of this attempt may still be waiting (its timeout
/// and a margin); past that, any later rank 0 in the directory removes the file (sweep).
void write(const std::string& address, const std::string& token, const std::string& reason, double keep_s = 3600);

/// Removes a tombstone at `address` (rank 0 at its start: any one there is an earlier attempt's).
void remove(const std::string& address);

struct Found {
  std::string reason;          // "" when no tombstone carries `token`
  bool this_attempt = false;   // written in this boot after this process started, not reported by it before
  bool earlier_boot = false;   // written before this host's last boot
  double age_at_start_s = 0;   // !this_attempt, same boot: seconds from the tombstone to this process's start
  int64_t written_ns = 0;      // CLOCK_BOOTTIME when written
};

/// The tombstone at `address` for `token`, classified against this process's start time.
Found read(const std::string& address, const std::string& token);

/// Removes the tombstones in `dir` that no rank can still be waiting for (kept past their keep_s, or from an
/// earlier boot): rank 0 at its start reclaims what failed jobs with other addresses left.
void sweep(const std::string& dir);

/// Marks `found` as reported by this process: a later rendezvous in it treats the same tombstone as old.
void mark_reported(const Found& found);

}  // namespace pcpkv::bootstrap_tombstone
