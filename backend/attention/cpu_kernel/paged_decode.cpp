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
// With a sliding window W > 0 (0: none) sequence s attends only positions seq_len - W .. seq_len - 1:
// the blocks before the one holding seq_len - W are skipped, and in that block the positions before
// it are masked (their scores -inf, their probabilities 0).
// The plain loops (any head size): one task per (sequence, kv head), its `group` query heads sharing
// one pass over that head's K/V (GQA), with an online softmax kept in float32 per query head. The
// vector path below (head sizes a multiple of the vector width; built with -march=native) is what
// serves real models.

#include <algorithm>
#include <limits>
#include <vector>

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
            int block_size, int max_blocks, float scale, int window) {
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
      const int first = window > 0 && seq_len > window ? seq_len - window : 0;  // the window's first position
      for (int b = first / block_size; b < num_blocks; ++b) {
        const int64_t block = block_tables[static_cast<int64_t>(s) * max_blocks + b];
        const int tokens = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        const int t_begin = first > b * block_size ? first - b * block_size : 0;  // tokens before: outside the window
        const T* k_block = key_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        const T* v_block = value_cache + block * block_stride + static_cast<int64_t>(kv_head) * head_size;
        for (int t = t_begin; t < tokens; ++t) {
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
          for (int t = t_begin; t < tokens; ++t) block_max = scores[t * group + g] > block_max ? scores[t * group + g] : block_max;
          const float correction = std::exp(running_max[g] - block_max);  // exp(-inf) = 0 at the start
          running_max[g] = block_max;
          running_sum[g] *= correction;
          float* acc_row = acc + g * head_size;
#pragma omp simd
          for (int d = 0; d < head_size; ++d) acc_row[d] *= correction;
          for (int t = t_begin; t < tokens; ++t) {
            const float p = std::exp(scores[t * group + g] - block_max);
            scores[t * group + g] = p;
            running_sum[g] += p;
          }
        }
        for (int t = t_begin; t < tokens; ++t) {
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
// The vector path (head sizes that are a multiple of the vector width), written once against the
// traits of simd.h (Avx512 where the CPU has it, else Avx2). What makes it fast is memory, not
// arithmetic: inside a step every layer's K/V comes from DRAM, so
//   * a work item is one sequence (or one partition of a long one) with all its KV heads: it walks
//     whole blocks, which are contiguous in the cache ([block_size, num_kv_heads, head_size] per
//     block), instead of one head's rows at a stride;
//   * the next block of K and V is prefetched while this one is computed (block tables scatter
//     blocks, so the hardware prefetcher cannot guess them), in one slice per head computed: a
//     whole block's prefetches at once stall the core on its few line-fill buffers;
//   * contexts longer than kPartitionTokens are split into partitions computed in parallel and
//     merged (their softmax maxima and sums), so a few long sequences still use every core.
// q.k of up to `width` tokens at once, reduced with one horizontal-sums step; bfloat16 K uses
// vdpbf16ps where the CPU has AVX512_BF16 (exact bf16 products, float32 sums), and so does p.v
// (the probabilities rounded to bfloat16, as transformers' eager attention and vLLM's kernels
// round them before the product with V); otherwise p.v accumulates in float32, for up to 4 query
// heads per pass over a V row chunk.

constexpr int kPartitionTokens = 512;

// Starts fetching slice `index` of `count` (whole 64-byte lines) of the `bytes` from `start` into L2
// (a block's rows are contiguous); the caller spreads a block's slices over its own work.
template <typename T>
inline void prefetch_slice(const T* start, int64_t bytes, int index, int count) {
  const char* p = reinterpret_cast<const char*>(start);
  const int64_t slice = (bytes / count + 63) / 64 * 64;
  const int64_t end = std::min(bytes, (index + 1) * slice);
  for (int64_t offset = index * slice; offset < end; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
}

// scores[j] = q_row . k_rows[j] for j < count (count <= V::width); q_row holds float32 values.
template <typename V, typename T>
inline void dot_tokens(const float* q_row, const T* k_rows, int64_t token_stride, int count, int head_size,
                       float* scores) {
  typename V::reg acc[V::width];
  for (int j = 0; j < count; ++j) {
    const T* k = k_rows + j * token_stride;
    typename V::reg a = V::mul(V::load(q_row), V::load(k));
    for (int c = V::width; c < head_size; c += V::width) a = V::fma(V::load(q_row + c), V::load(k + c), a);
    acc[j] = a;
  }
  for (int j = count; j < V::width; ++j) acc[j] = V::zero();
  V::store(scores, V::sums(acc));
}

// One query head's scores over a partition (`tokens` keys, `padded` entries, a multiple of the
// width) become unnormalised probabilities in place: scaled, exp(score - max), 0 before `masked`
// (positions before a sliding window) and past `tokens`. Returns (max, sum) for the partition merge
// and the final division.
template <typename V>
inline void softmax_row(float* scores, int masked, int tokens, int padded, float scale, float& row_max,
                        float& row_sum) {
  constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < masked; ++t) scores[t] = kMinusInfinity;
  for (int t = tokens; t < padded; ++t) scores[t] = kMinusInfinity;
  const typename V::reg scale_v = V::set1(scale);
  typename V::reg maxima[2] = {V::set1(kMinusInfinity), V::set1(kMinusInfinity)};
  for (int t = 0; t < padded; t += V::width) {
    const typename V::reg x = V::mul(V::load(scores + t), scale_v);
    V::store(scores + t, x);
    maxima[(t / V::width) & 1] = V::max(maxima[(t / V::width) & 1], x);
  }
  row_max = V::reduce_max(V::max(maxima[0], maxima[1]));
  const typename V::reg shift = V::set1(row_max);
  typename V::reg totals[2] = {V::zero(), V::zero()};
  for (int t = 0; t < padded; t += V::width) {
    const typename V::reg p = V::exp(V::sub(V::load(scores + t), shift));  // exactly 0 past `tokens`
    V::store(scores + t, p);
    totals[(t / V::width) & 1] = V::add(totals[(t / V::width) & 1], p);
  }
  row_sum = V::reduce_add(V::add(totals[0], totals[1]));
}

// acc[h][d] += sum_t probs[h][t] * v[t][d] for `Heads` query heads, their sums kept in registers
// while the block's `tokens` rows of one V chunk stream by.
template <typename V, int Heads, typename T>
inline void accumulate_values(float* acc, const float* probs, int probs_stride, const T* v_block,
                              int64_t token_stride, int tokens, int head_size) {
  for (int c = 0; c < head_size; c += V::width) {
    typename V::reg sums[Heads];
    for (int h = 0; h < Heads; ++h) sums[h] = V::load(acc + h * head_size + c);
    for (int t = 0; t < tokens; ++t) {
      const typename V::reg v = V::load(v_block + t * token_stride + c);
      for (int h = 0; h < Heads; ++h) sums[h] = V::fma(V::set1(probs[h * probs_stride + t]), v, sums[h]);
    }
    for (int h = 0; h < Heads; ++h) V::store(acc + h * head_size + c, sums[h]);
  }
}

template <typename V, typename T>
inline void accumulate_group(float* acc, const float* probs, int probs_stride, const T* v_block,
                             int64_t token_stride, int tokens, int head_size, int group) {
  int g = 0;
  for (; g + 4 <= group; g += 4)
    accumulate_values<V, 4>(acc + g * head_size, probs + g * probs_stride, probs_stride, v_block, token_stride,
                            tokens, head_size);
  const int rest = group - g;
  float* a = acc + g * head_size;
  const float* p = probs + g * probs_stride;
  if (rest == 3) accumulate_values<V, 3>(a, p, probs_stride, v_block, token_stride, tokens, head_size);
  if (rest == 2) accumulate_values<V, 2>(a, p, probs_stride, v_block, token_stride, tokens, head_size);
  if (rest == 1) accumulate_values<V, 1>(a, p, probs_stride, v_block, token_stride, tokens, head_size);
}

#ifdef LLM_CPU_AVX512_BF16
// q.k for bfloat16 q and K (head_size a multiple of 32): pairs of exact products summed in float32.
inline void dot_tokens_bf16(const uint16_t* q_row, const uint16_t* k_rows, int64_t token_stride, int count,
                            int head_size, float* scores) {
  __m512 acc[16];
  for (int j = 0; j < count; ++j) {
    const uint16_t* k = k_rows + j * token_stride;
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < head_size; c += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q_row + c), (__m512bh)_mm512_loadu_si512(k + c));
    acc[j] = a;
  }
  for (int j = count; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  _mm512_storeu_ps(scores, horizontal_sums16(acc));
}

// float32 probabilities [padded] -> bfloat16 pairs (p[2i], p[2i + 1]) as 32-bit words [padded / 2].
inline void probabilities_to_pairs(const float* probs, int padded, uint32_t* pairs) {
  for (int t = 0; t < padded; t += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + t / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs + t)));
}

// acc[h][d] += sum_t p[h][t] * v[t][d] with vdpbf16ps over token pairs: rows t and t + 1 of a
// 32-dim chunk interleaved into (v[t][d], v[t + 1][d]) words, times the broadcast pair
// (p[t], p[t + 1]). An odd last token pairs with itself; its partner's probability is 0.
template <int Heads>
inline void accumulate_values_bf16(float* acc, const uint32_t* pairs, int pairs_stride, const uint16_t* v_block,
                                   int64_t token_stride, int tokens, int head_size) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kInterleave);  // words: row t's d, row t + 1's d, for d = 0..15
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int c = 0; c < head_size; c += 32) {
    __m512 sums[Heads][2];
    for (int h = 0; h < Heads; ++h) {
      sums[h][0] = _mm512_loadu_ps(acc + h * head_size + c);
      sums[h][1] = _mm512_loadu_ps(acc + h * head_size + c + 16);
    }
    for (int t = 0; t < tokens; t += 2) {
      const __m512i a = _mm512_loadu_si512(v_block + t * token_stride + c);
      const __m512i b = t + 1 < tokens ? _mm512_loadu_si512(v_block + (t + 1) * token_stride + c) : a;
      const __m512bh v0 = (__m512bh)_mm512_permutex2var_epi16(a, low, b);
      const __m512bh v1 = (__m512bh)_mm512_permutex2var_epi16(a, high, b);
      for (int h = 0; h < Heads; ++h) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h * pairs_stride + t / 2]));
        sums[h][0] = _mm512_dpbf16_ps(sums[h][0], p, v0);
        sums[h][1] = _mm512_dpbf16_ps(sums[h][1], p, v1);
      }
    }
    for (int h = 0; h < Heads; ++h) {
      _mm512_storeu_ps(acc + h * head_size + c, sums[h][0]);
      _mm512_storeu_ps(acc + h * head_size + c + 16, sums[h][1]);
    }
  }
}

inline void accumulate_group_bf16(float* acc, const uint32_t* pairs, int pairs_stride, const uint16_t* v_block,
                                  int64_t token_stride, int tokens, int head_size, int group) {
  int g = 0;
  for (; g + 4 <= group; g += 4)
    accumulate_values_bf16<4>(acc + g * head_size, pairs + g * pairs_stride, pairs_stride, v_block, token_stride,
                              tokens, head_size);
  const int rest = group - g;
  float* a = acc + g * head_size;
  const uint32_t* p = pairs + g * pairs_stride;
  if (rest == 3) accumulate_values_bf16<3>(a, p, pairs_stride, v_block, token_stride, tokens, head_size);
  if (rest == 2) accumulate_values_bf16<2>(a, p, pairs_stride, v_block, token_stride, tokens, head_size);
  if (rest == 1) accumulate_values_bf16<1>(a, p, pairs_stride, v_block, token_stride, tokens, head_size);
}
#endif

template <typename V, typename T>
void decode_vec(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
                const int32_t* seq_lens, T* out, int num_seqs, int num_heads, int num_kv_heads, int head_size,
                int block_size, int max_blocks, float scale, int window) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * token_stride;
  const int64_t block_bytes = block_stride * static_cast<int64_t>(sizeof(T));
  const int part_blocks = kPartitionTokens > block_size ? kPartitionTokens / block_size : 1;
  // A partition's scores, padded to 16, plus 16: a block's last chunk of keys may write a whole vector.
  const int probs_stride = (part_blocks * block_size + 15) / 16 * 16 + 16;
#ifdef LLM_CPU_AVX512_BF16
  const bool bf16_dots = sizeof(T) == 2 && head_size % 32 == 0;
#endif

  // A sequence's window starts at position first(s); its partitions from the block holding it.
  const auto first_position = [&](int s) { return window > 0 && seq_lens[s] > window ? seq_lens[s] - window : 0; };
  // Work items: (sequence, partition), numbered sequence by sequence.
  std::vector<int> first_item(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) {
    const int blocks = (seq_lens[s] + block_size - 1) / block_size - first_position(s) / block_size;
    first_item[s + 1] = first_item[s] + (blocks + part_blocks - 1) / part_blocks;
  }
  const int num_items = first_item[num_seqs];
  const int64_t partial_floats = static_cast<int64_t>(num_heads) * (head_size + 2);
  std::vector<float> partials;  // only sequences split into partitions write here
  if (num_items > num_seqs) partials.resize(static_cast<size_t>(num_items) * partial_floats);

#pragma omp parallel
  {
    std::vector<float> q_buffer(static_cast<size_t>(num_heads) * head_size);
    std::vector<float> acc_buffer(static_cast<size_t>(num_heads) * head_size);
    std::vector<float> probs_buffer(static_cast<size_t>(num_heads) * probs_stride);
    std::vector<float> max_buffer(num_heads), sum_buffer(num_heads);
    std::vector<uint32_t> pairs_buffer(static_cast<size_t>(num_heads) * probs_stride / 2);
    float* q = q_buffer.data();
    float* acc = acc_buffer.data();
    float* probs = probs_buffer.data();
    float* row_max = max_buffer.data();
    float* row_sum = sum_buffer.data();
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < num_items; ++item) {
      const int s = static_cast<int>(std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin()) - 1;
      const int part = item - first_item[s];
      const bool split = first_item[s + 1] - first_item[s] > 1;
      const int seq_len = seq_lens[s];
      const int num_blocks = (seq_len + block_size - 1) / block_size;
      const int first = first_position(s);
      const int b_begin = first / block_size + part * part_blocks;
      const int b_end = b_begin + part_blocks < num_blocks ? b_begin + part_blocks : num_blocks;
      const int tokens = std::min(seq_len, b_end * block_size) - b_begin * block_size;
      const int masked = std::max(0, first - b_begin * block_size);  // the first block's positions before the window
      const int padded = (tokens + 15) / 16 * 16;
      const int32_t* table = block_tables + static_cast<int64_t>(s) * max_blocks;
      const T* q_seq = query + static_cast<int64_t>(s) * num_heads * head_size;
      for (int i = 0; i < num_heads * head_size; ++i) q[i] = load(q_seq[i]);
      // 1. every q.k of the partition (scores[head][t], t counted from the partition's start)
      for (int b = b_begin; b < b_end; ++b) {
        const T* next_block = b + 1 < b_end ? key_cache + table[b + 1] * block_stride
                                            : value_cache + table[b_begin] * block_stride;  // the values come next
        const T* k_block = key_cache + static_cast<int64_t>(table[b]) * block_stride;
        const int block_tokens = std::min(seq_len - b * block_size, block_size);
        const int offset = (b - b_begin) * block_size;
        const int t_begin = b == b_begin ? masked : 0;  // their scores are masked: not computed
        for (int head = 0; head < num_heads; ++head) {
          prefetch_slice(next_block, block_bytes, head, num_heads);
          const T* k_head = k_block + static_cast<int64_t>(head / group) * head_size;
          for (int t = t_begin; t < block_tokens; t += V::width) {
            const int count = block_tokens - t < V::width ? block_tokens - t : V::width;
            float* scores = probs + head * probs_stride + offset + t;
#ifdef LLM_CPU_AVX512_BF16
            if (bf16_dots) {
              dot_tokens_bf16(reinterpret_cast<const uint16_t*>(q_seq) + head * head_size,
                              reinterpret_cast<const uint16_t*>(k_head) + t * token_stride, token_stride, count,
                              head_size, scores);
              continue;
            }
#endif
            dot_tokens<V>(q + head * head_size, k_head + t * token_stride, token_stride, count, head_size, scores);
          }
        }
      }
      // 2. one softmax per head over the partition
      for (int head = 0; head < num_heads; ++head)
        softmax_row<V>(probs + head * probs_stride, masked, tokens, padded, scale, row_max[head], row_sum[head]);
      // 3. p.v, block by block
      std::fill(acc, acc + num_heads * head_size, 0.0f);
#ifdef LLM_CPU_AVX512_BF16
      const bool bf16_values = bf16_dots && block_size % 2 == 0;
      if (bf16_values)
        for (int head = 0; head < num_heads; ++head)
          probabilities_to_pairs(probs + head * probs_stride, padded, pairs_buffer.data() + head * (probs_stride / 2));
#endif
      for (int b = b_begin; b < b_end; ++b) {
        const T* next_values = b + 1 < b_end ? value_cache + table[b + 1] * block_stride : nullptr;
        const T* v_block = value_cache + static_cast<int64_t>(table[b]) * block_stride;
        const int block_tokens = std::min(seq_len - b * block_size, block_size);
        const int t_begin = b == b_begin ? masked : 0;  // rows before the window: probability 0, not read
        const int offset = (b - b_begin) * block_size;
        for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          if (next_values != nullptr) prefetch_slice(next_values, block_bytes, kv_head, num_kv_heads);
          const int first_head = kv_head * group;
          const T* v_head = v_block + static_cast<int64_t>(kv_head) * head_size;
#ifdef LLM_CPU_AVX512_BF16
          if (bf16_values) {  // from an even row: the pairs are (p[2i], p[2i + 1])
            const int t0 = t_begin & ~1;
            accumulate_group_bf16(acc + first_head * head_size,
                                  pairs_buffer.data() + first_head * (probs_stride / 2) + (offset + t0) / 2,
                                  probs_stride / 2, reinterpret_cast<const uint16_t*>(v_head + t0 * token_stride),
                                  token_stride, block_tokens - t0, head_size, group);
            continue;
          }
#endif
          accumulate_group<V>(acc + first_head * head_size, probs + first_head * probs_stride + offset + t_begin,
                              probs_stride, v_head + t_begin * token_stride, token_stride, block_tokens - t_begin,
                              head_size, group);
        }
      }
      if (!split) {
        finish_task(acc, row_sum, num_heads, head_size, out + static_cast<int64_t>(s) * num_heads * head_size);
      } else {
        float* partial = partials.data() + static_cast<int64_t>(item) * partial_floats;
        std::copy(acc, acc + num_heads * head_size, partial);
        std::copy(row_max, row_max + num_heads, partial + num_heads * head_size);
        std::copy(row_sum, row_sum + num_heads, partial + num_heads * head_size + num_heads);
      }
    }
    // Sequences split into partitions: merge each head's partials (rescaled to the common max).
#pragma omp for schedule(static)
    for (int s = 0; s < num_seqs; ++s) {
      const int parts = first_item[s + 1] - first_item[s];
      if (parts <= 1) continue;
      T* out_seq = out + static_cast<int64_t>(s) * num_heads * head_size;
      for (int head = 0; head < num_heads; ++head) {
        float maximum = -std::numeric_limits<float>::infinity();
        for (int p = 0; p < parts; ++p) {
          const float* partial = partials.data() + static_cast<int64_t>(first_item[s] + p) * partial_floats;
          maximum = std::max(maximum, partial[num_heads * head_size + head]);
        }
        float total = 0.0f;
        std::fill(acc, acc + head_size, 0.0f);
        for (int p = 0; p < parts; ++p) {
          const float* partial = partials.data() + static_cast<int64_t>(first_item[s] + p) * partial_floats;
          const float weight = std::exp(partial[num_heads * head_size + head] - maximum);
          total += partial[num_heads * head_size + num_heads + head] * weight;
          for (int d = 0; d < head_size; ++d) acc[d] += partial[head * head_size + d] * weight;
        }
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < head_size; ++d) store(out_seq + head * head_size + d, acc[d] * inverse);
      }
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

// dtype: 0 float32, 1 bfloat16; sliding_window: 0 for none.
void paged_decode(int dtype, const void* query, const void* key_cache, const void* value_cache,
                  const int32_t* block_tables, const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                  int num_kv_heads, int head_size, int block_size, int max_blocks, float scale,
                  int sliding_window) {
#ifdef LLM_CPU_AVX2
  if (head_size % Vec::width == 0) {
    if (dtype == 0) {
      decode_vec<Vec>(static_cast<const float*>(query), static_cast<const float*>(key_cache),
                      static_cast<const float*>(value_cache), block_tables, seq_lens, static_cast<float*>(out),
                      num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale, sliding_window);
    } else {
      decode_vec<Vec>(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
                      static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, static_cast<uint16_t*>(out),
                      num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale, sliding_window);
    }
    return;
  }
#endif
  if (dtype == 0) {
    decode(static_cast<const float*>(query), static_cast<const float*>(key_cache),
           static_cast<const float*>(value_cache), block_tables, seq_lens, static_cast<float*>(out), num_seqs,
           num_heads, num_kv_heads, head_size, block_size, max_blocks, scale, sliding_window);
  } else {
    decode(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
           static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, static_cast<uint16_t*>(out),
           num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale, sliding_window);
  }
}

}  // extern "C"
