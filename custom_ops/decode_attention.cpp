// gpt2forge::decode_attention: one query per (row, head) attending over the filled slots of a KV cache.
//
// A decode step's attention reads the cache: at GPT-2 small, B=1, 192 slots, that is 14 MB per token
// over the 12 layers, next to 498 MB of weights. SDPA under the cache's (B, 1, 1, S) mask reads and
// scores every slot, the ones not written yet included, and its bookkeeping per call costs more than
// the arithmetic: 2.25 ms of a 20.6 ms token in the profile of benchmarks/generation_latency.py's
// shape. This kernel reads only slots pad[b] .. slot of each row (the query in `slot` attends to the
// row's real tokens up to itself, as gpt2forge.generate.kv_cache.attention_mask says; a padding
// query, slot < pad[b], attends to itself alone), each key and value once.
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

#include "pool.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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
// bound by that read: at 128 slots a layer's keys and values are 790 KB. With the AVX2 clone and
// the vectorized exp below, a layer's call took 52-53 us against 64-70 us before (128 slots, the
// cache evicted between calls, 2 threads, three alternating runs; AVX2 machine).
constexpr int64_t kSegments = 4;

// While the scores are taken, each segment asks for its key row kAheadRows ahead, and for the value
// row of the key being scored (the values are read next): the memory system then has the values
// and the coming keys in flight while the core computes. At 128 filled slots (the cache evicted
// between calls, 12 layers a pass, 40 interleaved passes, AVX-512 EPYC) a call took 39.3 us against
// 54.2 us without prefetches, 43.4 us with the values' alone; 2 and 8 rows ahead gave 40.3 and 41.0 us
// (at 64 slots: 23.1 against 31.5 us).
constexpr int64_t kAheadRows = 4;

// Asks for a row's cache lines ahead of their use (a prefetch never faults).
template <typename T>
[[gnu::always_inline]] inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

template <typename T>
[[gnu::always_inline]] inline void attend_one(const float* q, const T* k, const T* v, int64_t lo, int64_t hi,
                                              int64_t D, float scale, float* scores, float* acc, T* out) {
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
    out[d] = static_cast<T>(sum * inv);
  }
}

// attend_one compiled for AVX2 and for baseline x86-64 (vec_math.h); with AVX2 a (row, head) takes
// about half the time.
#define GPT2FORGE_MULTIVERSION GPT2FORGE_TARGET_CLONES("avx2", "default")

GPT2FORGE_MULTIVERSION
void attend(const float* q, const float* k, const float* v, int64_t lo, int64_t hi, int64_t D, float scale,
            float* scores, float* acc, float* out) {
  attend_one(q, k, v, lo, hi, D, scale, scores, acc, out);
}

GPT2FORGE_MULTIVERSION
void attend(const float* q, const c10::BFloat16* k, const c10::BFloat16* v, int64_t lo, int64_t hi, int64_t D,
            float scale, float* scores, float* acc, c10::BFloat16* out) {
  attend_one(q, k, v, lo, hi, D, scale, scores, acc, out);
}

template <typename T>
struct AttendJob {
  const float* q;
  const T *k, *v;
  const int64_t* pad;
  int64_t H, S, D, slot;
  float scale;
  float* work;  // per (row, head): slot + 1 scores, then kSegments x D sums
  T* out;
  int64_t pairs, per;  // B x H (row, head) pairs, `per` of them in each chunk

  static void run_chunk(const void* self, int64_t c) {
    const auto* job = static_cast<const AttendJob*>(self);
    for (int64_t bh = c * job->per; bh < std::min(job->pairs, (c + 1) * job->per); ++bh) job->one(bh);
  }

  void one(int64_t bh) const {
    const int64_t b = bh / H;
    const int64_t lo = pad[b] <= slot ? pad[b] : slot;  // a padding query attends to itself
    float* scores = work + bh * (slot + 1 + kSegments * D);
    attend(q + bh * D, k + bh * S * D, v + bh * S * D, lo, slot, D, scale, scores, scores + slot + 1,
                  out + bh * D);
  }
};

template <typename T>
void attend_all(const at::Tensor& qf, const at::Tensor& k, const at::Tensor& v, const int64_t* pad, int64_t slot,
                float scale, at::Tensor& out) {
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3);
  std::vector<float> work(static_cast<size_t>(B * H * (slot + 1 + kSegments * D)));
  // One chunk of consecutive (row, head) pairs per thread, so that a pair goes to the same thread
  // token after token (the caller claims chunk 0 first) and its cache lines stay with that core.
  // When the VM's two vCPUs sat on different core complexes (a cache line's round trip 365-395 ns,
  // gpt2forge::pool_round_trip_ns), the time from the qkv matmul to the next took 32-36 us a layer
  // against 41-46 with a chunk per pair, which the threads took in a different order each token;
  // 40-77 ns apart it made no difference (GPT-2 small, interleaved generations, 128 filled slots
  // on average; batch 8: 246-261 against 254-281 us).
  const int threads = pool_threads();
  const int64_t pairs = B * H, per = (pairs + threads - 1) / threads;
  const AttendJob<T> job{qf.const_data_ptr<float>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), pad, H, S, D,
                         slot, scale, work.data(), out.mutable_data_ptr<T>(), pairs, per};
  Pool::get().run(&AttendJob<T>::run_chunk, &job, (pairs + per - 1) / per, threads);
}

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
  if (dtype == at::kFloat)
    attend_all<float>(qf, k_cache, v_cache, pp, i, static_cast<float>(scale), out);
  else
    attend_all<c10::BFloat16>(qf, k_cache, v_cache, pp, i, static_cast<float>(scale), out);
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
