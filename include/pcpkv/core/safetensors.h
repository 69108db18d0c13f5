// pcpkv/core/safetensors.h: a small reader and writer of the safetensors format.
//
// Format (https://github.com/huggingface/safetensors): bytes [0, 8) hold N, the header length, as a
// little-endian u64; bytes [8, 8 + N) hold a UTF-8 JSON object (padded with spaces) mapping each tensor
// name to {"dtype": "BF16", "shape": [4096, 512], "data_offsets": [begin, end]}, plus an optional
// "__metadata__" object of string -> string; the data buffer follows at byte 8 + N, and data_offsets are
// relative to it. Tensors are dense, row-major, little-endian, and tile the buffer without gaps.
//
// pcpkv reads and writes the dtypes BF16, F32, I64, I32 and U8. Every error is a pcpkv::Error that names
// the file, the tensor and the byte offset (absolute, from the start of the file) where it applies.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace pcpkv {

enum class StDtype : uint8_t { kBF16, kF32, kI64, kI32, kU8 };

/// "BF16" | "F32" | "I64" | "I32" | "U8".
const char* to_string(StDtype d);
/// Bytes per element: 2, 4, 8, 4, 1.
int64_t dtype_bytes(StDtype d);
/// Parses a safetensors dtype name; throws pcpkv::Error naming `what` (e.g. "tensor 'kv'") and the value.
StDtype parse_st_dtype(const std::string& s, const std::string& what);

/// "[4096, 512]".
std::string shape_string(const std::vector<int64_t>& shape);

/// One tensor entry of a safetensors header.
struct StTensorInfo {
  std::string name;
  StDtype dtype = StDtype::kU8;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // data_offsets[0], relative to the data buffer
  int64_t end = 0;    // data_offsets[1]
  int64_t num_elements() const;
  int64_t num_bytes() const { return end - begin; }
};

/// Reads a safetensors file. The constructor reads and validates the whole header against the file size
/// (known dtypes, non-negative shapes, data_offsets consistent with shape * dtype size, tensors tiling
/// the buffer without overlap or gap, the file neither truncated nor followed by trailing bytes) and
/// throws pcpkv::Error on the first problem, e.g.
///   "in.safetensors: tensor 'kv': data [1024, 4195328) ends past the end of the file (size 2097152): the
///    file is truncated".
/// Tensor data is read on demand.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);

  const std::string& path() const { return path_; }
  /// Tensors in data-offset order.
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Absolute file offset of the data buffer (8 + N).
  int64_t data_start() const { return data_start_; }
  int64_t file_bytes() const { return file_bytes_; }

  bool has(const std::string& name) const { return find(name) != nullptr; }
  /// nullptr when absent.
  const StTensorInfo* find(const std::string& name) const;
  /// The entry of `name`; throws pcpkv::Error("<file>: tensor 'x' is missing; present: a, b, c").
  const StTensorInfo& get(const std::string& name) const;

  /// Raw bytes of tensor `name`. Throws when missing or when the read comes up short.
  std::vector<uint8_t> read_bytes(const std::string& name) const;

  /// Checks that `name` has `dtype` and `shape` (a -1 in `shape` matches any extent) and returns its
  /// elements. T must have sizeof(T) == dtype_bytes(dtype). Throws pcpkv::Error
  ///   "<file>: tensor 'kv': expected BF16 [4096, 512], got F32 [4096, 512]".
  template <class T>
  std::vector<T> read_as(const std::string& name, StDtype dtype, const std::vector<int64_t>& shape) const {
    static_assert(std::is_trivially_copyable_v<T>);
    const StTensorInfo& info = expect(name, dtype, shape, sizeof(T));
    std::vector<T> out(static_cast<size_t>(info.num_elements()));
    read_into(info, out.data(), info.num_bytes());
    return out;
  }

  /// The checks of read_as without reading; returns the entry.
  const StTensorInfo& expect(const std::string& name, StDtype dtype, const std::vector<int64_t>& shape,
                             size_t element_bytes = 0) const;

 private:
  void read_into(const StTensorInfo& info, void* dst, int64_t bytes) const;

  std::string path_;
  std::vector<StTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  int64_t data_start_ = 0;
  int64_t file_bytes_ = 0;
};

/// The file SafetensorsWriter::write(path) replaces: `path`, or the file its symbolic links lead to
/// (dangling links included). Throws pcpkv::Error on a link loop.
std::string write_target(const std::string& path);

/// Collects tensors and writes one safetensors file. add() does not copy: `data` must stay valid until
/// write() returns. Names must be unique and not "__metadata__"; bytes must equal
/// product(shape) * dtype_bytes(dtype). write() goes to "<path>.tmp.<pid>" and renames it over `path`
/// only when every byte is on disk (fsync), so a failed write leaves `path` as it was (a write killed
/// by a signal may leave the temporary behind). It throws pcpkv::Error, writing nothing, when `path`
/// exists and is not a regular file (a directory, device, FIFO or socket); through a symbolic link it
/// replaces the link's target.
class SafetensorsWriter {
 public:
  void add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, const void* data, int64_t bytes);
  template <class T>
  void add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
    add(name, dtype, std::move(shape), v.data(), static_cast<int64_t>(v.size() * sizeof(T)));
  }
  void set_metadata(const std::string& key, const std::string& value);
  /// The JSON header text (padded with spaces to a multiple of 8 bytes).
  std::string header() const;
  /// Total file size write() produces.
  int64_t file_bytes() const;
  void write(const std::string& path) const;

 private:
  struct Entry {
    StTensorInfo info;
    const void* data = nullptr;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  int64_t data_bytes_ = 0;
};

}  // namespace pcpkv
