#include "progress.h"

#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "error_line.h"

namespace pcpkv::cli {

Progress::Progress(bool enabled, double quiet_s)
    : enabled_(enabled),
      quiet_s_(quiet_s),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()) {
  if (enabled_) thread_ = std::thread([this] { loop(); });
}

Progress::~Progress() { finish(); }

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::step(std::string what) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = std::move(what);
  step_changed_ = true;
  cv_.notify_all();
}

void Progress::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  if (shown_ && tty_) std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}

void Progress::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  double last_print = -1e9;
  while (!done_) {
    // A terminal line refreshes its clock in place.
    cv_.wait_for(lock, std::chrono::milliseconds(tty_ ? 200 : 500));
    if (done_) break;
    const double t = elapsed_s();
    if (t < quiet_s_ || step_.empty()) continue;
    if (tty_) {
      print_stderr(fmt::format("\r\033[Kpcpkv: [{:6.1f} s] {}", t, step_));
    } else if ((step_changed_ && t - last_print >= 2.0) || t - last_print >= 10.0) {
      // A log gets at most a line every 2 s (the step current then) and a heartbeat every 10 s.
      print_stderr(fmt::format("pcpkv: [{:6.1f} s] {}\n", t, step_));
    } else {
      continue;
    }
    std::fflush(stderr);
    shown_ = true;
    step_changed_ = false;
    last_print = t;
  }
}

}  // namespace pcpkv::cli
