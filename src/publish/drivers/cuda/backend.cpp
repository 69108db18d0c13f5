// The CUDA backend (pcpkv/publish/cuda.h): W logical PCP ranks on one GPU, each with its own replica and staging
// workspace, running the SPEC section 5 transports with the kernels of src/publish/cuda. Byte-identical to
// make_cpu_backend() for the same setup and inputs (tests/publish/test_publish_backend.cpp).
//
// Stage profile: one CUDA event between consecutive stages of one stream, so a stage's ms covers all W
// ranks' launches of that stage; the mean over setup.repeats. Stages and bytes: the transport tables
// (publish/drivers/transport_table.h), the same as the CPU backend's: topk-fill (indexer layers with topk_width > 0;
// a byte fill of -1), dispatch, then all-gather / insert (collect), fence / combine (staging) or fence (direct).
#include <cuda_runtime_api.h>

#include <map>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "publish/drivers/cuda/publisher.h"
#include "pcpkv/publish/cuda.h"

namespace pcpkv {
namespace cuda {
namespace {

using cuda::Publisher;
using cuda::StageTimer;
using cuda::Stream;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_idx) : device_idx_(device_idx) {
    cudaDeviceProp prop{};
    PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_idx));
    device_name_ = prop.name;
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }

  PublishResult publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) override {
    PCPKV_CUDA_CHECK(cudaSetDevice(device_idx_));
    PCPKV_CHECK(transport == Transport::kCollect || transport == Transport::kStaging || transport == Transport::kDirect,
                "publish: transport = {} is not a Transport", static_cast<int>(transport));
    Publisher pub(setup, inputs);
    Stream stream;
    StageTimer timer;
    std::map<std::string, double> total_ms;
    for (int32_t rep = 0; rep < setup.repeats; ++rep) {
      pub.enqueue(transport, stream.get(), &timer);
      stream.sync();
      pub.check_fence();
      for (const auto& [name, ms] : timer.read()) total_ms[name] += ms;
    }
    PublishResult result = pub.download(transport);
    for (Stage s : pub.stage_model(transport)) {
      s.ms = total_ms[s.name] / setup.repeats;
      result.profile.stages.push_back(s);
    }
    return result;
  }

 private:
  int device_idx_;
  std::string device_name_;
};

}  // namespace

std::unique_ptr<Backend> make_backend(int device_idx) {
  std::string why;
  const int n = device_count(&why);
  PCPKV_CHECK(n > 0, "backend 'cuda': no usable CUDA device: {}", why);
  PCPKV_CHECK(device_idx >= 0 && device_idx < n, "backend 'cuda': device {} does not exist ({} visible)", device_idx, n);
  return std::make_unique<CudaBackend>(device_idx);
}

}  // namespace cuda
}  // namespace pcpkv
