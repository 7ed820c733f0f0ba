// Helpers shared by the attention kernels: element conversions, 16-byte vectors, warp reductions.
//
// Kept free of HEAD_SIZE / CACHE_T so it can be included by every module whatever its options.
// NVRTC has no <cfloat> or <math.h> constants (INFINITY does not compile there): use NEG_LARGE.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// Smaller than every finite logit; the start value of running maxima.
#define NEG_LARGE (-3.402823466e+38f)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes of T, loaded and stored as one vector access (the address must be 16-byte aligned).
template <typename T>
struct __align__(16) Vec16 {
  T v[16 / sizeof(T)];
};

__device__ __forceinline__ float warp_reduce_sum(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) x += __shfl_xor_sync(FULL_MASK, x, mask);
  return x;
}

__device__ __forceinline__ float warp_reduce_max(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, mask));
  return x;
}
