// src/ranks/nccl_env.h: what pcpkv asks of NCCL's environment before it creates a communicator. Internal to ranks.
#pragma once

namespace pcpkv::nccl_env {

/// pcpkv never uses NVLink multicast (NVLS: NVLink SHARP reductions and multicast objects; on a shared NVSwitch host
/// it can take GPUs out of service). NCCL reads NCCL_NVLS_ENABLE when a communicator is created and, left unset,
/// turns NVLS on where the fabric offers it. So before pcpkv creates one: unset or empty -> set to "0"; "0" -> kept;
/// any other value -> pcpkv::Error naming the variable and its value, nothing changed.
/// NCCL keeps the first value it read in a process: a communicator the caller created before pcpkv's has used the
/// environment of its own time (set NCCL_NVLS_ENABLE=0 before that one too).
void keep_nccl_nvls_off();

}  // namespace pcpkv::nccl_env
