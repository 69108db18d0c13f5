// The process's interrupt check (see pcpkv/core/interrupt.h).
#include "pcpkv/core/interrupt.h"

#include <atomic>

namespace pcpkv {
namespace {

std::atomic<InterruptCheck> g_check{nullptr};

}  // namespace

void set_interrupt_check(InterruptCheck check) noexcept { g_check.store(check); }

void check_interrupt() {
  if (const InterruptCheck check = g_check.load()) check();
}

}  // namespace pcpkv
