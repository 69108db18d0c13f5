// pcpkv/publish/cuda_multiproc.h: the per-process CUDA publication driver (CUDA builds only; no CUDA headers needed;
// its benchmarks: pcpkv_bench/fence.h, link.h, allreduce.h). Devices and symmetric device memory: pcpkv/ranks/cuda.h.
//
// Processes must fork before they touch CUDA; `pcpkv launch` starts fresh processes, so any rank may. Each
// rank uses device PCPKV_DEVICE, or local_rank % visible devices (round-robin: several ranks may share one
// GPU). Symmetric device memory is allocated with the CUDA VMM API (cuMemCreate, exported as a POSIX file
// descriptor, passed over the bootstrap socket with SCM_RIGHTS, imported and cuMemMap'd by every rank) and
// works between processes on one GPU and between GPUs with peer access. NVLink multicast is never used.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/publish/multiproc.h"
#include "pcpkv/ranks/cuda.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

/// The CUDA RankPublisher (pcpkv/publish/multiproc.h): this process's rank on its device. Caches, staging and the
/// fence pads live in device symmetric memory; the fence is the SPEC section 5 kernel with this rank's
/// device-resident epochs and a host-mapped error word (a timeout becomes pcpkv::FenceTimeout naming the
/// missing rank; a peer process that dies is noticed by the host while it waits, and named at once).
/// collect: the three all-gathers go through NCCL when every rank has its own GPU, else (and with
/// options.collect_via == "p2p") as peer reads of symmetric memory after a fence.
std::unique_ptr<RankPublisher> make_rank_publisher(Bootstrap& group, const PublishSetup& setup,
                                                   const RankPublishOptions& options);

}  // namespace pcpkv::cuda
