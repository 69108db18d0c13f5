// pcpkv/core/error.h: the one exception type pcpkv throws, and the host check macro.
//
// Every user-facing failure (bad config, slot out of range, misaligned stride, rank count mismatch,
// non-finite activations, a peer missing at a fence) is a pcpkv::Error whose what() names the field and
// the value, e.g. "plan: slot_mapping[17] = 9000 is out of range [0, 8192)". where() gives file:line of the
// check for developers. Validation happens before anything is written.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace pcpkv {

class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string where = {})
      : std::runtime_error(std::move(message)), where_(std::move(where)) {}
  /// "file.cpp:123" of the check that failed (empty when thrown without PCPKV_CHECK).
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
};

/// A wait at a fence that ran past its bound. missing_rank names the first peer that never arrived.
class FenceTimeout : public Error {
 public:
  FenceTimeout(std::string message, int missing_rank, std::string where = {})
      : Error(std::move(message), std::move(where)), missing_rank_(missing_rank) {}
  int missing_rank() const noexcept { return missing_rank_; }

 private:
  int missing_rank_;
};

/// Throws pcpkv::Error(message) with where() = "file:line". Public because PCPKV_CHECK and PCPKV_FAIL expand to
/// a call of it in every file that uses them; call it directly only where a check needs its own file and line.
[[noreturn]] inline void raise_error(const char* file, int line, std::string message) {
  throw Error(std::move(message), fmt::format("{}:{}", file, line));
}

}  // namespace pcpkv

/// Throws pcpkv::Error with a fmt-formatted message when cond is false.
/// Usage: PCPKV_CHECK(pcp >= 1, "--pcp: must be >= 1, got {}", pcp);
#define PCPKV_CHECK(cond, ...)                                                       \
  do {                                                                               \
    if (!(cond)) ::pcpkv::raise_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define PCPKV_FAIL(...) ::pcpkv::raise_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
