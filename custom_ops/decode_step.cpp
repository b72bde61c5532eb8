// gpt2forge.DecodeModel: one decode step of a GPT-2 (one new token per row through every layer and
// the LM head) in one call, for the CPU.
//
// A compiled decode step spends its time reading the weights (gemv.cpp) and, around that, entering
// and leaving the graph: inductor's wrapper takes ~175 tensors in and releases them after, and a
// dozen small kernels and dispatcher calls run between the matmuls of each layer. On GPT-2 small
// on the 2-core EPYC that work showed in rdtsc traces of every matmul call as the gap from the LM
// head's matmul to the next token's first and the gaps between a layer's other matmuls. Here the
// step's small work runs in plain loops on the calling thread between the same matmul and attention
// kernels (gemv_into, attend_into), entered once per token, which shortens both kinds of gap in
// the same traces (measured: docs/benchmarks.md, Design measurements).
//
// DecodeModel(params, caches, scales, n_head, eps, activation) holds:
//   params: wte (Vp, C), wpe (P, C), then per layer ln_1 weight, bias (C,); c_attn weight (3C, C),
//     bias (3C,); attn c_proj weight (C, C), bias (C,); ln_2 weight, bias (C,); c_fc weight (I, C),
//     bias (I,); mlp c_proj weight (C, I), bias (C,); then ln_f weight, bias (C,), the LM head's
//     weight (V, C) and optionally its bias (V,): all float32 or all bfloat16, contiguous;
//   caches: each layer's key and value cache (B, H, S, D) in that dtype (the layout of
//     gpt2forge.generate.kv_cache.CachedLM, rows left-padded);
//   scales: each layer's attention scale; activation: "gelu_tanh", "gelu", "relu", "quick_gelu" or
//     "silu".
// step(ids (B, 1) int64, slot (1,) int64, pad (B,) int64) writes the tokens' keys and values into the
// caches' slot `slot` and returns the LM head's logits (B, V) in float32. Activations, LayerNorm and
// attention are computed in fp32 (bf16 weights and caches widened as read). The reference is
// CachedLM's forward (tests/generate/test_fused_step.py).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "avx2.h"
#include "decode_kernels.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace gpt2forge {
namespace {

enum class Act { kGeluTanh, kGelu, kRelu, kQuickGelu, kSilu };

Act parse_activation(const std::string& name) {
  if (name == "gelu_tanh") return Act::kGeluTanh;
  if (name == "gelu") return Act::kGelu;
  if (name == "relu") return Act::kRelu;
  if (name == "quick_gelu") return Act::kQuickGelu;
  if (name == "silu") return Act::kSilu;
  TORCH_CHECK(false, "gpt2forge.DecodeModel: unknown activation '", name,
              "' (expected gelu_tanh, gelu, relu, quick_gelu or silu)");
}

constexpr int64_t kPerLayer = 12;  // the tensors of one block in `params`

// The sum of (x[i] - shift)^2 over x[0 .. n] in 8 lanes (vectorized by the compiler without
// -ffast-math), and below the sum of x[0 .. n] the same way.
inline float lane_sum_squares(const float* x, int64_t n, float shift) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += (x[i + l] - shift) * (x[i + l] - shift);
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += (x[i] - shift) * (x[i] - shift);
  return s;
}

inline float lane_sum(const float* x, int64_t n) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += x[i + l];
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += x[i];
  return s;
}

// y (C,) = LayerNorm(x (C,)) with weight w and bias b: the mean, then the (biased) variance about it.
template <typename T>
void layer_norm(const float* x, const T* w, const T* b, int64_t C, float eps, float* y) {
  const float mean = lane_sum(x, C) / static_cast<float>(C);
  const float var = lane_sum_squares(x, C, mean) / static_cast<float>(C);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - mean) * inv * static_cast<float>(w[c]) + static_cast<float>(b[c]);
}

// tanh(u) from exp of a non-positive argument: sign(u) (1 - e) / (1 + e), e = exp(-2|u|).
inline float tanh_via_exp(float u) {
  const float e = exp_nonpositive(-2.0f * std::fabs(u));
  return std::copysign((1.0f - e) / (1.0f + e), u);
}

// 1 / (1 + exp(-z)) from exp of a non-positive argument.
inline float sigmoid_via_exp(float z) {
  const float e = exp_nonpositive(-std::fabs(z));
  return z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

inline float gelu_tanh(float v) {
  return 0.5f * v * (1.0f + tanh_via_exp(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

#ifdef GPT2FORGE_AVX2
// gelu_tanh over n values, 8 at a time, in the scalar function's arithmetic (its time on GPT-2
// small's 3072 values: docs/benchmarks.md, Design measurements).
__attribute__((target("avx2"))) void gelu_tanh_avx2(float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), v), v);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(v, v3));
    const __m256 e = exp8_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, u)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 th = _mm256_or_ps(t, _mm256_and_ps(sign, u));  // t >= 0: u's sign
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(one, th)));
  }
  for (; i < n; ++i) x[i] = gelu_tanh(x[i]);
}
#endif

// The MLP's activation in place over n values (gelu's erf and the sigmoids in scalar loops: only
// GPT-2 variants that use them pay for that).
void activate(float* x, int64_t n, Act act) {
  switch (act) {
    case Act::kGeluTanh:
#ifdef GPT2FORGE_AVX2
      if (has_avx2_fma()) return gelu_tanh_avx2(x, n);
#endif
      for (int64_t i = 0; i < n; ++i) x[i] = gelu_tanh(x[i]);
      break;
    case Act::kGelu:
      for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.7071067811865476f));
      break;
    case Act::kRelu:
      for (int64_t i = 0; i < n; ++i) x[i] = std::max(x[i], 0.0f);
      break;
    case Act::kQuickGelu:
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] * sigmoid_via_exp(1.702f * x[i]);
      break;
    case Act::kSilu:
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] * sigmoid_via_exp(x[i]);
      break;
  }
}

template <typename T>
void add_bias(float* y, const T* b, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] += static_cast<float>(b[n]);
}

// What the MLP's first matmul does to its outputs, on the thread that computed them: a bf16 bias
// (fp32 ones go into the kernel's stores), then the activation. Done by the caller after the matmul,
// the activation over GPT-2 small's 3072 values (half of them computed on the other core) took
// longer than the same work on values in the caller's cache (measured: docs/benchmarks.md, Design
// measurements).
template <typename T>
struct BiasActivation {
  const T* bias;  // null: none to add
  Act act;

  static void run(const void* self, float* y, int64_t first, int64_t n) {
    const auto* e = static_cast<const BiasActivation*>(self);
    if (e->bias)
      for (int64_t i = 0; i < n; ++i) y[i] += static_cast<float>(e->bias[first + i]);
    activate(y, n, e->act);
  }
};

// y (M, N) = x (M, K) @ w.T + b, then `act` unless null: fp32 biases go into the kernel's stores,
// bf16 ones are added by the epilogue (with the activation) or after.
template <typename T>
void linear(const float* x, const at::Tensor& w, const at::Tensor* b, float* y, int64_t M, const Act* act = nullptr) {
  const int64_t N = w.size(0), K = w.size(1);
  constexpr bool fp32 = std::is_same_v<T, float>;
  const float* fused_bias = nullptr;
  if constexpr (fp32) fused_bias = b ? b->const_data_ptr<float>() : nullptr;
  const T* late_bias = fp32 || !b ? nullptr : b->const_data_ptr<T>();
  if (act) {
    const BiasActivation<T> e{late_bias, *act};
    gemv_into(x, w.const_data_ptr<T>(), fused_bias, y, M, K, N, Epilogue{&BiasActivation<T>::run, &e});
    return;
  }
  gemv_into(x, w.const_data_ptr<T>(), fused_bias, y, M, K, N);
  if (late_bias) add_bias(y, late_bias, M, N);
}

struct Shapes {
  int64_t L, C, I, V, Vp, P, B, H, S, D;
};

// Every tensor's dtype, device, layout and shape, against the first ones'.
Shapes check(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& caches,
             const std::vector<double>& scales, int64_t n_head) {
  const char* op = "gpt2forge.DecodeModel: ";
  const int64_t L = static_cast<int64_t>(scales.size());
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(L >= 1 && (n == 2 + kPerLayer * L + 3 || n == 2 + kPerLayer * L + 4), op, "expected ",
              2 + kPerLayer * L + 3, " or ", 2 + kPerLayer * L + 4, " parameters for ", L,
              " layers (one attention scale per layer), got ", n);
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * L, op, "expected ", 2 * L, " caches (a key and a value per layer), got ",
              caches.size());
  const auto dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, "expected float32 or bfloat16 weights");
  for (const auto* list : {&params, &caches})
    for (const at::Tensor& t : *list)
      TORCH_CHECK(t.scalar_type() == dtype && t.device().is_cpu() && t.is_contiguous(), op,
                  "expected every weight and cache contiguous on the CPU in the embedding's dtype");
  TORCH_CHECK(params[0].dim() == 2 && params[1].dim() == 2, op, "expected wte and wpe (rows, C)");
  Shapes s{};
  s.L = L;
  s.Vp = params[0].size(0);
  s.C = params[0].size(1);
  s.P = params[1].size(0);
  s.I = params[2 + 8].dim() == 2 ? params[2 + 8].size(0) : -1;
  const at::Tensor& head = params[2 + kPerLayer * L + 2];
  TORCH_CHECK(head.dim() == 2 && head.size(1) == s.C, op, "expected the LM head (V, ", s.C, ")");
  s.V = head.size(0);
  const int64_t C = s.C, I = s.I;
  TORCH_CHECK(params[1].size(1) == C && I > 0, op, "expected wpe (P, ", C, ") and c_fc's weight (I, ", C, ")");
  const std::vector<std::vector<int64_t>> block = {{C}, {C}, {3 * C, C}, {3 * C}, {C, C}, {C},
                                                   {C}, {C}, {I, C},     {I},     {C, I}, {C}};
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < kPerLayer; ++i)
      TORCH_CHECK(params[2 + kPerLayer * l + i].sizes() == c10::IntArrayRef(block[i]), op, "layer ", l,
                  ": parameter ", i, " has shape ", params[2 + kPerLayer * l + i].sizes(), ", expected ",
                  c10::IntArrayRef(block[i]));
  TORCH_CHECK(params[2 + kPerLayer * L].sizes() == c10::IntArrayRef({C}) &&
                  params[3 + kPerLayer * L].sizes() == c10::IntArrayRef({C}),
              op, "expected ln_f's weight and bias (", C, ",)");
  if (n == 2 + kPerLayer * L + 4)
    TORCH_CHECK(params[n - 1].sizes() == c10::IntArrayRef({s.V}), op, "expected the LM head's bias (", s.V, ",)");
  const at::Tensor& k0 = caches[0];
  TORCH_CHECK(k0.dim() == 4 && k0.size(1) == n_head && n_head * k0.size(3) == C, op, "expected caches (B, ", n_head,
              ", S, ", C / std::max<int64_t>(n_head, 1), "), got ", k0.sizes());
  for (const at::Tensor& t : caches) TORCH_CHECK(t.sizes() == k0.sizes(), op, "expected the caches all of one shape");
  s.B = k0.size(0);
  s.H = n_head;
  s.S = k0.size(2);
  s.D = k0.size(3);
  return s;
}

template <typename T>
at::Tensor step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& caches, const Shapes& s,
                const int64_t* ids, int64_t slot, const int64_t* pad, const std::vector<double>& scales, float eps,
                Act act) {
  const int64_t B = s.B, C = s.C, I = s.I, H = s.H, S = s.S, D = s.D;
  std::vector<float> x(B * C), h(B * C), qkv(B * 3 * C), q(B * C), att(B * C), y(B * C), f(B * I);
  const T* wte = params[0].const_data_ptr<T>();
  const T* wpe = params[1].const_data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t pos = std::max<int64_t>(slot - pad[b], 0);  // the unpadded prompt's position
    for (int64_t c = 0; c < C; ++c)
      x[b * C + c] = static_cast<float>(wte[ids[b] * C + c]) + static_cast<float>(wpe[pos * C + c]);
  }
  for (int64_t l = 0; l < s.L; ++l) {
    const at::Tensor* w = params.data() + 2 + kPerLayer * l;
    for (int64_t b = 0; b < B; ++b)
      layer_norm(&x[b * C], w[0].const_data_ptr<T>(), w[1].const_data_ptr<T>(), C, eps, &h[b * C]);
    linear<T>(h.data(), w[2], &w[3], qkv.data(), B);
    // q to (B, H, D); this token's key and value into the caches' slot.
    T* kc = caches[2 * l].data_ptr<T>();
    T* vc = caches[2 * l + 1].data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) {
      const float* row = &qkv[b * 3 * C];
      std::copy(row, row + C, &q[b * C]);
      for (int64_t hd = 0; hd < H; ++hd) {
        T* kd = kc + ((b * H + hd) * S + slot) * D;
        T* vd = vc + ((b * H + hd) * S + slot) * D;
        for (int64_t d = 0; d < D; ++d) {
          kd[d] = static_cast<T>(row[C + hd * D + d]);
          vd[d] = static_cast<T>(row[2 * C + hd * D + d]);
        }
      }
    }
    attend_into(q.data(), kc, vc, pad, B, H, S, D, slot, static_cast<float>(scales[l]), att.data());
    linear<T>(att.data(), w[4], &w[5], y.data(), B);
    for (int64_t i = 0; i < B * C; ++i) x[i] += y[i];
    for (int64_t b = 0; b < B; ++b)
      layer_norm(&x[b * C], w[6].const_data_ptr<T>(), w[7].const_data_ptr<T>(), C, eps, &h[b * C]);
    linear<T>(h.data(), w[8], &w[9], f.data(), B, &act);
    linear<T>(f.data(), w[10], &w[11], y.data(), B);
    for (int64_t i = 0; i < B * C; ++i) x[i] += y[i];
  }
  const int64_t last = 2 + kPerLayer * s.L;
  for (int64_t b = 0; b < B; ++b)
    layer_norm(&x[b * C], params[last].const_data_ptr<T>(), params[last + 1].const_data_ptr<T>(), C, eps, &h[b * C]);
  at::Tensor logits = at::empty({B, s.V}, params[0].options().dtype(at::kFloat));
  const bool head_bias = static_cast<int64_t>(params.size()) == last + 4;
  linear<T>(h.data(), params[last + 2], head_bias ? &params[last + 3] : nullptr, logits.mutable_data_ptr<float>(), B);
  return logits;
}

// The model's tensors and settings, checked once; step() runs a token through them. A class rather
// than an op taking the ~150 tensors each call: through the dispatcher, that call's entry and return
// cost each token the list's conversion and the autograd fallback's work on the mutated caches
// (measured: docs/benchmarks.md, Design measurements).
struct DecodeModel : torch::CustomClassHolder {
  std::vector<at::Tensor> params, caches;
  std::vector<double> scales;
  int64_t n_head;
  float eps;
  Act act;
  Shapes s;

  DecodeModel(std::vector<at::Tensor> params_, std::vector<at::Tensor> caches_, std::vector<double> scales_,
              int64_t n_head_, double eps_, const std::string& activation)
      : params(std::move(params_)), caches(std::move(caches_)), scales(std::move(scales_)), n_head(n_head_),
        eps(static_cast<float>(eps_)), act(parse_activation(activation)) {
    TORCH_CHECK(n_head >= 1, "gpt2forge.DecodeModel: expected n_head >= 1, got ", n_head);
    s = check(params, caches, scales, n_head);
  }

  at::Tensor step(const at::Tensor& ids, const at::Tensor& slot, const at::Tensor& pad) const {
    const char* op = "gpt2forge.DecodeModel.step: ";
    TORCH_CHECK(ids.scalar_type() == at::kLong && pad.scalar_type() == at::kLong && slot.scalar_type() == at::kLong &&
                    ids.device().is_cpu() && pad.device().is_cpu() && slot.device().is_cpu(),
                op, "expected ids, slot and pad int64 on the CPU");
    TORCH_CHECK(ids.numel() == s.B && pad.numel() == s.B && slot.numel() == 1, op, "expected ids (", s.B,
                ", 1), pad (", s.B, ",) and slot (1,), got ", ids.sizes(), ", ", pad.sizes(), " and ", slot.sizes());
    const at::Tensor idc = ids.contiguous(), padc = pad.contiguous();
    const int64_t* ip = idc.const_data_ptr<int64_t>();
    const int64_t* pp = padc.const_data_ptr<int64_t>();
    const int64_t i = slot.item<int64_t>();
    TORCH_CHECK(0 <= i && i < s.S, op, "slot ", i, " outside the caches' ", s.S, " slots");
    for (int64_t b = 0; b < s.B; ++b) {
      TORCH_CHECK(0 <= ip[b] && ip[b] < s.Vp, op, "token id ", ip[b], " in row ", b, " outside the embedding's ", s.Vp,
                  " rows");
      TORCH_CHECK(pp[b] >= 0, op, "negative padding ", pp[b], " in row ", b);
      TORCH_CHECK(i - pp[b] < s.P, op, "position ", i - pp[b], " in row ", b, " beyond the position embedding's ",
                  s.P, " rows");
    }
    if (params[0].scalar_type() == at::kFloat) return gpt2forge::step<float>(params, caches, s, ip, i, pp, scales, eps, act);
    return gpt2forge::step<c10::BFloat16>(params, caches, s, ip, i, pp, scales, eps, act);
  }
};

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.class_<gpt2forge::DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>, int64_t, double,
                       std::string>())
      .def("step", &gpt2forge::DecodeModel::step);
}
