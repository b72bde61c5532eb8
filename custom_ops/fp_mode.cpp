// gpt2forge::flush_denormals: the x86 "flush to zero" and "denormals are zero" modes on the calling
// thread and on every intra-op thread.
//
// A value below 1.2e-38 (a denormal) costs an Intel core a microcode assist on every multiply that
// reads or makes one. A softmax whose logits lie more than 87 apart makes them, and the gradient
// of the LM head then carries them into its matmuls: on the 2-core AMX Xeon GPT-2 small's training
// step took far longer (model left at nn.Linear's default initialisation, logits hundreds apart;
// measured: docs/benchmarks.md, Design measurements). With these modes such values read and come
// out as zero, as TensorFlow's CPU runtime and oneDNN's kernels arrange; what they change is below
// fp32's normal range (and bf16's, whose exponent range is fp32's).
//
// The modes live in each thread's MXCSR register. torch.set_flush_denormal sets the calling thread's
// only, and a thread inherits them only when it is created, so once torch's OpenMP threads exist
// they keep theirs: here one task per intra-op thread sets each (at::parallel_for over as many
// indices as threads gives each thread one). Returns how many threads were set, the caller's
// included; 0 where the CPU is not x86 (nothing to set). gpt2forge::denormals_flushed tells whether the
// calling thread has both modes on. The reference is torch.set_flush_denormal on the calling thread
// (gpt2forge.ops.fp_mode falls back to it without this library).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <xmmintrin.h>
#define GPT2FORGE_MXCSR 1
#endif

namespace gpt2forge {
namespace {

#ifdef GPT2FORGE_MXCSR
constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;

constexpr unsigned kBoth = kFlushToZero | kDenormalsAreZero;

void set_this_thread(bool on) { _mm_setcsr(on ? (_mm_getcsr() | kBoth) : (_mm_getcsr() & ~kBoth)); }
#endif

bool denormals_flushed() {
#ifdef GPT2FORGE_MXCSR
  return (_mm_getcsr() & kBoth) == kBoth;
#else
  return false;
#endif
}

int64_t flush_denormals(bool on) {
#ifdef GPT2FORGE_MXCSR
  set_this_thread(on);
  std::atomic<int64_t> helpers{0};
  const int64_t threads = at::get_num_threads();
  if (threads > 1) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      if (at::get_thread_num() != 0) {  // the caller takes part too: it is set already
        set_this_thread(on);
        helpers += end - begin;
      }
    });
  }
  return 1 + helpers.load();
#else
  (void)on;
  return 0;
#endif
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  // No tensors: one kernel for every backend.
  m.def("flush_denormals(bool on) -> int", &gpt2forge::flush_denormals);
  m.def("denormals_flushed() -> bool", &gpt2forge::denormals_flushed);
}
