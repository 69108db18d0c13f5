// src/core/cuda/device.h: per-device facts the kernel launchers size their grids by.
#pragma once

namespace pcpkv::cuda {

/// Multiprocessors of the current device (cached per device; thread-safe).
int num_sms();

}  // namespace pcpkv::cuda
