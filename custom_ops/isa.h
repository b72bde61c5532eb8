#pragma once

// Which instruction-set path the kernels take: the widest this CPU has, or the one the environment
// variable GPT2FORGE_OPS_ISA names (scalar, avx2 or avx512), read once per process (isa.cpp). A
// kernel takes its AVX2 or AVX-512 path only where the CPU has the instructions and isa_path()
// allows that path (avx2.h's has_avx2_fma and has_avx512f, argmax.cpp, host_optim_kernels.h's
// kernels()); GPT2FORGE_ISA_CLONES below compiles a function once per path and calls the one
// isa_path() picks. Unset, every kernel takes the path it took before the variable existed, so
// tests/ops/test_isa_paths.py can run each path on one machine and compare them.

namespace gpt2forge {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// GPT2FORGE_OPS_ISA's path, else the widest the CPU has (AVX-512F, else AVX2, else scalar: the order
// in which GCC's target_clones resolver picks a clone). Raises c10::ValueError, naming the variable
// and the CPU's features, for a value that is not a path or a path this CPU cannot run. Defined in
// isa.cpp.
Isa isa_setting();

// isa_setting(), read once: what every dispatch below asks.
inline Isa isa_path() {
  static const Isa path = isa_setting();
  return path;
}

}  // namespace gpt2forge

// GPT2FORGE_ISA_CLONES(ret, name, (params), (args), body) defines `ret name(params)`, which calls
// `body(args)` compiled for AVX-512F, for AVX2 and for baseline x86-64 (body is inlined into each:
// it must be GPT2FORGE_ALWAYS_INLINE; each form is a function of its own, as a clone was), whichever
// isa_path() picks. GPT2FORGE_ISA_CLONES_AVX2 compiles
// no AVX-512 form (the AVX2 one runs on both). The same target strings as GCC's target_clones("avx512f",
// "avx2", "default"), which these replace so that a path can be forced; other compilers and CPUs
// get the baseline form alone, as target_clones gave them.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GPT2FORGE_ISA_CLONE_FORMS(ret, name, params, args, body)                     \
  __attribute__((target("avx2"))) ret name##_avx2 params { return body args; }       \
  __attribute__((noinline)) ret name##_baseline params { return body args; }
#define GPT2FORGE_ISA_CLONES(ret, name, params, args, body)                          \
  __attribute__((target("avx512f"))) ret name##_avx512 params { return body args; }  \
  GPT2FORGE_ISA_CLONE_FORMS(ret, name, params, args, body)                           \
  ret name params {                                                                  \
    switch (::gpt2forge::isa_path()) {                                               \
      case ::gpt2forge::Isa::kAvx512: return name##_avx512 args;                     \
      case ::gpt2forge::Isa::kAvx2: return name##_avx2 args;                         \
      default: return name##_baseline args;                                          \
    }                                                                                \
  }
#define GPT2FORGE_ISA_CLONES_AVX2(ret, name, params, args, body)                     \
  GPT2FORGE_ISA_CLONE_FORMS(ret, name, params, args, body)                           \
  ret name params {                                                                  \
    if (::gpt2forge::isa_path() >= ::gpt2forge::Isa::kAvx2) return name##_avx2 args; \
    return name##_baseline args;                                                     \
  }
#else
#define GPT2FORGE_ISA_CLONES(ret, name, params, args, body) \
  ret name params { return body args; }
#define GPT2FORGE_ISA_CLONES_AVX2(ret, name, params, args, body) \
  ret name params { return body args; }
#endif
