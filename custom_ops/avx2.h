#pragma once

// AVX2 helpers shared by the kernels that have an AVX2 path (gemv.cpp, decode_attention.cpp). The
// library is built without -march=native, so such a path is compiled with a target attribute and
// taken only where has_avx2_fma() says the CPU has the instructions.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GPT2FORGE_AVX2 1

#include <c10/util/BFloat16.h>

namespace gpt2forge {

inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// 8 bf16 values widened to fp32: a bf16 is the high half of the fp32 with the same bits.
__attribute__((target("avx2"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

}  // namespace gpt2forge
#endif
