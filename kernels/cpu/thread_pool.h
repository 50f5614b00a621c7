// A small persistent fork-join thread pool for the CPU kernels, in place of OpenMP and
// at::parallel_for.
//
// Why: libgomp keeps one thread team per calling thread. Called from a thread other than the
// process's main one (the server runs the engine in a worker thread), a kernel's region got a new
// team whose threads competed with the main thread's idle (spinning) pool threads: about 2x slower
// than from the main thread, slower even than one thread.
//
// The pool: at::get_num_threads() - 1 worker std::threads, created lazily once per process (more
// when the count rises), each waiting on its own job slot: a short spin (kSpinNs, 20 us), then a
// condition variable (20 us: Python between two calls takes longer than 5 us, and a futex wake per
// call cost ~40% at 5 us). The calling thread takes part (participant 0); items are handed out in
// chunks by an atomic counter. The caller waits for the workers the same way (spin, then sleep). An
// exception thrown by the function on any participant stops the handing out and is rethrown on the
// caller. Regions from two threads at once are serialized by a mutex; a region called from inside
// a region (on any participant) runs inline. After fork() the child starts a fresh pool.
//
// Header-only, everything in an unnamed namespace: each extension module has its own pool.
#pragma once

#include <ATen/Parallel.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CTXFUSE_POOL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define CTXFUSE_POOL_PAUSE() asm volatile("yield")
#else
#define CTXFUSE_POOL_PAUSE() ((void)0)
#endif

namespace ctxfuse_pool {
namespace {

constexpr int64_t kSpinNs = 20000;  // a waiting thread spins this long before it sleeps (by default)

// One region: fn(begin, end, participant) over [0, n) in chunks of `chunk` items.
struct Job {
  void (*call)(void* ctx, int64_t begin, int64_t end, int participant) = nullptr;
  void* ctx = nullptr;
  int64_t n = 0;
  int64_t chunk = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int> pending{0};  // workers not yet done
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // written by the one participant that set `failed`

  void work(int participant) noexcept {
    try {
      for (;;) {
        if (failed.load(std::memory_order_relaxed)) return;
        const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= n) return;
        call(ctx, b, std::min(n, b + chunk), participant);
      }
    } catch (...) {
      if (!failed.exchange(true, std::memory_order_acq_rel)) error = std::current_exception();
    }
  }
};

inline thread_local bool t_in_region = false;  // this thread runs a region's items (or is a worker)

// Spin for about spin_ns, then sleep on cv under mu, until done() holds.
template <class Done>
void await(std::mutex& mu, std::condition_variable& cv, std::atomic<int>& sleepers, int64_t spin_ns,
           Done&& done) {
  if (done()) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  for (int i = 1;; ++i) {
    CTXFUSE_POOL_PAUSE();
    if (done()) return;
    if ((i & 63) == 0 && std::chrono::steady_clock::now() >= until) break;
  }
  std::unique_lock<std::mutex> lk(mu);
  sleepers.fetch_add(1, std::memory_order_relaxed);
  cv.wait(lk, done);
  sleepers.fetch_sub(1, std::memory_order_relaxed);
}

// Wake the sleepers of cv after the state their predicate reads was stored: the lock orders the
// store before any predicate check still to come, so no wakeup is lost.
inline void wake(std::mutex& mu, std::condition_variable& cv, std::atomic<int>& sleepers, bool all) {
  bool any;
  {
    std::lock_guard<std::mutex> lk(mu);
    any = sleepers.load(std::memory_order_relaxed) > 0;
  }
  if (any) {
    if (all) cv.notify_all();
    else cv.notify_one();
  }
}

class Pool {
 public:
  // Run fn(begin, end, participant) over [0, n) in chunks; participants < threads.
  template <class F>
  void run(int64_t n, int64_t chunk, int threads, F& fn, int64_t linger_ns) {
    std::lock_guard<std::mutex> region(region_mu_);  // one region at a time
    grow(threads - 1);
    linger_ns_.store(linger_ns, std::memory_order_relaxed);
    Job job;
    job.call = [](void* ctx, int64_t b, int64_t e, int p) { (*static_cast<F*>(ctx))(b, e, p); };
    job.ctx = &fn;
    job.n = n;
    job.chunk = chunk;
    const int helpers = threads - 1;
    job.pending.store(helpers, std::memory_order_relaxed);
    for (int i = 0; i < helpers; ++i) workers_[i]->slot.store(&job, std::memory_order_release);
    wake(work_mu_, work_cv_, work_sleepers_, true);
    t_in_region = true;
    job.work(0);
    t_in_region = false;
    await(done_mu_, done_cv_, done_sleepers_, kSpinNs,
          [&] { return job.pending.load(std::memory_order_acquire) == 0; });
    if (job.failed.load(std::memory_order_acquire)) std::rethrow_exception(job.error);
  }

  static Pool& get() {
    Pool* p = instance().load(std::memory_order_acquire);
    if (p) return *p;
    static std::once_flag once;  // the first creation; a fork's child makes its own below
    std::call_once(once, [] {
      pthread_atfork(nullptr, nullptr, [] { instance().store(new Pool, std::memory_order_release); });
      Pool* expected = nullptr;
      Pool* fresh = new Pool;
      if (!instance().compare_exchange_strong(expected, fresh)) delete fresh;
    });
    return *instance().load(std::memory_order_acquire);
  }

 private:
  struct Worker {
    std::atomic<Job*> slot{nullptr};
  };

  // Never destroyed (the workers are detached and live to the process's end; a fork's child
  // leaks its parent's pool, whose threads it does not have).
  static std::atomic<Pool*>& instance() {
    static std::atomic<Pool*> p{nullptr};
    return p;
  }

  void grow(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      workers_.push_back(std::make_unique<Worker>());
      Worker* w = workers_.back().get();
      const int participant = static_cast<int>(workers_.size());
      std::thread([this, w, participant] { loop(w, participant); }).detach();
    }
  }

  void loop(Worker* w, int participant) {
    t_in_region = true;  // nested regions on a worker run inline
    for (;;) {
      await(work_mu_, work_cv_, work_sleepers_, linger_ns_.load(std::memory_order_relaxed),
            [w] { return w->slot.load(std::memory_order_acquire) != nullptr; });
      Job* job = w->slot.exchange(nullptr, std::memory_order_acq_rel);
      job->work(participant);
      if (job->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        wake(done_mu_, done_cv_, done_sleepers_, false);  // job is the caller's: not touched after
      }
    }
  }

  std::mutex region_mu_;
  std::vector<std::unique_ptr<Worker>> workers_;  // grown under region_mu_ only
  std::mutex work_mu_, done_mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<int> work_sleepers_{0}, done_sleepers_{0};
  std::atomic<int64_t> linger_ns_{kSpinNs};  // how long workers spin for the next job: the last region's
};

}  // namespace

// Threads a region may use: torch's intra-op setting (torch.set_num_threads), at least 1.
inline int num_threads() { return std::max(1, at::get_num_threads()); }

// fn(begin, end, participant) over [0, n) in chunks of `chunk` items handed out dynamically;
// participant in [0, threads) names the thread (0: the caller) for per-thread scratch. Uses at most
// `threads` participants (num_threads() when <= 0), fewer when there are fewer chunks. Runs inline
// (participant 0) for one thread or chunk, or inside another region. After the region the workers
// spin `linger_ns` for the next one before they sleep (waking a sleeping one costs tens of us).
template <class F>
void parallel_for(int64_t n, int64_t chunk, F&& fn, int threads = 0, int64_t linger_ns = kSpinNs) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  if (threads <= 0) threads = num_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, (n + chunk - 1) / chunk));
  if (threads <= 1 || t_in_region) {
    fn(int64_t{0}, n, 0);
    return;
  }
  Pool::get().run(n, chunk, threads, fn, linger_ns);
}

}  // namespace ctxfuse_pool
