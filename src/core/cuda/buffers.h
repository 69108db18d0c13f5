// src/core/cuda/buffers.h: owning handles for device memory, host-mapped memory and CUDA events/streams.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "core/cuda/check.h"

namespace pcpkv::cuda {

/// cudaMalloc'd bytes (256-byte aligned), freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t bytes) { reset(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  void reset(int64_t bytes) {
    release();
    if (bytes > 0) PCPKV_CUDA_CHECK(cudaMalloc(&ptr_, static_cast<size_t>(bytes)));
    bytes_ = bytes;
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  int64_t bytes() const { return bytes_; }

  /// Synchronous upload of a host vector (sizes must agree).
  template <class T>
  void upload(const std::vector<T>& v) {
    PCPKV_CHECK(static_cast<int64_t>(v.size() * sizeof(T)) <= bytes_, "upload: {} B into a {} B buffer",
                v.size() * sizeof(T), bytes_);
    if (!v.empty()) PCPKV_CUDA_CHECK(cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  /// Allocates exactly the vector's bytes and uploads it.
  template <class T>
  static DeviceBuffer from(const std::vector<T>& v) {
    DeviceBuffer b(static_cast<int64_t>(v.size() * sizeof(T)));
    b.upload(v);
    return b;
  }
  template <class T>
  std::vector<T> download(int64_t count) const {
    std::vector<T> v(static_cast<size_t>(count));
    if (count > 0) PCPKV_CUDA_CHECK(cudaMemcpy(v.data(), ptr_, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

/// Page-locked host memory mapped into the device's address space (cudaHostAllocMapped), zeroed.
template <class T>
class HostMapped {
 public:
  HostMapped() {
    PCPKV_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(T), cudaHostAllocMapped));
    *host_ = T{};
    PCPKV_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
  }
  ~HostMapped() {
    if (host_) cudaFreeHost(host_);
  }
  HostMapped(const HostMapped&) = delete;
  HostMapped& operator=(const HostMapped&) = delete;
  T* host() const { return host_; }
  T* device() const { return device_; }

 private:
  T* host_ = nullptr;
  T* device_ = nullptr;
};

class Event {
 public:
  Event() { PCPKV_CUDA_CHECK(cudaEventCreate(&e_)); }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Milliseconds between two recorded events (after they completed).
inline float elapsed_ms(const Event& a, const Event& b) {
  float ms = 0.0f;
  PCPKV_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return ms;
}

class Stream {
 public:
  Stream() { PCPKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void sync() const { PCPKV_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace pcpkv::cuda
