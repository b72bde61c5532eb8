#pragma once

// The decode kernels on raw pointers, for the fused decode step (decode_step.cpp). Both share their
// work through the pool (pool.h) on gpt2forge::gemv_set_threads's thread count.

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace gpt2forge {

// Work applied in place to a stretch of a matmul's output: fn(ctx, y + first, first, n) for the n
// values of one output row that start at column `first`.
struct Epilogue {
  void (*fn)(const void* ctx, float* y, int64_t first, int64_t n) = nullptr;
  const void* ctx = nullptr;
};

// y (M, N) fp32 = x (M, K) fp32 @ w (N, K).T, + b (N,) fp32 unless null (gemv.cpp: gemv_linear's kernel),
// then epilogue (unless null) over each stretch of y as soon as the thread that computed it has.
void gemv_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
               Epilogue epilogue = {});
void gemv_into(const float* x, const c10::BFloat16* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
               Epilogue epilogue = {});

// out (B, H, D) fp32: each row and head of q (B, H, D) fp32 attending over the filled slots of the
// caches k, v (B, H, S, D), pad[b] .. slot, scaled by `scale` (decode_attention.cpp: the op's kernel).
void attend_into(const float* q, const float* k, const float* v, const int64_t* pad, int64_t B, int64_t H, int64_t S,
                 int64_t D, int64_t slot, float scale, float* out);
void attend_into(const float* q, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* pad, int64_t B,
                 int64_t H, int64_t S, int64_t D, int64_t slot, float scale, float* out);

}  // namespace gpt2forge
