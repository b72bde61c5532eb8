#pragma once

// The decode kernels on raw pointers, for the fused decode step (decode_step.cpp). The matmul and the
// attention share their work through the pool (pool.h) on gpt2forge::gemv_set_threads's thread count.

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace gpt2forge {

// The most chunks a matmul's rows are cut into (gemv.cpp).
constexpr int64_t kMaxGemvChunks = 1024;

// Work applied in place to a matmul's output, once for each of its chunks and output rows, by the
// thread that computed them: fn(ctx, y, m, chunk, first, n) with y pointing at the n values of row m
// that start at column `first`, chunk c covering columns before those of chunk c + 1.
struct Epilogue {
  void (*fn)(const void* ctx, float* y, int64_t m, int64_t chunk, int64_t first, int64_t n) = nullptr;
  const void* ctx = nullptr;
};

// y (M, N) fp32 = x (M, K) fp32 @ w (N, K).T, + b (N,) fp32 unless null (gemv.cpp: gemv_linear's kernel),
// then the epilogue (unless its fn is null) over each chunk's stretch of y as soon as the thread that
// computed it has. Returns the number of chunks.
int64_t gemv_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
                  Epilogue epilogue = {});
int64_t gemv_into(const float* x, const c10::BFloat16* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
                  Epilogue epilogue = {});

// torch.argmax's choice over p[lo .. hi) (hi > lo; argmax.cpp): `index` is the first index of the
// largest value, `nan` the first NaN's index (-1: none), which torch takes as the largest value.
struct ArgmaxBest {
  float value;
  int64_t index;
  int64_t nan;
};
ArgmaxBest argmax_scan(const float* p, int64_t lo, int64_t hi);

// The choice over two stretches, `a`'s before `b`'s.
inline ArgmaxBest argmax_then(const ArgmaxBest& a, const ArgmaxBest& b) {
  return a.nan >= 0 || !(b.nan >= 0 || b.value > a.value) ? a : b;
}

// out (B, H, D) fp32: each row and head of q (B, H, D) fp32 attending over the filled slots of the
// caches k, v (B, H, S, D), pad[b] .. slot, scaled by `scale` (decode_attention.cpp: the op's kernel).
void attend_into(const float* q, const float* k, const float* v, const int64_t* pad, int64_t B, int64_t H, int64_t S,
                 int64_t D, int64_t slot, float scale, float* out);
void attend_into(const float* q, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* pad, int64_t B,
                 int64_t H, int64_t S, int64_t D, int64_t slot, float scale, float* out);

}  // namespace gpt2forge
