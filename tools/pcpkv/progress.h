// tools/pcpkv/progress.h: a progress line on stderr for runs that last more than a few seconds.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace pcpkv::cli {

/// Shows "pcpkv: [12.3 s] <step>" on stderr once the run has lasted `quiet_s` seconds: rewritten in
/// place on a terminal; otherwise a line when the step changes (at most every 2 s) and every 10 s.
/// Silent before quiet_s, so short runs and tests print nothing. Thread-safe; the destructor (or finish()) stops it.
class Progress {
 public:
  explicit Progress(bool enabled, double quiet_s = 2.0);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void step(std::string what);
  void finish();
  /// Seconds since construction.
  double elapsed_s() const;

 private:
  void loop();

  const bool enabled_;
  const double quiet_s_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string step_;
  bool step_changed_ = false;
  bool done_ = false;
  bool shown_ = false;
  std::thread thread_;
};

}  // namespace pcpkv::cli
