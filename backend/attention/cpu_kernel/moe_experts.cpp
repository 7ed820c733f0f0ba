// The experts of a sparse MLP layer (Mixtral, Qwen2-MoE, Qwen3-MoE) in one call, CPU:
//   out[t] = sum over t's top-k pairs p of  w_p * down_e(silu(gate_e(x[t])) * up_e(x[t])),
// e being pair p's expert. torch ran this as a GEMM pair per expert with work plus an activation, a
// multiply, a scale and an index_add: about six Python dispatches an expert, and oneDNN GEMMs of a
// handful of rows. Here the (expert, weight block) tasks of all experts are spread over torch's
// OpenMP threads at once, each block's weights are read once for all of the expert's rows, and the
// rows are read in place (no gather). A small decode step reads every expert's weights for a few
// rows each, so it is bound by reading them; the packed layout makes each task read one contiguous
// run, and from a few dozen tokens a step the multiplies themselves take over.
//
// Layouts (packed once at load by backend/models/moe_cpu.py):
//   gate_up [E, I_pad / 32, H, 64]: block b, depth k holds gate columns 32b .. 32b + 31, then the
//           same up columns (I_pad: the intermediate size rounded up to 32, zero-padded);
//   down    [E, H_pad / 64, I_pad, 64]: block c, depth k holds output columns 64c .. 64c + 63.
// Where the library has AVX512_BF16 (moe_experts_bf16_pairs() says so), bfloat16 weights are packed
// in pairs of depths instead, [..., depth / 2, 64, 2] (the depth rounded up to even, zero-padded),
// so that one vdpbf16ps multiplies two depths of 16 columns: twice the float32 FMAs' rate.
// Rounding follows the torch path: gate and up are rounded to the dtype, silu(gate) is rounded,
// then the product; the down projection is rounded, scaled by the pair's weight and rounded; a
// token's pairs are added in expert order, each sum rounded (index_add_ into a tensor of the dtype).
// Vectorized through simd.h's traits (AVX-512 or AVX2) with plain loops where neither exists.

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace llm_cpu;

constexpr int kBlock = 64;  // packed columns per weight block
constexpr int kHalf = 32;   // intermediate columns per gate_up block (32 gate + 32 up)
constexpr int kRows = 4;    // rows computed together

// result[r][0 .. 64) = sum_k row_r[k] * w[k][0 .. 64) for R rows.
template <int R, typename T>
void block_product(const T* const* rows, int64_t depth, const T* w, float (*result)[kBlock]) {
#ifdef LLM_CPU_AVX2
  constexpr int kVectors = 4;
  constexpr int kPass = kVectors * Vec::width;  // 64 columns (AVX-512) or 32 (AVX2: two passes)
  for (int c0 = 0; c0 < kBlock; c0 += kPass) {
    typename Vec::reg acc[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = Vec::zero();
    for (int64_t k = 0; k < depth; ++k) {
      typename Vec::reg weights[kVectors];
      for (int c = 0; c < kVectors; ++c) weights[c] = Vec::load(w + k * kBlock + c0 + c * Vec::width);
      for (int r = 0; r < R; ++r) {
        const typename Vec::reg value = Vec::set1(load(rows[r][k]));
        for (int c = 0; c < kVectors; ++c) acc[r][c] = Vec::fma(value, weights[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVectors; ++c) Vec::store(result[r] + c0 + c * Vec::width, acc[r][c]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kBlock; ++j) result[r][j] = 0.0f;
  for (int64_t k = 0; k < depth; ++k)
    for (int r = 0; r < R; ++r) {
      const float value = load(rows[r][k]);
      for (int j = 0; j < kBlock; ++j) result[r][j] += value * load(w[k * kBlock + j]);
    }
#endif
}

#ifdef LLM_CPU_AVX512_BF16
constexpr bool kBf16Pairs = true;

inline uint32_t depth_pair(const uint16_t* row, int64_t kp, int64_t depth) {  // (row[2kp], row[2kp + 1] or 0)
  if (2 * kp + 1 < depth) {
    uint32_t word;
    std::memcpy(&word, row + 2 * kp, sizeof(word));
    return word;
  }
  return row[2 * kp];  // an odd depth's last element; its weight pair's second half is zero
}

// result[r][0 .. 64) = sum_k row_r[k] * w[k][0 .. 64), bfloat16 weights packed in depth pairs
// (w[kp][column][2]), by vdpbf16ps: 16 columns x 2 depths per instruction.
template <int R>
void block_product_pairs(const uint16_t* const* rows, int64_t depth, const uint16_t* w, float (*result)[kBlock]) {
  constexpr int kVectors = kBlock / 16;
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = (depth + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i weights[kVectors];
    for (int c = 0; c < kVectors; ++c) weights[c] = _mm512_loadu_si512(w + (kp * kBlock + c * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i value = _mm512_set1_epi32(static_cast<int>(depth_pair(rows[r], kp, depth)));
      for (int c = 0; c < kVectors; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)value, (__m512bh)weights[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVectors; ++c) _mm512_storeu_ps(result[r] + c * 16, acc[r][c]);
}
#else
constexpr bool kBf16Pairs = false;
#endif

// One block product of R rows: by vdpbf16ps on depth pairs for bfloat16 where the build has
// AVX512_BF16, else by FMAs.
template <int R, typename T>
void block_product_of(const T* const* rows, int64_t depth, const T* w, float (*result)[kBlock]) {
#ifdef LLM_CPU_AVX512_BF16
  if constexpr (std::is_same_v<T, uint16_t>)
    block_product_pairs<R>(rows, depth, w, result);
  else
#endif
    block_product<R>(rows, depth, w, result);
}

template <typename T>
void product(int rows, const T* const* pointers, int64_t depth, const T* w, float (*result)[kBlock]) {
  switch (rows) {
    case 4: block_product_of<4>(pointers, depth, w, result); break;
    case 3: block_product_of<3>(pointers, depth, w, result); break;
    case 2: block_product_of<2>(pointers, depth, w, result); break;
    default: block_product_of<1>(pointers, depth, w, result); break;
  }
}

// h[j] = round(round(silu(round(gate[j]))) * round(up[j])) for the 32 columns of one block row.
template <typename T>
void silu_times_up(const float* gate_up, T* h) {
  int j = 0;
#ifdef LLM_CPU_AVX2
  for (; j < kHalf; j += Vec::width) {
    const typename Vec::reg gate = Vec::round(T{}, Vec::load(gate_up + j));
    const typename Vec::reg up = Vec::round(T{}, Vec::load(gate_up + kHalf + j));
    const typename Vec::reg one = Vec::set1(1.0f);
    const typename Vec::reg silu = Vec::round(T{}, Vec::div(gate, Vec::add(one, Vec::exp(Vec::sub(Vec::zero(), gate)))));
    Vec::store(h + j, Vec::mul(silu, up));  // rounded to T by the store
  }
#endif
  for (; j < kHalf; ++j) {
    const float gate = round_to(T{}, gate_up[j]), up = round_to(T{}, gate_up[kHalf + j]);
    const float silu = round_to(T{}, gate / (1.0f + std::exp(-gate)));
    store(h + j, silu * up);
  }
}

struct Task {
  int expert;
  int64_t block;
};

template <typename T>
void experts(const T* x, int64_t x_stride, int64_t num_tokens, int64_t hidden, const T* gate_up, const T* down,
             int64_t inter, int num_experts, int top_k, const int64_t* expert_ids, const float* weights, T* out) {
  // The (token, expert) pairs sorted by expert (a stable counting sort): expert e owns pairs
  // [offsets[e], offsets[e + 1]); pair p is token pair_token[p] with weight pair_weight[p]; a
  // token's pairs, in ascending order, are token_pairs[t * top_k ...] (its experts in ascending order).
  const int64_t num_pairs = num_tokens * top_k;
  std::vector<int64_t> offsets(num_experts + 1, 0), pair_token(num_pairs), token_pairs(num_pairs);
  std::vector<float> pair_weight(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) ++offsets[expert_ids[i] + 1];
  for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t p = next[expert_ids[i]]++;
      pair_token[p] = i / top_k;
      pair_weight[p] = weights[i];
      token_pairs[i] = p;
    }
    for (int64_t t = 0; t < num_tokens; ++t) std::sort(token_pairs.begin() + t * top_k, token_pairs.begin() + (t + 1) * top_k);
  }
  const int64_t* expert_offsets = offsets.data();
  const int64_t up_blocks = inter / kHalf, down_blocks = (hidden + kBlock - 1) / kBlock;
  std::vector<Task> up_tasks, down_tasks;
  for (int e = 0; e < num_experts; ++e) {
    if (expert_offsets[e + 1] == expert_offsets[e]) continue;  // nobody chose it: its weights are not read
    for (int64_t b = 0; b < up_blocks; ++b) up_tasks.push_back({e, b});
    for (int64_t b = 0; b < down_blocks; ++b) down_tasks.push_back({e, b});
  }
  std::unique_ptr<T[]> h(new T[num_pairs * inter]);           // [pairs, I_pad]: silu(gate) * up, rounded to T
  const int64_t up_depth = std::is_same_v<T, uint16_t> && kBf16Pairs ? (hidden + 1) / 2 * 2 : hidden;
  std::unique_ptr<float[]> y(new float[num_pairs * hidden]);   // [pairs, H]: weighted down projections
  const int64_t num_up = static_cast<int64_t>(up_tasks.size()), num_down = static_cast<int64_t>(down_tasks.size());
#pragma omp parallel if (num_up > 1)
  {
    float result[kRows][kBlock];
    const T* x_rows[kRows];
    const T* h_rows[kRows];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_up; ++i) {
      const Task task = up_tasks[i];
      const T* w = gate_up + (task.expert * up_blocks + task.block) * up_depth * kBlock;
      for (int64_t p0 = expert_offsets[task.expert]; p0 < expert_offsets[task.expert + 1]; p0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, expert_offsets[task.expert + 1] - p0));
        for (int r = 0; r < rows; ++r) x_rows[r] = x + pair_token[p0 + r] * x_stride;
        product(rows, x_rows, hidden, w, result);
        for (int r = 0; r < rows; ++r) silu_times_up<T>(result[r], h.get() + (p0 + r) * inter + task.block * kHalf);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_down; ++i) {
      const Task task = down_tasks[i];
      const T* w = down + (task.expert * down_blocks + task.block) * inter * kBlock;
      const int64_t c0 = task.block * kBlock, columns = std::min<int64_t>(kBlock, hidden - c0);
      for (int64_t p0 = expert_offsets[task.expert]; p0 < expert_offsets[task.expert + 1]; p0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, expert_offsets[task.expert + 1] - p0));
        for (int r = 0; r < rows; ++r) h_rows[r] = h.get() + (p0 + r) * inter;
        product(rows, h_rows, inter, w, result);
        for (int r = 0; r < rows; ++r) {
          float* target = y.get() + (p0 + r) * hidden + c0;
          const float weight = pair_weight[p0 + r];
          for (int64_t j = 0; j < columns; ++j) target[j] = round_to(T{}, round_to(T{}, result[r][j]) * weight);
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      T* row = out + t * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) sum = round_to(T{}, sum + y[token_pairs[t * top_k + k] * hidden + j]);
        store(row + j, sum);
      }
    }
  }
}

}  // namespace

extern "C" {

// dtype 0 float32, 1 bfloat16. x [num_tokens, hidden] (row stride x_stride); gate_up and down packed
// as above, inter = I_pad; expert_ids and weights [num_tokens, top_k]: each token's experts (each
// in [0, num_experts), distinct within a token) and their router weights. out [num_tokens, hidden],
// contiguous, is overwritten.
void moe_experts(int dtype, const void* x, int64_t x_stride, int64_t num_tokens, int64_t hidden, const void* gate_up,
                 const void* down, int64_t inter, int num_experts, int top_k, const int64_t* expert_ids,
                 const float* weights, void* out) {
  if (dtype == 0) {
    experts(static_cast<const float*>(x), x_stride, num_tokens, hidden, static_cast<const float*>(gate_up),
            static_cast<const float*>(down), inter, num_experts, top_k, expert_ids, weights, static_cast<float*>(out));
  } else {
    experts(static_cast<const uint16_t*>(x), x_stride, num_tokens, hidden, static_cast<const uint16_t*>(gate_up),
            static_cast<const uint16_t*>(down), inter, num_experts, top_k, expert_ids, weights,
            static_cast<uint16_t*>(out));
  }
}

// 1 where bfloat16 weights are packed in depth pairs (this build has AVX512_BF16), else 0.
int moe_experts_bf16_pairs() { return kBf16Pairs ? 1 : 0; }

}  // extern "C"
