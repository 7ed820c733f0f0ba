// Small kernels that exercise the CPU emulation harness itself (tests/kernels/test_emulation_harness.py).
// Several of them break CUDA rules on purpose: the harness must report each break.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void index_variables(int* out) {  // [num_blocks * threads_per_block * 12]
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* o = out + (block * threads + thread) * 12;
  o[0] = threadIdx.x, o[1] = threadIdx.y, o[2] = threadIdx.z;
  o[3] = blockIdx.x, o[4] = blockIdx.y, o[5] = blockIdx.z;
  o[6] = blockDim.x, o[7] = blockDim.y, o[8] = blockDim.z;
  o[9] = gridDim.x, o[10] = gridDim.y, o[11] = gridDim.z;
}

extern "C" __global__ void read_shared_unwritten(float* out) {  // [num_blocks]
  __shared__ float buffer[64];
  if (threadIdx.x == 0) out[blockIdx.x] = buffer[5];  // nobody wrote it in this block
  __syncthreads();
  if (threadIdx.x == 0) buffer[5] = 1.0f;  // what the next block would see without the refill
}

extern "C" __global__ void shuffles(int* out) {  // [blockDim.x * 3]
  const int t = threadIdx.x;
  out[3 * t + 0] = __shfl_xor_sync(0xffffffffu, t, 5);
  out[3 * t + 1] = __shfl_sync(0xffffffffu, t, 3);
  out[3 * t + 2] = __shfl_down_sync(0xffffffffu, t, 4);
}

extern "C" __global__ void divergent_syncthreads(float* out) {  // [blockDim.x]
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void early_return(float* out) {  // [blockDim.x]
  if (threadIdx.x == 7) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void partial_mask_shuffle(float* out) {  // [blockDim.x]
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.0f, 1);
}

extern "C" __global__ void warp_split_shuffle(float* out) {  // [blockDim.x]
  float v = 1.0f;
  if (threadIdx.x % 32 < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 2);
  }
  out[threadIdx.x] = v;
}

extern "C" __global__ void conversions(const float* in,        // [n]
                                       __half* half_out,       // [n]
                                       float* half_back,       // [n]
                                       __nv_bfloat16* bf16_out,  // [n]
                                       float* bf16_back,       // [n]
                                       int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    half_out[i] = __float2half_rn(in[i]);
    half_back[i] = __half2float(half_out[i]);
    bf16_out[i] = __float2bfloat16_rn(in[i]);
    bf16_back[i] = __bfloat162float(bf16_out[i]);
  }
}

extern "C" __global__ void scalar_arguments(float* out, int a, long long b, float c) {  // out: [3]
  out[0] = (float)a;
  out[1] = (float)b;
  out[2] = c;
}
