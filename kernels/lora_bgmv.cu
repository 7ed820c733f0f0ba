// The LoRA deltas of a step's decode rows, every adapter at once (Punica's BGMV shape), on the GPU:
//   out[row] += expand_s(shrink_s(x[row]))  for each row whose slot s = row_slot[row] is >= 0.
// The same computation and layout as the CPU kernel (backend/attention/cpu_kernel/lora_bgmv.cpp):
// a slot's A is [parts x rank, in] (part p from row p x rank), its B compact and transposed,
// [rank, out], output column j of part p reading rank entries [p x rank, (p + 1) x rank).
//
//   * lora_shrink: one thread block per row; each warp takes rank entries in turn, its lanes stride
//     over the input (coalesced), a warp reduction gives the dot product, rounded to the dtype as
//     torch's shrink GEMM would round it, into a float32 buffer [rows, parts x rank];
//   * lora_expand: grid (rows, output chunks); one thread per output column (coalesced reads of B),
//     out = out + sum over the part's rank entries, accumulated in float32 and rounded once.
//
// Compile-time option: -DLORA_T=float|__half|__nv_bfloat16 (x, A, B and out element type).
#include "common.cuh"

#ifndef LORA_T
#error "compile with -DLORA_T=float, __half or __nv_bfloat16"
#endif

typedef LORA_T lora_t;

extern "C" __global__ void lora_shrink(
    const lora_t* __restrict__ x,         // [rows, in] (rows x_stride apart)
    const lora_t* __restrict__ a,         // [slots, width, in]
    const int* __restrict__ row_slot,     // [rows]; -1: no adapter
    float* __restrict__ shrunk,           // [rows, width]
    long long x_stride,
    int in_features,
    int width) {                          // parts x rank
  const long long row = blockIdx.x;
  const int slot = row_slot[row];
  if (slot < 0) return;  // the whole block returns: no barrier follows
  const lora_t* x_row = x + row * x_stride;
  const lora_t* a_slot = a + (long long)slot * width * in_features;
  const int lane = threadIdx.x % WARP_SIZE;
  const int num_warps = blockDim.x / WARP_SIZE;
  for (int q = threadIdx.x / WARP_SIZE; q < width; q += num_warps) {
    const lora_t* a_row = a_slot + (long long)q * in_features;
    float sum = 0.0f;
    for (int k = lane; k < in_features; k += WARP_SIZE) sum += to_float(x_row[k]) * to_float(a_row[k]);
    sum = warp_reduce_sum(sum);
    if (lane == 0) shrunk[row * width + q] = to_float(from_float<lora_t>(sum));
  }
}

extern "C" __global__ void lora_expand(
    const float* __restrict__ shrunk,     // [rows, width]
    const lora_t* __restrict__ bt,        // [slots, rank, out]
    const int* __restrict__ row_slot,     // [rows]; -1: no adapter
    lora_t* __restrict__ out,             // [rows, out] (rows out_stride apart), updated in place
    long long out_stride,
    int out_features,
    int rank,                             // rank entries per part (the slots' max rank)
    int width,                            // parts x rank
    int part1_start,                      // first output column of part 1 (out_features when none)
    int part2_start) {                    // first output column of part 2 (out_features when none)
  const long long row = blockIdx.x;
  const int slot = row_slot[row];
  const int j = blockIdx.y * blockDim.x + threadIdx.x;
  if (slot < 0 || j >= out_features) return;
  const int part = (j >= part1_start) + (j >= part2_start);
  const float* s = shrunk + row * width + part * rank;
  const lora_t* b = bt + (long long)slot * rank * out_features + j;
  float sum = 0.0f;
  for (int r = 0; r < rank; ++r) sum += s[r] * to_float(b[(long long)r * out_features]);
  lora_t* cell = out + row * out_stride + j;
  *cell = from_float<lora_t>(to_float(*cell) + sum);
}
