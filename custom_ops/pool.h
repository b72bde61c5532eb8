#pragma once

#include <ATen/Parallel.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace gpt2forge {

// The thread pool of the decode kernels (gemv.cpp, decode_attention.cpp): one per process, shared.
//
// The calling thread plus up to kMaxHelpers helper threads share a job's chunks: each takes the
// next unclaimed chunk until none is left, and the caller returns once every claimed chunk is
// done. A helper that is not running (another process has its core) claims nothing, so it never
// holds the caller up; an OpenMP `parallel for` waits for every thread of its team instead, and
// on the shared 2-core development machine that wait made a short call far longer (measured:
// docs/benchmarks.md, Design measurements). (A helper descheduled while it holds a chunk still
// makes the caller wait: under steady load on the other core one thread is faster, which
// Generator's thread probe finds out.) Idle helpers spin for kSpin, then sleep until the next job.
// One job at a time: a second caller (another Python thread, or a call from inside a parallel
// region) runs its job alone.
class Pool {
 public:
  using Body = void (*)(const void* ctx, int64_t chunk);
  static constexpr int kMaxHelpers = 63;
  // How long an idle helper spins before it sleeps: longer than the gap between two decode steps
  // (GPT-2 small: from the LM head's matmul to the next token's first, the token chosen and the
  // compiled step entered in between). A sleeping helper joined that first matmul late (futex
  // wake-up, AVX-512 EPYC VM); spinning on avoids that late wake-up and makes whole tokens faster
  // (measured: docs/benchmarks.md, Design measurements).
  static constexpr std::chrono::microseconds kSpin{2000};

  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still be spinning at exit
    return *pool;
  }

  // body(ctx, c) for every c in [0, chunks), on the caller and up to `threads - 1` helpers.
  void run(Body body, const void* ctx, int64_t chunks, int threads) {
    const int helpers = std::min(threads - 1, kMaxHelpers);
    // (busy_ is only taken when the pool is used; a caller that finds it taken runs alone.)
    if (helpers < 1 || chunks < 2 || busy_.exchange(true, std::memory_order_acquire)) {
      for (int64_t c = 0; c < chunks; ++c) body(ctx, c);
      return;
    }
    start_helpers(helpers);
    const uint32_t gen = generation(word_.load(std::memory_order_relaxed)) + 1;
    body_.store(body, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    wanted_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    word_.store(uint64_t{gen} << 32, std::memory_order_seq_cst);  // publishes the job
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      bell_.fetch_add(1, std::memory_order_release);
      bell_.notify_all();
    }
    int64_t mine = 0;
    for (uint64_t w = uint64_t{gen} << 32; claim(w, gen, chunks); w = word_.load(std::memory_order_acquire), ++mine)
      body(ctx, index(w));
    // Every chunk is claimed; wait for the ones a helper is still computing.
    for (int spins = 0; done_.load(std::memory_order_acquire) + mine < chunks; ++spins) {
      if (spins < 4096) pause();
      else std::this_thread::yield();  // the helper may share this core
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  Pool() { pthread_atfork(nullptr, nullptr, [] { get().after_fork(); }); }

  static uint32_t generation(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
  static int64_t index(uint64_t w) { return static_cast<int64_t>(w & 0xffffffffu); }
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  // Takes chunk index(w) of job `gen` if it is still unclaimed; w is the last word seen, updated.
  bool claim(uint64_t& w, uint32_t gen, int64_t chunks) {
    while (generation(w) == gen && index(w) < chunks)
      if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    return false;
  }

  void start_helpers(int helpers) {
    for (; started_ < helpers; ++started_) std::thread([this, i = started_] { helper(i); }).detach();
  }

  void after_fork() {  // the child has this thread only
    started_ = 0;
    sleepers_.store(0);
    busy_.store(false);
  }

  void helper(int i) {
    uint32_t seen = generation(word_.load(std::memory_order_acquire));
    for (;;) {
      uint64_t w = next_job(seen);
      seen = generation(w);
      if (i >= wanted_.load(std::memory_order_relaxed)) continue;
      // A job that ended meanwhile makes these stale, but then no claim below succeeds.
      const Body body = body_.load(std::memory_order_relaxed);
      const void* ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t chunks = chunks_.load(std::memory_order_relaxed);
      for (; claim(w, seen, chunks); w = word_.load(std::memory_order_acquire)) {
        body(ctx, index(w));
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  // The word of the first job after generation `seen`: spin for kSpin, then sleep on the bell.
  uint64_t next_job(uint32_t seen) {
    auto since = std::chrono::steady_clock::now();
    for (uint32_t spins = 0;; ++spins) {
      uint64_t w = word_.load(std::memory_order_acquire);
      if (generation(w) != seen) return w;
      if (spins % 64 != 63 || std::chrono::steady_clock::now() - since < kSpin) {  // the clock every 64 pauses
        pause();
        continue;
      }
      const uint32_t ticket = bell_.load(std::memory_order_acquire);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation(word_.load(std::memory_order_seq_cst)) == seen) bell_.wait(ticket);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      since = std::chrono::steady_clock::now();
    }
  }

  std::atomic<uint64_t> word_{0};  // generation << 32 | next unclaimed chunk
  std::atomic<Body> body_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> chunks_{0};
  std::atomic<int> wanted_{0};  // helpers 0 .. wanted_ - 1 take part in the current job
  std::atomic<int64_t> done_{0};  // chunks the helpers finished in the current job
  std::atomic<uint32_t> bell_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};
  int started_ = 0;  // helpers running (only the job's caller starts them)
};

// Threads the pool's callers run on; 0 = torch's intra-op thread count (set by gpt2forge::gemv_set_threads).
inline std::atomic<int64_t> pool_thread_setting{0};

// The thread count a job started now runs on: 1 inside an ATen parallel region, else the setting.
inline int pool_threads() {
  const int64_t set = pool_thread_setting.load(std::memory_order_relaxed);
  return at::in_parallel_region() ? 1 : set > 0 ? static_cast<int>(std::min<int64_t>(set, 64)) : at::get_num_threads();
}

}  // namespace gpt2forge
