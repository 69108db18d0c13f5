// safetensors reader and writer (include/pcpkv/core/safetensors.h). The JSON header goes through nlohmann-json.
#include "pcpkv/core/safetensors.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "core/fatal_signals.h"
#include "core/json_keys.h"

namespace pcpkv {
namespace {

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length would
// otherwise ask for gigabytes).
constexpr int64_t kMaxHeaderBytes = 100'000'000;
constexpr int64_t kLengthBytes = 8;

// "a, b, c" (the first kMaxListedNames, then "and N more"): a header of 700k tensors must not give a
// 6 MB message.
std::string quoted_names(const std::vector<StTensorInfo>& tensors) {
  constexpr size_t kMaxListedNames = 20;
  std::string s;
  for (size_t i = 0; i < tensors.size() && i < kMaxListedNames; ++i) s += (i ? ", " : "") + clip(tensors[i].name);
  if (tensors.size() > kMaxListedNames) s += fmt::format(" and {} more", tensors.size() - kMaxListedNames);
  return s.empty() ? "(none)" : s;
}

// Product of a shape, refusing negative extents and overflow past int64.
int64_t checked_num_elements(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    PCPKV_CHECK(shape[i] >= 0, "{}: shape[{}] = {} is negative", what, i, shape[i]);
    if (shape[i] != 0 && n > std::numeric_limits<int64_t>::max() / shape[i]) {
      PCPKV_FAIL("{}: shape {} has more elements than fit in 64 bits", what, shape_string(shape));
    }
    n *= shape[i];
  }
  return n;
}

int64_t read_json_int(const nlohmann::json& v, const std::string& what) {
  PCPKV_CHECK(v.is_number_integer(), "{} must be an integer, got {}", what, clip(v.dump()));
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    PCPKV_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "{} = {} is too large", what, u);
    return static_cast<int64_t>(u);
  }
  const auto i = v.get<int64_t>();
  PCPKV_CHECK(i >= 0, "{} = {} is negative", what, i);
  return i;
}

// "file offset 105" for data offset `rel` past data_start, or "file offset 105 + 9223372036854775807"
// when the sum would overflow int64 (a corrupt header must not print a negative offset).
std::string file_offset(int64_t data_start, int64_t rel) {
  if (rel > std::numeric_limits<int64_t>::max() - data_start) return fmt::format("{} + {}", data_start, rel);
  return std::to_string(data_start + rel);
}

// While the writer's temporary file exists, a signal whose default action ends the process (Ctrl-C, kill, a lost
// terminal, ulimit -f or -t, SIGUSR1/2, an alarm, a profiling timer, SIGPWR, SIGIO, a real-time signal, kill -ABRT)
// removes it first, then takes its previous course: a killed save leaves no FILE.tmp.<pid>. (SIGKILL cannot be
// caught; a power cut leaves the file too.) One write at a time per process.
using signals::default_action_ends_process;
char g_temp_path[PATH_MAX + 1];
volatile sig_atomic_t g_temp_armed = 0;
struct sigaction g_old_actions[_NSIG];
bool g_hooked[_NSIG];

extern "C" void remove_temp_on_signal(int sig) {
  if (g_temp_armed) ::unlink(g_temp_path);  // async-signal-safe
  if (sig > 0 && sig < _NSIG) ::sigaction(sig, &g_old_actions[sig], nullptr);
  ::raise(sig);  // delivered with the previous action once this handler returns
}

class TempFileGuard {
 public:
  explicit TempFileGuard(const std::string& path) {
    if (path.size() > PATH_MAX) return;  // open() refuses it anyway
    std::memcpy(g_temp_path, path.c_str(), path.size() + 1);
    struct sigaction sa {};
    sa.sa_handler = remove_temp_on_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig = 1; sig < _NSIG; ++sig)
      if (default_action_ends_process(sig)) sigaddset(&sa.sa_mask, sig);  // one handler run at a time
    for (int sig = 1; sig < _NSIG; ++sig) {
      g_hooked[sig] = false;
      if (!default_action_ends_process(sig) || ::sigaction(sig, nullptr, &g_old_actions[sig]) != 0) continue;
      // Only a signal left at its default action would end the process. An ignored one stays ignored (cmd_run
      // ignores SIGXFSZ so that the write fails with EFBIG); one with a handler (Python's SIGINT, a program's
      // SIGALRM timer) does not end it here, and removing the file under a handler that returns would fail the save.
      if (g_old_actions[sig].sa_handler != SIG_DFL || (g_old_actions[sig].sa_flags & SA_SIGINFO)) continue;
      g_hooked[sig] = ::sigaction(sig, &sa, nullptr) == 0;
    }
    g_temp_armed = 1;
    armed_ = true;
  }
  ~TempFileGuard() {
    if (!armed_) return;
    for (int sig = 1; sig < _NSIG; ++sig)
      if (g_hooked[sig]) ::sigaction(sig, &g_old_actions[sig], nullptr);
    g_temp_armed = 0;
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;

 private:
  bool armed_ = false;
};

}  // namespace

const char* to_string(StDtype d) {
  switch (d) {
    case StDtype::kBF16:
      return "BF16";
    case StDtype::kF32:
      return "F32";
    case StDtype::kI64:
      return "I64";
    case StDtype::kI32:
      return "I32";
    case StDtype::kU8:
      return "U8";
  }
  return "?";
}

int64_t dtype_bytes(StDtype d) {
  switch (d) {
    case StDtype::kBF16:
      return 2;
    case StDtype::kF32:
      return 4;
    case StDtype::kI64:
      return 8;
    case StDtype::kI32:
      return 4;
    case StDtype::kU8:
      return 1;
  }
  return 0;
}

StDtype parse_st_dtype(const std::string& s, const std::string& what) {
  for (StDtype d : {StDtype::kBF16, StDtype::kF32, StDtype::kI64, StDtype::kI32, StDtype::kU8}) {
    if (s == to_string(d)) return d;
  }
  PCPKV_FAIL("{}: dtype '{}' is not supported; pcpkv reads BF16, F32, I64, I32, U8", what, clip(s));
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t StTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

// ---- reader ---------------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::string& file) : path_(file) {
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  // A regular file only (input_limits.h): a FIFO would hang, a device stream forever. Its size is not
  // bounded here: the header is (kMaxHeaderBytes), and callers size what they read from it.
  file_bytes_ = check_input_file("safetensors", file, 0);

  std::ifstream in(file, std::ios::binary);
  PCPKV_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
  PCPKV_CHECK(file_bytes_ >= kLengthBytes,
              "{}: the file is truncated: it has {} bytes, but the header length at offset 0 needs 8", path,
              file_bytes_);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  PCPKV_CHECK(in.gcount() == 8, "{}: short read of the header length at offset 0", path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  PCPKV_CHECK(header_len >= 2 && header_len <= static_cast<uint64_t>(kMaxHeaderBytes),
              "{}: header length {} at offset 0 is not in [2, {}] (not a safetensors file?)", path, header_len,
              kMaxHeaderBytes);
  const auto n = static_cast<int64_t>(header_len);
  PCPKV_CHECK(kLengthBytes + n <= file_bytes_,
              "{}: the file is truncated: the {}-byte JSON header at offset 8 ends at {}, past the end of the "
              "file (size {})",
              path, n, kLengthBytes + n, file_bytes_);
  std::string text(static_cast<size_t>(n), '\0');
  in.read(text.data(), n);
  PCPKV_CHECK(in.gcount() == n, "{}: short read of the JSON header at offset 8", path);
  data_start_ = kLengthBytes + n;

  check_json_depth(text, path + ": the JSON header", kLengthBytes);  // before the parse: dump() recurses
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    PCPKV_FAIL("{}: the JSON header is invalid near offset {}: {}", path, kLengthBytes + static_cast<int64_t>(e.byte),
               clip(e.what()));
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range 406: a number that overflows a double
    PCPKV_FAIL("{}: the JSON header at offset 8 holds an unusable value: {}", path, clip(e.what()));
  }
  PCPKV_CHECK(header.is_object(), "{}: the JSON header at offset 8 is not an object", path);
  // A tensor named twice would lose one entry (and the other order blamed a gap in the buffer).
  if (const auto dup = first_duplicate_key(text)) {
    PCPKV_FAIL("{}: the JSON header names {} '{}' twice; every key must be unique", path,
               dup->depth == 1 && dup->key != "__metadata__" ? "tensor" : "the key", clip(dup->key));
  }

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      PCPKV_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", path);
      for (auto m = v.begin(); m != v.end(); ++m) {
        PCPKV_CHECK(m.value().is_string(), "{}: __metadata__['{}'] must be a string, got {}", path, clip(m.key()),
                    clip(m.value().dump()));
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = fmt::format("{}: tensor '{}'", path, clip(name));
    PCPKV_CHECK(!name.empty(), "{}: a tensor has an empty name", path);
    PCPKV_CHECK(v.is_object(), "{}: header entry must be an object, got {}", what, clip(v.dump()));
    // The format has exactly these three fields per tensor; another one is a different format or a typo.
    for (auto f = v.begin(); f != v.end(); ++f)
      PCPKV_CHECK(f.key() == "dtype" || f.key() == "shape" || f.key() == "data_offsets",
                  "{}: unknown field '{}' (a tensor entry holds dtype, shape and data_offsets)", what, clip(f.key()));
    PCPKV_CHECK(v.contains("dtype") && v["dtype"].is_string(), "{}: 'dtype' is missing or not a string", what);
    PCPKV_CHECK(v.contains("shape") && v["shape"].is_array(), "{}: 'shape' is missing or not an array", what);
    PCPKV_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
                "{}: 'data_offsets' must be an array [begin, end]", what);
    StTensorInfo info;
    info.name = name;
    info.dtype = parse_st_dtype(v["dtype"].get<std::string>(), what);
    for (size_t i = 0; i < v["shape"].size(); ++i) {
      info.shape.push_back(read_json_int(v["shape"][i], fmt::format("{}: shape[{}]", what, i)));
    }
    info.begin = read_json_int(v["data_offsets"][0], what + ": data_offsets[0]");
    info.end = read_json_int(v["data_offsets"][1], what + ": data_offsets[1]");
    PCPKV_CHECK(info.begin <= info.end, "{}: data_offsets [{}, {}] end before they begin (file offset {})", what,
                info.begin, info.end, file_offset(data_start_, info.begin));
    const int64_t numel = checked_num_elements(info.shape, what);
    PCPKV_CHECK(numel <= std::numeric_limits<int64_t>::max() / dtype_bytes(info.dtype), "{}: shape {} is too large",
                what, shape_string(info.shape));
    const int64_t want = numel * dtype_bytes(info.dtype);
    PCPKV_CHECK(info.end - info.begin == want,
                "{}: data_offsets [{}, {}] hold {} bytes, but {} {} needs {} (file offset {})", what, info.begin,
                info.end, info.end - info.begin, to_string(info.dtype), shape_string(info.shape), want,
                file_offset(data_start_, info.begin));
    tensors_.push_back(std::move(info));
  }

  // By begin, then end: an empty tensor comes before the one whose data begins at its offset (safetensors writes
  // it there when it sorts first), not after it, where it would read as an overlap.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  int64_t expected_begin = 0;
  const StTensorInfo* prev = nullptr;
  for (const StTensorInfo& t : tensors_) {
    const std::string what = fmt::format("{}: tensor '{}'", path, clip(t.name));
    PCPKV_CHECK(t.begin >= expected_begin, "{}: data [{}, {}) overlaps tensor '{}' (file offset {})", what, t.begin,
                t.end, prev ? clip(prev->name) : "", file_offset(data_start_, t.begin));
    PCPKV_CHECK(t.begin == expected_begin,
                "{}: data begins at {} but the previous tensor ends at {}: a gap in the buffer (file offset {})", what,
                t.begin, expected_begin, file_offset(data_start_, expected_begin));
    // Compared as data offsets (file size minus header), so no sum can overflow.
    PCPKV_CHECK(t.end <= file_bytes_ - data_start_,
                "{}: data at file offsets [{}, {}) ends past the end of the file (size {}): the file is truncated",
                what, file_offset(data_start_, t.begin), file_offset(data_start_, t.end), file_bytes_);
    expected_begin = t.end;
    prev = &t;
  }
  PCPKV_CHECK(data_start_ + expected_begin == file_bytes_,
              "{}: {} trailing bytes after the last tensor's data at offset {} (size {})", path,
              file_bytes_ - data_start_ - expected_begin, data_start_ + expected_begin, file_bytes_);
}

const StTensorInfo* SafetensorsReader::find(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const StTensorInfo& SafetensorsReader::get(const std::string& name) const {
  const StTensorInfo* t = find(name);
  PCPKV_CHECK(t != nullptr, "{}: tensor '{}' is missing; present: {}", clip(path_), clip(name), quoted_names(tensors_));
  return *t;
}

const StTensorInfo& SafetensorsReader::expect(const std::string& name, StDtype dtype, const std::vector<int64_t>& shape,
                                              size_t element_bytes) const {
  const StTensorInfo& t = get(name);
  bool ok = t.dtype == dtype && t.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape[i];
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    }
    want += "]";
    PCPKV_FAIL("{}: tensor '{}' (file offset {}): expected {} {}, got {} {}", clip(path_), name, data_start_ + t.begin,
               to_string(dtype), want, to_string(t.dtype), shape_string(t.shape));
  }
  PCPKV_CHECK(element_bytes == 0 || static_cast<int64_t>(element_bytes) == dtype_bytes(dtype),
              "tensor '{}': read as a {}-byte type, but {} has {} bytes per element", name, element_bytes,
              to_string(dtype), dtype_bytes(dtype));
  return t;
}

std::vector<uint8_t> SafetensorsReader::read_bytes(const std::string& name) const {
  const StTensorInfo& t = get(name);
  std::vector<uint8_t> out(static_cast<size_t>(t.num_bytes()));
  read_into(t, out.data(), t.num_bytes());
  return out;
}

void SafetensorsReader::read_into(const StTensorInfo& info, void* dst, int64_t bytes) const {
  if (bytes == 0) return;
  std::ifstream in(path_, std::ios::binary);
  PCPKV_CHECK(in.good(), "{}: cannot open: {}", clip(path_), std::strerror(errno));
  in.seekg(data_start_ + info.begin);
  in.read(static_cast<char*>(dst), bytes);
  // The header was checked against the file size; a short read means the file changed since.
  PCPKV_CHECK(in.gcount() == bytes, "{}: tensor '{}': read {} of {} bytes at file offset {}: the file is truncated",
              clip(path_), info.name, static_cast<int64_t>(in.gcount()), bytes, data_start_ + info.begin);
}

// ---- writer ---------------------------------------------------------------------------------------

void SafetensorsWriter::add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, const void* data,
                            int64_t bytes) {
  PCPKV_CHECK(!name.empty() && name != "__metadata__", "safetensors writer: invalid tensor name '{}'", name);
  for (const auto& e : entries_) {
    PCPKV_CHECK(e.info.name != name, "safetensors writer: tensor '{}' added twice", name);
  }
  const std::string what = fmt::format("safetensors writer: tensor '{}'", name);
  const int64_t numel = checked_num_elements(shape, what);
  PCPKV_CHECK(bytes == numel * dtype_bytes(dtype), "{}: {} bytes given, {} {} needs {}", what, bytes, to_string(dtype),
              shape_string(shape), numel * dtype_bytes(dtype));
  PCPKV_CHECK(bytes == 0 || data != nullptr, "{}: data is null", what);
  Entry e;
  e.info.name = name;
  e.info.dtype = dtype;
  e.info.shape = std::move(shape);
  e.info.begin = data_bytes_;
  e.info.end = data_bytes_ + bytes;
  e.data = data;
  data_bytes_ += bytes;
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

std::string SafetensorsWriter::header() const {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    h["__metadata__"] = m;
  }
  for (const auto& e : entries_) {
    h[e.info.name] = {
        {"dtype", to_string(e.info.dtype)}, {"shape", e.info.shape}, {"data_offsets", {e.info.begin, e.info.end}}};
  }
  std::string text = h.dump();
  // Pad so the data buffer starts 8-byte aligned (the reference writer does the same).
  while ((text.size() + kLengthBytes) % 8 != 0) text.push_back(' ');
  return text;
}

int64_t SafetensorsWriter::file_bytes() const {
  return kLengthBytes + static_cast<int64_t>(header().size()) + data_bytes_;
}

std::string write_target(const std::string& file) {
  const std::string path = clip(file);  // as messages quote it
  namespace fs = std::filesystem;
  fs::path p(file);
  std::error_code ec;
  for (int hops = 0; fs::is_symlink(p, ec); ++hops) {
    PCPKV_CHECK(hops < 40, "{}: too many levels of symbolic links", path);
    const fs::path link = fs::read_symlink(p, ec);
    PCPKV_CHECK(!ec, "{}: cannot read the symbolic link '{}': {}", path, clip(p.string()), ec.message());
    p = link.is_absolute() ? link : p.parent_path() / link;
  }
  return p.string();
}

void SafetensorsWriter::write(const std::string& file) const {
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  namespace fs = std::filesystem;
  std::error_code ec;
  // rename() replaces whatever is at `path`: as root, a device such as /dev/null would become this file.
  const fs::file_status st = fs::status(file, ec);
  PCPKV_CHECK(!fs::exists(st) || fs::is_regular_file(st),
              "{}: exists and is not a regular file (a directory, device, FIFO or socket); refusing to replace it",
              path);
  const std::string target = write_target(file);
  const std::string text = header();
  const std::string tmp = fmt::format("{}.tmp.{}", target, static_cast<long>(::getpid()));
  // Armed before the file exists and disarmed after it is renamed or removed (declared first: destroyed last).
  const TempFileGuard guard(tmp);
  // O_NOFOLLOW: never write through a link planted at the temporary name.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  PCPKV_CHECK(fd >= 0, "{}: cannot create '{}': {}", path, clip(tmp), std::strerror(errno));
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    std::remove(tmp.c_str());
    PCPKV_FAIL("{}: cannot write '{}': {}", path, clip(tmp), std::strerror(err));
  }
  bool ok = true;
  uint8_t len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  ok = ok && std::fwrite(len_bytes, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& e : entries_) {
    const auto bytes = static_cast<size_t>(e.info.num_bytes());
    if (bytes) ok = ok && std::fwrite(e.data, 1, bytes, f) == bytes;
  }
  // The bytes reach the disk before the rename publishes the name (the header promises "on disk").
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int saved_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    PCPKV_FAIL("{}: writing '{}' failed: {}", path, clip(tmp), std::strerror(saved_errno ? saved_errno : errno));
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    PCPKV_FAIL("{}: cannot move '{}' into place: {}", path, clip(tmp), ec.message());
  }
}

}  // namespace pcpkv
