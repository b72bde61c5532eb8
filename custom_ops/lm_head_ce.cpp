// gpt2forge::lm_head_ce: the tied LM head and its cross-entropy, fused and chunked.
//
// For hidden states h (N, C) and the tied embedding W (V_pad, C), computes the summed
// cross-entropy of softmax(h @ W[:V].T) against labels (N,), the number of rows whose argmax is
// the label, and the number of scored rows (label != ignore_index), without ever holding the
// (N, V) logits: rows go through in chunks of `token_chunk`, the vocabulary in `vocab_chunks`
// pieces (--enable-sequence-serialized / --serialized-seq-len and
// --embedding-serialization-factor). When `compute_grad` is set, the same pass also produces the
// gradients of the loss sum with respect to h and W, so backward only scales them by the
// incoming gradient and never recomputes the logits.
//
// Columns at or above `vocab_size` (the padding of the embedding table) are never computed: they
// get no probability mass, are never predicted, and their gradient rows stay zero.
//
// Precision: the matmuls run in `compute_dtype` (bf16/fp16 under autocast, else the input's
// dtype); softmax statistics, the loss and the weight gradient accumulate in fp32.
//
// The pure-PyTorch reference with the same contract is gpt2forge.ops.lm_head_loss.lm_head_ce_reference:
// the fallback when this library is not built and the oracle of tests/ops/test_lm_head_loss.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "isa.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace gpt2forge {
namespace {

// The row loops are compiled for AVX-512, AVX2 and baseline x86-64, each called through the one
// isa_path() picks (GPT2FORGE_ISA_CLONES, isa.h).

// The largest value of x, NaNs passed over (as std::max(m, x) does), in sixteen running maxima: GCC
// left the `omp simd reduction(max)` form of this loop as one vmaxss chain (4 cycles a value).
GPT2FORGE_ALWAYS_INLINE float row_max_body(const float* x, int64_t n) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  float lane[16];
  for (float& l : lane) l = kLowest;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] = lane[l] < x[i + l] ? x[i + l] : lane[l];
  float m = kLowest;
  for (const float l : lane) m = std::max(m, l);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}
GPT2FORGE_ISA_CLONES(float, row_max, (const float* x, int64_t n), (x, n), row_max_body)

// sum_i exp(x_i - shift); when `store`, x_i is replaced by exp(x_i - shift).
GPT2FORGE_ALWAYS_INLINE float exp_sum_body(float* x, int64_t n, float shift, bool store) {
  float s = 0.0f;
  if (store) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) {
      const float e = exp_nonpositive(x[i] - shift);
      x[i] = e;
      s += e;
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += exp_nonpositive(x[i] - shift);
  }
  return s;
}
GPT2FORGE_ISA_CLONES(float, exp_sum, (float* x, int64_t n, float shift, bool store), (x, n, shift, store),
                     exp_sum_body)

GPT2FORGE_ALWAYS_INLINE void scale_body(float* x, int64_t n, float a) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}
GPT2FORGE_ISA_CLONES(void, scale, (float* x, int64_t n, float a), (x, n, a), scale_body)

// out = x rounded to bf16 (as Tensor.to(torch.bfloat16) rounds). Through bf16_bits: a loop of
// c10::BFloat16(float) conversions stays scalar (measured: docs/benchmarks.md, Design measurements).
GPT2FORGE_ALWAYS_INLINE void round_to_bf16_body(const float* x, c10::BFloat16* out, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(x[i]);
}
GPT2FORGE_ISA_CLONES(void, round_to_bf16, (const float* x, c10::BFloat16* out, int64_t n), (x, out, n),
                     round_to_bf16_body)

// y = x, or y += x with `add`: bf16 values widened to fp32 (exactly) on the way.
GPT2FORGE_ALWAYS_INLINE void widen_bf16_body(const c10::BFloat16* x, float* y, int64_t n, bool add) {
  if (add) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += static_cast<float>(x[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
  }
}
GPT2FORGE_ISA_CLONES(void, widen_bf16, (const c10::BFloat16* x, float* y, int64_t n, bool add), (x, y, n, add),
                     widen_bf16_body)

// First index of the maximum, as torch.argmax picks it.
int64_t first_index_of(const float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == value) return i;
  }
  return 0;  // value is NaN: no index matches
}

// Running softmax statistics of one row across vocabulary chunks.
struct RowState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;  // sum of exp(logit - max) over the chunks seen
  float best = -std::numeric_limits<float>::infinity();
  int64_t argmax = 0;
  float label_logit = 0.0f;
};

// Fold the chunk `x` (fp32 logits of columns [v0, v0 + n)) into `st`. With `store_exp`, x is left
// holding exp(x - chunk max) (the single-chunk case reuses it as the softmax numerator).
float fold_chunk(RowState& st, float* x, int64_t n, int64_t v0, int64_t label, bool store_exp) {
  const float m = row_max(x, n);
  if (m > st.best) {  // strictly greater: earlier chunks win ties, as torch.argmax does
    st.best = m;
    st.argmax = v0 + first_index_of(x, n, m);
  }
  if (label >= v0 && label < v0 + n) st.label_logit = x[label - v0];
  if (!std::isfinite(m)) {  // inf/NaN logits (fp16 overflow): poison the row, never hide it
    st.max = m;
    st.sum = std::numeric_limits<float>::quiet_NaN();
    return m;
  }
  const float s = exp_sum(x, n, m, store_exp);
  const float new_max = std::max(st.max, m);
  st.sum = st.sum * exp_nonpositive(st.max - new_max) + s * exp_nonpositive(m - new_max);
  st.max = new_max;
  return m;
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                  int64_t vocab_size, int64_t ignore_index, int64_t token_chunk,
                  int64_t vocab_chunks) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
                    "gpt2forge::lm_head_ce: expected hidden (N, C) and weight (V, C), got ",
                    hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == hidden.size(0) &&
                        labels.scalar_type() == at::kLong,
                    "gpt2forge::lm_head_ce: labels must be int64 of shape (N,)");
  TORCH_CHECK_VALUE(vocab_size >= 1 && vocab_size <= weight.size(0),
                    "gpt2forge::lm_head_ce: vocab_size ", vocab_size, " outside [1, ",
                    weight.size(0), "]");
  TORCH_CHECK_VALUE(token_chunk >= 1 && vocab_chunks >= 1,
                    "gpt2forge::lm_head_ce: token_chunk and vocab_chunks must be >= 1");
  TORCH_CHECK_VALUE(hidden.device().is_cpu() && weight.device().is_cpu() && labels.device().is_cpu(),
                    "gpt2forge::lm_head_ce: this kernel runs on the CPU");
  const auto bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size));
  TORCH_CHECK_VALUE(!bad.any().item<bool>(), "gpt2forge::lm_head_ce: a label is outside [0, ",
                    vocab_size, ") and is not ignore_index ", ignore_index);
}

// (n, vlen) fp32 logits of the vocabulary columns [v0, v0 + vlen): h (n, C) @ W[v0:v0 + vlen].T.
// One mm with an (n, 50k)-wide output runs well below the speed of mm's whose output fits the
// cache (MKL, 2-core AVX2, n = 667, C = 768). So the columns go in tiles, each computed by one
// thread: one parallel region for all tiles (many small multi-threaded mm's would each pay a
// barrier, which costs most on a loaded machine). In fp32 a tile is written in place (its rows vlen
// apart, as BLAS takes them) instead of into a temporary copied after: with row_max's sixteen
// lanes, GPT-2 small's head + loss (1024 tokens in chunks of 667, fp32, with gradients) ran faster
// that way on the 2-core AMX Xeon. Measuring each row's stretch of a tile (max, exp-sum) in the
// same thread while it is in its cache was slower there than the separate pass below. (Measured:
// docs/benchmarks.md, Design measurements.)
constexpr int64_t kLogitsTile = 256;  // columns; 2-core AVX2: 128-512 measured alike

// body(c0, w) for the tiles [c0, c0 + w) of [0, vlen), kLogitsTile wide, each on one thread, in one
// parallel region.
template <typename Body>
void for_each_tile(int64_t vlen, const Body& body) {
  const int64_t tiles = (vlen + kLogitsTile - 1) / kLogitsTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c0 = t * kLogitsTile;
      body(c0, std::min(kLogitsTile, vlen - c0));
    }
  });
}

at::Tensor logits_of(const at::Tensor& h, const at::Tensor& W, int64_t v0, int64_t vlen) {
  const int64_t n = h.size(0);
  at::Tensor out = at::empty({n, vlen}, h.options().dtype(at::kFloat));
  float* op = out.mutable_data_ptr<float>();
  for_each_tile(vlen, [&](int64_t c0, int64_t w) {
    at::Tensor tile = out.narrow(1, c0, w);
    const at::Tensor Wt = W.narrow(0, v0 + c0, w).t();
    if (h.scalar_type() == at::kFloat) {
      at::mm_out(tile, h, Wt);
    } else if (h.scalar_type() == at::kBFloat16) {
      // The tile's bf16 products, still in this thread's cache, widened into the fp32 logits.
      const at::Tensor product = at::mm(h, Wt);  // (n, w), contiguous
      const c10::BFloat16* pp = product.const_data_ptr<c10::BFloat16>();
      for (int64_t r = 0; r < n; ++r) widen_bf16(pp + r * w, op + r * vlen + c0, w, /*add=*/false);
    } else {
      tile.copy_(at::mm(h, Wt));  // fp16 products, widened into the fp32 logits
    }
  });
  return out;
}

// `x` (rows, C) in `cdt`, contiguous; fp32 -> bf16 rounded on all threads.
at::Tensor in_compute_dtype(const at::Tensor& x, at::ScalarType cdt) {
  if (cdt != at::kBFloat16 || x.scalar_type() != at::kFloat) return x.to(cdt).contiguous();
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kBFloat16));
  const float* sp = src.const_data_ptr<float>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, src.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    round_to_bf16(sp + begin, op + begin, end - begin);
  });
  return out;
}

// gw (vlen, C), contiguous fp32 rows of the weight gradient, = d.T @ h, or += with `add`; d (n, vlen)
// and h (n, C) bf16. In tiles of rows, like the logits: each tile's bf16 product is
// widened into gw by the thread that computed it, while it is in that thread's cache (one
// (vlen, C) product widened after would pass over memory twice more).
void weight_grad_bf16(const at::Tensor& d, const at::Tensor& h, at::Tensor& gw, bool add) {
  const int64_t vlen = d.size(1), C = h.size(1);
  float* gp = gw.mutable_data_ptr<float>();
  for_each_tile(vlen, [&](int64_t c0, int64_t w) {
    const at::Tensor product = at::mm(d.narrow(1, c0, w).t(), h);  // (w, C), contiguous
    widen_bf16(product.const_data_ptr<c10::BFloat16>(), gp + c0 * C, w * C, add);
  });
}

// Returns (stats (3,) fp32 = [loss sum, correct, scored], grad_hidden (N, C) like hidden,
// grad_weight (V_pad, C) fp32); the gradients are empty (0 elements) without compute_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lm_head_ce(
    const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& labels,
    int64_t vocab_size, int64_t ignore_index, int64_t token_chunk, int64_t vocab_chunks,
    std::optional<at::ScalarType> compute_dtype, bool compute_grad) {
  // The op computes its gradients itself: nothing here is for autograd to record. Detached, because
  // grad mode is per thread and the intra-op threads have it on whatever the caller's is (the
  // in-place mm's out= form refuses inputs that require grad; an mm would record a node per tile).
  const at::Tensor hidden = hidden_in.detach(), weight = weight_in.detach();
  check_inputs(hidden, weight, labels, vocab_size, ignore_index, token_chunk, vocab_chunks);
  const at::ScalarType cdt = compute_dtype.value_or(hidden.scalar_type());
  const int64_t N = hidden.size(0), C = hidden.size(1), V = vocab_size;
  const int64_t vchunk = (V + vocab_chunks - 1) / vocab_chunks;
  const bool single = vchunk >= V;  // one vocabulary chunk: reuse its logits for the gradient

  const at::Tensor W = in_compute_dtype(weight.narrow(0, 0, V), cdt);  // (V, C), padding rows dropped
  const at::Tensor y = labels.contiguous();
  const int64_t* yp = y.const_data_ptr<int64_t>();
  at::Tensor grad_hidden = compute_grad ? at::empty_like(hidden) : at::empty({0}, hidden.options());
  at::Tensor grad_weight = at::empty({0}, weight.options().dtype(at::kFloat));
  if (compute_grad) {
    // The first row chunk writes rows [0, V) of the weight gradient (no zero-filling pass over
    // its V x C floats); the padding rows [V, V_pad) stay zero.
    grad_weight = at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
    const int64_t first_zero = N > 0 ? V : 0;
    grad_weight.narrow(0, first_zero, weight.size(0) - first_zero).zero_();
  }
  std::vector<double> row_loss(N, 0.0);
  std::vector<uint8_t> row_correct(N, 0);

  for (int64_t t0 = 0; t0 < N; t0 += token_chunk) {
    const int64_t n = std::min(token_chunk, N - t0);
    const at::Tensor h = in_compute_dtype(hidden.narrow(0, t0, n), cdt);  // (n, C)
    std::vector<RowState> st(n);
    at::Tensor logits;  // (n, vlen) fp32, the last chunk's
    for (int64_t v0 = 0; v0 < V; v0 += vchunk) {
      const int64_t vlen = std::min(vchunk, V - v0);
      logits = logits_of(h, W, v0, vlen);
      float* lp = logits.mutable_data_ptr<float>();
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          fold_chunk(st[i], lp + i * vlen, vlen, v0, yp[t0 + i], single && compute_grad);
        }
      });
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = yp[t0 + i];
      if (label == ignore_index) continue;
      row_loss[t0 + i] = std::log(static_cast<double>(st[i].sum)) + st[i].max - st[i].label_logit;
      row_correct[t0 + i] = st[i].argmax == label;
    }
    if (!compute_grad) continue;

    // d(loss sum)/d(logits) = softmax - onehot(label), zero on ignored rows.
    at::Tensor gh32 = single ? at::Tensor() : at::zeros({n, C}, hidden.options().dtype(at::kFloat));
    for (int64_t v0 = 0; v0 < V; v0 += vchunk) {
      const int64_t vlen = std::min(vchunk, V - v0);
      const at::Tensor Wv = W.narrow(0, v0, vlen);
      if (!single) logits = logits_of(h, W, v0, vlen);
      float* lp = logits.mutable_data_ptr<float>();
      // In bf16, d is rounded row by row as the rows are made, not in a pass over all of them after.
      const bool bf16 = cdt == at::kBFloat16;
      at::Tensor d16 = bf16 ? at::empty({n, vlen}, h.options().dtype(at::kBFloat16)) : at::Tensor();
      c10::BFloat16* dp = bf16 ? d16.mutable_data_ptr<c10::BFloat16>() : nullptr;
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          float* x = lp + i * vlen;
          const int64_t label = yp[t0 + i];
          if (label == ignore_index) {
            std::fill(x, x + vlen, 0.0f);
            if (bf16) std::fill(dp + i * vlen, dp + (i + 1) * vlen, c10::BFloat16(0.0f));
            continue;
          }
          if (single) {
            scale(x, vlen, 1.0f / st[i].sum);  // x holds exp(logit - max)
          } else {
            exp_sum(x, vlen, st[i].max + std::log(st[i].sum), /*store=*/true);
          }
          if (label >= v0 && label < v0 + vlen) x[label - v0] -= 1.0f;
          if (bf16) round_to_bf16(x, dp + i * vlen, vlen);
        }
      });
      const at::Tensor d = bf16 ? d16 : logits.to(cdt);  // (n, vlen)
      if (single) {
        grad_hidden.narrow(0, t0, n).copy_(at::mm(d, Wv));
      } else {
        gh32.add_(at::mm(d, Wv));
      }
      at::Tensor gw = grad_weight.narrow(0, v0, vlen);  // contiguous rows
      if (bf16) {
        weight_grad_bf16(d, h, gw, /*add=*/t0 != 0);
      } else if (t0 == 0 && cdt == at::kFloat) {
        at::mm_out(gw, d.t(), h);
      } else if (t0 == 0) {
        gw.copy_(at::mm(d.t(), h));
      } else if (cdt == at::kFloat) {
        gw.addmm_(d.t(), h);
      } else {
        gw.add_(at::mm(d.t(), h));
      }
    }
    if (!single) grad_hidden.narrow(0, t0, n).copy_(gh32);
  }

  // Sequential sums: the result does not depend on the thread count.
  double loss_sum = 0.0;
  int64_t correct = 0, scored = 0;
  for (int64_t i = 0; i < N; ++i) {
    loss_sum += row_loss[i];
    correct += row_correct[i];
    scored += yp[i] != ignore_index;
  }
  at::Tensor stats = at::empty({3}, hidden.options().dtype(at::kFloat));
  float* sp = stats.mutable_data_ptr<float>();
  sp[0] = static_cast<float>(loss_sum);
  sp[1] = static_cast<float>(correct);
  sp[2] = static_cast<float>(scored);
  return {stats, grad_hidden, grad_weight};
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def(
      "lm_head_ce(Tensor hidden, Tensor weight, Tensor labels, int vocab_size, int ignore_index, "
      "int token_chunk, int vocab_chunks, ScalarType? compute_dtype, bool compute_grad) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("lm_head_ce", &gpt2forge::lm_head_ce);
}
