// gpt2forge custom ops: the namespace owner, a build description and one small CPU kernel.
//
// All files in custom_ops/ are linked into one library, build/custom_ops/gpt2forge_ops.so (a
// second venv's under build/<venv>/; `make`, or `python -m gpt2forge.ops.build build`), loaded by
// gpt2forge.ops.library.load_custom_ops(). This file holds the one TORCH_LIBRARY(gpt2forge, m)
// block; every other source file adds its ops with TORCH_LIBRARY_FRAGMENT(gpt2forge, m), since
// a namespace may have only one TORCH_LIBRARY.
//
// Every op has a pure-PyTorch (or numpy) reference beside its Python wrapper, with the same
// argument checks and messages: it is the fallback when this library is not built and the oracle
// of tests/ops/test_custom_ops.py.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef GPT2FORGE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gpt2forge {
namespace {

// Below this many elements a parallel region costs more than it saves; the same grain as
// ATen's at::internal::GRAIN_SIZE.
constexpr int64_t kParallelGrain = 32768;

std::string compiler_description() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("GCC ") + __VERSION__;
#elif defined(_MSC_VER)
  return "MSVC " + std::to_string(_MSC_FULL_VER);
#else
  return "unknown compiler";
#endif
}

std::string openmp_description() {
#ifdef _OPENMP
  // omp_get_max_threads() is read at call time: it follows OMP_NUM_THREADS and
  // torch.set_num_threads() (torch and this library share the libgomp.so.1 runtime).
  return "OpenMP yes (" + std::to_string(_OPENMP) + ", max threads " +
      std::to_string(omp_get_max_threads()) + ")";
#else
  return "OpenMP no";
#endif
}

std::string cuda_description() {
#ifdef GPT2FORGE_WITH_CUDA
  return "CUDA yes (runtime headers " + std::to_string(CUDART_VERSION / 1000) + "." +
      std::to_string(CUDART_VERSION % 1000 / 10) + ")";
#else
  return "CUDA no";
#endif
}

// "float32", "float64", ...: the names Python prints after "torch.", so that these messages match
// the reference's word for word.
std::string dtype_name(const at::Tensor& t) {
  return std::string(c10::getDtypeNames(t.scalar_type()).first);
}

// gpt2forge::build_info() -> str
// One line: compiler, C++ standard, OpenMP, CUDA, and the torch headers built against.
std::string build_info() {
  return "gpt2forge_ops: " + compiler_description() + ", C++ " + std::to_string(__cplusplus) +
      ", " + openmp_description() + ", " + cuda_description() + ", torch " +
      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
      std::to_string(TORCH_VERSION_PATCH);
}

// gpt2forge::scaled_add_(Tensor(a!) x, Tensor y, float alpha) -> Tensor(a!)
// x += alpha * y, elementwise and in place; returns x. x and y: float32, same shape,
// contiguous, on the CPU. No autograd formula: it is an update for no-grad code (an SGD step);
// gpt2forge.ops.library.scaled_add_ routes differentiable calls to the reference.
at::Tensor& scaled_add_(at::Tensor& x, const at::Tensor& y, double alpha) {
  TORCH_CHECK_TYPE(
      x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
      "gpt2forge::scaled_add_: expected float32 tensors, got x ", dtype_name(x), " and y ",
      dtype_name(y));
  TORCH_CHECK_VALUE(
      x.sizes() == y.sizes(), "gpt2forge::scaled_add_: x and y must have the same shape, got x ",
      x.sizes(), " and y ", y.sizes());
  TORCH_CHECK_VALUE(
      x.is_contiguous() && y.is_contiguous(),
      "gpt2forge::scaled_add_: x and y must be contiguous (call .contiguous() first)");
  TORCH_CHECK_VALUE(
      x.device().is_cpu() && y.device().is_cpu(),
      "gpt2forge::scaled_add_: this kernel runs on the CPU, got x on ", x.device(), " and y on ",
      y.device());

  const int64_t n = x.numel();
  float* xp = x.mutable_data_ptr<float>();
  const float* yp = y.const_data_ptr<float>();
  const float a = static_cast<float>(alpha);
  // One flat loop over the contiguous buffers; static schedule gives each thread one block.
#pragma omp parallel for schedule(static) if (n >= 2 * kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    xp[i] += a * yp[i];
  }
  return x;
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY(gpt2forge, m) {
  m.def("build_info() -> str", &gpt2forge::build_info);
  m.def("scaled_add_(Tensor(a!) x, Tensor y, float alpha) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("scaled_add_", &gpt2forge::scaled_add_);
}
