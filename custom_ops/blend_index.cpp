// gpt2forge::build_blending_indices and gpt2forge::build_exhaustive_blending_indices: the order of a
// weighted blend of corpora (Megatron-Core's BlendedDataset), as torch ops.
//
// The C++ twins of megatron/core/datasets/helpers.cpp's functions of the same names: for each
// sample of the blend, the corpus whose share lags its weight most (ties to the lowest index), and
// that corpus's next sample. Each choice depends on every earlier one, so the loop is sequential,
// slow in Python (benchmarks/blend_order.py; its figures in docs/data.md), and a GPT-2-scale blend
// has hundreds of millions of samples. The arithmetic is Megatron's, in double precision and
// in its order (weight * max(sample, 1) - taken), so the arrays are equal to Megatron-Core's, which
// tests/data/test_megatron_core_parity.py checks; the pure-Python references with the same contract
// (the fallback without this library) are gpt2forge.data.blend.blending_indices_reference and
// exhaustive_indices_reference.
//
// Differences from Megatron's helpers: the inputs are checked instead of asserted, and a corpus
// of size 0 in the exhaustive order is never chosen (Megatron's loop would never end).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace gpt2forge {
namespace {

// How many samples a corpus lags its weight at sample `at`. The multiply and the subtract must not
// be fused into one FMA (that rounds differently from Megatron's two operations): GCC does not
// fuse them in ISO C++ mode (-std=c++20, as built), clang is told here.
#ifdef __clang__
#pragma clang fp contract(off)
#endif
inline double lag(double weight, double at, double taken) { return weight * at - taken; }

void check_count(int64_t n, const char* what) {
  TORCH_CHECK_VALUE(n >= 1 && n <= std::numeric_limits<int16_t>::max(), "gpt2forge::", what, ": ", n,
                    " corpora; a blend holds 1 to 32767 (the corpus index is int16, as in Megatron)");
}

// The order of `size` samples over corpora with weights w[0 .. n): sample s goes to the corpus of
// largest lag(w[i], max(s, 1), taken[i]), the lowest index on ties. With `cap`, corpus i leaves
// the race once it has given cap[i] samples (those with cap[i] = 0 never enter it).
std::tuple<at::Tensor, at::Tensor> blend_order(const double* w, int64_t n, int64_t size, const int64_t* cap) {
  at::Tensor index = at::empty({size}, at::TensorOptions().dtype(at::kShort));
  at::Tensor sample = at::empty({size}, at::TensorOptions().dtype(at::kLong));
  int16_t* ip = index.mutable_data_ptr<int16_t>();
  int64_t* sp = sample.mutable_data_ptr<int64_t>();
  std::vector<int64_t> racing;  // ascending, as Megatron's std::set of unspent corpora iterates
  for (int64_t i = 0; i < n; ++i)
    if (cap == nullptr || cap[i] > 0) racing.push_back(i);
  std::vector<int64_t> taken(n, 0);
  for (int64_t s = 0; s < size; ++s) {
    const double at = std::max(static_cast<double>(s), 1.0);
    size_t best_pos = 0;
    double best_error = std::numeric_limits<double>::lowest();
    for (size_t p = 0; p < racing.size(); ++p) {
      const double error = lag(w[racing[p]], at, static_cast<double>(taken[racing[p]]));
      if (error > best_error) {
        best_error = error;
        best_pos = p;
      }
    }
    const int64_t best = racing[best_pos];
    ip[s] = static_cast<int16_t>(best);
    sp[s] = taken[best]++;
    if (cap != nullptr && taken[best] == cap[best]) racing.erase(racing.begin() + static_cast<std::ptrdiff_t>(best_pos));
  }
  return {index, sample};
}

std::tuple<at::Tensor, at::Tensor> build_blending_indices(const at::Tensor& weights, int64_t size) {
  TORCH_CHECK_VALUE(weights.dim() == 1 && weights.scalar_type() == at::kDouble && weights.device().is_cpu(),
                    "gpt2forge::build_blending_indices: expected weights as a 1-D float64 CPU tensor");
  TORCH_CHECK_VALUE(size >= 0, "gpt2forge::build_blending_indices: size ", size, " is negative");
  const int64_t n = weights.numel();
  check_count(n, "build_blending_indices");
  const at::Tensor wc = weights.contiguous();
  const double* w = wc.const_data_ptr<double>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(std::isfinite(w[i]) && w[i] >= 0, "gpt2forge::build_blending_indices: weight ", i, " is ",
                      w[i], "; weights are finite and non-negative");
  return blend_order(w, n, size, nullptr);
}

std::tuple<at::Tensor, at::Tensor> build_exhaustive_blending_indices(const at::Tensor& sizes) {
  TORCH_CHECK_VALUE(sizes.dim() == 1 && sizes.scalar_type() == at::kLong && sizes.device().is_cpu(),
                    "gpt2forge::build_exhaustive_blending_indices: expected sizes as a 1-D int64 CPU tensor");
  const int64_t n = sizes.numel();
  check_count(n, "build_exhaustive_blending_indices");
  const at::Tensor sc = sizes.contiguous();
  const int64_t* size_of = sc.const_data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(size_of[i] >= 0, "gpt2forge::build_exhaustive_blending_indices: size ", i, " is ",
                      size_of[i], "; sizes are non-negative");
    total += size_of[i];
  }
  std::vector<double> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = static_cast<double>(size_of[i]) / static_cast<double>(total);
  return blend_order(w.data(), n, total, size_of);
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  // No CPU-only dispatch key needed: CPU tensors in, CPU tensors out.
  m.def("build_blending_indices(Tensor weights, int size) -> (Tensor, Tensor)",
        &gpt2forge::build_blending_indices);
  m.def("build_exhaustive_blending_indices(Tensor sizes) -> (Tensor, Tensor)",
        &gpt2forge::build_exhaustive_blending_indices);
}
