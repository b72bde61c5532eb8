// gpt2forge::multi_tensor_adamw_ and gpt2forge::multi_tensor_lamb_ (and their one-tensor forms
// adamw_step_ and lamb_step_): the optimizer update on the host, in place.
//
// With --optimizer-state-offchip the fp32 master weights and both moments live in host memory and
// the update runs on the CPU. It does a few flops per parameter and touches 28 bytes of fp32 state
// per parameter (read p, g, m, v; write p, m, v), so it is bound by memory bandwidth: AdamW makes
// exactly one pass over memory here (PyTorch's foreach implementation makes several) and can write
// the rounded bf16/fp16 copy of the new weights for the device in the same pass (the copy that goes
// back over PCIe). The multi-tensor ops update a whole param group in one call: every tensor is cut
// into pieces of kGrain elements, and one parallel region (two for LAMB, whose trust ratios need
// each tensor's norms first) hands the pieces of all tensors to the threads, rather than one call
// and one region per tensor (GPT-2 small has 148 tensors, most of them small).
//
// Arithmetic follows torch.optim.AdamW's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
// operation by operation, in fp32 with the step's scalars computed in double as Python does:
//     p = p * (1 - lr*wd)                        (decoupled weight decay, skipped when wd == 0)
//     m = lerp(m, g, 1 - beta1)                  (fma(w, g - m, m); from g when w >= 0.5, as ATen)
//     v = v * beta2 + ((1 - beta2) * g) * g
//     p = p + (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)
// so results equal torch's to fp32 rounding (compilers may contract a multiply-add into an fma).
// LAMB follows gpt2forge.train.optim.Lamb: pass 1 updates the moments and sums ||w||^2 and ||u||^2
// of u = m/bc1 / (sqrt(v)/sqrt(bc2) + eps) + wd*w; pass 2 recomputes u and applies
// w = w - lr * (ratio * u), ratio = min(||w||, max_weight_norm) / ||u|| (1 when either is 0).
//
// Vector paths: AVX-512F and AVX2+FMA+F16C intrinsics, chosen once at run time from the CPU's
// features, and a portable scalar loop (other CPUs, and every tail). The library is built without
// -march=native, so each path is compiled with its own target attribute and `flatten` pulls the
// shared templated body into it.
//
// param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors of one size (any shape); grad: the same
// size, fp32, bf16 or fp16; device_copy: absent, or bf16/fp16 of the same size (the multi-tensor
// ops take a list of each, and a step count per tensor). The PyTorch references are
// torch.optim.AdamW and gpt2forge.train.optim.Lamb (gpt2forge.ops.host_optim falls back to them;
// tests/ops/test_host_optim.py compares against them, and the multi-tensor ops bit for bit against
// the one-tensor ops).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "host_optim_kernels.h"

namespace gpt2forge {
namespace {

// Elements per piece, the parallel task: large enough to amortize a task (128 KB per fp32 tensor),
// small enough that the pieces of one step balance across the threads.
constexpr int64_t kGrain = 1 << 15;

Args check_and_bind(const char* op, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy) {
  const int64_t n = param.numel();
  for (const at::Tensor* t : {&param, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(), "gpt2forge::", op,
                ": param, exp_avg and exp_avg_sq must be contiguous float32 CPU tensors");
    TORCH_CHECK(t->numel() == n, "gpt2forge::", op, ": param, exp_avg and exp_avg_sq must have the same size");
  }
  const auto gd = grad.scalar_type();
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n &&
                  (gd == at::kFloat || gd == at::kBFloat16 || gd == at::kHalf),
              "gpt2forge::", op, ": grad must be a contiguous float32/bfloat16/float16 CPU tensor of the param's size");
  Args a{param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), grad.data_ptr(),
         nullptr, gd, at::ScalarType::Undefined, n, Scalars{}};
  if (device_copy.has_value() && device_copy->defined()) {
    const auto cd = device_copy->scalar_type();
    TORCH_CHECK(device_copy->device().is_cpu() && device_copy->is_contiguous() && device_copy->numel() == n &&
                    (cd == at::kBFloat16 || cd == at::kHalf),
                "gpt2forge::", op, ": device_copy must be a contiguous bfloat16/float16 CPU tensor of the param's size");
    a.copy = device_copy->data_ptr();
    a.copy_dtype = cd;
  }
  return a;
}

// Binds tensor i of each list; device_copies is empty (no copies) or one optional tensor per param.
std::vector<Args> check_and_bind_lists(const char* op, at::TensorList params, at::TensorList grads,
                                       at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                       const c10::List<std::optional<at::Tensor>>& device_copies,
                                       at::ArrayRef<double> steps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (device_copies.empty() || device_copies.size() == n),
              "gpt2forge::", op, ": params, grads, exp_avgs, exp_avg_sqs and steps must have one entry per param, "
              "device_copies none or one per param");
  std::vector<Args> args;
  args.reserve(n);
  for (size_t i = 0; i < n; ++i)
    args.push_back(check_and_bind(op, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                  device_copies.empty() ? std::nullopt : device_copies.get(i)));
  return args;
}

// The scalars shared by both optimizers, from the hyper-parameters as torch computes them (double).
Scalars moment_scalars(double beta1, double beta2, double eps, double step, bool bias_correction) {
  Scalars s;
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_grad = !(std::abs(s.lerp_weight) < 0.5f);
  s.beta2 = static_cast<float>(beta2);
  s.grad_sq_weight = static_cast<float>(1.0 - beta2);
  if (bias_correction) {
    s.bc1 = static_cast<float>(1.0 - std::pow(beta1, step));
    s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  }
  s.eps = static_cast<float>(eps);
  return s;
}

// The elements [begin, end) of tensor `t`: one task of a step's parallel region.
struct Piece {
  size_t t;
  int64_t begin, end;
};

// Every tensor cut into pieces of kGrain elements from its start (the last one shorter), in order.
// Cutting at multiples of kGrain from each tensor's start keeps the vector/scalar split of every
// element, hence its rounding, and LAMB's partial sums independent of the thread count.
std::vector<Piece> pieces_of(const std::vector<Args>& args) {
  std::vector<Piece> pieces;
  for (size_t t = 0; t < args.size(); ++t)
    for (int64_t b = 0; b < args[t].n; b += kGrain) pieces.push_back({t, b, std::min(args[t].n, b + kGrain)});
  return pieces;
}

// Calls f(i) for every piece index i in one parallel region: each thread takes the next piece off
// a shared counter, so the work balances by element count whatever the mix of tensor sizes, and a
// thread slowed by other work on its core takes fewer pieces. Runs inline below kGrain elements.
template <class F>
void for_each_piece(const std::vector<Piece>& pieces, const F& f) {
  int64_t elements = 0;
  for (const Piece& p : pieces) elements += p.end - p.begin;
  std::atomic<size_t> next{0};
  const int64_t workers = elements > kGrain ? std::min<int64_t>(at::get_num_threads(), pieces.size()) : 1;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < pieces.size();
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// One AdamW step of the bound tensors: each one's scalars from the group's hyper-parameters and its
// own step count steps[t], then one parallel region over the pieces of all of them.
void adamw_update(std::vector<Args>& args, double lr, double beta1, double beta2, double eps, double weight_decay,
                  at::ArrayRef<double> steps) {
  for (size_t t = 0; t < args.size(); ++t) {
    Scalars& s = args[t].s;
    s = moment_scalars(beta1, beta2, eps, steps[t], /*bias_correction=*/true);
    s.decays = weight_decay != 0.0;
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, steps[t]))));
  }
  const auto kernel = kernels().adamw;
  const std::vector<Piece> pieces = pieces_of(args);
  for_each_piece(pieces, [&](size_t i) { kernel(args[pieces[i].t], pieces[i].begin, pieces[i].end); });
}

// One LAMB step of the bound tensors: pass 1 (moments, partial norms) over the pieces of all of
// them, each tensor's trust ratio from its own pieces' sums, then pass 2 over all pieces.
void lamb_update(std::vector<Args>& args, double lr, double beta1, double beta2, double eps, double weight_decay,
                 at::ArrayRef<double> steps, bool bias_correction, std::optional<double> max_weight_norm) {
  for (size_t t = 0; t < args.size(); ++t) {
    Scalars& s = args[t].s;
    s = moment_scalars(beta1, beta2, eps, steps[t], bias_correction);
    s.decays = weight_decay != 0.0;
    s.wd = static_cast<float>(weight_decay);
    s.neg_step_size = static_cast<float>(-lr);
  }
  const auto& k = kernels();
  const std::vector<Piece> pieces = pieces_of(args);
  std::vector<double> sums(2 * pieces.size(), 0.0);  // ||w||^2, ||u||^2 per piece
  for_each_piece(pieces, [&](size_t i) {
    k.lamb_moments(args[pieces[i].t], pieces[i].begin, pieces[i].end, &sums[2 * i]);
  });
  // Each tensor's norms add its pieces in order: they do not depend on the thread count.
  for (size_t i = 0; i < pieces.size();) {
    double ww = 0.0, uu = 0.0;
    const size_t t = pieces[i].t;
    for (; i < pieces.size() && pieces[i].t == t; ++i) {
      ww += sums[2 * i];
      uu += sums[2 * i + 1];
    }
    float w_norm = static_cast<float>(std::sqrt(ww));
    const float u_norm = static_cast<float>(std::sqrt(uu));
    if (max_weight_norm.has_value()) w_norm = std::min(w_norm, static_cast<float>(*max_weight_norm));
    args[t].s.ratio = (w_norm > 0.0f && u_norm > 0.0f) ? w_norm / u_norm : 1.0f;
  }
  for_each_piece(pieces, [&](size_t i) { k.lamb_apply(args[pieces[i].t], pieces[i].begin, pieces[i].end); });
}

void adamw_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy, double lr, double beta1,
                 double beta2, double eps, double weight_decay, double step) {
  std::vector<Args> args{check_and_bind("adamw_step_", param, grad, exp_avg, exp_avg_sq, device_copy)};
  adamw_update(args, lr, beta1, beta2, eps, weight_decay, {step});
}

void multi_tensor_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, const c10::List<std::optional<at::Tensor>>& device_copies,
                         double lr, double beta1, double beta2, double eps, double weight_decay,
                         at::ArrayRef<double> steps) {
  std::vector<Args> args =
      check_and_bind_lists("multi_tensor_adamw_", params, grads, exp_avgs, exp_avg_sqs, device_copies, steps);
  adamw_update(args, lr, beta1, beta2, eps, weight_decay, steps);
}

void lamb_step_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& device_copy, double lr, double beta1,
                double beta2, double eps, double weight_decay, double step, bool bias_correction,
                std::optional<double> max_weight_norm) {
  std::vector<Args> args{check_and_bind("lamb_step_", param, grad, exp_avg, exp_avg_sq, device_copy)};
  lamb_update(args, lr, beta1, beta2, eps, weight_decay, {step}, bias_correction, max_weight_norm);
}

void multi_tensor_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, const c10::List<std::optional<at::Tensor>>& device_copies,
                        double lr, double beta1, double beta2, double eps, double weight_decay,
                        at::ArrayRef<double> steps, bool bias_correction, std::optional<double> max_weight_norm) {
  std::vector<Args> args =
      check_and_bind_lists("multi_tensor_lamb_", params, grads, exp_avgs, exp_avg_sqs, device_copies, steps);
  lamb_update(args, lr, beta1, beta2, eps, weight_decay, steps, bias_correction, max_weight_norm);
}

std::string host_optim_isa() { return kernels().name; }

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? device_copy, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float step) -> ()");
  m.def("multi_tensor_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)?[] device_copies, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float[] steps) -> ()");
  m.def("lamb_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? device_copy, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float step, bool bias_correction, float? max_weight_norm) -> ()");
  m.def("multi_tensor_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)?[] device_copies, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float[] steps, bool bias_correction, float? max_weight_norm) -> ()");
  m.def("host_optim_isa() -> str", &gpt2forge::host_optim_isa);
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("adamw_step_", &gpt2forge::adamw_step_);
  m.impl("multi_tensor_adamw_", &gpt2forge::multi_tensor_adamw_);
  m.impl("lamb_step_", &gpt2forge::lamb_step_);
  m.impl("multi_tensor_lamb_", &gpt2forge::multi_tensor_lamb_);
}
