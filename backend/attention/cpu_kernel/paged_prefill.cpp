// Prefill attention on CPU: the new tokens of each prompt chunk attend causally over the whole
// context, cached prefix included, read in place from the paged KV cache (this step's K/V are
// already written there). Flash-attention style with the query rows in vector lanes: a work item
// is 16 query rows of one (sequence, KV head), the rows being the chunk's tokens x the KV head's
// query heads (GQA: the group shares every K/V row it reads); keys stream by in tiles of 16 with
// an online softmax kept per lane, so the softmax is vector arithmetic across the 16 rows (no
// horizontal reductions, no per-row scalar code: the first version, with keys in lanes, spent
// more time in per-row softmax chains than in its dot products). Needs AVX-512 (the Python side
// falls back to torch's SDPA without it).
//
//   query        [num_tokens, num_heads, head_size]                 float32 or bfloat16
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size]   same dtype
//   value_cache  [num_blocks, block_size, num_kv_heads, head_size]   same dtype
//   block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
//   query_start_loc [num_seqs + 1] int32 (sequence s owns query rows query_start_loc[s]..[s+1])
//   out          [num_tokens, num_heads, head_size]                 same dtype (prefill rows only)
//
// Sequence s's new tokens sit at positions seq_lens[s] - query_len .. seq_lens[s] - 1; the token
// at position p sees keys 0..p, or with a sliding window W > 0 keys p - W + 1..p: a work item's keys
// then start at its first row's window, and each lane masks the keys before its own.
//
// Two inner products, chosen by dtype and CPU:
//   * bfloat16 with AVX512_BF16: S = QK^T and O += PV with vdpbf16ps (pairs of exact bf16
//     products summed in float32). Q is transposed once per item into one register per pair of
//     dimensions (the 16 rows' (q[d], q[d+1]) words); each key's (k[d], k[d+1]) word is broadcast
//     straight from the cache. V rows are interleaved into (v[j][d], v[j+1][d]) words and P into
//     (p[j], p[j+1]) words per lane, P rounded to bfloat16 first, as torch's CPU flash attention and
//     transformers' eager attention round it.
//   * otherwise (float32, or bfloat16 without AVX512_BF16): float32 FMAs, Q transposed into one
//     register per dimension, K and V values broadcast, P kept in float32.
// Softmax state (running max and sum per lane) and the output accumulators (O transposed: one
// register of 16 rows per dimension) are float32.

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#ifdef LLM_CPU_AVX512
namespace {

using namespace llm_cpu;

constexpr int kLanes = 16;    // query rows per work item
constexpr int kKeyTile = 16;  // keys per step of the online softmax
constexpr int kMaxHeadSize = 256;  // the decode kernel's limit too (paged_decode_max_head_size)

// Where the key (or value) at `position` lives, for one KV head.
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

inline __m512 broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline __m512 broadcast(const uint16_t* p) { return _mm512_set1_ps(bf16_to_float(*p)); }
inline __m512i broadcast_word(const uint16_t* p) {  // the 32-bit word of two bf16 at p
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(static_cast<int>(word));
}

// One work item's state: 16 lanes (query rows), their positions, and the output pointers.
template <typename T>
struct LaneRows {
  const T* q[kLanes];
  T* out[kLanes];
  __m512i positions;
  __m512i window_starts;  // with a sliding window: each lane's first key (position - W + 1)
  bool windowed;
  int valid;          // lanes holding real rows; the rest repeat the last one
  int first_key;      // the nearest key any lane sees (0 without a window)
  int last_position;  // the furthest key any lane sees
};

// Online-softmax step for the 16 lanes over one key tile: scores s[j] (lanes = rows) become
// probabilities and the running max and sum advance. Returns whether some lane's max grew, with
// `correction` the factor that lane's output must be scaled by (1 elsewhere); the product with V
// applies it as it loads the accumulators. With a window, every lane's first key lies in the item's
// first tile (its rows are at most 16 consecutive positions, the tiles start at the first row's
// window), so no lane's max is still -inf after that tile, as without a window.
inline bool softmax_tile(__m512* s, int keys, int k0, __m512i positions, bool windowed, __m512i window_starts,
                         float scale, __m512& row_max, __m512& row_sum, __m512& correction) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 tile_max = minus_infinity;
  for (int j = 0; j < kKeyTile; ++j) {
    const __m512i key = _mm512_set1_epi32(k0 + j);
    __mmask16 allowed = j < keys ? _mm512_cmpge_epi32_mask(positions, key) : 0;
    if (windowed) allowed = _mm512_mask_cmple_epi32_mask(allowed, window_starts, key);
    s[j] = _mm512_mask_mul_ps(minus_infinity, allowed, s[j], scale_v);
    tile_max = _mm512_max_ps(tile_max, s[j]);
  }
  const __m512 new_max = _mm512_max_ps(row_max, tile_max);
  const bool grew = _mm512_cmp_ps_mask(new_max, row_max, _CMP_GT_OQ) != 0;
  if (grew) {
    correction = exp16(_mm512_sub_ps(row_max, new_max));  // exp(-inf) = 0 at the start
    row_sum = _mm512_mul_ps(row_sum, correction);
    row_max = new_max;
  }
  for (int j = 0; j < kKeyTile; ++j) {
    s[j] = exp16(_mm512_sub_ps(s[j], row_max));  // exactly 0 where masked
    row_sum = _mm512_add_ps(row_sum, s[j]);
  }
  return grew;
}

// acc = out_t's 16 dimensions from d0, rescaled when the max grew.
inline void load_accumulators(const float* out_t, int d0, bool rescale, __m512 correction, __m512* acc) {
  for (int dd = 0; dd < 16; ++dd) {
    acc[dd] = _mm512_load_ps(out_t + (d0 + dd) * kLanes);
    if (rescale) acc[dd] = _mm512_mul_ps(acc[dd], correction);
  }
}

#ifdef LLM_CPU_AVX512_BF16
// s[j] += q . k[j] for `Keys` keys (all 16 but in a context's last tile), q transposed into words.
template <int Keys>
inline void scores_bf16(const __m512i* q_t, int q_words, const uint16_t* const* key_row, __m512* s) {
  for (int i = 0; i < q_words; ++i) {
    const __m512bh q = (__m512bh)q_t[i];
    for (int j = 0; j < Keys; ++j) s[j] = _mm512_dpbf16_ps(s[j], q, (__m512bh)broadcast_word(key_row[j] + 2 * i));
  }
}
#endif

// The same in float32 (q transposed per dimension, keys broadcast one value at a time).
template <int Keys, typename T>
inline void scores_fp32(const __m512i* q_t, int head_size, const T* const* key_row, __m512* s) {
  for (int d = 0; d < head_size; ++d) {
    const __m512 q = _mm512_castsi512_ps(q_t[d]);
    for (int j = 0; j < Keys; ++j) s[j] = _mm512_fmadd_ps(q, broadcast(key_row[j] + d), s[j]);
  }
}

template <typename T>
void prefill_item(const LaneRows<T>& lanes, const KeyRows<T>& keys_at, const KeyRows<T>& values_at, int head_size,
                  float scale, bool bf16_dots) {
  alignas(64) float out_t[kMaxHeadSize * kLanes];  // O transposed: out_t[d * 16 + lane]
  alignas(64) __m512i q_t[kMaxHeadSize];          // Q transposed: per dimension (or pair of dimensions)
  alignas(64) uint32_t value_words[(kKeyTile / 2) * kMaxHeadSize];  // (v[2i][d], v[2i+1][d]) per pair i
  std::fill(out_t, out_t + head_size * kLanes, 0.0f);
  const int q_words = bf16_dots ? head_size / 2 : head_size;
  for (int w0 = 0; w0 < q_words; w0 += 16) {  // transpose 16 lanes x 16 words at a time
    __m512i block[16];
    for (int l = 0; l < kLanes; ++l)
      block[l] = bf16_dots ? _mm512_loadu_si512(lanes.q[l] + 2 * w0) : _mm512_castps_si512(load16(lanes.q[l] + w0));
    transpose16(block);
    for (int i = 0; i < 16; ++i) q_t[w0 + i] = block[i];
  }
  __m512 row_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 row_sum = _mm512_setzero_ps();
  for (int k0 = lanes.first_key; k0 <= lanes.last_position; k0 += kKeyTile) {
    const int keys = std::min(kKeyTile, lanes.last_position + 1 - k0);
    const T* key_row[kKeyTile];
    const T* value_row[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) {  // rows past `keys` repeat the last one (finite; their p is 0)
      key_row[j] = keys_at.row(k0 + std::min(j, keys - 1));
      value_row[j] = values_at.row(k0 + std::min(j, keys - 1));
    }
    __m512 s[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) s[j] = _mm512_setzero_ps();
    // Always all 16 keys, loops of known length: in a context's last tile the rows past `keys`
    // repeat the last key and are masked (their p is exactly 0).
#ifdef LLM_CPU_AVX512_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (bf16_dots) scores_bf16<kKeyTile>(q_t, q_words, key_row, s);
    }
#endif
    if (!bf16_dots) scores_fp32<kKeyTile>(q_t, head_size, key_row, s);
    __m512 correction = _mm512_set1_ps(1.0f);
    const bool rescale = softmax_tile(s, keys, k0, lanes.positions, lanes.windowed, lanes.window_starts, scale,
                                      row_max, row_sum, correction);
#ifdef LLM_CPU_AVX512_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (bf16_dots) {
        alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
        const __m512i low = _mm512_load_si512(kInterleave);
        const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
        const int pairs = (keys + 1) / 2;
        __m512bh p[kKeyTile / 2];  // per lane, the (p[2i], p[2i+1]) word
        for (int i = 0; i < pairs; ++i) {
          const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[2 * i]));
          const __m512i odd = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[2 * i + 1]));
          p[i] = (__m512bh)_mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
          for (int c = 0; c < head_size; c += 32) {
            const __m512i a = _mm512_loadu_si512(value_row[2 * i] + c);
            const __m512i b = _mm512_loadu_si512(value_row[2 * i + 1] + c);
            _mm512_store_si512(value_words + i * head_size + c, _mm512_permutex2var_epi16(a, low, b));
            _mm512_store_si512(value_words + i * head_size + c + 16, _mm512_permutex2var_epi16(a, high, b));
          }
        }
        for (int d0 = 0; d0 < head_size; d0 += 16) {
          __m512 acc[16];
          load_accumulators(out_t, d0, rescale, correction, acc);
          for (int i = 0; i < pairs; ++i)
            for (int dd = 0; dd < 16; ++dd)
              acc[dd] = _mm512_dpbf16_ps(acc[dd], p[i],
                                         (__m512bh)_mm512_set1_epi32(static_cast<int>(value_words[i * head_size + d0 + dd])));
          for (int dd = 0; dd < 16; ++dd) _mm512_store_ps(out_t + (d0 + dd) * kLanes, acc[dd]);
        }
      }
    }
#endif
    if (!bf16_dots) {
      for (int d0 = 0; d0 < head_size; d0 += 16) {
        __m512 acc[16];
        load_accumulators(out_t, d0, rescale, correction, acc);
        for (int j = 0; j < kKeyTile; ++j)
          for (int dd = 0; dd < 16; ++dd) acc[dd] = _mm512_fmadd_ps(s[j], broadcast(value_row[j] + d0 + dd), acc[dd]);
        for (int dd = 0; dd < 16; ++dd) _mm512_store_ps(out_t + (d0 + dd) * kLanes, acc[dd]);
      }
    }
  }
  const __m512 inverse = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(row_sum, _mm512_setzero_ps(), _CMP_GT_OQ),
                                             _mm512_set1_ps(1.0f), row_sum);
  for (int d0 = 0; d0 < head_size; d0 += 16) {  // back to rows: transpose 16 dims x 16 lanes
    __m512i block[16];
    for (int dd = 0; dd < 16; ++dd)
      block[dd] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(out_t + (d0 + dd) * kLanes), inverse));
    transpose16(block);
    for (int l = 0; l < lanes.valid; ++l) Avx512::store(lanes.out[l] + d0, _mm512_castsi512_ps(block[l]));
  }
}

template <typename T>
void prefill(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
             const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int first_seq, int num_seqs,
             int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks, float scale,
             int window) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * token_stride;
  const int64_t row_stride = static_cast<int64_t>(num_heads) * head_size;
  // Work items: 16 query rows of one (sequence, KV head), rows = the chunk's tokens x the group's
  // query heads, token-major; the items that see the most keys first.
  struct Item {
    int seq, kv_head, first_row, first_key, last_position;
  };
  std::vector<Item> items;
  for (int s = first_seq; s < num_seqs; ++s) {
    const int query_len = query_start_loc[s + 1] - query_start_loc[s];
    const int first_position = seq_lens[s] - query_len;
    const int rows = query_len * group;
    for (int h = 0; h < num_kv_heads; ++h)
      for (int r = 0; r < rows; r += kLanes) {
        const int first_key = window > 0 ? std::max(0, first_position + r / group - window + 1) : 0;
        items.push_back({s, h, r, first_key, first_position + (std::min(r + kLanes, rows) - 1) / group});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.last_position - a.first_key > b.last_position - b.first_key;
  });
#ifdef LLM_CPU_AVX512_BF16
  const bool bf16_dots = sizeof(T) == 2 && head_size % 32 == 0;
#else
  const bool bf16_dots = false;
#endif
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    const int s = item.seq;
    const int query_len = query_start_loc[s + 1] - query_start_loc[s];
    const int first_position = seq_lens[s] - query_len;
    const int rows = query_len * group;
    LaneRows<T> lanes;
    lanes.valid = std::min(kLanes, rows - item.first_row);
    lanes.first_key = item.first_key;
    lanes.last_position = item.last_position;
    lanes.windowed = window > 0;
    alignas(64) int32_t positions[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int r = item.first_row + std::min(l, lanes.valid - 1);
      const int token = r / group;
      const int64_t offset = (static_cast<int64_t>(query_start_loc[s]) + token) * row_stride +
                             static_cast<int64_t>(item.kv_head * group + r % group) * head_size;
      lanes.q[l] = query + offset;
      lanes.out[l] = out + offset;
      positions[l] = first_position + token;
    }
    lanes.positions = _mm512_load_si512(positions);
    lanes.window_starts = _mm512_sub_epi32(lanes.positions, _mm512_set1_epi32(window - 1));
    const int32_t* table = block_tables + static_cast<int64_t>(s) * max_blocks;
    const int64_t head_offset = static_cast<int64_t>(item.kv_head) * head_size;
    const KeyRows<T> keys_at{key_cache, table, block_size, block_stride, token_stride, head_offset};
    const KeyRows<T> values_at{value_cache, table, block_size, block_stride, token_stride, head_offset};
    prefill_item(lanes, keys_at, values_at, head_size, scale, bf16_dots);
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
// sliding_window: 0 for none.
void paged_prefill(int dtype, const void* query, const void* key_cache, const void* value_cache,
                   const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc, void* out,
                   int first_seq, int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                   int max_blocks, float scale, int sliding_window) {
#ifdef LLM_CPU_AVX512
  if (dtype == 0) {
    prefill(static_cast<const float*>(query), static_cast<const float*>(key_cache),
            static_cast<const float*>(value_cache), block_tables, seq_lens, query_start_loc, static_cast<float*>(out),
            first_seq, num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, scale, sliding_window);
  } else {
    prefill(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
            static_cast<const uint16_t*>(value_cache), block_tables, seq_lens, query_start_loc,
            static_cast<uint16_t*>(out), first_seq, num_seqs, num_heads, num_kv_heads, head_size, block_size,
            max_blocks, scale, sliding_window);
  }
#else
  (void)dtype, (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)seq_lens;
  (void)query_start_loc, (void)out, (void)first_seq, (void)num_seqs, (void)num_heads, (void)num_kv_heads;
  (void)head_size, (void)block_size, (void)max_blocks, (void)scale, (void)sliding_window;
#endif
}

}  // extern "C"
