// Prefill attention on CPU: the new tokens of each prompt chunk attend causally over the whole
// context, cached prefix included, read in place from the paged KV cache (this step's K/V are
// already written there). Flash-attention style: a work item is one (sequence, KV head, tile of
// up to kQueryTile query tokens); its rows are the tile's tokens x the KV head's query heads
// (GQA: one pass over K/V serves them all); keys stream by in tiles of 16 with an online softmax.
// Needs AVX-512 (the Python side falls back to torch's SDPA without it).
//
//   query        [num_tokens, num_heads, head_size]                 float32 or bfloat16
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size]   same dtype
//   value_cache  [num_blocks, block_size, num_kv_heads, head_size]   same dtype
//   block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
//   query_start_loc [num_seqs + 1] int32 (sequence s owns query rows query_start_loc[s]..[s+1])
//   out          [num_tokens, num_heads, head_size]                 same dtype (prefill rows only)
//
// Sequence s's new tokens sit at positions seq_lens[s] - query_len .. seq_lens[s] - 1; the token
// at position p sees keys 0..p.
//
// Two inner products, chosen by dtype and CPU:
//   * bfloat16 with AVX512_BF16: S = QK^T and O += PV with vdpbf16ps (pairs of exact bf16
//     products summed in float32). K is transposed per tile into (k[j][d], k[j][d+1]) words, one
//     register per dimension pair holding the 16 keys; V rows are interleaved into
//     (v[j][d], v[j+1][d]) words; P is rounded to bfloat16 first, as torch's CPU flash attention
//     and transformers' eager attention round it.
//   * otherwise (float32, or bfloat16 without AVX512_BF16): float32 FMAs, K transposed into one
//     register per dimension holding the 16 keys, P kept in float32.
// Softmax state (running max and sum per row) and the output accumulators are float32.

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#ifdef LLM_CPU_AVX512
namespace {

using namespace llm_cpu;

constexpr int kKeyTile = 16;
constexpr int kQueryTile = 16;
constexpr int kMaxHeadSize = 256;  // the decode kernel's limit too (paged_decode_max_head_size)

// Where key `j` of the tile starting at `k0` lives, for one KV head.
template <typename T>
struct KeyRows {
  const T* cache;
  const int32_t* table;
  int block_size;
  int64_t block_stride, token_stride, head_offset;
  const T* row(int position) const {
    return cache + static_cast<int64_t>(table[position / block_size]) * block_stride +
           static_cast<int64_t>(position % block_size) * token_stride + head_offset;
  }
};

// The tile's rows: `count` query tokens x `group` query heads, token-major; position of row r's token.
struct Tile {
  int rows;
  int group;
  int first_position;  // of the tile's first query token
  int position(int r) const { return first_position + r / group; }
};

// Online softmax over one key tile for every row: scores [rows][16] become probabilities, the
// running max/sum advance, and rows whose max grew get their accumulators rescaled.
inline void softmax_tile(float* scores, const Tile& tile, int k0, int keys, float scale, float* row_max,
                         float* row_sum, float* acc, int head_size) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < tile.rows; ++r) {
    float* s = scores + r * kKeyTile;
    const int visible = std::min(keys, tile.position(r) - k0 + 1);  // keys k0 .. position
    const __mmask16 allowed = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(visible));
    const __m512 x = _mm512_mask_mov_ps(minus_infinity, allowed, _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(scale)));
    const float tile_max = _mm512_reduce_max_ps(x);
    if (tile_max > row_max[r]) {  // exp(-inf) = 0 at the start; no rescale while the max holds
      const float correction = std::exp(row_max[r] - tile_max);
      row_sum[r] *= correction;
      const __m512 c = _mm512_set1_ps(correction);
      float* a = acc + r * head_size;
      for (int d = 0; d < head_size; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), c));
      row_max[r] = tile_max;
    }
    const __m512 p = exp16(_mm512_sub_ps(x, _mm512_set1_ps(row_max[r])));  // exactly 0 where masked
    _mm512_storeu_ps(s, p);
    row_sum[r] += _mm512_reduce_add_ps(p);
  }
}

// ---- float32 inner products (float32 caches; bfloat16 without AVX512_BF16) ----------------------

// scores[r][j] = q[r] . k[j] for `Rows` rows, with kt[d] = the 16 keys' d-th values.
template <int Rows>
inline void scores_fp32_rows(const float* q, const __m512* kt, int head_size, float* scores) {
  __m512 s[Rows];
  for (int r = 0; r < Rows; ++r) s[r] = _mm512_setzero_ps();
  for (int d = 0; d < head_size; ++d)
    for (int r = 0; r < Rows; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_size + d]), kt[d], s[r]);
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(scores + r * kKeyTile, s[r]);
}

inline void scores_fp32(const float* q, const __m512* kt, int rows, int head_size, float* scores) {
  int r = 0;
  for (; r + 8 <= rows; r += 8) scores_fp32_rows<8>(q + r * head_size, kt, head_size, scores + r * kKeyTile);
  for (; r + 4 <= rows; r += 4) scores_fp32_rows<4>(q + r * head_size, kt, head_size, scores + r * kKeyTile);
  for (; r < rows; ++r) scores_fp32_rows<1>(q + r * head_size, kt, head_size, scores + r * kKeyTile);
}

// acc[r] += sum_j p[r][j] v[j] for `Rows` rows over `Chunks` chunks of 16 dims from dim d0; v holds
// float32 rows [16][head_size].
template <int Rows, int Chunks>
inline void values_fp32_rows(const float* probs, const float* v, int keys, int d0, int head_size, float* acc) {
  __m512 sums[Rows][Chunks];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm512_loadu_ps(acc + r * head_size + d0 + 16 * c);
  for (int j = 0; j < keys; ++j) {
    __m512 values[Chunks];
    for (int c = 0; c < Chunks; ++c) values[c] = _mm512_loadu_ps(v + j * head_size + d0 + 16 * c);
    for (int r = 0; r < Rows; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * kKeyTile + j]);
      for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm512_fmadd_ps(p, values[c], sums[r][c]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + r * head_size + d0 + 16 * c, sums[r][c]);
}

// acc[r] += sum_j p[r][j] v[j] for every row.
inline void values_fp32(const float* probs, const float* v, int keys, int rows, int head_size, float* acc) {
  for (int d0 = 0; d0 < head_size; d0 += 64) {
    const bool four = head_size - d0 >= 64;
    for (int r = 0; r < rows;) {
      const float* p = probs + r * kKeyTile;
      float* a = acc + r * head_size;
      if (rows - r >= 4 && four) { values_fp32_rows<4, 4>(p, v, keys, d0, head_size, a); r += 4; continue; }
      if (four) { values_fp32_rows<1, 4>(p, v, keys, d0, head_size, a); r += 1; continue; }
      for (int d = d0; d < head_size; d += 16) {  // the last 16-48 dims
        const float* pr = p;
        __m512 sum = _mm512_loadu_ps(a + d);
        for (int j = 0; j < keys; ++j) sum = _mm512_fmadd_ps(_mm512_set1_ps(pr[j]), _mm512_loadu_ps(v + j * head_size + d), sum);
        _mm512_storeu_ps(a + d, sum);
      }
      r += 1;
    }
  }
}

template <typename T>
void prefill_item_fp32(const T* query, const KeyRows<T>& keys_at, const KeyRows<T>& values_at, T* out, int q_row0,
                       int num_heads, int head_size, const Tile& tile, int first_head, float scale,
                       std::vector<float>& scratch) {
  const int rows = tile.rows, group = tile.group;
  // scratch: q [rows][head_size] | acc [rows][head_size] | scores [rows][16] | v [16][head_size] | max, sum [rows]
  scratch.resize(static_cast<size_t>(rows) * head_size * 2 + rows * kKeyTile + kKeyTile * head_size + 2 * rows + 16);
  float* q = scratch.data();
  float* acc = q + rows * head_size;
  float* scores = acc + rows * head_size;
  float* v = scores + rows * kKeyTile;
  float* row_max = v + kKeyTile * head_size;
  float* row_sum = row_max + rows;
  for (int r = 0; r < rows; ++r) {
    const T* src = query + (static_cast<int64_t>(q_row0 + r / group) * num_heads + first_head + r % group) * head_size;
    for (int d = 0; d < head_size; ++d) q[r * head_size + d] = load(src[d]);
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
  }
  std::fill(acc, acc + rows * head_size, 0.0f);
  __m512 kt[kMaxHeadSize];
  const int last_position = tile.position(rows - 1);
  for (int k0 = 0; k0 <= last_position; k0 += kKeyTile) {
    const int keys = std::min(kKeyTile, last_position + 1 - k0);
    for (int d0 = 0; d0 < head_size; d0 += 16) {  // transpose 16 keys x 16 dims at a time
      __m512i block[16];
      for (int j = 0; j < 16; ++j)
        block[j] = j < keys ? _mm512_castps_si512(load16(keys_at.row(k0 + j) + d0)) : _mm512_setzero_si512();
      transpose16(block);
      for (int d = 0; d < 16; ++d) kt[d0 + d] = _mm512_castsi512_ps(block[d]);
    }
    scores_fp32(q, kt, rows, head_size, scores);
    softmax_tile(scores, tile, k0, keys, scale, row_max, row_sum, acc, head_size);
    for (int j = 0; j < keys; ++j) {
      const T* src = values_at.row(k0 + j);
      for (int d = 0; d < head_size; d += 16) _mm512_storeu_ps(v + j * head_size + d, load16(src + d));
    }
    values_fp32(scores, v, keys, rows, head_size, acc);
  }
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (static_cast<int64_t>(q_row0 + r / group) * num_heads + first_head + r % group) * head_size;
    const float inverse = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    for (int d = 0; d < head_size; ++d) store(dst + d, acc[r * head_size + d] * inverse);
  }
}

#ifdef LLM_CPU_AVX512_BF16
// ---- bfloat16 inner products with vdpbf16ps ------------------------------------------------------

// scores[r][j] = q[r] . k[j] for `Rows` rows; q holds (q[d], q[d+1]) words [rows][pairs], kp[i] the
// 16 keys' (k[j][2i], k[j][2i+1]) words. Rows independent accumulators keep vdpbf16ps's latency hidden.
template <int Rows>
inline void scores_bf16_rows(const uint32_t* q, const __m512bh* kp, int pairs, float* scores) {
  __m512 s[Rows];
  for (int r = 0; r < Rows; ++r) s[r] = _mm512_setzero_ps();
  for (int i = 0; i < pairs; ++i)
    for (int r = 0; r < Rows; ++r)
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + i])), kp[i]);
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(scores + r * kKeyTile, s[r]);
}

inline void scores_bf16(const uint32_t* q, const __m512bh* kp, int rows, int pairs, float* scores) {
  int r = 0;
  for (; r + 8 <= rows; r += 8) scores_bf16_rows<8>(q + r * pairs, kp, pairs, scores + r * kKeyTile);
  for (; r + 4 <= rows; r += 4) scores_bf16_rows<4>(q + r * pairs, kp, pairs, scores + r * kKeyTile);
  for (; r < rows; ++r) scores_bf16_rows<1>(q + r * pairs, kp, pairs, scores + r * kKeyTile);
}

// acc[r] += sum_j p[r][j] v[j] for `Rows` rows over 4 chunks of 16 dims starting at chunk c0;
// vp[j2 * chunks + c] holds (v[2 j2][d], v[2 j2 + 1][d]) for the dims d of chunk c, p_pairs[r] the
// row's probabilities as bfloat16 pairs.
template <int Rows, int Chunks>
inline void values_bf16_rows(const uint32_t* p_pairs, const __m512bh* vp, int key_pairs, int chunks, int c0,
                             float* acc, int head_size) {
  __m512 sums[Rows][Chunks];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm512_loadu_ps(acc + r * head_size + 16 * (c0 + c));
  for (int j2 = 0; j2 < key_pairs; ++j2) {
    for (int r = 0; r < Rows; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[r * 8 + j2]));
      for (int c = 0; c < Chunks; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], p, vp[j2 * chunks + c0 + c]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + r * head_size + 16 * (c0 + c), sums[r][c]);
}

// acc[r] += sum_j p[r][j] v[j] for every row; probs are float32 [rows][16], rounded to bfloat16 pairs here.
inline void values_bf16(const float* probs, const __m512bh* vp, int key_pairs, int rows, int head_size, float* acc,
                        uint32_t* p_pairs) {
  const int chunks = head_size / 16;
  for (int r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + r * 8),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs + r * kKeyTile)));
  for (int c0 = 0; c0 < chunks; c0 += 4) {
    int r = 0;
    if (chunks - c0 >= 4) {
      for (; r + 2 <= rows; r += 2)
        values_bf16_rows<2, 4>(p_pairs + r * 8, vp, key_pairs, chunks, c0, acc + r * head_size, head_size);
      for (; r < rows; ++r) values_bf16_rows<1, 4>(p_pairs + r * 8, vp, key_pairs, chunks, c0, acc + r * head_size, head_size);
    } else {
      for (; r + 2 <= rows; r += 2)
        values_bf16_rows<2, 2>(p_pairs + r * 8, vp, key_pairs, chunks, c0, acc + r * head_size, head_size);
      for (; r < rows; ++r) values_bf16_rows<1, 2>(p_pairs + r * 8, vp, key_pairs, chunks, c0, acc + r * head_size, head_size);
    }
  }
}

void prefill_item_bf16(const uint16_t* query, const KeyRows<uint16_t>& keys_at, const KeyRows<uint16_t>& values_at,
                       uint16_t* out, int q_row0, int num_heads, int head_size, const Tile& tile, int first_head,
                       float scale, std::vector<float>& scratch) {
  const int rows = tile.rows, group = tile.group, pairs = head_size / 2, chunks = head_size / 16;
  // scratch (floats): q pairs [rows][pairs] | acc [rows][head_size] | scores [rows][16] | max, sum [rows]
  // | p pairs [rows][8]
  scratch.resize(static_cast<size_t>(rows) * pairs + rows * head_size + rows * kKeyTile + 2 * rows + rows * 8 + 16);
  uint32_t* q = reinterpret_cast<uint32_t*>(scratch.data());
  float* acc = scratch.data() + rows * pairs;
  float* scores = acc + rows * head_size;
  float* row_max = scores + rows * kKeyTile;
  float* row_sum = row_max + rows;
  uint32_t* p_pairs = reinterpret_cast<uint32_t*>(row_sum + rows);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* src = query + (static_cast<int64_t>(q_row0 + r / group) * num_heads + first_head + r % group) * head_size;
    std::memcpy(q + r * pairs, src, head_size * sizeof(uint16_t));
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
  }
  std::fill(acc, acc + rows * head_size, 0.0f);
  __m512bh kp[kMaxHeadSize / 2], vp[8 * (kMaxHeadSize / 16)];
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kInterleave);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const int last_position = tile.position(rows - 1);
  for (int k0 = 0; k0 <= last_position; k0 += kKeyTile) {
    const int keys = std::min(kKeyTile, last_position + 1 - k0);
    const uint16_t* key_row[kKeyTile];
    const uint16_t* value_row[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) {  // rows past `keys` repeat the last one (finite; their p is 0)
      key_row[j] = keys_at.row(k0 + std::min(j, keys - 1));
      value_row[j] = values_at.row(k0 + std::min(j, keys - 1));
    }
    for (int i0 = 0; i0 < pairs; i0 += 16) {  // transpose 16 keys x 16 dimension pairs at a time
      __m512i block[16];
      for (int j = 0; j < 16; ++j) block[j] = _mm512_loadu_si512(key_row[j] + 2 * i0);
      transpose16(block);
      for (int i = 0; i < 16 && i0 + i < pairs; ++i) kp[i0 + i] = (__m512bh)block[i];
    }
    scores_bf16(q, kp, rows, pairs, scores);
    softmax_tile(scores, tile, k0, keys, scale, row_max, row_sum, acc, head_size);
    const int key_pairs = (keys + 1) / 2;
    for (int j2 = 0; j2 < key_pairs; ++j2) {
      for (int c = 0; c < chunks; c += 2) {  // 32 dims of rows 2 j2 and 2 j2 + 1 -> two chunks of pairs
        const __m512i a = _mm512_loadu_si512(value_row[2 * j2] + 16 * c);
        const __m512i b = _mm512_loadu_si512(value_row[2 * j2 + 1] + 16 * c);
        vp[j2 * chunks + c] = (__m512bh)_mm512_permutex2var_epi16(a, low, b);
        vp[j2 * chunks + c + 1] = (__m512bh)_mm512_permutex2var_epi16(a, high, b);
      }
    }
    values_bf16(scores, vp, key_pairs, rows, head_size, acc, p_pairs);
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst = out + (static_cast<int64_t>(q_row0 + r / group) * num_heads + first_head + r % group) * head_size;
    const __m512 inverse = _mm512_set1_ps(row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f);
    for (int d = 0; d < head_size; d += 16) Avx512::store(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * head_size + d), inverse));
  }
}
#endif  // LLM_CPU_AVX512_BF16

template <typename T>
void prefill(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
             const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int first_seq, int num_seqs,
             int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks, float scale) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * token_stride;
  // Work items: (sequence, query tile, KV head), the tiles with the most keys first.
  struct Item {
    int seq, tile_start, tile_tokens, kv_head;
  };
  std::vector<Item> items;
  for (int s = first_seq; s < num_seqs; ++s) {
    const int query_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int t = 0; t < query_len; t += kQueryTile)
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({s, t, std::min(kQueryTile, query_len - t), h});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int pa = seq_lens[a.seq] - (query_start_loc[a.seq + 1] - query_start_loc[a.seq]) + a.tile_start;
    const int pb = seq_lens[b.seq] - (query_start_loc[b.seq + 1] - query_start_loc[b.seq]) + b.tile_start;
    return pa > pb;
  });
#ifdef LLM_CPU_AVX512_BF16
  const bool bf16_dots = sizeof(T) == 2 && head_size % 32 == 0;
#endif
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& item = items[i];
      const int s = item.seq;
      const int query_len = query_start_loc[s + 1] - query_start_loc[s];
      const Tile tile{item.tile_tokens * group, group, seq_lens[s] - query_len + item.tile_start};
      const int32_t* table = block_tables + static_cast<int64_t>(s) * max_blocks;
      const int64_t head_offset = static_cast<int64_t>(item.kv_head) * head_size;
      const KeyRows<T> keys_at{key_cache, table, block_size, block_stride, token_stride, head_offset};
      const KeyRows<T> values_at{value_cache, table, block_size, block_stride, token_stride, head_offset};
      const int q_row0 = query_start_loc[s] + item.tile_start;
#ifdef LLM_CPU_AVX512_BF16
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (bf16_dots) {
          prefill_item_bf16(query, keys_at, values_at, out, q_row0, num_heads, head_size, tile, item.kv_head * group,
                            scale, scratch);
          continue;
        }
      }
#endif
      prefill_item_fp32(query, keys_at, values_at, out, q_row0, num_heads, head_size, tile, item.kv_head * group,
                        scale, scratch);
    }
  }
}

}  // namespace
#endif  // LLM_CPU_AVX512

extern "C" {

// Whether this build has the prefill kernel (AVX-512), and the head sizes it takes (a multiple of 16).
int paged_prefill_available() {
#ifdef LLM_CPU_AVX512
  return 1;
#else
  return 0;
#endif
}

// dtype: 0 float32, 1 bfloat16. Sequences first_seq .. num_seqs - 1 of the tables are prefills.
void paged_prefill(int dtype, const void* query, const void* key_cache, const void* value_cache,
                   const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc, void* out,
                   int first_seq, int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                   int max_blocks, float scale) {
#ifdef LLM_CPU_AVX512
  if (dtype == 0) {
    prefill(static_cast<const float*>(query), static_cast<const float*>(key_cache),
            static_cast<const float*>(value_cache), block_tables, seq_lens, query_start_loc, static_cast<float*>(out),
            first_seq, num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale);
  } else {
    prefill(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
            static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, query_start_loc,
            static_cast<uint16_t*>(out), first_seq, num_seqs, num_heads, num_kv_heads, head_size, block_size,
            max_blocks, scale);
  }
#else
  (void)dtype, (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)seq_lens;
  (void)query_start_loc, (void)out, (void)first_seq, (void)num_seqs, (void)num_heads, (void)num_kv_heads;
  (void)head_size, (void)block_size, (void)max_blocks, (void)scale;
#endif
}

}  // extern "C"
