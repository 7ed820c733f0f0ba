// The small per-token ops of a Llama layer, fused into one pass each over their rows (CPU):
//   * residual add + RMSNorm: residual += x (in place), out = weight * normalize(residual);
//   * RMSNorm alone: out = weight * normalize(x);
//   * SiLU x up: out = silu(gate) * up, gate and up being the two halves of gate_up's rows.
// torch runs each as 4-6 separate ops, each a full pass over memory with a temporary. These follow
// transformers' rounding order exactly, so bfloat16 results are what torch's ops give: the sum in
// float32, the normalized row rounded to the dtype, then multiplied by the weight and rounded
// again; silu rounded to the dtype before the multiply. Built into the same library as
// paged_decode.cpp (build.py); rows are split over torch's OpenMP threads.

#include "simd.h"

namespace {

using namespace llm_cpu;

template <typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * hidden;
    T* out_row = out + r * hidden;
    T* res_row = residual == nullptr ? nullptr : residual + r * hidden;
    float sum = 0.0f;
    if (res_row != nullptr) {
      for (int64_t d = 0; d < hidden; ++d) {
        const float value = round_to(T{}, load(res_row[d]) + load(x_row[d]));  // x = residual + x
        store(res_row + d, value);
        sum += value * value;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) sum += load(x_row[d]) * load(x_row[d]);
    }
    const T* source = res_row != nullptr ? res_row : x_row;
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) {
      const float normed = round_to(T{}, load(source[d]) * inverse);
      store(out_row + d, load(weight[d]) * normed);
    }
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* out_row = out + r * width;
    int64_t d = 0;
#ifdef LLM_CPU_AVX2
    alignas(32) float product[8];
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; d + 8 <= width; d += 8) {
      const __m256 g = load8(gate + d);
      const __m256 activated = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_store_ps(product, activated);
      for (int j = 0; j < 8; ++j) product[j] = round_to(T{}, product[j]);  // silu's own rounding
      _mm256_store_ps(product, _mm256_mul_ps(_mm256_load_ps(product), load8(up + d)));
      for (int j = 0; j < 8; ++j) store(out_row + d + j, product[j]);
    }
#endif
    for (; d < width; ++d) {
      const float g = load(gate[d]);
      const float activated = round_to(T{}, g / (1.0f + std::exp(-g)));
      store(out_row + d, activated * load(up[d]));
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

}  // extern "C"
