// pcpkv/core/input_limits.h: what pcpkv accepts from a file a user names (a flag's --config or --inputs, a
// preset file), and how much of a value one message may quote.
//
// One rule for every such file: it must be a regular file (a FIFO would hang the read, a device such as
// /dev/zero would stream forever, a directory cannot be read), at most a stated size for its kind, checked
// before anything is read. JSON text is refused past kMaxJsonDepth nesting levels before it is parsed, so
// no recursive walk (nlohmann's dump, a message quoting a value) can exhaust the stack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pcpkv {

/// Nesting levels of JSON pcpkv parses. Real config.json and safetensors headers nest 3 deep.
constexpr int kMaxJsonDepth = 64;

/// Size limit of a config.json given with --config or read as a preset: real ones are 2-4 KB.
constexpr int64_t kMaxConfigFileBytes = 16 << 20;

/// Characters of a value (a JSON value as written, a tensor name) one message quotes.
constexpr size_t kMaxQuotedChars = 200;

/// Refuses JSON text that nests deeper than max_depth arrays/objects, naming `origin`, the depth reached
/// and the byte offset (offset_base + the index in `text`) where it passes the limit:
/// "c.json: JSON nests 100000 levels deep (pcpkv reads at most 64); the limit is passed at byte offset 64".
/// Brackets inside strings do not count; other syntax errors are left to the parser.
void check_json_depth(const std::string& text, const std::string& origin, int64_t offset_base = 0,
                      int max_depth = kMaxJsonDepth);

/// `s` when it has at most max_chars characters; else its first max_chars followed by
/// "... (N characters)".
std::string clip(const std::string& s, size_t max_chars = kMaxQuotedChars);

/// Characters of one error line the CLI prints (pcpkv: error: ...).
constexpr size_t kMaxErrorChars = 2000;

/// `s` when it has at most max_chars characters; else its head and its tail (where a message's reason
/// usually stands) around "... [N characters omitted] ...".
std::string clip_middle(const std::string& s, size_t max_chars = kMaxErrorChars);

/// Checks the file `flag` names before anything reads it: it must exist and, after symbolic links, be a
/// regular file of at most max_bytes bytes (max_bytes <= 0: no size limit). Throws pcpkv::Error naming the
/// flag, the path and what it is ("--config: '/dev/zero' is a character device, not a regular file").
/// Returns the file's size.
int64_t check_input_file(const std::string& flag, const std::string& path, int64_t max_bytes);

/// The whole text of such a file. Opens without blocking (a FIFO swapped in after a check cannot hang it),
/// checks the opened descriptor with the same rule, and reads at most max_bytes.
std::string read_input_file(const std::string& flag, const std::string& path, int64_t max_bytes);

}  // namespace pcpkv
