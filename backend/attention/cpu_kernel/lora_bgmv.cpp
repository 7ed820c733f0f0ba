// The LoRA deltas of a step's decode rows, every adapter in one call (Punica's BGMV shape, CPU):
//   out[t] += expand_s(shrink_s(x[t]))  for each row t of each slot s,
// where shrink_s = A_s ([parts x rank, in]) and expand_s is the slot's B, stored compact and
// transposed ([rank, out]: part p's output columns read only part p's rank entries, where PEFT's
// fused B is block-diagonal and mostly zeros).
// torch ran this as gather, two bmm over every slot, a mask and an index_add: five passes and a
// Python dispatch each, per projection and layer, at a quarter of the base GEMMs' efficiency. Here
// a slot's rows are processed together, so its A and B are read once per step and projection
// (a decode step is bound by reading weights), and the rows stay where they are (each slot owns
// one contiguous run of rows). Rounding follows the torch path: the shrunk vector is rounded to the
// dtype, then out + x A^T B^T is accumulated in float32 and rounded once.
// Vectorized through simd.h's traits (AVX-512 or AVX2) with plain loops for the remainder; the
// (slot, block) tasks of each phase are split over torch's OpenMP threads.

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using namespace llm_cpu;

constexpr int kRows = 4;     // rows of one slot computed together
constexpr int kShrink = 4;   // shrink outputs (rank entries) computed together
constexpr int kColumns = 4;  // vectors of output columns computed together in the expand

// s[row][q0 .. q0 + kShrink) = round(x[row] . a[q]) for up to kRows rows and kShrink rank entries.
template <typename T>
void shrink_block(const T* x, int64_t x_stride, const T* a, int64_t in, int64_t row0, int rows, int64_t q0, int qs,
                  float* s, int64_t s_stride) {
  float sums[kRows][kShrink] = {};
  int64_t k = 0;
#ifdef LLM_CPU_AVX2
  typename Vec::reg acc[kRows][kShrink];
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < kShrink; ++q) acc[r][q] = Vec::zero();
  for (; k + Vec::width <= in; k += Vec::width) {
    typename Vec::reg weights[kShrink];
    for (int q = 0; q < qs; ++q) weights[q] = Vec::load(a + (q0 + q) * in + k);
    for (int r = 0; r < rows; ++r) {
      const typename Vec::reg value = Vec::load(x + (row0 + r) * x_stride + k);
      for (int q = 0; q < qs; ++q) acc[r][q] = Vec::fma(value, weights[q], acc[r][q]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int q = 0; q < qs; ++q) sums[r][q] = Vec::reduce_add(acc[r][q]);
#endif
  for (; k < in; ++k)
    for (int r = 0; r < rows; ++r)
      for (int q = 0; q < qs; ++q) sums[r][q] += load(x[(row0 + r) * x_stride + k]) * load(a[(q0 + q) * in + k]);
  for (int r = 0; r < rows; ++r)
    for (int q = 0; q < qs; ++q) s[(row0 + r) * s_stride + q0 + q] = round_to(T{}, sums[r][q]);
}

// out[row][j0 .. j1) += s[row][part rank entries] . bt[:, j] for up to kRows rows; [j0, j1) lies in one part.
template <typename T>
void expand_block(const float* s, int64_t s_stride, int64_t s_offset, const T* bt, int64_t out_features, int64_t rank,
                  T* out, int64_t out_stride, int64_t row0, int rows, int64_t j0, int64_t j1) {
  int64_t j = j0;
#ifdef LLM_CPU_AVX2
  for (; j + kColumns * Vec::width <= j1; j += kColumns * Vec::width) {
    typename Vec::reg acc[kRows][kColumns];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kColumns; ++c) acc[r][c] = Vec::zero();
    for (int64_t q = 0; q < rank; ++q) {
      typename Vec::reg weights[kColumns];
      for (int c = 0; c < kColumns; ++c) weights[c] = Vec::load(bt + q * out_features + j + c * Vec::width);
      for (int r = 0; r < rows; ++r) {
        const typename Vec::reg factor = Vec::set1(s[(row0 + r) * s_stride + s_offset + q]);
        for (int c = 0; c < kColumns; ++c) acc[r][c] = Vec::fma(factor, weights[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      T* row = out + (row0 + r) * out_stride + j;
      for (int c = 0; c < kColumns; ++c)
        Vec::store(row + c * Vec::width, Vec::add(Vec::load(row + c * Vec::width), acc[r][c]));
    }
  }
  for (; j + Vec::width <= j1; j += Vec::width) {
    typename Vec::reg acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = Vec::zero();
    for (int64_t q = 0; q < rank; ++q) {
      const typename Vec::reg weights = Vec::load(bt + q * out_features + j);
      for (int r = 0; r < rows; ++r) acc[r] = Vec::fma(Vec::set1(s[(row0 + r) * s_stride + s_offset + q]), weights, acc[r]);
    }
    for (int r = 0; r < rows; ++r) {
      T* row = out + (row0 + r) * out_stride + j;
      Vec::store(row, Vec::add(Vec::load(row), acc[r]));
    }
  }
#endif
  for (; j < j1; ++j) {
    for (int r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t q = 0; q < rank; ++q) sum += s[(row0 + r) * s_stride + s_offset + q] * load(bt[q * out_features + j]);
      T* cell = out + (row0 + r) * out_stride + j;
      store(cell, load(*cell) + sum);
    }
  }
}

struct Task {
  int slot;
  int64_t row0;
  int rows;
  int64_t begin, end;  // rank entries (shrink) or output columns (expand)
  int part;
};

template <typename T>
void bgmv(const T* x, int64_t x_stride, T* out, int64_t out_stride, const int64_t* row_start, const int64_t* row_end,
          int num_slots, const T* a, const T* bt, int64_t in, int64_t out_features, int64_t rank, int parts,
          const int64_t* part_columns) {
  const int64_t width = parts * rank;  // shrink outputs per row
  int64_t num_rows = 0;
  std::vector<Task> shrink_tasks, expand_tasks;
  for (int slot = 0; slot < num_slots; ++slot) {
    num_rows = std::max(num_rows, row_end[slot]);
    for (int64_t row0 = row_start[slot]; row0 < row_end[slot]; row0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, row_end[slot] - row0));
      for (int64_t q = 0; q < width; q += kShrink) shrink_tasks.push_back({slot, row0, rows, q, std::min(q + kShrink, width), 0});
      for (int part = 0; part < parts; ++part) {
        constexpr int64_t step = 4 * 16;
        for (int64_t j = part_columns[part]; j < part_columns[part + 1]; j += step)
          expand_tasks.push_back({slot, row0, rows, j, std::min(j + step, part_columns[part + 1]), part});
      }
    }
  }
  std::vector<float> shrunk(static_cast<size_t>(num_rows * width));
  const int64_t num_shrink = static_cast<int64_t>(shrink_tasks.size());
  const int64_t num_expand = static_cast<int64_t>(expand_tasks.size());
#pragma omp parallel if (num_shrink > 1)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_shrink; ++i) {
      const Task& task = shrink_tasks[i];
      shrink_block(x, x_stride, a + task.slot * width * in, in, task.row0, task.rows, task.begin,
                   static_cast<int>(task.end - task.begin), shrunk.data(), width);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_expand; ++i) {
      const Task& task = expand_tasks[i];
      expand_block(shrunk.data(), width, task.part * rank, bt + task.slot * rank * out_features, out_features, rank,
                   out, out_stride, task.row0, task.rows, task.begin, task.end);
    }
  }
}

}  // namespace

extern "C" {

// dtype 0 float32, 1 bfloat16. x [rows, in] (row stride x_stride), out [rows, out_features] (row
// stride out_stride), slot s owns rows [row_start[s], row_end[s]); a [num_slots, parts x rank, in];
// bt [num_slots, rank, out_features], part p's output columns [part_columns[p], part_columns[p + 1])
// reading rank entries [p x rank, (p + 1) x rank) of the shrunk vector.
void lora_bgmv(int dtype, const void* x, int64_t x_stride, void* out, int64_t out_stride, const int64_t* row_start,
               const int64_t* row_end, int num_slots, const void* a, const void* bt, int64_t in, int64_t out_features,
               int64_t rank, int parts, const int64_t* part_columns) {
  if (dtype == 0) {
    bgmv(static_cast<const float*>(x), x_stride, static_cast<float*>(out), out_stride, row_start, row_end, num_slots,
         static_cast<const float*>(a), static_cast<const float*>(bt), in, out_features, rank, parts, part_columns);
  } else {
    bgmv(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(out), out_stride, row_start, row_end,
         num_slots, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(bt), in, out_features, rank, parts,
         part_columns);
  }
}

}  // extern "C"
