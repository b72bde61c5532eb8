// gpt2forge::ops_isa: which instruction-set path the kernels take (isa.h), from GPT2FORGE_OPS_ISA.
//
// Unset (or empty), the kernels take the widest path the CPU has, as before the variable existed.
// Set to scalar, avx2 or avx512, every kernel with such a path takes it (avx512 lets the kernels
// that have no AVX-512 form take their AVX2 one, as on an AVX-512 CPU by default), so one machine
// runs each CPU class's code (tests/ops/test_isa_paths.py). A path this CPU cannot run is refused,
// never replaced by another: gpt2forge.ops.library.load_custom_ops calls ops_isa() once after
// loading, so a bad value stops the process at load with this file's one-line message.

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "isa.h"

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace gpt2forge {
namespace {

constexpr const char* kEnv = "GPT2FORGE_OPS_ISA";
constexpr const char* kNames[] = {"scalar", "avx2", "avx512"};

// The instructions each path's kernels use: the AVX2 forms need avx2, fma and f16c (host_optim's
// conversions), the AVX-512 forms avx512f besides.
struct Feature {
  const char* name;
  Isa needed_from;
  bool present;
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Read when first asked (a dispatch or ops_isa()), never while the library's constructors run.
const std::vector<Feature>& features() {
  static const std::vector<Feature> read = {
      {"avx2", Isa::kAvx2, __builtin_cpu_supports("avx2") != 0},
      {"fma", Isa::kAvx2, __builtin_cpu_supports("fma") != 0},
      {"f16c", Isa::kAvx2, __builtin_cpu_supports("f16c") != 0},
      {"avx512f", Isa::kAvx512, __builtin_cpu_supports("avx512f") != 0},
  };
  return read;
}
#else
const std::vector<Feature>& features() {
  static const std::vector<Feature> read = {{"avx2", Isa::kAvx2, false}, {"avx512f", Isa::kAvx512, false}};
  return read;
}
#endif

bool cpu_has(std::string_view name) {
  for (const Feature& f : features())
    if (name == f.name) return f.present;
  return false;
}

// The clone GCC's target_clones resolver takes, and the path every hand dispatch took unforced.
Isa widest() {
  if (cpu_has("avx512f")) return Isa::kAvx512;
  if (cpu_has("avx2")) return Isa::kAvx2;
  return Isa::kScalar;
}

std::string cpu_features() {
  std::string has;
  for (const Feature& f : features())
    if (f.present) has += std::string(has.empty() ? "" : " ") + f.name;
  return has.empty() ? "none of them" : has;
}

}  // namespace

Isa isa_setting() {
  const char* value = std::getenv(kEnv);
  const std::string asked = value ? value : "";
  const char* widest_name = kNames[static_cast<int>(widest())];
  if (asked.empty()) return widest();
  int path = 0;
  while (path < 3 && asked != kNames[path]) ++path;
  TORCH_CHECK_VALUE(path < 3, kEnv, "=", asked, " is not a path of the custom ops: use scalar, avx2 or avx512, ",
                    "or unset it for the widest this CPU has (", widest_name, ")");
  std::string missing;
  for (const Feature& f : features())
    if (static_cast<int>(f.needed_from) <= path && !f.present) missing += std::string(missing.empty() ? "" : " ") + f.name;
  TORCH_CHECK_VALUE(missing.empty(), kEnv, "=", asked, ": this CPU cannot run that path (it lacks ", missing,
                    "; it has ", cpu_features(), "): use ", widest_name, " or below, or unset it");
  return static_cast<Isa>(path);
}

namespace {

std::string ops_isa() { return kNames[static_cast<int>(isa_path())]; }

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  // The path the kernels take: "scalar", "avx2" or "avx512" (GPT2FORGE_OPS_ISA, else the CPU's widest).
  m.def("ops_isa() -> str", &gpt2forge::ops_isa);
}
