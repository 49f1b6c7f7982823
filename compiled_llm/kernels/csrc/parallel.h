// A parallel-for for the CPU kernels that never waits for a thread that has not started.
//
// Why not OpenMP (at::parallel_for): an OpenMP region ends at a barrier every thread of the team
// must reach. Where cores are shared (other processes; the server's frontend process beside the
// engine; the benchmark client), a descheduled thread holds every region up for a scheduler time
// slice, and a decode step opens a region per projection: on a loaded 2-core machine decode steps
// ran 3-6x slower with 2 threads than with 1. Here the work is cut in chunks that threads claim
// from one shared counter; the caller claims chunks too and returns as soon as every chunk is
// done, so a worker that has not woken up claims nothing and holds nothing up. Chunks are claimed
// in order, so each thread still streams through memory mostly sequentially.
//
// Workers (at::get_num_threads() - 1 of them, started at the first call) spin briefly between
// calls, which keeps a decode step's back-to-back kernels from paying a wake-up each, then sleep
// on a futex. A call from a worker, or from a second thread while one call runs, runs serially.

#pragma once

#include <ATen/Parallel.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COMPILED_LLM_CPU_RELAX() _mm_pause()
#else
#define COMPILED_LLM_CPU_RELAX() ((void)0)
#endif

namespace compiled_llm_cpu {

class WorkerPool {
 public:
  // Field widths of the claim word: generation | workers allowed | total chunks | next chunk.
  static constexpr int kNextBits = 20, kTotalBits = 20, kWorkerBits = 8;
  static constexpr int64_t kMaxChunks = (int64_t{1} << kNextBits) - 1;

  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers may outlive static teardown
    return *pool;
  }

  // fn(chunk) for every chunk in [0, chunks), on up to `threads` threads (the caller included).
  template <class F>
  void run(int64_t chunks, int threads, const F& fn) {
    if (chunks <= 0) return;
    if (threads <= 1 || chunks == 1 || chunks > kMaxChunks || in_worker() || !ensure_workers(threads - 1)) {
      for (int64_t c = 0; c < chunks; c++) fn(c);
      return;
    }
    std::unique_lock<std::mutex> lock(call_mutex_, std::try_to_lock);
    if (!lock.owns_lock()) {  // another thread is inside a call: do this one alone
      for (int64_t c = 0; c < chunks; c++) fn(c);
      return;
    }
    call_ = [](const void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); };
    ctx_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & ((uint64_t{1} << (64 - kNextBits - kTotalBits - kWorkerBits)) - 1);
    const uint64_t word = (generation_ << (kNextBits + kTotalBits + kWorkerBits)) |
                          (static_cast<uint64_t>(threads - 1) << (kNextBits + kTotalBits)) |
                          (static_cast<uint64_t>(chunks) << kNextBits);
    word_.store(word, std::memory_order_seq_cst);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    int64_t mine = 0;
    int64_t c;
    while ((c = claim(generation_)) >= 0) {
      fn(c);
      mine++;
    }
    // Wait only for the chunks workers claimed and are still running.
    int64_t seen = done_.load(std::memory_order_acquire);
    for (int spins = 0; seen + mine < chunks; spins++) {
      if (spins < 4096)
        COMPILED_LLM_CPU_RELAX();
      else
        std::this_thread::yield();
      seen = done_.load(std::memory_order_acquire);
    }
  }

 private:
  WorkerPool() = default;

  static bool& in_worker() {
    static thread_local bool flag = false;
    return flag;
  }

  static uint64_t generation_of(uint64_t w) { return w >> (kNextBits + kTotalBits + kWorkerBits); }
  static int64_t workers_of(uint64_t w) {
    return static_cast<int64_t>((w >> (kNextBits + kTotalBits)) & ((1u << kWorkerBits) - 1));
  }
  static int64_t total_of(uint64_t w) { return static_cast<int64_t>((w >> kNextBits) & kMaxChunks); }
  static int64_t next_of(uint64_t w) { return static_cast<int64_t>(w & kMaxChunks); }

  // The next unclaimed chunk of generation `gen`, or -1 when there is none.
  int64_t claim(uint64_t gen) {
    uint64_t w = word_.load(std::memory_order_acquire);
    while (generation_of(w) == gen && next_of(w) < total_of(w)) {
      if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return next_of(w);
    }
    return -1;
  }

  bool ensure_workers(int wanted) {
    if (getpid() != owner_pid_) {  // a forked child inherits no threads: start its own
      workers_.clear();
      owner_pid_ = getpid();
    }
    wanted = std::min(wanted, (1 << kWorkerBits) - 1);
    while (static_cast<int>(workers_.size()) < wanted) {
      const int index = static_cast<int>(workers_.size());
      try {
        workers_.emplace_back([this, index] { work(index); });
        workers_.back().detach();
      } catch (...) {
        return !workers_.empty();
      }
    }
    return true;
  }

  void work(int index) {
    in_worker() = true;
    uint64_t last_gen = generation_of(word_.load(std::memory_order_acquire));
    for (;;) {
      // Wait for a call with chunks left that lets this worker take part: spin a while, then sleep.
      uint64_t w;
      auto ready = [&] {
        w = word_.load(std::memory_order_acquire);
        return generation_of(w) != last_gen && next_of(w) < total_of(w) && index < workers_of(w);
      };
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      bool got = false;
      for (int i = 0;; i++) {
        if (ready()) {
          got = true;
          break;
        }
        COMPILED_LLM_CPU_RELAX();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > spin_until) break;
      }
      if (!got) {
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        const uint32_t seen = wake_.load(std::memory_order_seq_cst);
        if (!ready()) wake_.wait(seen, std::memory_order_seq_cst);
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      const uint64_t gen = generation_of(w);
      last_gen = gen;
      int64_t c;
      while ((c = claim(gen)) >= 0) {
        // The call is alive: its caller waits for this chunk.
        call_(ctx_, c);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  static constexpr int kSpinMicros = 100;

  std::mutex call_mutex_;
  std::vector<std::thread> workers_;
  pid_t owner_pid_ = getpid();
  uint64_t generation_ = 0;  // of the current or last call (the caller's copy)
  void (*call_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> word_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleeping_{0};
};

// fn(chunk) for chunk in [0, chunks), spread over at::get_num_threads() threads.
template <class F>
inline void parallel_chunks(int64_t chunks, const F& fn) {
  WorkerPool::instance().run(chunks, at::get_num_threads(), fn);
}

}  // namespace compiled_llm_cpu
