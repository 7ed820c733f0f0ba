// The small per-token ops of a Llama layer, one pass each over their rows (CPU):
//   * residual add + RMSNorm: residual += x (in place), out = weight * normalize(residual);
//   * RMSNorm alone: out = weight * normalize(x);
//   * SiLU x up: out = silu(gate) * up, gate and up being the two halves of gate_up's rows;
//   * rotary embedding + KV-cache write: q and k of the fused qkv projection rotated (neox style,
//     rotate-half), q written to its own tensor, k and v written into their cache slots.
// torch runs each as 4-12 separate ops, each a Python dispatch and a pass over memory with a
// temporary, most of them on one core (tensors this small stay under torch's parallel grain).
// These follow transformers' rounding order exactly, so bfloat16 results are torch's: the sum in
// float32, the normalized row rounded to the dtype, then multiplied by the weight and rounded
// again; silu rounded to the dtype before the multiply; each rotary product rounded before the
// sum. The library is built with -ffp-contract=off so float32 products are not fused into FMAs
// behind our back either. Vectorized through simd.h's traits (AVX-512 or AVX2) with plain loops
// for the remainder; rows are split over torch's OpenMP threads.

#include <algorithm>

#include "simd.h"

namespace {

using namespace llm_cpu;

template <typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * hidden;
    T* out_row = out + r * hidden;
    T* res_row = residual == nullptr ? nullptr : residual + r * hidden;
    float sum = 0.0f;
    int64_t d = 0;
#ifdef LLM_CPU_AVX2
    typename Vec::reg sums = Vec::zero();
    for (; d + Vec::width <= hidden; d += Vec::width) {
      typename Vec::reg value = Vec::load(x_row + d);
      if (res_row != nullptr) {  // x = residual + x, rounded to the dtype
        value = Vec::round(T{}, Vec::add(Vec::load(res_row + d), value));
        Vec::store(res_row + d, value);
      }
      sums = Vec::add(sums, Vec::mul(value, value));
    }
    sum = Vec::reduce_add(sums);
#endif
    for (; d < hidden; ++d) {
      float value = load(x_row[d]);
      if (res_row != nullptr) {
        value = round_to(T{}, load(res_row[d]) + value);
        store(res_row + d, value);
      }
      sum += value * value;
    }
    const T* source = res_row != nullptr ? res_row : x_row;
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    d = 0;
#ifdef LLM_CPU_AVX2
    const typename Vec::reg scale = Vec::set1(inverse);
    for (; d + Vec::width <= hidden; d += Vec::width) {
      const typename Vec::reg normed = Vec::round(T{}, Vec::mul(Vec::load(source + d), scale));
      Vec::store(out_row + d, Vec::mul(Vec::load(weight + d), normed));
    }
#endif
    for (; d < hidden; ++d) {
      const float normed = round_to(T{}, load(source[d]) * inverse);
      store(out_row + d, load(weight[d]) * normed);
    }
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* out_row = out + r * width;
    int64_t d = 0;
#ifdef LLM_CPU_AVX2
    const typename Vec::reg one = Vec::set1(1.0f);
    for (; d + Vec::width <= width; d += Vec::width) {
      const typename Vec::reg g = Vec::load(gate + d);
      const typename Vec::reg activated = Vec::round(T{}, Vec::div(g, Vec::add(one, Vec::exp(Vec::sub(Vec::zero(), g)))));
      Vec::store(out_row + d, Vec::mul(activated, Vec::load(up + d)));
    }
#endif
    for (; d < width; ++d) {
      const float g = load(gate[d]);
      const float activated = round_to(T{}, g / (1.0f + std::exp(-g)));
      store(out_row + d, activated * load(up[d]));
    }
  }
}

// One head's rotation, rotate-half style: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), every
// product and sum rounded to the dtype as torch's separate ops round them.
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, int half, T* out) {
  int d = 0;
#ifdef LLM_CPU_AVX2
  for (; d + Vec::width <= half; d += Vec::width) {
    const typename Vec::reg x1 = Vec::load(x + d), x2 = Vec::load(x + half + d);
    const typename Vec::reg c = Vec::load(cos + d), s = Vec::load(sin + d);
    Vec::store(out + d, Vec::sub(Vec::round(T{}, Vec::mul(x1, c)), Vec::round(T{}, Vec::mul(x2, s))));
    Vec::store(out + half + d, Vec::add(Vec::round(T{}, Vec::mul(x2, c)), Vec::round(T{}, Vec::mul(x1, s))));
  }
#endif
  for (; d < half; ++d) {
    const float x1 = load(x[d]), x2 = load(x[half + d]), c = load(cos[d]), s = load(sin[d]);
    store(out + d, round_to(T{}, x1 * c) - round_to(T{}, x2 * s));
    store(out + half + d, round_to(T{}, x2 * c) + round_to(T{}, x1 * s));
  }
}

template <typename T>
void rope_cache(const T* qkv, const int64_t* positions, const T* cos_sin, T* q_out, T* k_out, T* key_cache,
                T* value_cache, const int64_t* slot_mapping, int64_t num_tokens, int num_heads, int num_kv_heads,
                int head_size) {
  const int half = head_size / 2;
  const int64_t q_size = static_cast<int64_t>(num_heads) * head_size;
  const int64_t kv_size = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t row = q_size + 2 * kv_size;
#pragma omp parallel for schedule(static) if (num_tokens > 1)
  for (int64_t i = 0; i < num_tokens; ++i) {
    const T* q = qkv + i * row;
    const T* k = q + q_size;
    const T* v = k + kv_size;
    const T* cos = cos_sin + positions[i] * head_size;
    const T* sin = cos + half;
    for (int h = 0; h < num_heads; ++h) rotate_head(q + h * head_size, cos, sin, half, q_out + i * q_size + h * head_size);
    T* k_rotated = k_out + i * kv_size;
    for (int h = 0; h < num_kv_heads; ++h) rotate_head(k + h * head_size, cos, sin, half, k_rotated + h * head_size);
    const int64_t slot = slot_mapping[i];
    if (slot >= 0) {
      std::copy(k_rotated, k_rotated + kv_size, key_cache + slot * kv_size);
      std::copy(v, v + kv_size, value_cache + slot * kv_size);
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. residual may be null (no add). Rows are contiguous.
void fused_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out, int64_t rows,
                    int64_t hidden, float eps) {
  if (dtype == 0) {
    rms_norm(static_cast<const float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
             static_cast<float*>(out), rows, hidden, eps);
  } else {
    rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(weight),
             static_cast<uint16_t*>(out), rows, hidden, eps);
  }
}

// gate_up: [rows, 2 * width] (gate | up), out: [rows, width].
void fused_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t width) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, width);
  } else {
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, width);
  }
}

// qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] (q | k | v), positions: [num_tokens],
// cos_sin: [max_position, head_size] (cos half | sin half), q_out: [num_tokens, num_heads, head_size],
// k_out: [num_tokens, num_kv_heads, head_size] (the rotated keys), key_cache and value_cache:
// [num_slots, num_kv_heads, head_size], slot_mapping: [num_tokens] (-1: not written).
void fused_rope_cache(int dtype, const void* qkv, const int64_t* positions, const void* cos_sin, void* q_out,
                      void* k_out, void* key_cache, void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                      int num_heads, int num_kv_heads, int head_size) {
  if (dtype == 0) {
    rope_cache(static_cast<const float*>(qkv), positions, static_cast<const float*>(cos_sin), static_cast<float*>(q_out),
               static_cast<float*>(k_out), static_cast<float*>(key_cache), static_cast<float*>(value_cache),
               slot_mapping, num_tokens, num_heads, num_kv_heads, head_size);
  } else {
    rope_cache(static_cast<const uint16_t*>(qkv), positions, static_cast<const uint16_t*>(cos_sin),
               static_cast<uint16_t*>(q_out), static_cast<uint16_t*>(k_out), static_cast<uint16_t*>(key_cache),
               static_cast<uint16_t*>(value_cache), slot_mapping, num_tokens, num_heads, num_kv_heads, head_size);
  }
}

}  // extern "C"
