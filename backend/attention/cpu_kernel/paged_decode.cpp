// Paged decode attention on CPU: each sequence's one new query attends over its context, read in
// place from the paged KV cache through its block table (no gather copy). Built by build.py into a
// small shared library called through ctypes; it links the libgomp that torch already loaded, so it
// shares torch's OpenMP thread pool.
//
// Layouts (backend/attention/base.py):
//   query        [n, num_heads, head_size]                      float32 or bfloat16
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size] same dtype
//   value_cache  [num_blocks, block_size, num_kv_heads, head_size] same dtype
//   block_tables [n, max_blocks] int32, seq_lens [n] int32
//   out          [n, num_heads, head_size]                      same dtype
// One task per (sequence, kv head): its `group` query heads share one pass over that head's K/V
// (GQA), with an online softmax kept in float32 per query head. An AVX2 path serves head sizes
// that are a multiple of 8 (built with -march=native); the plain loops serve the rest.

#include <limits>

#include "simd.h"

namespace {

using namespace llm_cpu;

constexpr int kMaxGroup = 32;
constexpr int kMaxHeadSize = 256;
constexpr int kMaxBlockSize = 256;

// One (sequence, KV head) task's start: its `group` query rows scaled into float32, the accumulators
// zeroed, the online softmax's running max at -inf and running sum at 0.
template <typename T>
inline void begin_task(const T* query_rows, int group, int head_size, float scale, float* q, float* acc,
                       float* running_max, float* running_sum) {
  for (int g = 0; g < group; ++g) {
    for (int d = 0; d < head_size; ++d) q[g * head_size + d] = load(query_rows[g * head_size + d]) * scale;
    for (int d = 0; d < head_size; ++d) acc[g * head_size + d] = 0.0f;
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
}

// Its end: each query row's accumulated values divided by its softmax sum, in the output's dtype.
template <typename T>
inline void finish_task(const float* acc, const float* running_sum, int group, int head_size, T* out_rows) {
  for (int g = 0; g < group; ++g) {
    const float inverse = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
    for (int d = 0; d < head_size; ++d) store(out_rows + g * head_size + d, acc[g * head_size + d] * inverse);
  }
}

template <typename T>
void decode(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
            const int32_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads, int head_size,
            int block_size, int max_blocks, float scale) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * token_stride;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int s = 0; s < num_seqs; ++s) {
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      float q[kMaxGroup * kMaxHeadSize];
      float acc[kMaxGroup * kMaxHeadSize];
      float scores[kMaxBlockSize * kMaxGroup];
      float running_max[kMaxGroup];
      float running_sum[kMaxGroup];
      const int first_head = kv_head * group;
      begin_task(query + (static_cast<int64_t>(s) * num_heads + first_head) * head_size, group, head_size, scale, q,
                 acc, running_max, running_sum);
      const int seq_len = seq_lens[s];
      const int num_blocks = (seq_len + block_size - 1) / block_size;
      for (int b = 0; b < num_blocks; ++b) {
        const int64_t block = block_tables[static_cast<int64_t>(s) * max_blocks + b];
        const int tokens = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        const T* k_block = key_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        const T* v_block = value_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        for (int t = 0; t < tokens; ++t) {
          const T* k_row = k_block + t * token_stride;
          for (int g = 0; g < group; ++g) {
            const float* q_row = q + g * head_size;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_size; ++d) dot += q_row[d] * load(k_row[d]);
            scores[t * group + g] = dot;
          }
        }
        for (int g = 0; g < group; ++g) {
          float block_max = running_max[g];
          for (int t = 0; t < tokens; ++t) block_max = scores[t * group + g] > block_max ? scores[t * group + g] : block_max;
          const float correction = std::exp(running_max[g] - block_max);  // exp(-inf) = 0 at the start
          running_max[g] = block_max;
          running_sum[g] *= correction;
          float* acc_row = acc + g * head_size;
#pragma omp simd
          for (int d = 0; d < head_size; ++d) acc_row[d] *= correction;
          for (int t = 0; t < tokens; ++t) {
            const float p = std::exp(scores[t * group + g] - block_max);
            scores[t * group + g] = p;
            running_sum[g] += p;
          }
        }
        for (int t = 0; t < tokens; ++t) {
          const T* v_row = v_block + t * token_stride;
          for (int g = 0; g < group; ++g) {
            const float p = scores[t * group + g];
            float* acc_row = acc + g * head_size;
#pragma omp simd
            for (int d = 0; d < head_size; ++d) acc_row[d] += p * load(v_row[d]);
          }
        }
      }
      finish_task(acc, running_sum, group, head_size, out + (static_cast<int64_t>(s) * num_heads + first_head) * head_size);
    }
  }
}


#ifdef LLM_CPU_AVX2
// The AVX2 path (head sizes that are a multiple of 8): q.k for 8 tokens at a time with one
// horizontal reduction for all 8, a vectorized exp, and p.v accumulated in registers for up to 4
// query heads per pass over a V chunk. Same arithmetic as the scalar path, in float32.

// acc[g][d] += sum_t p[g][t] * v[t][d] for `Heads` query heads starting at g0, kept in registers per chunk.
template <int Heads, typename T>
inline void accumulate_values(float* acc, const float* probs, const T* v_block, int64_t token_stride, int tokens,
                              int head_size, int g0, int probs_stride) {
  for (int c = 0; c < head_size; c += 8) {
    __m256 sums[Heads];
    for (int h = 0; h < Heads; ++h) sums[h] = _mm256_loadu_ps(acc + (g0 + h) * head_size + c);
    for (int t = 0; t < tokens; ++t) {
      const __m256 v = load8(v_block + t * token_stride + c);
      for (int h = 0; h < Heads; ++h) sums[h] = _mm256_fmadd_ps(_mm256_set1_ps(probs[(g0 + h) * probs_stride + t]), v, sums[h]);
    }
    for (int h = 0; h < Heads; ++h) _mm256_storeu_ps(acc + (g0 + h) * head_size + c, sums[h]);
  }
}

template <typename T>
void decode_avx2(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
                 const int32_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                 int block_size, int max_blocks, float scale) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * token_stride;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int s = 0; s < num_seqs; ++s) {
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      alignas(32) float q[kMaxGroup * kMaxHeadSize];
      alignas(32) float acc[kMaxGroup * kMaxHeadSize];
      alignas(32) float probs[kMaxGroup * (kMaxBlockSize + 8)];  // [group][block_size], g-major
      float running_max[kMaxGroup];
      float running_sum[kMaxGroup];
      const int probs_stride = block_size;
      const int first_head = kv_head * group;
      begin_task(query + (static_cast<int64_t>(s) * num_heads + first_head) * head_size, group, head_size, scale, q,
                 acc, running_max, running_sum);
      const int seq_len = seq_lens[s];
      const int num_blocks = (seq_len + block_size - 1) / block_size;
      for (int b = 0; b < num_blocks; ++b) {
        const int64_t block = block_tables[static_cast<int64_t>(s) * max_blocks + b];
        const int tokens = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        const T* k_block = key_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        const T* v_block = value_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        if (b + 1 < num_blocks) {  // the next block is anywhere in memory: start fetching its rows now
          const int64_t next = block_tables[static_cast<int64_t>(s) * max_blocks + b + 1];
          const char* k_next = reinterpret_cast<const char*>(key_cache + next * block_stride + static_cast<int64_t>(kv_head) * head_size);
          const char* v_next = reinterpret_cast<const char*>(value_cache + next * block_stride + static_cast<int64_t>(kv_head) * head_size);
          const int row_bytes = head_size * static_cast<int>(sizeof(T));
          const int64_t stride_bytes = token_stride * static_cast<int64_t>(sizeof(T));
          for (int t = 0; t < block_size; ++t) {
            for (int offset = 0; offset < row_bytes; offset += 64) {
              _mm_prefetch(k_next + t * stride_bytes + offset, _MM_HINT_T0);
              _mm_prefetch(v_next + t * stride_bytes + offset, _MM_HINT_T0);
            }
          }
        }
        for (int g = 0; g < group; ++g) {
          const float* q_row = q + g * head_size;
          float* scores = probs + g * probs_stride;
          int t = 0;
          for (; t + 8 <= tokens; t += 8) {
            __m256 dots[8];
            for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
            for (int c = 0; c < head_size; c += 8) {
              const __m256 qv = _mm256_load_ps(q_row + c);
              for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qv, load8(k_block + (t + j) * token_stride + c), dots[j]);
            }
            _mm256_storeu_ps(scores + t, horizontal_sums8(dots));
          }
          for (; t < tokens; ++t) {
            __m256 dot = _mm256_setzero_ps();
            for (int c = 0; c < head_size; c += 8)
              dot = _mm256_fmadd_ps(_mm256_load_ps(q_row + c), load8(k_block + t * token_stride + c), dot);
            scores[t] = horizontal_sum(dot);
          }
          float block_max = running_max[g];
          for (int u = 0; u < tokens; ++u) block_max = scores[u] > block_max ? scores[u] : block_max;
          const float correction = std::exp(running_max[g] - block_max);  // exp(-inf) = 0 at the start
          running_max[g] = block_max;
          float* acc_row = acc + g * head_size;
          const __m256 correct = _mm256_set1_ps(correction);
          for (int c = 0; c < head_size; c += 8) _mm256_store_ps(acc_row + c, _mm256_mul_ps(_mm256_load_ps(acc_row + c), correct));
          const __m256 maximum = _mm256_set1_ps(block_max);
          __m256 total = _mm256_setzero_ps();
          int u = 0;
          for (; u + 8 <= tokens; u += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + u), maximum));
            _mm256_storeu_ps(scores + u, p);
            total = _mm256_add_ps(total, p);
          }
          float sum = horizontal_sum(total);
          for (; u < tokens; ++u) {
            scores[u] = std::exp(scores[u] - block_max);
            sum += scores[u];
          }
          running_sum[g] = running_sum[g] * correction + sum;
        }
        int g0 = 0;
        for (; g0 + 4 <= group; g0 += 4) accumulate_values<4>(acc, probs, v_block, token_stride, tokens, head_size, g0, probs_stride);
        switch (group - g0) {
          case 3: accumulate_values<3>(acc, probs, v_block, token_stride, tokens, head_size, g0, probs_stride); break;
          case 2: accumulate_values<2>(acc, probs, v_block, token_stride, tokens, head_size, g0, probs_stride); break;
          case 1: accumulate_values<1>(acc, probs, v_block, token_stride, tokens, head_size, g0, probs_stride); break;
          default: break;
        }
      }
      finish_task(acc, running_sum, group, head_size, out + (static_cast<int64_t>(s) * num_heads + first_head) * head_size);
    }
  }
}
#endif  // LLM_CPU_AVX2

}  // namespace

extern "C" {

// Limits the Python side checks before calling (a bigger shape would overflow the stack arrays).
int paged_decode_max_group() { return kMaxGroup; }
int paged_decode_max_head_size() { return kMaxHeadSize; }
int paged_decode_max_block_size() { return kMaxBlockSize; }

// dtype: 0 float32, 1 bfloat16.
void paged_decode(int dtype, const void* query, const void* key_cache, const void* value_cache,
                  const int32_t* block_tables, const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                  int num_kv_heads, int head_size, int block_size, int max_blocks, float scale) {
#ifdef LLM_CPU_AVX2
  if (head_size % 8 == 0) {
    if (dtype == 0) {
      decode_avx2(static_cast<const float*>(query), static_cast<const float*>(key_cache),
                  static_cast<const float*>(value_cache), block_tables, seq_lens, static_cast<float*>(out), num_seqs,
                  num_heads, num_kv_heads, head_size, block_size, max_blocks, scale);
    } else {
      decode_avx2(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
                  static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, static_cast<uint16_t*>(out),
                  num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale);
    }
    return;
  }
#endif
  if (dtype == 0) {
    decode(static_cast<const float*>(query), static_cast<const float*>(key_cache),
           static_cast<const float*>(value_cache), block_tables, seq_lens, static_cast<float*>(out), num_seqs,
           num_heads, num_kv_heads, head_size, block_size, max_blocks, scale);
  } else {
    decode(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
           static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, static_cast<uint16_t*>(out),
           num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale);
  }
}

}  // extern "C"
