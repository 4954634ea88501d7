// profile.cuh — where a step's GPU time goes, op by op (dfl_cuda_profile).
//
// Off by default and then free: one relaxed atomic load per op.  When on, each
// backend op is bracketed by two events on the backend's stream; the pairs are
// read at the backend's next host sync (download, sync), never in between, so
// profiling adds no host round trip.  An op's time is the GPU time between its
// events (its kernels, back to back), so the per-op sum is close to the step's
// GPU time; launch gaps and host time are not in it.  Rows are keyed by op
// name (matmuls also by weight format, shape and token count), with the bytes
// the op must read at least (a matmul's weights), so a row's GB/s can be set
// against the copy bandwidth.  Host waits for the stream are counted too, as
// rows "host sync: <why>" with no time.
#pragma once
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common.cuh"

namespace dfl {
namespace cuda {

struct OpProfileRow {
  double ms = 0.0, bytes = 0.0;
  int64_t calls = 0;
};

struct OpProfileTable {
  std::atomic<bool> on{false};
  std::mutex mu;
  std::map<std::string, OpProfileRow> rows;
};
inline OpProfileTable& op_profile() {
  static OpProfileTable t;
  return t;
}

// One backend's open event pairs.
class OpProfiler {
 public:
  ~OpProfiler() {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
    for (Pending& p : pending_) cudaEventDestroy(p.a), cudaEventDestroy(p.b);
  }
  // Records the start of an op on `s`; returns false (nothing recorded) when off.
  bool begin(cudaStream_t s) {
    if (!op_profile().on.load(std::memory_order_relaxed)) return false;
    open_ = take();
    CUDA_CHECK(cudaEventRecord(open_, s));
    return true;
  }
  // Records the op's end (from a destructor: a failure drops the pair, never throws).
  void end(cudaStream_t s, std::string op, double bytes) noexcept {
    try {
      cudaEvent_t b = take();
      if (cudaEventRecord(b, s) != cudaSuccess) {
        pool_.push_back(b), pool_.push_back(open_);
        return;
      }
      pending_.push_back({std::move(op), bytes, open_, b});
    } catch (...) {
    }
  }
  // A host wait for the stream (download, upload, free, sync): a row "host sync: <why>" counts them, 0 ms
  // (the step's syncs are the ones the issue allows: reading back what the host needs).
  static void count_sync(const char* why) {
    OpProfileTable& t = op_profile();
    if (!t.on.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(t.mu);
    t.rows[std::string("host sync: ") + why].calls += 1;
  }
  // After the stream has synchronised: every pair's time into the table.
  void resolve() {
    if (pending_.empty()) return;
    OpProfileTable& t = op_profile();
    std::lock_guard<std::mutex> lock(t.mu);
    for (Pending& p : pending_) {
      float ms = 0.f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, p.a, p.b));
      if (t.on.load(std::memory_order_relaxed)) {
        OpProfileRow& r = t.rows[p.op];
        r.ms += ms, r.bytes += p.bytes, r.calls += 1;
      }
      pool_.push_back(p.a), pool_.push_back(p.b);
    }
    pending_.clear();
  }

 private:
  struct Pending {
    std::string op;
    double bytes;
    cudaEvent_t a, b;
  };
  cudaEvent_t take() {
    if (pool_.empty()) {
      cudaEvent_t e = nullptr;
      CUDA_CHECK(cudaEventCreate(&e));
      return e;
    }
    cudaEvent_t e = pool_.back();
    pool_.pop_back();
    return e;
  }
  std::vector<cudaEvent_t> pool_;
  std::vector<Pending> pending_;
  cudaEvent_t open_ = nullptr;
};

}  // namespace cuda
}  // namespace dfl
