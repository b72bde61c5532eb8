// gpt2forge::multi_tensor_adamw_ and gpt2forge::multi_tensor_lamb_ (and their one-tensor forms
// adamw_step_ and lamb_step_): the optimizer update on the host, in place.
//
// With --optimizer-state-offchip the fp32 master weights and both moments live in host memory and
// the update runs on the CPU. It does a few flops per parameter and touches 28 bytes of fp32 state
// per parameter (read p, g, m, v; write p, m, v), so it is bound by memory bandwidth: AdamW makes
// exactly one pass over memory here (PyTorch's foreach implementation makes several) and can write
// the rounded bf16/fp16 copy of the new weights for the device in the same pass (the copy that goes
// back over PCIe). The multi-tensor ops update a whole param group in one call: every tensor is cut
// into pieces of kGrain elements, and one parallel region (two for LAMB, whose trust ratios need
// each tensor's norms first) hands the pieces of all tensors to the threads, rather than one call
// and one region per tensor (GPT-2 small has 148 tensors, most of them small).
//
// Arithmetic follows torch.optim.AdamW's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
// operation by operation, in fp32 with the step's scalars computed in double as Python does:
//     p = p * (1 - lr*wd)                        (decoupled weight decay, skipped when wd == 0)
//     m = lerp(m, g, 1 - beta1)                  (fma(w, g - m, m); from g when w >= 0.5, as ATen)
//     v = v * beta2 + ((1 - beta2) * g) * g
//     p = p + (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)
// so results equal torch's to fp32 rounding (compilers may contract a multiply-add into an fma).
// LAMB follows gpt2forge.train.optim.Lamb: pass 1 updates the moments and sums ||w||^2 and ||u||^2
// of u = m/bc1 / (sqrt(v)/sqrt(bc2) + eps) + wd*w; pass 2 recomputes u and applies
// w = w - lr * (ratio * u), ratio = min(||w||, max_weight_norm) / ||u|| (1 when either is 0).
//
// Vector paths: AVX-512F and AVX2+FMA+F16C intrinsics, chosen once at run time from the CPU's
// features, and a portable scalar loop (other CPUs, and every tail). The library is built without
// -march=native, so each path is compiled with its own target attribute and `flatten` pulls the
// shared templated body into it.
//
// param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors of one size (any shape); grad: the same
// size, fp32, bf16 or fp16; device_copy: absent, or bf16/fp16 of the same size (the multi-tensor
// ops take a list of each, and a step count per tensor). The PyTorch references are
// torch.optim.AdamW and gpt2forge.train.optim.Lamb (gpt2forge.ops.host_optim falls back to them;
// tests/ops/test_host_optim.py compares against them, and the multi-tensor ops bit for bit against
// the one-tensor ops).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GPT2FORGE_HOST_OPTIM_X86 1
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments of inlined helpers never cross an ABI boundary
#endif

namespace gpt2forge {
namespace {

// Elements per piece, the parallel task: large enough to amortize a task (128 KB per fp32 tensor),
// small enough that the pieces of one step balance across the threads.
constexpr int64_t kGrain = 1 << 15;
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
    if (__builtin_cpu_supports("avx512f"))
      return Kernels{adamw_range_Avx512, lamb_moments_range_Avx512, lamb_apply_range_Avx512, "avx512f"};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Kernels{adamw_range_Avx2, lamb_moments_range_Avx2, lamb_apply_range_Avx2, "avx2"};
#endif
    return Kernels{adamw_range_Scalar, lamb_moments_range_Scalar, lamb_apply_range_Scalar, "portable"};
  }();
  return chosen;
}

Args check_and_bind(const char* op, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy) {
  const int64_t n = param.numel();
  for (const at::Tensor* t : {&param, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(), "gpt2forge::", op,
                ": param, exp_avg and exp_avg_sq must be contiguous float32 CPU tensors");
    TORCH_CHECK(t->numel() == n, "gpt2forge::", op, ": param, exp_avg and exp_avg_sq must have the same size");
  }
  const auto gd = grad.scalar_type();
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n &&
                  (gd == at::kFloat || gd == at::kBFloat16 || gd == at::kHalf),
              "gpt2forge::", op, ": grad must be a contiguous float32/bfloat16/float16 CPU tensor of the param's size");
  Args a{param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), grad.data_ptr(),
         nullptr, gd, at::ScalarType::Undefined, n, Scalars{}};
  if (device_copy.has_value() && device_copy->defined()) {
    const auto cd = device_copy->scalar_type();
    TORCH_CHECK(device_copy->device().is_cpu() && device_copy->is_contiguous() && device_copy->numel() == n &&
                    (cd == at::kBFloat16 || cd == at::kHalf),
                "gpt2forge::", op, ": device_copy must be a contiguous bfloat16/float16 CPU tensor of the param's size");
    a.copy = device_copy->data_ptr();
    a.copy_dtype = cd;
  }
  return a;
}

// Binds tensor i of each list; device_copies is empty (no copies) or one optional tensor per param.
std::vector<Args> check_and_bind_lists(const char* op, at::TensorList params, at::TensorList grads,
                                       at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                       const c10::List<std::optional<at::Tensor>>& device_copies,
                                       at::ArrayRef<double> steps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (device_copies.empty() || device_copies.size() == n),
              "gpt2forge::", op, ": params, grads, exp_avgs, exp_avg_sqs and steps must have one entry per param, "
              "device_copies none or one per param");
  std::vector<Args> args;
  args.reserve(n);
  for (size_t i = 0; i < n; ++i)
    args.push_back(check_and_bind(op, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                  device_copies.empty() ? std::nullopt : device_copies.get(i)));
  return args;
}

// The scalars shared by both optimizers, from the hyper-parameters as torch computes them (double).
Scalars moment_scalars(double beta1, double beta2, double eps, double step, bool bias_correction) {
  Scalars s;
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_grad = !(std::abs(s.lerp_weight) < 0.5f);
  s.beta2 = static_cast<float>(beta2);
  s.grad_sq_weight = static_cast<float>(1.0 - beta2);
  if (bias_correction) {
    s.bc1 = static_cast<float>(1.0 - std::pow(beta1, step));
    s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  }
  s.eps = static_cast<float>(eps);
  return s;
}

// The elements [begin, end) of tensor `t`: one task of a step's parallel region.
struct Piece {
  size_t t;
  int64_t begin, end;
};

// Every tensor cut into pieces of kGrain elements from its start (the last one shorter), in order.
// Cutting at multiples of kGrain from each tensor's start keeps the vector/scalar split of every
// element, hence its rounding, and LAMB's partial sums independent of the thread count.
std::vector<Piece> pieces_of(const std::vector<Args>& args) {
  std::vector<Piece> pieces;
  for (size_t t = 0; t < args.size(); ++t)
    for (int64_t b = 0; b < args[t].n; b += kGrain) pieces.push_back({t, b, std::min(args[t].n, b + kGrain)});
  return pieces;
}

// Calls f(i) for every piece index i in one parallel region: each thread takes the next piece off
// a shared counter, so the work balances by element count whatever the mix of tensor sizes, and a
// thread slowed by other work on its core takes fewer pieces. Runs inline below kGrain elements.
template <class F>
void for_each_piece(const std::vector<Piece>& pieces, const F& f) {
  int64_t elements = 0;
  for (const Piece& p : pieces) elements += p.end - p.begin;
  std::atomic<size_t> next{0};
  const int64_t workers = elements > kGrain ? std::min<int64_t>(at::get_num_threads(), pieces.size()) : 1;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < pieces.size();
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// One AdamW step of the bound tensors: each one's scalars from the group's hyper-parameters and its
// own step count steps[t], then one parallel region over the pieces of all of them.
void adamw_update(std::vector<Args>& args, double lr, double beta1, double beta2, double eps, double weight_decay,
                  at::ArrayRef<double> steps) {
  for (size_t t = 0; t < args.size(); ++t) {
    Scalars& s = args[t].s;
    s = moment_scalars(beta1, beta2, eps, steps[t], /*bias_correction=*/true);
    s.decays = weight_decay != 0.0;
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, steps[t]))));
  }
  const auto kernel = kernels().adamw;
  const std::vector<Piece> pieces = pieces_of(args);
  for_each_piece(pieces, [&](size_t i) { kernel(args[pieces[i].t], pieces[i].begin, pieces[i].end); });
}

// One LAMB step of the bound tensors: pass 1 (moments, partial norms) over the pieces of all of
// them, each tensor's trust ratio from its own pieces' sums, then pass 2 over all pieces.
void lamb_update(std::vector<Args>& args, double lr, double beta1, double beta2, double eps, double weight_decay,
                 at::ArrayRef<double> steps, bool bias_correction, std::optional<double> max_weight_norm) {
  for (size_t t = 0; t < args.size(); ++t) {
    Scalars& s = args[t].s;
    s = moment_scalars(beta1, beta2, eps, steps[t], bias_correction);
    s.decays = weight_decay != 0.0;
    s.wd = static_cast<float>(weight_decay);
    s.neg_step_size = static_cast<float>(-lr);
  }
  const auto& k = kernels();
  const std::vector<Piece> pieces = pieces_of(args);
  std::vector<double> sums(2 * pieces.size(), 0.0);  // ||w||^2, ||u||^2 per piece
  for_each_piece(pieces, [&](size_t i) {
    k.lamb_moments(args[pieces[i].t], pieces[i].begin, pieces[i].end, &sums[2 * i]);
  });
  // Each tensor's norms add its pieces in order: they do not depend on the thread count.
  for (size_t i = 0; i < pieces.size();) {
    double ww = 0.0, uu = 0.0;
    const size_t t = pieces[i].t;
    for (; i < pieces.size() && pieces[i].t == t; ++i) {
      ww += sums[2 * i];
      uu += sums[2 * i + 1];
    }
    float w_norm = static_cast<float>(std::sqrt(ww));
    const float u_norm = static_cast<float>(std::sqrt(uu));
    if (max_weight_norm.has_value()) w_norm = std::min(w_norm, static_cast<float>(*max_weight_norm));
    args[t].s.ratio = (w_norm > 0.0f && u_norm > 0.0f) ? w_norm / u_norm : 1.0f;
  }
  for_each_piece(pieces, [&](size_t i) { k.lamb_apply(args[pieces[i].t], pieces[i].begin, pieces[i].end); });
}

void adamw_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy, double lr, double beta1,
                 double beta2, double eps, double weight_decay, double step) {
  std::vector<Args> args{check_and_bind("adamw_step_", param, grad, exp_avg, exp_avg_sq, device_copy)};
  adamw_update(args, lr, beta1, beta2, eps, weight_decay, {step});
}

void multi_tensor_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, const c10::List<std::optional<at::Tensor>>& device_copies,
                         double lr, double beta1, double beta2, double eps, double weight_decay,
                         at::ArrayRef<double> steps) {
  std::vector<Args> args =
      check_and_bind_lists("multi_tensor_adamw_", params, grads, exp_avgs, exp_avg_sqs, device_copies, steps);
  adamw_update(args, lr, beta1, beta2, eps, weight_decay, steps);
}

void lamb_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy, double lr, double beta1,
                double beta2, double eps, double weight_decay, double step, bool bias_correction,
                std::optional<double> max_weight_norm) {
  std::vector<Args> args{check_and_bind("lamb_step_", param, grad, exp_avg, exp_avg_sq, device_copy)};
  lamb_update(args, lr, beta1, beta2, eps, weight_decay, {step}, bias_correction, max_weight_norm);
}

void multi_tensor_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, const c10::List<std::optional<at::Tensor>>& device_copies,
                        double lr, double beta1, double beta2, double eps, double weight_decay,
                        at::ArrayRef<double> steps, bool bias_correction, std::optional<double> max_weight_norm) {
  std::vector<Args> args =
      check_and_bind_lists("multi_tensor_lamb_", params, grads, exp_avgs, exp_avg_sqs, device_copies, steps);
  lamb_update(args, lr, beta1, beta2, eps, weight_decay, steps, bias_correction, max_weight_norm);
}

std::string host_optim_isa() { return kernels().name; }

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? device_copy, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float step) -> ()");
  m.def("multi_tensor_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)?[] device_copies, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float[] steps) -> ()");
  m.def("lamb_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? device_copy, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float step, bool bias_correction, float? max_weight_norm) -> ()");
  m.def("multi_tensor_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)?[] device_copies, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float[] steps, bool bias_correction, float? max_weight_norm) -> ()");
  m.def("host_optim_isa() -> str", &gpt2forge::host_optim_isa);
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("adamw_step_", &gpt2forge::adamw_step_);
  m.impl("multi_tensor_adamw_", &gpt2forge::multi_tensor_adamw_);
  m.impl("lamb_step_", &gpt2forge::lamb_step_);
  m.impl("multi_tensor_lamb_", &gpt2forge::multi_tensor_lamb_);
}
