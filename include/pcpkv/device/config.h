// pcpkv/device/config.h: macros that let one header serve the host reference and CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define PCPKV_HD __host__ __device__ __forceinline__
#define PCPKV_DEVICE __device__ __forceinline__
#else
#define PCPKV_HD inline
#endif

// Loop unrolling hint for device compilation; host compilers that do not know it stay quiet.
#if defined(__CUDACC__)
#define PCPKV_UNROLL _Pragma("unroll")
#else
#define PCPKV_UNROLL
#endif

#if defined(__CUDA_ARCH__)
#define PCPKV_ON_DEVICE 1
#else
#define PCPKV_ON_DEVICE 0
#endif
