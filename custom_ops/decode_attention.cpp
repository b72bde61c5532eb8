// gpt2forge::decode_attention: one query per (row, head) attending over the filled slots of a KV cache.
//
// A decode step's attention reads the cache: at GPT-2 small, B=1, 192 slots, that is 14 MB per token
// over the 12 layers, next to 498 MB of weights. SDPA under the cache's (B, 1, 1, S) mask reads and
// scores every slot, the ones not written yet included, and its bookkeeping per call costs more than
// the arithmetic (in the profile of benchmarks/generation_latency.py's shape; measured:
// docs/benchmarks.md, Design measurements). This kernel reads only slots pad[b] .. slot of each row
// (the query in `slot` attends to the row's real tokens up to itself, as
// gpt2forge.generate.kv_cache.attention_mask says; a padding query, slot < pad[b], attends to
// itself alone), each key and value once.
//
// q (B, H, 1, D); k_cache, v_cache (B, H, S, D), contiguous, the new key and value already stored
// in `slot`; pad (B,) int64; slot a one-element int64 tensor (a tensor, so that a compiled decode step
// takes it as an input); scale multiplies q.k. fp32 or bf16 (bf16 widened to fp32 in registers; the
// sums in fp32, the result rounded to q's dtype). Returns (B, H, 1, D), contiguous. The reference is
// F.scaled_dot_product_attention under that mask (tests/ops/test_custom_ops.py); the softmax is
// taken with the same max subtraction, so the two agree to fp32 rounding. The (row, head) pairs are
// shared by the threads of the matmul kernel's pool (pool.h; gpt2forge::gemv_set_threads sets how
// many), not torch's: a decode step runs torch's ops on one thread, and the pool never waits for a
// thread that has not started.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "avx2.h"
#include "decode_kernels.h"
#include "isa.h"
#include "pool.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

namespace gpt2forge {
namespace {

// dot(q, k[0 .. D]) in 8 lanes (sums in a fixed order: the compiler vectorizes it without -ffast-math).
template <typename T>
[[gnu::always_inline]] inline float dot(const float* q, const T* k, int64_t D) {
  float lane[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; ++l) lane[l] += q[d + l] * static_cast<float>(k[d + l]);
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// The slots of one (row, head) are read as kSegments interleaved segments (slot j of each at once),
// so that that many cache-line streams are in flight: the cache comes from memory (the step's
// weights evict it), and one stream at a time left a core waiting on each line. The kernel is
// bound by that read: at 128 slots a layer's keys and values are 790 KB. The AVX2 clone and the
// vectorized exp below made a layer's call faster on the AVX2 machine (docs/benchmarks.md, "Design
// measurements", has these kernels' A/Bs).
constexpr int64_t kSegments = 4;

// While the scores are taken, each segment asks for its key row kAheadRows ahead, and for the value
// row of the key being scored (the values are read next): the memory system then has the values
// and the coming keys in flight while the core computes, and a call with the cache evicted is
// faster than without prefetches (AVX-512 EPYC; 2 and 8 rows ahead were no better than 4; measured:
// docs/benchmarks.md, Design measurements).
constexpr int64_t kAheadRows = 4;

// Asks for a row's cache lines ahead of their use (a prefetch never faults).
template <typename T>
[[gnu::always_inline]] inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

template <typename T, typename O>
[[gnu::always_inline]] inline void attend_one(const float* q, const T* k, const T* v, int64_t lo, int64_t hi,
                                              int64_t D, float scale, float* scores, float* acc, O* out) {
  const int64_t n = hi - lo + 1, per = n / kSegments, rest = lo + kSegments * per;
  for (int64_t i = 0; i < per; ++i)
    for (int64_t g = 0; g < kSegments; ++g) {
      const int64_t j = lo + g * per + i;
      if (i + kAheadRows < per) prefetch_row(k + (j + kAheadRows) * D, D);
      prefetch_row(v + j * D, D);
      scores[j - lo] = dot(q, k + j * D, D) * scale;
    }
  for (int64_t j = rest; j <= hi; ++j) {
    prefetch_row(v + j * D, D);
    scores[j - lo] = dot(q, k + j * D, D) * scale;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, scores[j]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = exp_nonpositive(scores[j] - top);
    total += scores[j];
  }
  // acc holds kSegments partial sums of D values, added in a fixed order at the end.
  std::fill(acc, acc + kSegments * D, 0.0f);
  for (int64_t i = 0; i < per; ++i)
    for (int64_t g = 0; g < kSegments; ++g) {
      const int64_t j = lo + g * per + i;
      const float p = scores[j - lo];
      const T* vj = v + j * D;
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vj[d]);
    }
  for (int64_t j = rest; j <= hi; ++j) {
    const float p = scores[j - lo];
    const T* vj = v + j * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vj[d]);
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) {
    float sum = 0.0f;
    for (int64_t g = 0; g < kSegments; ++g) sum += acc[g * D + d];
    out[d] = static_cast<O>(sum * inv);
  }
}

// attend_one compiled for AVX2 and for baseline x86-64, called through the one isa_path() picks
// (GPT2FORGE_ISA_CLONES_AVX2, isa.h); with AVX2 a (row, head) takes less time (measured:
// docs/benchmarks.md, Design measurements).
#define GPT2FORGE_ATTEND_ARGS (q, k, v, lo, hi, D, scale, scores, acc, out)
GPT2FORGE_ISA_CLONES_AVX2(void, attend, (const float* q, const float* k, const float* v, int64_t lo, int64_t hi,
                                         int64_t D, float scale, float* scores, float* acc, float* out),
                          GPT2FORGE_ATTEND_ARGS, attend_one)
GPT2FORGE_ISA_CLONES_AVX2(void, attend, (const float* q, const c10::BFloat16* k, const c10::BFloat16* v, int64_t lo,
                                         int64_t hi, int64_t D, float scale, float* scores, float* acc,
                                         c10::BFloat16* out),
                          GPT2FORGE_ATTEND_ARGS, attend_one)
GPT2FORGE_ISA_CLONES_AVX2(void, attend, (const float* q, const c10::BFloat16* k, const c10::BFloat16* v, int64_t lo,
                                         int64_t hi, int64_t D, float scale, float* scores, float* acc, float* out),
                          GPT2FORGE_ATTEND_ARGS, attend_one)
#undef GPT2FORGE_ATTEND_ARGS

#ifdef GPT2FORGE_AVX2
// The head size of every GPT-2 (small to XL): one key, value or query row is 8 AVX2 registers.
constexpr int64_t kFastD = 64;

// Scale x ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])) for 8 accumulators at
// once: lane r of the result is accumulator r's sum, in the order dot64's tail also takes.
__attribute__((target("avx2"))) inline __m256 sums8(const __m256* a, __m256 scale) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_mul_ps(_mm256_add_ps(lo, hi), scale);
}

// q . k for one 64-value key in one accumulator: 8 keys at a time are 8 independent chains, and
// with q they fill the 16 AVX2 registers.
template <typename T>
[[gnu::always_inline]] __attribute__((target("avx2,fma"))) inline __m256 dot64(const __m256* q, const T* k) {
  __m256 a = _mm256_mul_ps(q[0], load8(k));
  for (int i = 1; i < 8; ++i) a = _mm256_fmadd_ps(q[i], load8(k + 8 * i), a);
  return a;
}

// attend_one for D = 64 in AVX2 registers: the scores 8 keys at a time (8 independent chains,
// their lanes summed together by sums8), the softmax's max and exp 8 scores at a time, the weighted
// values in 8 registers; keys and values read as one stream each, asked for kAheadRows8 rows ahead.
// The generic loop compiled to a scalar exp and max and kept its partial sums in memory. In a
// decode step, where the weights' stream has evicted the cache, a layer's call is faster here than
// in the generic loop and reads its 786 KB of keys and values at about the machine's read bandwidth
// (AVX-512 EPYC, its two vCPUs on one core complex; measured: docs/benchmarks.md, Design
// measurements).
constexpr int64_t kAheadRows8 = 8;

template <typename T, typename O>
__attribute__((target("avx2,fma"))) void attend64_avx2(const float* qp, const T* k, const T* v, int64_t lo, int64_t hi,
                                                       float scale, float* scores, O* out) {
  const int64_t n = hi - lo + 1;
  const T* kb = k + lo * kFastD;
  const T* vb = v + lo * kFastD;
  __m256 q[8];
  for (int i = 0; i < 8; ++i) q[i] = _mm256_loadu_ps(qp + 8 * i);
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    if (j + kAheadRows8 + 8 <= n) prefetch_row(kb + (j + kAheadRows8) * kFastD, 8 * kFastD);
    prefetch_row(vb + j * kFastD, 8 * kFastD);
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = dot64(q, kb + (j + r) * kFastD);
    _mm256_storeu_ps(scores + j, sums8(a, sv));
  }
  for (; j < n; ++j) {  // the last n % 8 keys, summed in sums8's order
    prefetch_row(vb + j * kFastD, kFastD);
    alignas(32) float l[8];
    _mm256_store_ps(l, dot64(q, kb + j * kFastD));
    scores[j] = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
  }
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (j = 0; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + j));
  alignas(32) float l[8];
  _mm256_store_ps(l, top8);
  float top = l[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, l[i]);
  for (; j < n; ++j) top = std::max(top, scores[j]);
  const __m256 topv = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), topv));
    _mm256_storeu_ps(scores + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  _mm256_store_ps(l, sum8);
  float total = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; j < n; ++j) {
    scores[j] = exp_nonpositive(scores[j] - top);
    total += scores[j];
  }
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(scores[j]);
    const T* vj = vb + j * kFastD;
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vj + 8 * i), acc[i]);
  }
  const float inv = 1.0f / total;
  alignas(32) float o[kFastD];
  for (int i = 0; i < 8; ++i) _mm256_store_ps(o + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
  for (int64_t d = 0; d < kFastD; ++d) out[d] = static_cast<O>(o[d]);
}
#endif

template <typename T, typename O>
struct AttendJob {
  const float* q;
  const T *k, *v;
  const int64_t* pad;
  int64_t H, S, D, slot;
  float scale;
  float* work;  // per (row, head): slot + 1 scores, then kSegments x D sums
  O* out;
  int64_t pairs, per;  // B x H (row, head) pairs, `per` of them in each chunk

  static void run_chunk(const void* self, int64_t c) {
    const auto* job = static_cast<const AttendJob*>(self);
    for (int64_t bh = c * job->per; bh < std::min(job->pairs, (c + 1) * job->per); ++bh) job->one(bh);
  }

  void one(int64_t bh) const {
    const int64_t b = bh / H;
    const int64_t lo = pad[b] <= slot ? pad[b] : slot;  // a padding query attends to itself
    float* scores = work + bh * (slot + 1 + kSegments * D);
#ifdef GPT2FORGE_AVX2
    if (D == kFastD && has_avx2_fma())
      return attend64_avx2(q + bh * D, k + bh * S * D, v + bh * S * D, lo, slot, scale, scores, out + bh * D);
#endif
    attend(q + bh * D, k + bh * S * D, v + bh * S * D, lo, slot, D, scale, scores, scores + slot + 1,
                  out + bh * D);
  }
};

// q (B, H, D) fp32 over the caches k, v (B, H, S, D) -> out (B, H, D), the pairs shared by the pool.
template <typename T, typename O>
void attend_pairs(const float* q, const T* k, const T* v, const int64_t* pad, int64_t B, int64_t H, int64_t S,
                  int64_t D, int64_t slot, float scale, O* out) {
  const std::unique_ptr<float[]> work(new float[static_cast<size_t>(B * H * (slot + 1 + kSegments * D))]);
  // One chunk of consecutive (row, head) pairs per thread, so that a pair goes to the same thread
  // token after token (the caller claims chunk 0 first) and its cache lines stay with that core.
  // With the VM's two vCPUs on different core complexes (gpt2forge::pool_round_trip_ns) the time
  // from the qkv matmul to the next was shorter than with a chunk per pair, which the threads took
  // in a different order each token; with them close it made no difference (measured:
  // docs/benchmarks.md, Design measurements).
  const int threads = pool_threads();
  const int64_t pairs = B * H, per = (pairs + threads - 1) / threads;
  const AttendJob<T, O> job{q, k, v, pad, H, S, D, slot, scale, work.get(), out, pairs, per};
  Pool::get().run(&AttendJob<T, O>::run_chunk, &job, (pairs + per - 1) / per, threads);
}

}  // namespace

void attend_into(const float* q, const float* k, const float* v, const int64_t* pad, int64_t B, int64_t H, int64_t S,
                 int64_t D, int64_t slot, float scale, float* out) {
  attend_pairs(q, k, v, pad, B, H, S, D, slot, scale, out);
}

void attend_into(const float* q, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* pad, int64_t B,
                 int64_t H, int64_t S, int64_t D, int64_t slot, float scale, float* out) {
  attend_pairs(q, k, v, pad, B, H, S, D, slot, scale, out);
}

namespace {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& pad, const at::Tensor& slot, double scale) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "gpt2forge::decode_attention: expected k_cache and v_cache (B, H, S, D) of one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == B && q.size(1) == H && q.size(2) == 1 && q.size(3) == D,
              "gpt2forge::decode_attention: expected q (", B, ", ", H, ", 1, ", D, "), got ", q.sizes());
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && q.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "gpt2forge::decode_attention: expected q and the caches all float32 or all bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "gpt2forge::decode_attention: expected contiguous caches");
  TORCH_CHECK(pad.scalar_type() == at::kLong && pad.numel() == B && slot.scalar_type() == at::kLong &&
                  slot.numel() == 1,
              "gpt2forge::decode_attention: expected pad (B,) and slot (1,) int64");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  pad.device().is_cpu() && slot.device().is_cpu(),
              "gpt2forge::decode_attention: expected CPU tensors");
  const int64_t i = slot.item<int64_t>();
  TORCH_CHECK(0 <= i && i < S, "gpt2forge::decode_attention: slot ", i, " outside the cache's ", S, " slots");
  const at::Tensor padc = pad.contiguous();
  const int64_t* pp = padc.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pp[b] >= 0, "gpt2forge::decode_attention: negative padding ", pp[b], " in row ", b);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, H, 1, D}, k_cache.options());
  const float* qp = qf.const_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  if (dtype == at::kFloat)
    attend_pairs(qp, k_cache.const_data_ptr<float>(), v_cache.const_data_ptr<float>(), pp, B, H, S, D, i, sc,
                 out.mutable_data_ptr<float>());
  else
    attend_pairs(qp, k_cache.const_data_ptr<c10::BFloat16>(), v_cache.const_data_ptr<c10::BFloat16>(), pp, B, H, S,
                 D, i, sc, out.mutable_data_ptr<c10::BFloat16>());
  return out;
}

at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, double) {
  return at::empty({k_cache.size(0), k_cache.size(1), 1, k_cache.size(3)}, q.options());
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pad, Tensor slot, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("decode_attention", &gpt2forge::decode_attention);
}

TORCH_LIBRARY_IMPL(gpt2forge, Meta, m) {
  m.impl("decode_attention", &gpt2forge::decode_attention_meta);
}
