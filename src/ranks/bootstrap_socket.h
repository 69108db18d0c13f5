// The filesystem side of the bootstrap's Unix-domain socket: the private directory it lives in, rank 0's lock on
// the address, what crashed jobs left there, the peer's credentials and the open-file limit a job needs.
#pragma once

#include <sys/types.h>
#include <sys/un.h>

#include <string>

#include "pcpkv/ranks/bootstrap.h"

namespace pcpkv::bootstrap_socket {

/// strerror(err) as a std::string, for messages.
std::string errno_text(int err);

/// "job 'MASTER_PORT 29500, command ...'" or "an unnamed job".
std::string job_name(const std::string& job);

/// The directory of a socket path ("." for a bare name).
std::string dir_of(const std::string& path);

/// The sockaddr of `path`; throws pcpkv::Error when it does not fit sun_path, naming PCPKV_BOOTSTRAP_DIR / TMPDIR.
sockaddr_un make_addr(const std::string& path);

/// The socket's directory must exist (created 0700 when missing) and be private to this user: a socket in a
/// world-writable directory could be replaced by another user's listener. Throws pcpkv::Error saying which rule fails.
void ensure_private_dir(const std::string& socket_path);

/// Rank 0's hold on `address` (a lock file next to it) for as long as its Bootstrap lives: a second rank 0 at the
/// same address (another job on the same MASTER_PORT) is refused at once, naming the holder. Unlink
/// "<address>.lock" while still holding the returned descriptor.
UniqueFd lock_address(const std::string& address, const std::string& job);

/// Removes the lock files in `dir` whose holder is gone, with the socket such a rank 0 left.
void sweep_stale_locks(const std::string& dir);

/// The uid and pid of the process at the other end of a Unix-domain socket (SO_PEERCRED); false when unreadable.
bool peer_uid(int fd, uid_t* uid, pid_t* pid);

/// "" when this rank's share of a job of `world` ranks fits the open-file limit (after raising the soft limit), else
/// why not. Rank 0 holds a connection per peer.
std::string fit_descriptor_limit(int world, int rank);

}  // namespace pcpkv::bootstrap_socket
