// threadpool.h — a small fork/join pool for the CPU backend.
//
// A decode step issues a few hundred short parallel loops, so waking workers
// through a condition variable each time would cost more than the work on a
// 2-core machine.  Workers therefore spin on a generation counter for a while
// after each job and only then sleep.  The calling thread takes part as worker
// 0.  Work is split into fixed contiguous ranges by index, so which thread
// computes an element never changes its result (every element is computed by
// exactly one thread, with the same code).
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dfl {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads) : n_(std::max(1, n_threads)) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n).  Ranges are
  // multiples of `grain` (except the last) so callers can keep blocks whole.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    int64_t chunks = (n + grain - 1) / grain;
    if (n_ == 1 || chunks == 1) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    // Every worker takes part in every job (some with an empty range), so no
    // worker can observe a job's parameters after they changed for the next.
    job_threads_ = n_;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    run_part(0);
    while (pending_.load(std::memory_order_acquire) != 0) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }

 private:
  void run_part(int tid) {
    if (tid >= job_threads_) return;
    int64_t chunks = (job_n_ + job_grain_ - 1) / job_grain_;
    int64_t c0 = chunks * tid / job_threads_, c1 = chunks * (tid + 1) / job_threads_;
    int64_t b = c0 * job_grain_, e = std::min(job_n_, c1 * job_grain_);
    if (b < e) (*job_)(b, e);
  }

  void worker_loop(int tid) {
    uint64_t seen = 0;  // generation 0 is "no job yet", even if a job started before this thread
    for (;;) {
      uint64_t g;
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen && spins < 200000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        ++spins;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        g = gen_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_) return;
      run_part(tid);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1;
  int job_threads_ = 1;
};

}  // namespace dfl
