// pcpkv/core/byte_range.h: byte extents of the memory an operation reads or writes, and the one overlap rule of
// every check that refuses an output sharing memory with an input or another output: the parameter checks of the
// publication kernels (pcpkv/publish/cpu.h, run by the CPU reference and the CUDA launchers) and the torch ops and
// pointer tables of python/csrc (which translate tensors to ranges).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace pcpkv {

/// Bytes [lo, hi) of one address space; lo == hi: no memory (overlaps nothing). Ranges of two spaces never
/// overlap: `space` tells apart memories whose addresses may repeat (python/csrc: one per torch device); the
/// library's kernel parameters address one space (the backend's), 0.
struct ByteRange {
  uintptr_t lo = 0, hi = 0;
  int64_t space = 0;
};

/// [p, p + num_bytes) in `space`; a null p or num_bytes == 0: no memory. hi saturates at UINTPTR_MAX instead of
/// wrapping below lo, so a range that runs past the end of the address space still covers its bytes.
ByteRange byte_range(const void* p, uint64_t num_bytes, int64_t space = 0);

/// The first pair of ranges sharing a byte: (i, j) indexes writes ++ reads, i into writes and j either into writes
/// (j > i, only when writes_pairwise) or past it into reads. Ranges in two spaces never overlap. Pairs within
/// reads are not compared (inputs may share memory, e.g. splits of one projection). No overlap is found by one
/// sorted sweep (O(n log n)); only then are the pairs compared in that order to name the first.
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<ByteRange>& writes,
                                                       const std::vector<ByteRange>& reads, bool writes_pairwise);

}  // namespace pcpkv
