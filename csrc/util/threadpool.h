// threadpool.h — a small fork/join pool for the CPU backend.
//
// A decode step issues a few hundred short parallel loops, so waking workers
// through a condition variable each time would cost more than the work on a
// 2-core machine: workers spin on the job ticket for a while after each job
// and only then sleep.  The calling thread takes part.  A job is cut into a
// fixed set of parts (contiguous index ranges that depend only on n, grain and
// the pool size) and participants claim parts from an atomic ticket, so a
// worker that the OS has not scheduled (another process on the cores) never
// holds up a job it has not started: the others take its parts.  Which thread
// computes a part never changes its result (every element is computed by
// exactly one thread, with the same code).  Spinning yields the core now and
// then so an oversubscribed machine degrades gracefully.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dfl {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads) : n_(std::max(1, n_threads)) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true, std::memory_order_relaxed);
      ticket_.store((++gen_) << 32, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n).  Ranges are
  // multiples of `grain` (except the last) so callers can keep blocks whole.
  // Not reentrant: one caller thread at a time.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    const int64_t chunks = (n + grain - 1) / grain;
    if (n_ == 1 || chunks == 1) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    job_chunks_ = chunks;
    const int parts = (int)std::min<int64_t>(chunks, std::min(n_ * 4, kMaxParts));
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = ++gen_;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ticket_.store(g << 32 | (uint64_t)parts << 16, std::memory_order_release);
    }
    cv_.notify_all();
    run_parts(g);
    for (int spins = 0; done_.load(std::memory_order_acquire) != parts; ++spins) pause(spins);
  }

 private:
  static void pause(int spins) {
    if ((spins & 1023) == 1023) {
      std::this_thread::yield();
    } else {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }

  // First chunk of part p of a job cut into `parts`: part sizes halve every n_
  // parts down to the last two rounds (weights 4 4 2 2 1 1 1 1 for 2 threads), so
  // the parts taken last are small and a job's threads finish close together.
  int64_t part_begin(uint32_t p, uint32_t parts) const {
    const uint32_t rounds = (parts + n_ - 1) / n_;
    auto weight = [&](uint32_t q) -> int64_t { return int64_t(1) << std::max<int>(0, (int)rounds - 2 - (int)(q / n_)); };
    int64_t before = 0, total = 0;
    for (uint32_t q = 0; q < parts; ++q) {
      if (q < p) before += weight(q);
      total += weight(q);
    }
    return job_chunks_ * before / total;
  }

  // Claims and runs parts of job g until none is left (or the job is gone).
  // The part count travels in the ticket itself: a ticket of a finished job
  // (next == parts) can never be claimed, even while the caller is already
  // writing the next job's fields.
  void run_parts(uint64_t g) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((t >> 32) != g) return;
      const uint32_t p = (uint32_t)(t & 0xffff), parts = (uint32_t)(t >> 16) & 0xffff;
      if (p >= parts) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // Part p of job g is ours: the job's fields stay put until every part is done.
      const int64_t c0 = part_begin(p, parts), c1 = part_begin(p + 1, parts);
      const int64_t b = c0 * job_grain_, e = std::min(job_n_, c1 * job_grain_);
      if (b < e) (*job_)(b, e);
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void worker_loop() {
    uint64_t seen = 0;  // generation 0 is "no job yet"
    for (;;) {
      uint64_t g;
      int spins = 0;
      while ((g = ticket_.load(std::memory_order_acquire) >> 32) == seen && spins < 200000) pause(spins++);
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
        g = ticket_.load(std::memory_order_acquire) >> 32;
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      run_parts(g);
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  static constexpr int kMaxParts = 0xffff;
  std::atomic<uint64_t> ticket_{0};  // generation << 32 | parts << 16 | next unclaimed part
  std::atomic<int> done_{0};         // parts finished in the current job
  std::atomic<bool> stop_{false};
  uint64_t gen_ = 0;                 // caller thread only
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1, job_chunks_ = 1;
};

}  // namespace dfl
