// pcpkv: the command-line tool. Subcommands live in cmd_<name>.cpp (commands.h).
// Exit codes: 0 success, 1 a verification check failed, 2 bad input or usage, 3 internal error, 4 (the
// multi-process subcommands) rank setup failed, a peer died or a fence timed out; a signal gives 128 + N.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "launch_cmds.h"
#include "pcpkv/commands.h"
#include "pcpkv/error_line.h"
#include "pcpkv/number_flags.h"
#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"

namespace {

// "run, bench, info, ...": the registered subcommands, for the unknown-command message.
std::string command_names(CLI::App& app) {
  std::string s;
  for (const CLI::App* sub : app.get_subcommands({})) s += (s.empty() ? "" : ", ") + sub->get_name();
  return s;
}

// A CLI11 parse error in the bounds the README states: every value quoted cut to kMaxQuotedChars, and the
// list of unexpected arguments to its first 20 ("and N more"). CLI11 quotes values whole and lists every one.
std::string bounded_parse_error(const std::string& message) {
  constexpr size_t kMaxNames = 20;
  std::string head = message;
  std::vector<std::string> words;
  for (const char* prefix :
       {"The following arguments were not expected: ", "The following argument was not expected: "}) {
    if (message.rfind(prefix, 0) != 0) continue;
    head = prefix;
    std::string rest = message.substr(head.size());
    for (size_t at = 0; at <= rest.size();) {
      const size_t sp = std::min(rest.find(' ', at), rest.size());
      if (sp > at) words.push_back(rest.substr(at, sp - at));
      at = sp + 1;
    }
    head.pop_back();
    std::reverse(words.begin(), words.end());  // CLI11 lists the last argument first
    break;
  }
  if (words.empty()) {  // any other message: clip each long word (a value CLI11 quotes)
    std::string out;
    for (size_t at = 0; at <= message.size();) {
      const size_t sp = std::min(message.find(' ', at), message.size());
      const std::string word = message.substr(at, sp - at);
      // Slack of 16: a value pcpkv already clipped ("'<200 characters>...'") is not clipped twice.
      out += word.size() > pcpkv::kMaxQuotedChars + 16 ? pcpkv::clip(word) : word;
      if (sp < message.size()) out += ' ';
      at = sp + 1;
    }
    return out;
  }
  std::string out = head;
  for (size_t i = 0; i < std::min(words.size(), kMaxNames); ++i) out += " " + pcpkv::clip(words[i]);
  if (words.size() > kMaxNames) out += fmt::format(" and {} more", words.size() - kMaxNames);
  return out;
}

int run_app(CLI::App& app, int argc, char** argv) {
  // CLI11 reports a mistyped command as "A subcommand is required"; name it instead.
  if (argc >= 2 && argv[1][0] != '-') {
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) known = known || sub->get_name() == argv[1];
    if (!known) {
      pcpkv::cli::print_error(
          fmt::format("unknown command '{}'; known: {}", pcpkv::clip(argv[1]), command_names(app)));
      pcpkv::cli::print_stderr("Run 'pcpkv --help' for usage.\n");
      return 2;
    }
  }
  // A rank program's rank with peers names a parse error on every rank (exit 2) instead of leaving them at the
  // rendezvous; elsewhere it is printed here.
  auto parse_error = [&](const std::string& message) {
    const std::optional<int> code = argc >= 2 ? pcpkv::cli::carry_parse_error(argv[1], message) : std::nullopt;
    if (!code) pcpkv::cli::print_error(message);
    pcpkv::cli::print_stderr("Run 'pcpkv --help' or 'pcpkv <command> --help' for usage.\n");
    return code.value_or(2);
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::RuntimeError& e) {
    // Thrown by a subcommand to set the exit code; a message, when present, is the reason.
    if (e.what() && *e.what()) pcpkv::cli::print_error(e.what());
    return e.get_exit_code();
  } catch (const CLI::RequiredError& e) {
    pcpkv::cli::print_error(
        fmt::format("{}{}", e.what(), argc < 2 ? fmt::format("; commands: {}", command_names(app)) : ""));
    pcpkv::cli::print_stderr("Run 'pcpkv --help' or 'pcpkv <command> --help' for usage.\n");
    return 2;
  } catch (const pcpkv::cli::IntegerOutOfRange& e) {
    return parse_error(pcpkv::cli::out_of_range_message(e.option, e.value));
  } catch (const CLI::ParseError& e) {
    // CLI11's "Could not convert: --pcp = 4294967296" is an integer past its field's width: named as the rest.
    const std::string range =
        dynamic_cast<const CLI::ConversionError*>(&e) ? pcpkv::cli::conversion_error_message(app) : "";
    return parse_error(range.empty() ? bounded_parse_error(e.what()) : range);
  } catch (const pcpkv::Error& e) {
    pcpkv::cli::print_error(e.what());
    if (pcpkv::read_env("PCPKV_DEBUG") && !e.where().empty())
      pcpkv::cli::print_stderr(fmt::format("pcpkv: (raised at {})\n", e.where()));
    return 2;
  } catch (const std::bad_alloc&) {
    pcpkv::cli::print_stderr("pcpkv: error: out of memory (try fewer --tokens or a smaller --pcp)\n");
    return 3;
  } catch (const std::exception& e) {
    pcpkv::cli::print_error(fmt::format("internal: {}", e.what()));
    return 3;
  }
  return 0;
}

// Descriptors 0-2 that the caller closed (2>&-) are opened on /dev/null: otherwise the next file pcpkv opens (a
// --save target, a config) would take descriptor 2 and receive the error messages.
void open_missing_std_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int null_fd = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (null_fd >= 0 && null_fd != fd) {
      ::dup2(null_fd, fd);
      ::close(null_fd);
    }
  }
}

int main_body(int argc, char** argv) {
  CLI::App app{
      "pcpkv: publish PCP KV-cache rows of sparse-MLA models (DeepSeek-V3.2, GLM-5) into every rank's "
      "cache replica, and verify them byte for byte"};
  app.require_subcommand(1);
  // A flag given twice takes its last value in every command (scripts append overrides); subcommands copy these
  // defaults when they are added.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  pcpkv::cli::add_run_command(app);
  pcpkv::cli::add_bench_command(app);
  pcpkv::cli::add_info_command(app);
  pcpkv::cli::add_launch_command(app);
  pcpkv::cli::add_attention_command(app);
  pcpkv::cli::add_serving_command(app);
  pcpkv::cli::check_number_flags(app);
  int code = run_app(app, argc, argv);
  // A report that never reached stdout (disk full, closed pipe) must not pass for success.
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int err = errno;
    pcpkv::cli::print_error(
        fmt::format("cannot write the output to stdout: {}", err ? std::strerror(err) : "write error"));
    if (code == 0) code = 3;  // a failed verdict (1) or bad input (2) keeps its code
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  open_missing_std_fds();
  try {
    return main_body(argc, argv);
  } catch (...) {
    // Nothing may leave main as an exception (std::terminate: SIGABRT, 134); an escape here is pcpkv's own fault.
    pcpkv::cli::print_error("internal: an unexpected exception escaped the command");
    return 3;
  }
}
