// src/core/fatal_signals.h: which signals end a process by default, for code that must clean up before it ends
// (the --save writer's temporary file, the launcher's directory and ranks). Every such signal, not a list of the
// usual ones: SIGPWR, SIGIO or a real-time signal left both behind (issue 31's break test).
#pragma once

#include <signal.h>

namespace pcpkv::signals {

/// True for a signal whose default action terminates the process (with or without a core dump) and that a
/// handler can catch: every standard signal but SIGKILL / SIGSTOP and those that stop, continue or are ignored by
/// default, and every real-time signal a caller can send.
inline bool default_action_ends_process(int sig) {
  switch (sig) {
    case SIGKILL:  // cannot be caught
    case SIGSTOP:
    case SIGTSTP:
    case SIGTTIN:
    case SIGTTOU:
    case SIGCONT:
    case SIGCHLD:
    case SIGURG:
    case SIGWINCH:
      return false;
    default:
      // The standard signals are 1..31; glibc keeps the two lowest real-time signals (32, 33) for its threads, so
      // the real-time signals a caller can send start at SIGRTMIN.
      return (sig > 0 && sig < 32) || (sig >= SIGRTMIN && sig <= SIGRTMAX);
  }
}

/// The signals a program's own fault raises (a bad access, abort()): a handler that returns re-runs the fault, so
/// code that only records a signal and carries on must leave these alone.
inline bool is_fault_signal(int sig) {
  return sig == SIGSEGV || sig == SIGBUS || sig == SIGFPE || sig == SIGILL || sig == SIGTRAP || sig == SIGSYS ||
         sig == SIGABRT;
}

}  // namespace pcpkv::signals
