// gpt2forge::gemv_linear: y = x @ W.T + b for a few rows of x, streaming W once.
//
// Decoding one token is a chain of matrix-vector products: at batch 1 every weight byte is read
// once per token, so a decode step is bound by memory bandwidth. BLAS sgemm/sgemv calls with
// M = 1..8 rows read GPT-2 small's 498 MB of fp32 weights more slowly than this kernel on the
// 2-core AVX2 development machine (measured: docs/benchmarks.md, Design measurements). This kernel
// hands W out in chunks of rows to the calling thread and its helper threads (Pool, pool.h). Within
// a chunk, one row of x is multiplied with S rows of W at a time, taken from S slices of the chunk,
// so that S read streams are in flight (on the AVX2 machine 8 streams read faster on one core than
// a row after another). S is 4 or 8, set by gpt2forge::gemv_set_streams: which is faster depends
// on the machine's memory system (8 on the AVX2 machine, 4 on the AVX-512 EPYC), so
// gpt2forge.generate.generator measures both.
//
// Chunks are guided: each takes 1/(2 x threads) of the rows still unassigned, at most kMaxChunkBytes
// of W and at least kMinChunkBytes, so the last chunks are small and no thread waits long for
// another's, and the chunks before them are long, restarting the read streams less often. With more
// rows of x each row of W is read once and multiplied into up to 8 rows of x at a time (8 AVX2
// accumulators), so batch 8 costs little more memory traffic than batch 1; x is packed once per
// call so that each step's 8 x vectors are contiguous (pack_rows), and the results go through a
// tile (GemvJob::rows). The measurements behind these choices: docs/benchmarks.md, "Design
// measurements".
//
// bf16 weights are read as bf16 (half the bytes) and widened to fp32 in registers; x and the
// accumulation are fp32 (x is converted once per call), the result is rounded to x's dtype. On a
// CPU without bf16 instructions this is also how bf16 prefill runs: ATen computes bf16 matmuls
// there through conversions, far slower (measured: docs/benchmarks.md, Design measurements).
//
// x (M, K) and W (N, K) on the CPU, both fp32 or both bf16, b (N,) of the same dtype or absent. The PyTorch
// reference is F.linear (gpt2forge.generate.gemv.gemv_linear falls back to it, and tests compare
// against it); the sums are taken in another order, so results agree to fp32 rounding. Each
// row's sum is taken the same way whichever thread, chunk or stream computes it, and (with AVX2)
// however many rows of x share the call: results do not depend on the thread or stream count, and
// a row of x gives the same bits alone as in a batch. gpt2forge::gemv_set_threads(n) sets the
// thread count (0: torch's intra-op count).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "avx2.h"
#include "decode_kernels.h"
#include "pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <thread>
#include <vector>

namespace gpt2forge {
namespace {

// out[m] = dot(x[m * ldx .. + K], w[0 .. K]) for m < MB, portable (vectorized by the compiler
// for the baseline instruction set). W is float or c10::BFloat16.
template <int MB, typename W>
void dots_portable(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t K, float* out) {
  float acc[MB][8] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < 8; ++j) acc[m][j] += x[m * ldx + k + j] * static_cast<float>(w[k + j]);
  for (int m = 0; m < MB; ++m) {
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += acc[m][j];
    for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * static_cast<float>(w[kk]);
    out[m] = s;
  }
}

#ifdef GPT2FORGE_AVX2
// How far ahead of its reads each stream asks for W's lines. The hardware prefetchers restart at
// every chunk and slice; asking 1 KiB ahead made a GPT-2 small token faster on the AVX-512 EPYC
// (2 and 4 KiB ahead were no better; measured: docs/benchmarks.md, Design measurements).
constexpr int64_t kAheadBytes = 1024;
// The several-rows loops read one row of W at a time, each row one stream: asking 4 KiB ahead (into
// the next rows) instead of 1 KiB made two threads read W faster with 2 rows of x on the AMX Xeon
// (measured: docs/benchmarks.md, Design measurements).
constexpr int64_t kPackedAheadBytes = 4096;

// Which prefetch instruction asks for W is a setting (gpt2forge::gemv_set_prefetch), because the best
// one depends on the CPU, by far (measured: docs/benchmarks.md, Design measurements):
// - kNonTemporal (prefetchnta). W is read once per token, and a temporal fetch of half a GB evicts
//   from every cache level what the rest of the step and the Python loop around it use again each
//   token (activations, the KV cache, the step's input tensors, the interpreter's own data). On the
//   AVX-512 EPYC, with NTA a GPT-2 small token spent less time outside the matmul calls (in its
//   slower memory state; no difference in the faster one).
// - kTemporal (prefetcht2, into L2). On the AMX Xeon NTA capped each core's read of W far below
//   T2's: there the decode step fell behind transformers'. The default, as the safe one.
// gpt2forge.generate.generator measures both and keeps the faster.
enum Prefetch : int { kNonTemporal = 0, kTemporal = 1 };

template <int P>
[[gnu::always_inline]] inline void prefetch_once(const void* p) {
  __builtin_prefetch(p, 0, P == kNonTemporal ? 0 : 1);  // prefetchnta or prefetcht2
}

// The 8 lanes of an accumulator added in one fixed order: every kernel below reduces a row's sum
// with it, so a row gives the same bits whichever kernel computed it.
__attribute__((target("avx2"))) inline float lane_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}

// R rows of W against one row of x, one accumulator per row (R = 4 or 8 independent chains).
template <int R, int P, typename W>
__attribute__((target("avx2,fma"))) void stream_dots_avx2(const float* __restrict x, const W* const* w, int64_t K,
                                                            float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  constexpr int64_t ahead = kAheadBytes / static_cast<int64_t>(sizeof(W));
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // 64 bytes of fp32 W a step: one prefetch per line and stream
    for (int r = 0; r < R; ++r) prefetch_once<P>(w[r] + k + ahead);
    const __m256 xv = _mm256_loadu_ps(x + k), xv2 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(w[r] + k), acc[r]);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv2, load8(w[r] + k + 8), acc[r]);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(w[r] + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = lane_sum(acc[r]);
    for (int64_t kk = k; kk < K; ++kk) s += x[kk] * static_cast<float>(w[r][kk]);
    out[r] = s;
  }
}

// MB rows of x against one row of W, x packed for the loop: block k/8 holds the 8 values of each of
// the MB rows at k .. k+8 (xp[k * MB + m * 8 + j] = x[m][k + j]), so each step reads one W vector
// and MB x vectors from 32 * MB contiguous bytes; the K % 8 tail comes from x itself (rows ldx
// apart). One accumulator per row and the same reduction as stream_dots_avx2: a row's sum does not
// depend on how many rows of x share the call. As the streams do, it asks for W
// ahead (kPackedAheadBytes).
template <int MB, int P, typename W>
__attribute__((target("avx2,fma"))) void packed_dots_avx2(const float* __restrict xp, const float* __restrict x,
                                                            int64_t ldx, const W* __restrict w, int64_t K,
                                                            float* out) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  constexpr int64_t ahead = kPackedAheadBytes / static_cast<int64_t>(sizeof(W)), line = 64 / sizeof(W);
  for (int64_t k = 0; k < K8; k += 8) {
    if ((k & (line - 1)) == 0) prefetch_once<P>(w + k + ahead);
    const __m256 wv = load8(w + k);
    const float* xb = xp + k * MB;
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * 8), wv, acc[m]);
  }
  for (int m = 0; m < MB; ++m) {
    float s = lane_sum(acc[m]);
    for (int64_t kk = K8; kk < K; ++kk) s += x[m * ldx + kk] * static_cast<float>(w[kk]);
    out[m] = s;
  }
}

// The AVX-512 forms of the two loops above (gpt2forge::gemv_set_lanes(16)): 16 lanes per
// accumulator, k in steps of 16, then the 16 lanes folded to 8 (lane i + lane i + 8) and reduced by
// lane_sum, then the K % 16 tail one value at a time. Both forms reduce a row the same way, so in
// this mode too a row gives the same bits alone and in a batch; the bits differ from the 8-lane
// mode's. With several rows of x the 8-lane loop is bound by its loads and FMAs, not by memory: on
// the AMX Xeon GPT-2 small's decode read W more slowly at batch 8 than at batch 1 (measured:
// docs/benchmarks.md, Design measurements).
__attribute__((target("avx512f"))) inline float lane_sum16(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX512F only
  return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}

template <int R, int P, typename W>
__attribute__((target("avx512f,avx2,fma"))) void stream_dots_avx512(const float* __restrict x, const W* const* w,
                                                                     int64_t K, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t ahead = kAheadBytes / static_cast<int64_t>(sizeof(W));
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int r = 0; r < R; ++r) prefetch_once<P>(w[r] + k + ahead);
    const __m512 xv = load16(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(xv, load16(w[r] + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = lane_sum16(acc[r]);
    for (int64_t kk = k; kk < K; ++kk) s += x[kk] * static_cast<float>(w[r][kk]);
    out[r] = s;
  }
}

// x packed by 16 (pack_rows<16>): block k/16 holds the 16 values of each of the MB rows at k .. k+16.
template <int MB, int P, typename W>
__attribute__((target("avx512f,avx2,fma"))) void packed_dots_avx512(const float* __restrict xp,
                                                                     const float* __restrict x, int64_t ldx,
                                                                     const W* __restrict w, int64_t K, float* out) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t K16 = K / 16 * 16;
  constexpr int64_t ahead = kPackedAheadBytes / static_cast<int64_t>(sizeof(W)), line = 64 / sizeof(W);
  for (int64_t k = 0; k < K16; k += 16) {
    if ((k & (line - 1)) == 0) prefetch_once<P>(w + k + ahead);
    const __m512 wv = load16(w + k);
    const float* xb = xp + k * MB;
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + m * 16), wv, acc[m]);
  }
  for (int m = 0; m < MB; ++m) {
    float s = lane_sum16(acc[m]);
    for (int64_t kk = K16; kk < K; ++kk) s += x[m * ldx + kk] * static_cast<float>(w[kk]);
    out[m] = s;
  }
}

// x packed by L (pack_rows) against one row of W: the 8-lane (AVX2) or the 16-lane (AVX-512) loop.
template <int MB, int P, int L, typename W>
void packed_dots(const float* xp, const float* x, int64_t ldx, const W* w, int64_t K, float* out) {
  if constexpr (L == 16) {
    packed_dots_avx512<MB, P>(xp, x, ldx, w, K, out);
  } else {
    packed_dots_avx2<MB, P>(xp, x, ldx, w, K, out);
  }
}

#endif

// One row of x against R rows of W at once (w[r] points at row r): R independent read streams
// keep more cache-line misses in flight than one row after another (figures at the top).
template <int R, int P, int L, typename W>
void stream_dots(const float* x, const W* const* w, int64_t K, float* out) {
#ifdef GPT2FORGE_AVX2
  if (L == 16) return stream_dots_avx512<R, P>(x, w, K, out);  // gemv_set_lanes took 16: the CPU has AVX-512
  if (has_avx2_fma()) return stream_dots_avx2<R, P>(x, w, K, out);
#endif
  for (int r = 0; r < R; ++r) dots_portable<1>(x, K, w[r], K, out + r);
}

// The largest and smallest chunk of W one claim takes (header), and the read streams one row of x
// is multiplied with at batch 1 (gpt2forge::gemv_set_streams).
constexpr int64_t kMaxChunkBytes = int64_t{3} << 19;  // 1.5 MiB
constexpr int64_t kMinChunkBytes = int64_t{64} << 10;
constexpr int kMaxChunks = 1024;
// Rows of W in the output tile of GemvJob::rows with several rows of x.
constexpr int64_t kTileW = 64;
inline std::atomic<int64_t> stream_setting{4};
inline std::atomic<int64_t> prefetch_setting{1};  // a Prefetch (gpt2forge::gemv_set_prefetch)
inline std::atomic<int64_t> lanes_setting{8};  // 8 (AVX2) or 16 (AVX-512) lanes (gpt2forge::gemv_set_lanes)

// The row bounds of a job's chunks for N rows of `row_bytes` on `threads` threads: chunk c is rows
// bounds[c] .. bounds[c + 1]; returns the number of chunks. Each chunk is 1/(2 x threads) of the rows
// left, within [kMinChunkBytes, kMaxChunkBytes], rounded up to a multiple of `multiple` rows.
int guided_bounds(int64_t N, int64_t row_bytes, int threads, int64_t multiple, int64_t* bounds) {
  const int64_t most = std::max<int64_t>(1, kMaxChunkBytes / row_bytes);
  const int64_t least = std::min(most, std::max<int64_t>(1, kMinChunkBytes / row_bytes));
  const int64_t least_chunk = std::max<int64_t>(least, (N + kMaxChunks - 2) / (kMaxChunks - 1));
  int n = 0;
  bounds[0] = 0;
  for (int64_t lo = 0; lo < N; ++n) {
    const int64_t share = (N - lo + 2 * threads - 1) / (2 * threads);
    int64_t size = std::clamp<int64_t>(share, least_chunk, std::max(most, least_chunk));
    size = (size + multiple - 1) / multiple * multiple;
    lo = std::min(N, lo + size);
    bounds[n + 1] = lo;
  }
  return n;
}

// y (M, N) fp32 = x (M, K) fp32 @ W.T + b for the rows of W in one chunk.
template <typename W>
struct GemvJob {
  const float* x;
  const W* w;
  const float* b;
  float* y;
  int64_t M, K, N;
  const int64_t* bounds;  // chunk c is rows bounds[c] .. bounds[c + 1] (guided_bounds)
  int streams;  // at batch 1: 4 or 8
  int prefetch;  // a Prefetch
  int lanes;  // 8 or 16: the AVX2 or the AVX-512 loops
  const float* packed;  // M > 1 with AVX2: x's groups of 8, 4 and 1 rows packed by `lanes` (pack_rows), else null
  Epilogue epilogue;  // applied to each stretch of y a chunk wrote, by the thread that wrote it (fn may be null)

  static void run_chunk(const void* self, int64_t chunk) { static_cast<const GemvJob*>(self)->rows(chunk); }

  void rows(int64_t chunk) const {
    const int64_t lo = bounds[chunk], hi = bounds[chunk + 1];
    if (M == 1) {
      if (lanes == 16)
        prefetch == kNonTemporal ? streamed<kNonTemporal, 16>(lo, hi) : streamed<kTemporal, 16>(lo, hi);
      else
        prefetch == kNonTemporal ? streamed<kNonTemporal, 8>(lo, hi) : streamed<kTemporal, 8>(lo, hi);
      if (epilogue.fn) epilogue.fn(epilogue.ctx, y + lo, lo, hi - lo);
      return;
    }
    // kTileW rows of W at a time into a (M, kTileW) tile, written out row of y by row of y. Storing
    // each result straight into y (M stores N floats apart per row of W) made the loop slower
    // (measured: docs/benchmarks.md, Design measurements).
    thread_local std::vector<float> tile_buffer;  // this thread's, grown to the largest M seen
    if (tile_buffer.size() < static_cast<size_t>(M * kTileW)) tile_buffer.resize(static_cast<size_t>(M * kTileW));
    float* tile = tile_buffer.data();
    for (int64_t t = lo; t < hi; t += kTileW) {
      const int64_t here = std::min(kTileW, hi - t);
      for (int64_t i = 0; i < here; ++i) {
        if (lanes == 16)
          prefetch == kNonTemporal ? row<kNonTemporal, 16>(t + i, tile + i, kTileW)
                                   : row<kTemporal, 16>(t + i, tile + i, kTileW);
        else
          prefetch == kNonTemporal ? row<kNonTemporal, 8>(t + i, tile + i, kTileW)
                                   : row<kTemporal, 8>(t + i, tile + i, kTileW);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < here; ++i) y[m * N + t + i] = tile[m * kTileW + i] + (b ? b[t + i] : 0.0f);
      if (epilogue.fn)
        for (int64_t m = 0; m < M; ++m) epilogue.fn(epilogue.ctx, y + m * N + t, t, here);
    }
  }

  // Rows lo .. hi of W against the one row of x: `streams` streams, each running down its own
  // contiguous slice of `per` rows.
  template <int P, int L>
  void streamed(int64_t lo, int64_t hi) const {
    if (streams == 4)
      streamed<4, P, L>(lo, hi);
    else
      streamed<8, P, L>(lo, hi);
  }

  template <int S, int P, int L>
  void streamed(int64_t lo, int64_t hi) const {
    const int64_t per = (hi - lo) / S;
    for (int64_t i = 0; i < per; ++i) {
      const W* ws[S];
      float out[S];
      for (int s = 0; s < S; ++s) ws[s] = w + (lo + s * per + i) * K;
      stream_dots<S, P, L>(x, ws, K, out);
      for (int s = 0; s < S; ++s) store(0, lo + s * per + i, out[s]);
    }
    for (int64_t n = lo + S * per; n < hi; ++n) {  // the same sum for a row as in the streams
      const W* wn = w + n * K;
      float out;
      stream_dots<1, P, L>(x, &wn, K, &out);
      store(0, n, out);
    }
  }

  // Every row of x against row n of W, 8, then 4, then 1 rows of x at a time: row m's result to
  // out[m * stride] (bias not added).
  template <int P, int L>
  void row(int64_t n, float* out_base, int64_t stride) const {
    const W* wn = w + n * K;
    float out[8];
    int64_t m = 0;
    const auto put = [&](int count) {
      for (int i = 0; i < count; ++i) out_base[(m + i) * stride] = out[i];
    };
#ifdef GPT2FORGE_AVX2
    if (packed != nullptr) {  // always with AVX2 (gemv_rows); L == 16 only with AVX-512 (gemv_set_lanes)
      const int64_t KL = K / L * L;
      for (; m + 8 <= M; m += 8) {
        packed_dots<8, P, L>(packed + m * KL, x + m * K, K, wn, K, out);
        put(8);
      }
      for (; m + 4 <= M; m += 4) {
        packed_dots<4, P, L>(packed + m * KL, x + m * K, K, wn, K, out);
        put(4);
      }
      for (; m < M; ++m) {
        packed_dots<1, P, L>(packed + m * KL, x + m * K, K, wn, K, out);
        put(1);
      }
      return;
    }
#endif
    for (; m + 8 <= M; m += 8) {
      dots_portable<8>(x + m * K, K, wn, K, out);
      put(8);
    }
    for (; m + 4 <= M; m += 4) {
      dots_portable<4>(x + m * K, K, wn, K, out);
      put(4);
    }
    for (; m < M; ++m) {
      dots_portable<1>(x + m * K, K, wn, K, out);
      put(1);
    }
  }

  void store(int64_t m, int64_t n, float v) const { y[m * N + n] = v + (b ? b[n] : 0.0f); }
};

int64_t gemv_set_streams(int64_t streams) {
  TORCH_CHECK(streams == 4 || streams == 8, "gpt2forge::gemv_set_streams: expected 4 or 8 read streams, got ",
              streams);
  return stream_setting.exchange(streams);
}

int64_t gemv_set_prefetch(int64_t prefetch) {
  TORCH_CHECK(prefetch == kNonTemporal || prefetch == kTemporal,
              "gpt2forge::gemv_set_prefetch: expected 0 (non-temporal, prefetchnta) or 1 (temporal, prefetcht2), got ",
              prefetch);
  return prefetch_setting.exchange(prefetch);
}

int64_t gemv_set_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "gpt2forge::gemv_set_lanes: expected 8 (AVX2) or 16 (AVX-512) lanes, got ",
              lanes);
#ifdef GPT2FORGE_AVX2
  TORCH_CHECK(lanes == 8 || has_avx512f(), "gpt2forge::gemv_set_lanes: 16 lanes need AVX-512, which this CPU lacks");
#else
  TORCH_CHECK(lanes == 8, "gpt2forge::gemv_set_lanes: 16 lanes need an x86 CPU with AVX-512");
#endif
  return lanes_setting.exchange(lanes);
}

int64_t gemv_set_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "gpt2forge::gemv_set_threads: expected a thread count >= 0 (0: torch's), got ", threads);
  return pool_thread_setting.exchange(threads);
}

// Two sides of the pool passing a cache line back and forth (pool_round_trip_ns).
struct PingPong {
  int64_t rounds;
  mutable std::atomic<int> sides{0};
  alignas(64) mutable std::atomic<int64_t> turn{0};  // 2i: side 0's move, 2i + 1: side 1's; -1: given up
  mutable double ns = std::numeric_limits<double>::quiet_NaN();

  static void run(const void* self, int64_t) { static_cast<const PingPong*>(self)->play(); }

  void play() const {
    const int side = sides.fetch_add(1);
    if (side > 1) return;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < rounds; ++i) {
      const int64_t want = 2 * i + side;
      for (int64_t seen = turn.load(std::memory_order_acquire); seen != want;
           seen = turn.load(std::memory_order_acquire)) {
        if (seen < 0) return;
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(100)) {
          turn.store(-1, std::memory_order_release);  // the other side never came (no helper running)
          return;
        }
      }
      turn.store(want + 1, std::memory_order_release);
    }
    if (side == 0) ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / rounds;
  }
};

// The round trip of a cache line between the caller's core and the pool's first helper's, in ns
// (the mean over `rounds` exchanges); NaN when no helper took part. How far apart the two cores
// are shapes every call: on the 2-core AVX-512 EPYC VM this reads short at times and much longer
// at others (the two vCPUs on different core complexes, each with its own L3 and memory path),
// and the decode step's work outside its matmuls, which passes data between the threads, takes
// longer in the far state than in the near one (benchmarks/generation_latency.py prints it with
// each round; the figures: docs/benchmarks.md, "What the two bandwidth states of the AVX-512 EPYC
// are").
double pool_round_trip_ns(int64_t rounds) {
  TORCH_CHECK(rounds >= 1, "gpt2forge::pool_round_trip_ns: expected rounds >= 1, got ", rounds);
  for (int attempt = 0;; ++attempt) {  // a helper started by the first job only takes part in later ones
    const PingPong game{rounds};
    Pool::get().run(&PingPong::run, &game, 2, 2);
    if (!std::isnan(game.ns) || attempt == 1) return game.ns;
  }
}

#ifdef GPT2FORGE_AVX2
// x (M, K)'s rows in the groups GemvJob::row takes them (8 at a time, then 4, then 1), each group
// of MB rows starting at m packed at m * KL in blocks of L values, as packed_dots_avx2 (L = 8) and
// packed_dots_avx512 (L = 16) read it (KL = K rounded down to L).
std::vector<float> pack_rows(const float* x, int64_t M, int64_t K, int64_t L) {
  const int64_t KL = K / L * L;
  std::vector<float> packed(static_cast<size_t>(std::max<int64_t>(1, M * KL)));  // K < L: empty, but a pointer
  int64_t m = 0;
  for (const int64_t MB : {8, 4, 1})
    for (; m + MB <= M; m += MB)
      for (int64_t k = 0; k < KL; k += L)
        for (int64_t r = 0; r < MB; ++r)
          for (int64_t j = 0; j < L; ++j) packed[m * KL + k * MB + r * L + j] = x[(m + r) * K + k + j];
  return packed;
}
#endif

template <typename W>
void gemv_rows(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N,
               Epilogue epilogue = {}) {
  const int threads = pool_threads();
  const int streams = static_cast<int>(stream_setting.load(std::memory_order_relaxed));
  const int prefetch = static_cast<int>(prefetch_setting.load(std::memory_order_relaxed));
  const int lanes = static_cast<int>(lanes_setting.load(std::memory_order_relaxed));
  int64_t bounds[kMaxChunks + 1];
  const int chunks = guided_bounds(N, K * static_cast<int64_t>(sizeof(W)), threads, M == 1 ? streams : 1, bounds);
  std::vector<float> packed;  // never empty once packed
#ifdef GPT2FORGE_AVX2
  if (M > 1 && has_avx2_fma()) packed = pack_rows(xp, M, K, lanes);
#endif
  const GemvJob<W> job{xp, wp, bp, yp, M, K, N, bounds, streams, prefetch, lanes,
                       packed.empty() ? nullptr : packed.data(), epilogue};
  Pool::get().run(&GemvJob<W>::run_chunk, &job, chunks, threads);
}

}  // namespace

void gemv_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
               Epilogue epilogue) {
  gemv_rows(x, w, b, y, M, K, N, epilogue);
}

void gemv_into(const float* x, const c10::BFloat16* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
               Epilogue epilogue) {
  gemv_rows(x, w, b, y, M, K, N, epilogue);
}

namespace {

at::Tensor gemv_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "gpt2forge::gemv_linear: expected x (M, K) and weight (N, K), got ", x.sizes(), " and ",
              weight.sizes());
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "gpt2forge::gemv_linear: expected x and weight both float32 or both bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == dtype && bias->numel() == weight.size(0)),
              "gpt2forge::gemv_linear: expected a bias of ", weight.size(0), " values in the weight's dtype");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "gpt2forge::gemv_linear: expected CPU tensors");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wc = weight.contiguous();
  const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t M = xf.size(0), K = xf.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* bp = has_bias ? bf.const_data_ptr<float>() : nullptr;
  if (dtype == at::kFloat)
    gemv_rows(xf.const_data_ptr<float>(), wc.const_data_ptr<float>(), bp, y.mutable_data_ptr<float>(), M, K, N);
  else
    gemv_rows(xf.const_data_ptr<float>(), wc.const_data_ptr<c10::BFloat16>(), bp, y.mutable_data_ptr<float>(), M, K,
              N);
  return dtype == at::kFloat ? y : y.to(dtype);
}

at::Tensor gemv_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&) {
  return at::empty({x.size(0), weight.size(0)}, x.options());  // x's dtype, as the CPU kernel returns
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("gemv_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Returns the previous setting. No tensors: one kernel for every backend.
  m.def("gemv_set_threads(int threads) -> int", &gpt2forge::gemv_set_threads);
  // Read streams at batch 1 (4 or 8); returns the previous setting.
  m.def("gemv_set_streams(int streams) -> int", &gpt2forge::gemv_set_streams);
  // How W is prefetched: 0 non-temporal (prefetchnta), 1 temporal (prefetcht2); returns the previous setting.
  m.def("gemv_set_prefetch(int prefetch) -> int", &gpt2forge::gemv_set_prefetch);
  // The loops' vector lanes: 8 (AVX2) or 16 (AVX-512, where the CPU has it); returns the previous setting.
  m.def("gemv_set_lanes(int lanes) -> int", &gpt2forge::gemv_set_lanes);
  // The caller's and the first helper's cores: a cache line's round trip in ns (NaN: no helper).
  m.def("pool_round_trip_ns(int rounds) -> float", &gpt2forge::pool_round_trip_ns);
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("gemv_linear", &gpt2forge::gemv_linear);
}

TORCH_LIBRARY_IMPL(gpt2forge, Meta, m) {
  m.impl("gemv_linear", &gpt2forge::gemv_linear_meta);
}
