#pragma once

// Small maths shared by the kernels of the custom ops library, written so that the compiler
// vectorizes loops over them.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

// Inlined into every caller, whatever the compiler's size budget for the file: called per element
// from vectorized loops, an out-of-line call (through the PLT, the library being -fPIC) keeps the
// loop scalar. GCC's heuristics once stopped inlining exp_nonpositive when lm_head_ce.cpp grew.
#if defined(__GNUC__)
#define GPT2FORGE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define GPT2FORGE_ALWAYS_INLINE inline
#endif

namespace gpt2forge {

// exp(x) for x <= 0 (values minus their maximum, as in a softmax), relative error below 2e-7, in
// branch-free arithmetic that the compiler vectorizes: x = n ln2 + r with |r| <= ln2/2, exp(r) by a
// degree-6 polynomial, 2^n by writing the exponent bits.
GPT2FORGE_ALWAYS_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows fp32's normal range; the term is ~0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // Cody-Waite: ln2 split into an exact head and a tail
  r = r - n * -2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// fp32 -> bf16 bits, rounded to nearest even with NaN as 0x7FC0: c10::BFloat16(float)'s rounding,
// in integer arithmetic the compiler vectorizes.
GPT2FORGE_ALWAYS_INLINE uint16_t bf16_bits(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16;
  return x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

}  // namespace gpt2forge
