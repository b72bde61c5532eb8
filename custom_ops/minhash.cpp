// gpt2forge::minhash_signatures: the MinHash signatures of a batch of documents' shingle hashes, as
// gpt2forge.preprocess.minhash.MinHasher.signature computes them one document at a time in numpy.
//
// Signature row p of a document is min over its shingle hashes x of ((a[p] * x + b[p]) mod 2^64),
// top 32 bits. numpy builds the (permutations, shingles) products as arrays and takes their
// minimum in further passes over memory; here each product lives in a register: a vector of
// shingles is loaded once and multiplied, added and folded into the running minimum of four
// permutations (AVX-512: 8 lanes with AVX512DQ's 64-bit multiply; AVX2: 4 lanes, the 64-bit
// product made of three 32x32-bit ones). The minimum is the same whichever order the shingles are
// taken in, and repeats do not change it, so the result equals numpy's on the unique shingles
// bit for bit (tests/preprocess/test_dedup.py, and every path in tests/ops/test_isa_paths.py).
// The speed against numpy: benchmarks/minhash_speed.py.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "isa.h"

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define GPT2FORGE_MINHASH_X86 1
#endif

namespace gpt2forge {
namespace {

constexpr uint64_t kAllOnes = ~uint64_t{0};

// Rows p in [p0, p1) of one document's signature, one permutation at a time.
void rows_scalar(const uint64_t* x, int64_t n, const uint64_t* a, const uint64_t* b, int64_t p0, int64_t p1,
                 uint32_t* out) {
  for (int64_t p = p0; p < p1; ++p) {
    uint64_t m = kAllOnes;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t v = a[p] * x[i] + b[p];
      m = v < m ? v : m;
    }
    out[p] = static_cast<uint32_t>(m >> 32);
  }
}

#ifdef GPT2FORGE_MINHASH_X86

__attribute__((target("avx512f,avx512dq"))) void rows_avx512(const uint64_t* x, int64_t n, const uint64_t* a,
                                                              const uint64_t* b, int64_t P, uint32_t* out) {
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) {
    const __m512i a0 = _mm512_set1_epi64(a[p]), a1 = _mm512_set1_epi64(a[p + 1]);
    const __m512i a2 = _mm512_set1_epi64(a[p + 2]), a3 = _mm512_set1_epi64(a[p + 3]);
    const __m512i b0 = _mm512_set1_epi64(b[p]), b1 = _mm512_set1_epi64(b[p + 1]);
    const __m512i b2 = _mm512_set1_epi64(b[p + 2]), b3 = _mm512_set1_epi64(b[p + 3]);
    __m512i m0 = _mm512_set1_epi64(-1), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m512i v = _mm512_loadu_si512(x + i);
      m0 = _mm512_min_epu64(m0, _mm512_add_epi64(_mm512_mullo_epi64(v, a0), b0));
      m1 = _mm512_min_epu64(m1, _mm512_add_epi64(_mm512_mullo_epi64(v, a1), b1));
      m2 = _mm512_min_epu64(m2, _mm512_add_epi64(_mm512_mullo_epi64(v, a2), b2));
      m3 = _mm512_min_epu64(m3, _mm512_add_epi64(_mm512_mullo_epi64(v, a3), b3));
    }
    if (i < n) {  // the tail: lanes past n keep the running minimum
      const __mmask8 k = static_cast<__mmask8>((1u << (n - i)) - 1);
      const __m512i v = _mm512_maskz_loadu_epi64(k, x + i);
      m0 = _mm512_mask_min_epu64(m0, k, m0, _mm512_add_epi64(_mm512_mullo_epi64(v, a0), b0));
      m1 = _mm512_mask_min_epu64(m1, k, m1, _mm512_add_epi64(_mm512_mullo_epi64(v, a1), b1));
      m2 = _mm512_mask_min_epu64(m2, k, m2, _mm512_add_epi64(_mm512_mullo_epi64(v, a2), b2));
      m3 = _mm512_mask_min_epu64(m3, k, m3, _mm512_add_epi64(_mm512_mullo_epi64(v, a3), b3));
    }
    out[p] = static_cast<uint32_t>(_mm512_reduce_min_epu64(m0) >> 32);
    out[p + 1] = static_cast<uint32_t>(_mm512_reduce_min_epu64(m1) >> 32);
    out[p + 2] = static_cast<uint32_t>(_mm512_reduce_min_epu64(m2) >> 32);
    out[p + 3] = static_cast<uint32_t>(_mm512_reduce_min_epu64(m3) >> 32);
  }
  rows_scalar(x, n, a, b, p, P, out);
}

// AVX2 has no 64-bit multiply or unsigned 64-bit compare. a * x mod 2^64 is lo(a)lo(x) +
// ((hi(a)lo(x) + lo(a)hi(x)) << 32); the minimum is kept with the top bit flipped, where unsigned
// order is signed order, and adding 2^63 flips that bit, so it is folded into b.
struct Avx2Row {
  __m256i a_lo, a_hi, b_flipped, m;
};

__attribute__((target("avx2"))) inline Avx2Row avx2_row(uint64_t a, uint64_t b) {
  return {_mm256_set1_epi64x(static_cast<int64_t>(a)), _mm256_set1_epi64x(static_cast<int64_t>(a >> 32)),
          _mm256_set1_epi64x(static_cast<int64_t>(b + (uint64_t{1} << 63))), _mm256_set1_epi64x(INT64_MAX)};
}

__attribute__((target("avx2"))) inline void avx2_fold(Avx2Row& r, __m256i x, __m256i x_hi) {
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(x_hi, r.a_lo), _mm256_mul_epu32(x, r.a_hi));
  const __m256i product = _mm256_add_epi64(_mm256_mul_epu32(x, r.a_lo), _mm256_slli_epi64(cross, 32));
  const __m256i v = _mm256_add_epi64(product, r.b_flipped);
  r.m = _mm256_blendv_epi8(r.m, v, _mm256_cmpgt_epi64(r.m, v));
}

__attribute__((target("avx2"))) inline uint64_t avx2_min(const Avx2Row& r) {
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), r.m);
  int64_t m = lanes[0];
  for (int j = 1; j < 4; ++j) m = lanes[j] < m ? lanes[j] : m;
  return static_cast<uint64_t>(m) ^ (uint64_t{1} << 63);
}

__attribute__((target("avx2"))) void rows_avx2(const uint64_t* x, int64_t n, const uint64_t* a, const uint64_t* b,
                                               int64_t P, uint32_t* out) {
  const int64_t whole = n - n % 4;
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) {
    Avx2Row r0 = avx2_row(a[p], b[p]), r1 = avx2_row(a[p + 1], b[p + 1]);
    Avx2Row r2 = avx2_row(a[p + 2], b[p + 2]), r3 = avx2_row(a[p + 3], b[p + 3]);
    for (int64_t i = 0; i < whole; i += 4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i v_hi = _mm256_srli_epi64(v, 32);
      avx2_fold(r0, v, v_hi);
      avx2_fold(r1, v, v_hi);
      avx2_fold(r2, v, v_hi);
      avx2_fold(r3, v, v_hi);
    }
    const Avx2Row* rows[4] = {&r0, &r1, &r2, &r3};
    for (int j = 0; j < 4; ++j) {
      uint64_t m = avx2_min(*rows[j]);
      for (int64_t i = whole; i < n; ++i) {  // the tail of under 4 shingles
        const uint64_t v = a[p + j] * x[i] + b[p + j];
        m = v < m ? v : m;
      }
      out[p + j] = static_cast<uint32_t>(m >> 32);
    }
  }
  rows_scalar(x, n, a, b, p, P, out);
}

#endif  // GPT2FORGE_MINHASH_X86

void signature(const uint64_t* x, int64_t n, const uint64_t* a, const uint64_t* b, int64_t P, uint32_t* out) {
#ifdef GPT2FORGE_MINHASH_X86
  static const bool avx512 = isa_path() >= Isa::kAvx512 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512dq");
  static const bool avx2 = isa_path() >= Isa::kAvx2 && __builtin_cpu_supports("avx2");
  if (avx512) return rows_avx512(x, n, a, b, P, out);
  if (avx2) return rows_avx2(x, n, a, b, P, out);
#endif
  rows_scalar(x, n, a, b, 0, P, out);
}

const uint64_t* words(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
                    "gpt2forge::minhash_signatures: ", name, " must be a contiguous 1-D int64 CPU tensor (the uint64 "
                    "bits), got ", t.scalar_type(), " of shape ", t.sizes());
  return reinterpret_cast<const uint64_t*>(t.const_data_ptr<int64_t>());
}

// Document d's shingle hashes are hashes[offsets[d] .. offsets[d + 1]); out (documents, P) int32
// holds the uint32 rows. A document without shingles gets all-ones rows, as in numpy.
at::Tensor minhash_signatures(const at::Tensor& hashes, const at::Tensor& offsets, const at::Tensor& a,
                              const at::Tensor& b) {
  const uint64_t* x = words(hashes, "hashes");
  const int64_t* off = reinterpret_cast<const int64_t*>(words(offsets, "offsets"));
  const uint64_t* ap = words(a, "a");
  const uint64_t* bp = words(b, "b");
  const int64_t P = a.numel(), docs = offsets.numel() - 1;
  TORCH_CHECK_VALUE(b.numel() == P && P > 0, "gpt2forge::minhash_signatures: a and b must have the same length >= 1");
  TORCH_CHECK_VALUE(docs >= 0, "gpt2forge::minhash_signatures: offsets needs one more entry than documents");
  for (int64_t d = 0; d < docs; ++d)
    TORCH_CHECK_VALUE(0 <= off[d] && off[d] <= off[d + 1] && off[d + 1] <= hashes.numel(),
                      "gpt2forge::minhash_signatures: offsets must rise from 0 to at most ", hashes.numel());
  at::Tensor out = at::empty({docs, P}, at::TensorOptions().dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<int32_t>());
  for (int64_t d = 0; d < docs; ++d) signature(x + off[d], off[d + 1] - off[d], ap, bp, P, o + d * P);
  return out;
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("minhash_signatures(Tensor hashes, Tensor offsets, Tensor a, Tensor b) -> Tensor",
        &gpt2forge::minhash_signatures);
}
