// A Backend over one process per rank (see make_multiproc_backend in pcpkv/multiproc.h).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "pcpkv/bootstrap.h"
#include "pcpkv/error.h"
#include "pcpkv/multiproc.h"

namespace pcpkv {
namespace {

template <class T>
std::vector<std::vector<T>> gather_vectors(Bootstrap& group, const std::vector<T>& mine) {
  const auto blobs = group.all_gather_v(mine.data(), mine.size() * sizeof(T));
  std::vector<std::vector<T>> out(blobs.size());
  for (size_t r = 0; r < blobs.size(); ++r) {
    out[r].resize(blobs[r].size() / sizeof(T));
    if (!blobs[r].empty()) std::memcpy(out[r].data(), blobs[r].data(), blobs[r].size());
  }
  return out;
}

class MultiprocBackend final : public Backend {
 public:
  MultiprocBackend(Bootstrap& group, RankPublisherFactory factory, std::string name, RankPublishOptions options)
      : group_(group), factory_(std::move(factory)), name_(std::move(name)), options_(std::move(options)) {}

  std::string name() const override { return name_; }
  std::string device() const override { return device_.empty() ? fmt::format("{}, {} processes", name_, group_.world_size()) : device_; }

  PublishResult publish(const PublishSetup& setup, const GlobalInputs& inputs, Transport transport) override {
    PCPKV_CHECK(setup.plan != nullptr, "publish: setup.plan is null");
    PCPKV_CHECK(setup.plan->pcp_world == group_.world_size(),
                "--pcp {} does not match the {} rank processes of this job; one process runs one PCP rank",
                setup.plan->pcp_world, group_.world_size());
    auto pub = factory_(group_, setup, options_);
    device_ = fmt::format("{}; {} processes, one per rank", pub->device(), group_.world_size());
    RankPublishResult mine = pub->publish(inputs, transport);
    group_.barrier();  // every rank's publication done: every replica final
    PublishResult r;
    r.transport = transport;
    r.mla_geometry = mine.mla_geometry;
    r.index_geometry = mine.index_geometry;
    r.mla_cache_offset = mine.mla_cache_offset;
    r.index_cache_offset = mine.index_cache_offset;
    const int32_t W = group_.world_size();
    for (int32_t q = 0; q < W; ++q) {
      r.mla_alloc.push_back(q == group_.rank() ? mine.mla_alloc : pub->read_mla_alloc(q));
      r.index_alloc.push_back(q == group_.rank() ? mine.index_alloc : pub->read_index_alloc(q));
    }
    if (!mine.q_c_out.empty()) r.q_c_out = gather_vectors(group_, mine.q_c_out);
    if (!mine.topk.empty()) r.topk = gather_vectors(group_, mine.topk);
    // Stage times: the slowest rank (the stage ends for the group when its last rank is done).
    std::vector<double> ms;
    for (const Stage& s : mine.profile.stages) ms.push_back(s.ms);
    const auto all_ms = gather_vectors(group_, ms);
    std::vector<int64_t> bytes;
    for (const Stage& s : mine.profile.stages) bytes.push_back(s.bytes);
    const auto all_bytes = gather_vectors(group_, bytes);
    for (size_t k = 0; k < mine.profile.stages.size(); ++k) {
      Stage s{mine.profile.stages[k].name, 0.0, 0};
      for (int32_t q = 0; q < W; ++q) {
        s.ms = std::max(s.ms, all_ms[static_cast<size_t>(q)][k]);
        s.bytes += all_bytes[static_cast<size_t>(q)][k];
      }
      r.profile.stages.push_back(s);
    }
    group_.barrier();  // peers keep their mappings until everyone has read them
    return r;
  }

 private:
  Bootstrap& group_;
  RankPublisherFactory factory_;
  std::string name_;
  RankPublishOptions options_;
  std::string device_;
};

}  // namespace

std::unique_ptr<Backend> make_multiproc_backend(Bootstrap& group, RankPublisherFactory factory, std::string name,
                                                RankPublishOptions options) {
  PCPKV_CHECK(factory != nullptr, "make_multiproc_backend: no rank publisher factory");
  return std::make_unique<MultiprocBackend>(group, std::move(factory), std::move(name), std::move(options));
}

}  // namespace pcpkv
