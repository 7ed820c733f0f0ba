// Decode attention over the paged KV cache: one new query token per sequence.
//
// paged_attention_decode: one thread block per (query head, sequence, partition). A partition is
//   PARTITION_SIZE context tokens; its logits sit in shared memory, so shared memory does not grow
//   with the context. With one partition (gridDim.z == 1) the block writes the final output; with
//   more, it writes its softmax-normalised partial output, its max logit and its exp sum, and
//   paged_attention_reduce combines the partitions. With a sliding window W > 0 (0: none) a sequence
//   attends only its last W positions: its partitions start at position seq_len - W (not at a block
//   start: the loops go token by token), so nothing before the window is read or masked.
// paged_attention_reduce: one thread block per (query head, sequence); rescales the partitions'
//   outputs by exp(max_p - max) * exp_sum_p and divides by the total (same sliding window).
//
// Cache layout (backend/attention/base.py): [num_blocks, block_size, num_kv_heads, HEAD_SIZE]; the
// strides are arguments (in elements), the head dimension must be contiguous and 16-byte aligned.
// Physical block numbers are multiplied by the block stride in 64-bit arithmetic: a cache of more
// than 2^31 elements is normal. GQA of any ratio: query head h reads kv head h / (num_heads /
// num_kv_heads). Only context positions < seq_len are read; padding entries of the block table
// (the null block 0) are never dereferenced.
//
// Work split inside a block: THREAD_GROUP_SIZE lanes share one token; lane g of a group owns the
// 16-byte chunks g, g + THREAD_GROUP_SIZE, ... of the head (coalesced 128-byte rows for fp16/bf16
// head 64). A group sums its dot product with xor shuffles; the groups combine their partial
// outputs through shared memory (NUM_GROUPS x HEAD_SIZE floats: 8 KiB for head 128).
//
// Compile-time options (cupy.RawModule options, see kernels/build_options.py):
//   -DCACHE_T=float|__half|__nv_bfloat16  cache, query and output element type
//   -DHEAD_SIZE=64|80|96|112|128|256       (any multiple of 8)
//   -DNUM_THREADS=128 -DPARTITION_SIZE=512 -DTHREAD_GROUP_SIZE=8
#include "common.cuh"

#ifndef CACHE_T
#error "compile with -DCACHE_T=float, __half or __nv_bfloat16"
#endif
#ifndef HEAD_SIZE
#error "compile with -DHEAD_SIZE=<head size>"
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 512
#endif
#ifndef THREAD_GROUP_SIZE
#define THREAD_GROUP_SIZE 8
#endif

typedef CACHE_T cache_t;

#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#define VEC_SIZE ((int)(16 / sizeof(cache_t)))            // elements per 16-byte chunk
#define NUM_CHUNKS (HEAD_SIZE / VEC_SIZE)                 // chunks per head row
#define CHUNKS_PER_LANE ((NUM_CHUNKS + THREAD_GROUP_SIZE - 1) / THREAD_GROUP_SIZE)
#define NUM_GROUPS (NUM_THREADS / THREAD_GROUP_SIZE)      // tokens in flight per block

static_assert(NUM_THREADS % WARP_SIZE == 0, "NUM_THREADS must be a multiple of the warp size");
static_assert(WARP_SIZE % THREAD_GROUP_SIZE == 0, "THREAD_GROUP_SIZE must divide the warp size");
static_assert(HEAD_SIZE % 8 == 0, "HEAD_SIZE must be a multiple of 8 (16-byte chunks of fp16)");

// Address of the HEAD_SIZE-row of `token` for one kv head, through the block table.
__device__ __forceinline__ const cache_t* cache_row(const cache_t* __restrict__ cache,  // [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
                                                    const int* __restrict__ block_table,  // [max_num_blocks_per_seq]
                                                    int token, int block_size, long long block_stride,
                                                    int token_stride, long long head_offset) {
  const long long physical_block = block_table[token / block_size];
  return cache + physical_block * block_stride + (long long)(token % block_size) * token_stride + head_offset;
}

// No __launch_bounds__: with it, ptxas (12.9 and 13.0) spilled on sm_90 at 40-64 registers for
// several head sizes; without it none spill and none use more than ~72 registers. The kernels
// must be launched with exactly NUM_THREADS threads (the backend does).
extern "C" __global__ void paged_attention_decode(
    cache_t* __restrict__ out,                // [num_seqs, num_heads, HEAD_SIZE] (written when gridDim.z == 1)
    float* __restrict__ tmp_out,              // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    float* __restrict__ max_logits,           // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ exp_sums,             // [num_seqs, num_heads, max_num_partitions]
    const cache_t* __restrict__ query,        // [num_seqs, num_heads, HEAD_SIZE] (row strides below)
    const cache_t* __restrict__ key_cache,    // [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
    const cache_t* __restrict__ value_cache,  // [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
    const int* __restrict__ block_tables,     // [num_seqs, block_table_stride], padded with block 0
    const int* __restrict__ seq_lens,         // [num_seqs] context length including the new token
    float scale,                              // softmax scale, usually 1/sqrt(HEAD_SIZE)
    int num_kv_heads,
    int block_size,                           // tokens per cache block
    int block_table_stride,                   // elements between block-table rows
    long long query_seq_stride,               // elements between query rows of two sequences
    int query_head_stride,                    // elements between query heads
    long long cache_block_stride,             // elements between cache blocks
    int cache_token_stride,                   // elements between the tokens of a block
    int cache_head_stride,                    // elements between kv heads
    int sliding_window) {                     // attend the last sliding_window positions; 0: all
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int num_heads = gridDim.x;
  const int num_partitions = gridDim.z;
  const int tid = threadIdx.x;
  const int warp = tid / WARP_SIZE;
  const int lane = tid % WARP_SIZE;
  const int group = tid / THREAD_GROUP_SIZE;
  const int group_lane = tid % THREAD_GROUP_SIZE;

  const long long out_row = (long long)seq * num_heads + head;  // index of this (seq, head) pair
  const int context_len = seq_lens[seq];
  const int window_start = sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
  const int start = window_start + partition * PARTITION_SIZE;
  if (start >= context_len) {  // uniform for the whole block: no barrier is skipped by some threads
    if (num_partitions == 1) {  // an empty context (never scheduled, but defined): zeros
      for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) out[out_row * HEAD_SIZE + d] = from_float<cache_t>(0.f);
    }
    return;
  }
  const int end = start + PARTITION_SIZE < context_len ? start + PARTITION_SIZE : context_len;
  const int num_tokens = end - start;
  const int kv_head = head / (num_heads / num_kv_heads);
  const long long head_offset = (long long)kv_head * cache_head_stride;
  const int* __restrict__ block_table = block_tables + (long long)seq * block_table_stride;

  __shared__ float q_smem[HEAD_SIZE];                // the scaled query
  __shared__ float logits[PARTITION_SIZE];           // logits, then softmax numerators
  __shared__ float red_max[NUM_WARPS];               // per-warp maxima
  __shared__ float red_sum[NUM_WARPS];               // per-warp exp sums
  __shared__ float out_smem[NUM_GROUPS][HEAD_SIZE];  // per-group partial outputs

  const cache_t* __restrict__ q = query + seq * query_seq_stride + (long long)head * query_head_stride;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) q_smem[d] = to_float(q[d]) * scale;
  __syncthreads();  // q_smem is complete

  // Whether this lane owns a chunk in the last round (false for some lanes when NUM_CHUNKS is not
  // a multiple of THREAD_GROUP_SIZE, e.g. head 80). Hoisted: testing `chunk < NUM_CHUNKS` inside
  // the loops made ptxas 13 spill on sm_90.
  const bool has_tail_chunk = group_lane + (CHUNKS_PER_LANE - 1) * THREAD_GROUP_SIZE < NUM_CHUNKS;
  float q_reg[CHUNKS_PER_LANE][VEC_SIZE];  // this lane's chunks of the query
#pragma unroll
  for (int j = 0; j < CHUNKS_PER_LANE; ++j) {
    const int chunk = group_lane + j * THREAD_GROUP_SIZE;
#pragma unroll
    for (int k = 0; k < VEC_SIZE; ++k) q_reg[j][k] = chunk < NUM_CHUNKS ? q_smem[chunk * VEC_SIZE + k] : 0.f;
  }

  // 1. logits = q . k for every token of the partition; each group takes one token per step.
  float qk_max = NEG_LARGE;
  for (int base = start; base < end; base += NUM_GROUPS) {  // the same trip count in every warp
    const int token = base + group;
    const bool valid = token < end;
    // Groups past the end re-read the last token instead of branching around the loads: fewer
    // divergent regions (ptxas spilled convergence state on sm_90 with the branch), same result.
    const cache_t* __restrict__ k_row = cache_row(key_cache, block_table, valid ? token : end - 1, block_size,
                                                  cache_block_stride, cache_token_stride, head_offset);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_LANE; ++j) {
      const int chunk = group_lane + j * THREAD_GROUP_SIZE;
      if (j < CHUNKS_PER_LANE - 1 || has_tail_chunk) {
        const Vec16<cache_t> k_vec = *reinterpret_cast<const Vec16<cache_t>*>(k_row + chunk * VEC_SIZE);
#pragma unroll
        for (int k = 0; k < VEC_SIZE; ++k) dot += q_reg[j][k] * to_float(k_vec.v[k]);
      }
    }
#pragma unroll
    for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2) dot += __shfl_xor_sync(FULL_MASK, dot, mask);
    if (valid) {
      if (group_lane == 0) logits[token - start] = dot;
      qk_max = fmaxf(qk_max, dot);
    }
  }

  // 2. softmax over the partition: block-wide max, exponentials, block-wide sum.
  qk_max = warp_reduce_max(qk_max);
  if (lane == 0) red_max[warp] = qk_max;
  __syncthreads();  // logits and red_max are complete
  qk_max = red_max[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) qk_max = fmaxf(qk_max, red_max[w]);

  float exp_sum = 0.f;
  for (int i = tid; i < num_tokens; i += NUM_THREADS) {
    const float e = __expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = warp_reduce_sum(exp_sum);
  if (lane == 0) red_sum[warp] = exp_sum;
  __syncthreads();  // the exponentials and red_sum are complete
  exp_sum = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) exp_sum += red_sum[w];
  const float inv_sum = 1.f / exp_sum;  // >= 1: the max token contributes exp(0)

  // 3. out = sum over tokens of p * v; lane g of every group accumulates the same chunks.
  float acc[CHUNKS_PER_LANE][VEC_SIZE];
#pragma unroll
  for (int j = 0; j < CHUNKS_PER_LANE; ++j)
#pragma unroll
    for (int k = 0; k < VEC_SIZE; ++k) acc[j][k] = 0.f;
  for (int base = start; base < end; base += NUM_GROUPS) {
    const int token = base + group;
    const bool valid = token < end;
    const float p = valid ? logits[token - start] : 0.f;  // past the end: weight 0 on the last token
    const cache_t* __restrict__ v_row = cache_row(value_cache, block_table, valid ? token : end - 1, block_size,
                                                  cache_block_stride, cache_token_stride, head_offset);
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_LANE; ++j) {
      const int chunk = group_lane + j * THREAD_GROUP_SIZE;
      if (j < CHUNKS_PER_LANE - 1 || has_tail_chunk) {
        const Vec16<cache_t> v_vec = *reinterpret_cast<const Vec16<cache_t>*>(v_row + chunk * VEC_SIZE);
#pragma unroll
        for (int k = 0; k < VEC_SIZE; ++k) acc[j][k] += p * to_float(v_vec.v[k]);
      }
    }
  }
  // Sum over the groups: each group's lane g stores its chunks, then each thread adds up its dims.
  if (num_tokens > group) {  // groups that saw no token hold zeros: skip their stores and loads
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_LANE; ++j) {
      const int chunk = group_lane + j * THREAD_GROUP_SIZE;
      if (j < CHUNKS_PER_LANE - 1 || has_tail_chunk) {
#pragma unroll
        for (int k = 0; k < VEC_SIZE; ++k) out_smem[group][chunk * VEC_SIZE + k] = acc[j][k];
      }
    }
  }
  __syncthreads();  // out_smem is complete

  const int groups_used = num_tokens < NUM_GROUPS ? num_tokens : NUM_GROUPS;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int g = 0; g < groups_used; ++g) o += out_smem[g][d];
    o *= inv_sum;
    if (num_partitions == 1) {
      out[out_row * HEAD_SIZE + d] = from_float<cache_t>(o);
    } else {
      tmp_out[(out_row * num_partitions + partition) * HEAD_SIZE + d] = o;
    }
  }
  if (num_partitions > 1 && tid == 0) {
    max_logits[out_row * num_partitions + partition] = qk_max;
    exp_sums[out_row * num_partitions + partition] = exp_sum;
  }
}

extern "C" __global__ void paged_attention_reduce(
    cache_t* __restrict__ out,               // [num_seqs, num_heads, HEAD_SIZE]
    const float* __restrict__ tmp_out,       // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    const float* __restrict__ max_logits,    // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ exp_sums,      // [num_seqs, num_heads, max_num_partitions]
    const int* __restrict__ seq_lens,        // [num_seqs]
    int max_num_partitions,
    int sliding_window) {                    // as the decode kernel's
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_heads = gridDim.x;
  const long long out_row = (long long)seq * num_heads + head;
  // Only the partitions that hold context (in the window) were written.
  const int context_len = seq_lens[seq];
  const int attended = sliding_window > 0 && context_len > sliding_window ? sliding_window : context_len;
  const int num_partitions = (attended + PARTITION_SIZE - 1) / PARTITION_SIZE;
  const float* __restrict__ row_max = max_logits + out_row * max_num_partitions;
  const float* __restrict__ row_sum = exp_sums + out_row * max_num_partitions;

  float global_max = NEG_LARGE;
  for (int p = 0; p < num_partitions; ++p) global_max = fmaxf(global_max, row_max[p]);
  float total = 0.f;
  for (int p = 0; p < num_partitions; ++p) total += row_sum[p] * __expf(row_max[p] - global_max);
  const float inv_total = num_partitions > 0 ? 1.f / total : 0.f;

  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int p = 0; p < num_partitions; ++p)
      o += tmp_out[(out_row * max_num_partitions + p) * HEAD_SIZE + d] * row_sum[p] * __expf(row_max[p] - global_max);
    out[out_row * HEAD_SIZE + d] = from_float<cache_t>(o * inv_total);
  }
}
