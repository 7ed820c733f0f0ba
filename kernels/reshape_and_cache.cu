// Writes this step's new K and V into their paged-cache slots.
//
// One thread block per new token; its threads copy the token's num_kv_heads * head_size elements of
// K and of V. slot_mapping[token] = block_id * block_size + offset; a slot of -1 (a padding token,
// or a token whose K/V is already cached) is skipped. Block ids times the block stride are 64-bit.
// K and V may be row-strided views (e.g. slices of a fused QKV projection) but each token's heads
// must be contiguous; the cache's strides are arguments, its head dimension must be contiguous.
//
// Compile-time option: -DCACHE_T=float|__half|__nv_bfloat16 (K, V and cache element type).
#include "common.cuh"

#ifndef CACHE_T
#error "compile with -DCACHE_T=float, __half or __nv_bfloat16"
#endif

typedef CACHE_T cache_t;

extern "C" __global__ void reshape_and_cache(
    const cache_t* __restrict__ key,          // [num_tokens, num_kv_heads, head_size] (rows key_token_stride apart)
    const cache_t* __restrict__ value,        // [num_tokens, num_kv_heads, head_size] (rows value_token_stride apart)
    cache_t* __restrict__ key_cache,          // [num_blocks, block_size, num_kv_heads, head_size]
    cache_t* __restrict__ value_cache,        // [num_blocks, block_size, num_kv_heads, head_size]
    const long long* __restrict__ slot_mapping,  // [num_tokens]; -1 = do not write
    long long key_token_stride,               // elements between two tokens of key
    long long value_token_stride,             // elements between two tokens of value
    int num_kv_heads,
    int head_size,
    int block_size,                           // tokens per cache block
    long long cache_block_stride,             // elements between cache blocks
    int cache_token_stride,                   // elements between the tokens of a block
    int cache_head_stride) {                  // elements between kv heads
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;  // the whole block returns: no barrier follows
  const long long block = slot / block_size;
  const int offset = (int)(slot % block_size);
  const long long base = block * cache_block_stride + (long long)offset * cache_token_stride;
  const int n = num_kv_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_size;
    const int d = i % head_size;
    const long long dst = base + (long long)h * cache_head_stride + d;
    key_cache[dst] = key[token * key_token_stride + i];
    value_cache[dst] = value[token * value_token_stride + i];
  }
}
