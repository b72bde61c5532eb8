// gpt2forge::argmax_rows: torch.argmax(x, dim=-1) for the (B, V) fp32 logits of a decode step.
//
// Greedy decoding takes the argmax of every row of logits once per token. The logits come from the
// LM head's gemv (gemv.cpp), whose threads each wrote part of them, so much of a row sits in
// another core's cache; ATen's argmax reads it one value at a time on one thread. Here the row is
// cut into parts shared by the decode pool's threads (pool.h) and each part is scanned 32 values a
// step (AVX2), so a GPT-2 row of 50257 logits straight after the head's call is scanned sooner than
// by ATen's argmax (measured: docs/benchmarks.md, Design measurements). The result is
// torch.argmax's: the first index of the largest value, and the first NaN's index when a row has a
// NaN (torch treats NaN as the largest value). The reference is torch.argmax
// (tests/ops/test_custom_ops.py).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "isa.h"
#include "pool.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GPT2FORGE_ARGMAX_AVX2 1
#endif

namespace gpt2forge {
namespace {

// The best value of a part, its first index, and its first NaN's index (-1: none).
struct Best {
  float value;
  int64_t index;
  int64_t nan;
};

// Values p[lo .. hi) (hi > lo): the first NaN, else the first index of the largest value.
Best scan_portable(const float* p, int64_t lo, int64_t hi) {
  Best best{p[lo], lo, -1};
  for (int64_t i = lo; i < hi; ++i) {
    if (std::isnan(p[i])) return {p[i], i, i};
    if (p[i] > best.value) best = {p[i], i, -1};
  }
  return best;
}

#ifdef GPT2FORGE_ARGMAX_AVX2
// The same, 32 values a step in 4 x 8 lanes: lane j of set s keeps the first index of its largest
// value among the positions 8s + j mod 32, so the smallest index among the lanes holding the
// overall largest value is the first one. (With one set of 8 lanes every step waits on the last
// step's compare and blend, and the scan runs well behind a sum over the same row; measured:
// docs/benchmarks.md, Design measurements.) A NaN anywhere sends the part to scan_portable for its
// first NaN.
__attribute__((target("avx2"))) Best scan_avx2(const float* p, int64_t lo, int64_t hi) {
  constexpr int kSets = 4;
  if (hi - lo < 8 * kSets * 2) return scan_portable(p, lo, hi);
  __m256 best[kSets], unordered = _mm256_setzero_ps();
  __m256i at[kSets], best_at[kSets];  // offsets from lo (a part is < 2^31 values)
  const __m256i step = _mm256_set1_epi32(8 * kSets);
  for (int s = 0; s < kSets; ++s) {
    best[s] = _mm256_loadu_ps(p + lo + 8 * s);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(best[s], best[s], _CMP_UNORD_Q));
    at[s] = best_at[s] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * s));
  }
  int64_t i = lo + 8 * kSets;
  for (; i + 8 * kSets <= hi; i += 8 * kSets)
    for (int s = 0; s < kSets; ++s) {
      at[s] = _mm256_add_epi32(at[s], step);
      const __m256 v = _mm256_loadu_ps(p + i + 8 * s);
      const __m256 greater = _mm256_cmp_ps(v, best[s], _CMP_GT_OQ);
      best[s] = _mm256_blendv_ps(best[s], v, greater);
      best_at[s] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_at[s]), _mm256_castsi256_ps(at[s]), greater));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  if (_mm256_movemask_ps(unordered) != 0) return scan_portable(p, lo, hi);
  float values[8 * kSets];
  int32_t offsets[8 * kSets];
  for (int s = 0; s < kSets; ++s) {
    _mm256_storeu_ps(values + 8 * s, best[s]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(offsets + 8 * s), best_at[s]);
  }
  Best out{values[0], lo + offsets[0], -1};
  for (int j = 1; j < 8 * kSets; ++j)
    if (values[j] > out.value || (values[j] == out.value && lo + offsets[j] < out.index))
      out = {values[j], lo + offsets[j], -1};
  for (; i < hi; ++i) {
    if (std::isnan(p[i])) return scan_portable(p, lo, hi);
    if (p[i] > out.value) out = {p[i], i, -1};
  }
  return out;
}
#endif

Best scan(const float* p, int64_t lo, int64_t hi) {
#ifdef GPT2FORGE_ARGMAX_AVX2
  static const bool avx2 = isa_path() >= Isa::kAvx2 && __builtin_cpu_supports("avx2");
  if (avx2) return scan_avx2(p, lo, hi);
#endif
  return scan_portable(p, lo, hi);
}

// Values per part: a part is one claim of the pool (large enough that claiming costs little).
constexpr int64_t kPartValues = 8192;

struct ArgmaxJob {
  const float* x;
  int64_t row_stride, V, parts;  // parts per row
  Best* results;  // one per (row, part)

  static void run_one(const void* self, int64_t c) { static_cast<const ArgmaxJob*>(self)->one(c); }

  void one(int64_t c) const {
    const int64_t row = c / parts, lo = (c % parts) * kPartValues, hi = std::min(V, lo + kPartValues);
    results[c] = scan(x + row * row_stride, lo, hi);
  }
};

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "gpt2forge::argmax_rows: expected a CPU float32 tensor (B, V) with V >= 1, got ", x.sizes(), " ",
              x.scalar_type());
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t B = rows.size(0), V = rows.size(1), parts = (V + kPartValues - 1) / kPartValues;
  std::vector<Best> results(static_cast<size_t>(B * parts));
  const ArgmaxJob job{rows.const_data_ptr<float>(), rows.stride(0), V, parts, results.data()};
  Pool::get().run(&ArgmaxJob::run_one, &job, B * parts, pool_threads());
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // parts in order: an earlier part wins a tie
    Best best = results[b * parts];
    for (int64_t k = 1; k < parts && best.nan < 0; ++k) {
      const Best& r = results[b * parts + k];
      if (r.nan >= 0 || r.value > best.value) best = r;
    }
    o[b] = best.nan >= 0 ? best.nan : best.index;
  }
  return out;
}

at::Tensor argmax_rows_meta(const at::Tensor& x) { return at::empty({x.size(0)}, x.options().dtype(at::kLong)); }

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("argmax_rows", &gpt2forge::argmax_rows);
}

TORCH_LIBRARY_IMPL(gpt2forge, Meta, m) {
  m.impl("argmax_rows", &gpt2forge::argmax_rows_meta);
}
