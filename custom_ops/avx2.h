#pragma once

// AVX2 (and AVX-512) helpers shared by the kernels that have such a path (gemv.cpp,
// decode_attention.cpp, decode_step.cpp). The library is built without -march=native, so such a
// path is compiled with a target attribute and taken only where has_avx2_fma() (has_avx512f())
// says the CPU has the instructions and isa_path() (isa.h: GPT2FORGE_OPS_ISA) allows the path.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GPT2FORGE_AVX2 1

#include <c10/util/BFloat16.h>

#include "isa.h"

namespace gpt2forge {

inline bool has_avx2_fma() {
  static const bool yes =
      isa_path() >= Isa::kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

inline bool has_avx512f() {
  static const bool yes = isa_path() >= Isa::kAvx512 && __builtin_cpu_supports("avx512f");
  return yes;
}

__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 8 bf16 values widened to fp32: a bf16 is the high half of the fp32 with the same bits.
__attribute__((target("avx2"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 bf16 values widened to fp32, as load8 does.
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp_nonpositive (vec_math.h) of 8 values, step by step the same arithmetic (no fused
// multiply-adds, as the scalar function is compiled).
__attribute__((target("avx2"))) inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace gpt2forge
#endif
