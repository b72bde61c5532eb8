// gpt2forge::dropout_mask: a dropout keep-mask drawn on every thread.
//
// gpt2forge.model.dropout.dropout_keep_mask needs n bool decisions "keep with probability
// 1 - threshold / 2^15". ATen's CPU random_() runs one Mersenne Twister on one thread, a visible
// part of a GPT-2 small training step (B=4, T=256, dropout 0.1) in the profile, plus the passes that
// turn its bits into bools. Here decision i takes 15 bits, from bit 16 * (i % 4) up, of 64-bit word
// i / 4 of the SplitMix64 sequence started at `seed` (word w = mix(seed + (w + 1) * golden ratio), the
// generator of Java's SplittableRandom and of xoshiro's seeding; its authors report that it passes
// BigCrush). A word depends only on its index, so threads fill disjoint ranges and the mask does
// not depend on the thread count. The seed comes from torch's generator (the Python caller draws
// it), so torch.manual_seed reproduces the masks, compiled or eager. On the 2-core AVX2 machine
// this draws one GPT-2 small layer's attention-probability mask (3.1M decisions at B=4, T=256)
// faster than random_() and the two passes after it (measured: docs/benchmarks.md, "Design
// measurements").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace gpt2forge {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

at::Tensor dropout_mask(int64_t n, int64_t threshold, int64_t seed) {
  TORCH_CHECK_VALUE(n >= 0, "gpt2forge::dropout_mask: n ", n, " is negative");
  TORCH_CHECK_VALUE(threshold >= 0 && threshold <= (1 << 15), "gpt2forge::dropout_mask: threshold ", threshold,
                    " outside [0, 32768]");
  at::Tensor keep = at::empty({n}, at::TensorOptions().dtype(at::kBool));
  bool* out = keep.mutable_data_ptr<bool>();
  const uint64_t base = static_cast<uint64_t>(seed);
  const uint32_t limit = static_cast<uint32_t>(threshold);
  const int64_t words = (n + 3) / 4;
  at::parallel_for(0, words, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const uint64_t bits = mix(base + static_cast<uint64_t>(w + 1) * kGolden);
      const int64_t i0 = 4 * w, lanes = std::min<int64_t>(4, n - i0);
      for (int64_t lane = 0; lane < lanes; ++lane) out[i0 + lane] = ((bits >> (16 * lane)) & 0x7fff) >= limit;
    }
  });
  return keep;
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("dropout_mask(int n, int threshold, int seed) -> Tensor", &gpt2forge::dropout_mask);
}
