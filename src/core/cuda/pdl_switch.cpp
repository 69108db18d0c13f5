// src/core/cuda/pdl_switch.cpp: the process-wide PDL switch of pcpkv/core/pdl.h.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "pcpkv/core/pdl.h"

namespace pcpkv::pdl {
namespace {
// -1: not decided yet (read PCPKV_PDL on first use), 0 off, 1 on.
std::atomic<int> g_state{-1};
}  // namespace

bool enabled() {
  int s = g_state.load(std::memory_order_relaxed);
  if (s < 0) {
    const char* env = std::getenv("PCPKV_PDL");
    s = (env != nullptr && std::strcmp(env, "1") == 0) ? 1 : 0;
    int expected = -1;
    g_state.compare_exchange_strong(expected, s);
    s = g_state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

void set_enabled(bool on) { g_state.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace pcpkv::pdl
