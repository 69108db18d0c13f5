// src/core/parallel.h: a minimal fork-join loop for the CPU reference (no pool: calls are coarse).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace pcpkv::cpu_detail {

/// Runs fn(begin, end) over [0, n) split into at most num_threads contiguous ranges, the calling thread
/// taking the first. Ranges shorter than min_chunk are merged (thread start-up costs ~20 us). The first
/// exception thrown by any range is rethrown after all ranges finished.
template <class Fn>
void parallel_for(int64_t n, int num_threads, Fn&& fn, int64_t min_chunk = 256) {
  if (n <= 0) return;
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(num_threads, (n + min_chunk - 1) / min_chunk));
  if (parts == 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(parts - 1));
  auto run = [&](int64_t part) {
    const int64_t begin = n * part / parts, end = n * (part + 1) / parts;
    try {
      fn(begin, end);
    } catch (...) {
      errors[static_cast<size_t>(part)] = std::current_exception();
    }
  };
  for (int64_t part = 1; part < parts; ++part) threads.emplace_back(run, part);
  run(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace pcpkv::cpu_detail
