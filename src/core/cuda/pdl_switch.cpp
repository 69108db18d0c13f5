// src/core/cuda/pdl_switch.cpp: the process-wide PDL switch of pcpkv/core/pdl.h.
#include <atomic>

#include "pcpkv/core/pdl.h"
#include "pcpkv/core/env.h"

namespace pcpkv::pdl {
namespace {
// -1: not decided yet (read PCPKV_PDL on first use; a refused value stays undecided and throws again), 0 off, 1 on.
std::atomic<int> g_state{-1};
}  // namespace

bool enabled() {
  int s = g_state.load(std::memory_order_relaxed);
  if (s < 0) {
    s = read_env_switch("PCPKV_PDL") ? 1 : 0;  // throws pcpkv::Error on a value other than 1, 0 or empty
    int expected = -1;
    g_state.compare_exchange_strong(expected, s);
    s = g_state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

void set_enabled(bool on) { g_state.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace pcpkv::pdl
