// The range kernels of host_optim.cpp: one AdamW or LAMB update of elements [begin, end) of one
// tensor, in the portable, AVX2 and AVX-512 forms, and `kernels()`, which picks one form at run
// time from the CPU's features and isa_path() (isa.h: GPT2FORGE_OPS_ISA). What they compute, and
// why this way: host_optim.cpp's header.
// Included by host_optim.cpp only (everything here has internal linkage).

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GPT2FORGE_HOST_OPTIM_X86 1
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments of inlined helpers never cross an ABI boundary
#endif

namespace gpt2forge {
namespace {

// LAMB sums squares per block of this many elements in fp32 lanes, then in double.
constexpr int64_t kNormBlock = 1 << 12;

struct NoCopy {};

// The portable path: one float at a time (also the tail of the vector paths).
struct Scalar {
  using V = float;
  static constexpr int W = 1;
  static V load(const float* p) { return *p; }
  static V load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static V load(const c10::Half* p) { return static_cast<float>(*p); }
  static void store(float* p, V x) { *p = x; }
  static void store(c10::BFloat16* p, V x) { *p = c10::BFloat16(x); }  // round to nearest even
  static void store(c10::Half* p, V x) { *p = c10::Half(x); }
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V sqrt(V a) { return std::sqrt(a); }
  static float sum(V a) { return a; }
};

#ifdef GPT2FORGE_HOST_OPTIM_X86
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  AVX2_TARGET static V load(const float* p) { return _mm256_loadu_ps(p); }
  AVX2_TARGET static V load(const c10::BFloat16* p) {  // a bf16 is the high half of an fp32
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  AVX2_TARGET static V load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  AVX2_TARGET static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  AVX2_TARGET static void store(c10::BFloat16* p, V x) {
    // Round to nearest even as c10::BFloat16(float): add 0x7FFF + the lowest kept bit; NaN -> 0x7FC0.
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);  // 8 x u16 in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  AVX2_TARGET static void store(c10::Half* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  AVX2_TARGET static V set1(float x) { return _mm256_set1_ps(x); }
  AVX2_TARGET static V add(V a, V b) { return _mm256_add_ps(a, b); }
  AVX2_TARGET static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  AVX2_TARGET static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  AVX2_TARGET static V div(V a, V b) { return _mm256_div_ps(a, b); }
  AVX2_TARGET static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  AVX2_TARGET static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  AVX2_TARGET static float sum(V a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
  }
};

#define AVX512_TARGET __attribute__((target("avx512f")))
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  AVX512_TARGET static V load(const float* p) { return _mm512_loadu_ps(p); }
  AVX512_TARGET static V load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  AVX512_TARGET static V load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  AVX512_TARGET static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  AVX512_TARGET static void store(c10::BFloat16* p, V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  AVX512_TARGET static void store(c10::Half* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  AVX512_TARGET static V set1(float x) { return _mm512_set1_ps(x); }
  AVX512_TARGET static V add(V a, V b) { return _mm512_add_ps(a, b); }
  AVX512_TARGET static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  AVX512_TARGET static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  AVX512_TARGET static V div(V a, V b) { return _mm512_div_ps(a, b); }
  AVX512_TARGET static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  AVX512_TARGET static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  AVX512_TARGET static float sum(V a) { return _mm512_reduce_add_ps(a); }
};
#endif

// The per-call scalars, rounded to fp32 as torch passes them to its kernels.
struct Scalars {
  float decay = 1.0f;          // 1 - lr*wd (AdamW)
  bool decays = false;         // weight decay != 0
  float wd = 0.0f;             // LAMB: u += wd * w
  float lerp_weight = 0.1f;    // 1 - beta1
  bool lerp_from_grad = false; // lerp_weight >= 0.5: ATen computes g + (w - 1) * (g - m)
  float beta2 = 0.999f, grad_sq_weight = 0.001f;  // v = v*beta2 + ((1-beta2)*g)*g
  float bc1 = 1.0f, bc2_sqrt = 1.0f, eps = 1e-8f;
  float neg_step_size = 0.0f;  // AdamW: -lr / bc1; LAMB pass 2: -lr
  float ratio = 1.0f;          // LAMB pass 2: the trust ratio
};

// One step's tensors, untyped; the range kernels cast them to the dtypes in `grad_dtype` / `copy_dtype`.
struct Args {
  float *p, *m, *v;
  const void* g;
  void* copy;
  at::ScalarType grad_dtype, copy_dtype;  // copy_dtype is Undefined without a device copy
  int64_t n;                              // elements
  Scalars s;
};

// m and v after one step at lanes [i, i + O::W); returns the new m (v stored).
template <class O, class G>
inline typename O::V moments(const Args& a, const G* g, int64_t i, typename O::V& gv) {
  using V = typename O::V;
  gv = O::load(g + i);
  const V m = O::load(a.m + i), w = O::set1(a.s.lerp_weight);
  const V m_new = a.s.lerp_from_grad ? O::fma(O::sub(w, O::set1(1.0f)), O::sub(gv, m), gv)
                                     : O::fma(w, O::sub(gv, m), m);
  const V v_new = O::add(O::mul(O::load(a.v + i), O::set1(a.s.beta2)),
                         O::mul(O::mul(O::set1(a.s.grad_sq_weight), gv), gv));
  O::store(a.v + i, v_new);
  return m_new;
}

template <class O>
inline typename O::V denominator(const Args& a, int64_t i) {
  return O::add(O::div(O::sqrt(O::load(a.v + i)), O::set1(a.s.bc2_sqrt)), O::set1(a.s.eps));
}

template <class O, class G, class C>
inline void adamw_lanes(const Args& a, int64_t i) {
  using V = typename O::V;
  V gv;
  V p = O::load(a.p + i);
  if (a.s.decays) p = O::mul(p, O::set1(a.s.decay));
  const V m = moments<O>(a, static_cast<const G*>(a.g), i, gv);
  O::store(a.m + i, m);
  p = O::add(p, O::div(O::mul(O::set1(a.s.neg_step_size), m), denominator<O>(a, i)));
  O::store(a.p + i, p);
  if constexpr (!std::is_same_v<C, NoCopy>) O::store(static_cast<C*>(a.copy) + i, p);
}

template <class O, class G, class C>
inline void adamw_body(const Args& a, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + O::W <= end; i += O::W) adamw_lanes<O, G, C>(a, i);
  for (; i < end; ++i) adamw_lanes<Scalar, G, C>(a, i);
}

// LAMB's update direction u at lanes [i, i + O::W) from the stored (new) m and v and the old w.
template <class O>
inline typename O::V lamb_direction(const Args& a, int64_t i, typename O::V p) {
  typename O::V u = O::div(O::div(O::load(a.m + i), denominator<O>(a, i)), O::set1(a.s.bc1));
  return a.s.decays ? O::fma(p, O::set1(a.s.wd), u) : u;
}

// Pass 1: new moments; adds ||w||^2 and ||u||^2 of [begin, end) to sums[0], sums[1].
template <class O, class G, class C>
inline void lamb_moments_body(const Args& a, int64_t begin, int64_t end, double* sums) {
  using V = typename O::V;
  for (int64_t block = begin; block < end; block += kNormBlock) {
    const int64_t stop = std::min(end, block + kNormBlock);
    V ww = O::set1(0.0f), uu = O::set1(0.0f);
    float ww_tail = 0.0f, uu_tail = 0.0f;
    int64_t i = block;
    for (; i + O::W <= stop; i += O::W) {
      V gv;
      O::store(a.m + i, moments<O>(a, static_cast<const G*>(a.g), i, gv));
      const V p = O::load(a.p + i), u = lamb_direction<O>(a, i, p);
      ww = O::fma(p, p, ww);
      uu = O::fma(u, u, uu);
    }
    for (; i < stop; ++i) {
      float gv;
      a.m[i] = moments<Scalar>(a, static_cast<const G*>(a.g), i, gv);
      const float p = a.p[i], u = lamb_direction<Scalar>(a, i, p);
      ww_tail += p * p;
      uu_tail += u * u;
    }
    sums[0] += static_cast<double>(O::sum(ww)) + ww_tail;
    sums[1] += static_cast<double>(O::sum(uu)) + uu_tail;
  }
}

template <class O, class G, class C>
inline void lamb_apply_lanes(const Args& a, int64_t i) {
  using V = typename O::V;
  V p = O::load(a.p + i);
  const V u = O::mul(lamb_direction<O>(a, i, p), O::set1(a.s.ratio));
  p = O::fma(u, O::set1(a.s.neg_step_size), p);
  O::store(a.p + i, p);
  if constexpr (!std::is_same_v<C, NoCopy>) O::store(static_cast<C*>(a.copy) + i, p);
}

// Pass 2: w = w - lr * (ratio * u) over [begin, end), and the device copy.
template <class O, class G, class C>
inline void lamb_apply_body(const Args& a, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + O::W <= end; i += O::W) lamb_apply_lanes<O, G, C>(a, i);
  for (; i < end; ++i) lamb_apply_lanes<Scalar, G, C>(a, i);
}

// Calls BODY<O, G, C>(a, args...) for the grad and copy dtypes of `a`.
#define GPT2FORGE_DISPATCH_DTYPES(BODY, O, a, ...)                                        \
  do {                                                                                    \
    auto with_grad = [&]<class G>() {                                                     \
      switch ((a).copy_dtype) {                                                           \
        case at::kBFloat16: return BODY<O, G, c10::BFloat16>(a, __VA_ARGS__);             \
        case at::kHalf: return BODY<O, G, c10::Half>(a, __VA_ARGS__);                     \
        default: return BODY<O, G, NoCopy>(a, __VA_ARGS__);                               \
      }                                                                                   \
    };                                                                                    \
    switch ((a).grad_dtype) {                                                             \
      case at::kBFloat16: return with_grad.template operator()<c10::BFloat16>();          \
      case at::kHalf: return with_grad.template operator()<c10::Half>();                  \
      default: return with_grad.template operator()<float>();                             \
    }                                                                                     \
  } while (0)

// One entry point per (kernel, instruction set); `flatten` inlines the templated body into it so
// the body is compiled for that target.
#define GPT2FORGE_RANGE_KERNELS(O, TARGET)                                                        \
  TARGET void adamw_range_##O(const Args& a, int64_t b, int64_t e) {                              \
    GPT2FORGE_DISPATCH_DTYPES(adamw_body, O, a, b, e);                                            \
  }                                                                                               \
  TARGET void lamb_moments_range_##O(const Args& a, int64_t b, int64_t e, double* sums) {         \
    GPT2FORGE_DISPATCH_DTYPES(lamb_moments_body, O, a, b, e, sums);                               \
  }                                                                                               \
  TARGET void lamb_apply_range_##O(const Args& a, int64_t b, int64_t e) {                         \
    GPT2FORGE_DISPATCH_DTYPES(lamb_apply_body, O, a, b, e);                                       \
  }

GPT2FORGE_RANGE_KERNELS(Scalar, __attribute__((flatten)))
#ifdef GPT2FORGE_HOST_OPTIM_X86
GPT2FORGE_RANGE_KERNELS(Avx2, __attribute__((target("avx2,fma,f16c"), flatten)))
GPT2FORGE_RANGE_KERNELS(Avx512, __attribute__((target("avx512f"), flatten)))
#endif

struct Kernels {
  void (*adamw)(const Args&, int64_t, int64_t);
  void (*lamb_moments)(const Args&, int64_t, int64_t, double*);
  void (*lamb_apply)(const Args&, int64_t, int64_t);
  const char* name;
};

const Kernels& kernels() {
  static const Kernels chosen = [] {
#ifdef GPT2FORGE_HOST_OPTIM_X86
    if (isa_path() >= Isa::kAvx512 && __builtin_cpu_supports("avx512f"))
      return Kernels{adamw_range_Avx512, lamb_moments_range_Avx512, lamb_apply_range_Avx512, "avx512f"};
    if (isa_path() >= Isa::kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return Kernels{adamw_range_Avx2, lamb_moments_range_Avx2, lamb_apply_range_Avx2, "avx2"};
#endif
    return Kernels{adamw_range_Scalar, lamb_moments_range_Scalar, lamb_apply_range_Scalar, "portable"};
  }();
  return chosen;
}

}  // namespace
}  // namespace gpt2forge
