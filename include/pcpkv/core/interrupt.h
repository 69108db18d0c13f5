// pcpkv/core/interrupt.h: lets a wait for a peer (the bootstrap's rendezvous and collectives, the host fence) be
// interrupted promptly, whatever its timeout.
//
// Where a signal's default action ends the process (the CLI), Ctrl-C needs nothing. Where a handler only records
// the signal and the program acts on it later (Python: KeyboardInterrupt is raised when the interpreter next runs),
// a wait that retries on EINTR would hold the signal until its timeout. Every such wait runs the process's
// interrupt check at least every kInterruptPollMs; the check throws to abandon the wait.
#pragma once

namespace pcpkv {

/// Returns to go on waiting; throws (any exception, passed on unchanged) to abandon the wait.
using InterruptCheck = void (*)();

/// The longest a wait goes without running the check.
constexpr int kInterruptPollMs = 100;

/// Sets this process's check (nullptr: none, the default).
void set_interrupt_check(InterruptCheck check) noexcept;

/// Runs the check when one is set (may throw what it throws).
void check_interrupt();

}  // namespace pcpkv
