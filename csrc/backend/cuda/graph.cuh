// graph.cuh — a step's launches replayed as CUDA graphs, chosen by their bytes.
//
// A 27B forward is ~1,300 launches.  One by one, each costs the host a few µs
// and the GPU a gap; a CUDA graph launches a run of them at once.  The backend
// builds no graph by hand.  While it defers (DFLASH27B_CUDA_GRAPHS, on by
// default; off while the op profile is on), every launch, device copy and
// memset of its stream is recorded — the kernel, the launch shape and the
// argument bytes — and issued in segments: at most kSegmentOps, or up to the
// next host sync or plan upload.  A segment is its bytes.  The first time a
// run of bytes is seen it is issued directly, the second time it is captured
// into a graph, and from then on the graph is launched — only for a segment
// whose every byte equals the one it was captured from: the same kernels,
// shapes, pointers and scalars.  So a replay does exactly what issuing the
// launches would; what repeats decides the speed, never the result.  (Hence
// per-step values — the KV slot, the visible slots — live in the device plan,
// not in kernel arguments: an AR step's segments repeat from step to step.)
//
// The argument bytes are packed at the kernel parameters' natural offsets with
// padding zeroed (__builtin_clear_padding), so equal arguments give equal bytes.
#pragma once
#include <array>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common.cuh"

#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
#define DFL_CLEAR_PADDING(p) __builtin_clear_padding(p)
#endif
#endif

namespace dfl {
namespace cuda {

#ifdef DFL_CLEAR_PADDING
constexpr bool kGraphsPossible = true;
#else
constexpr bool kGraphsPossible = false;  // padding bytes could differ between equal arguments
#define DFL_CLEAR_PADDING(p) ((void)(p))
#endif

// Offsets of each argument in the packed bytes, then the total.
template <class... T>
constexpr std::array<size_t, sizeof...(T) + 1> arg_layout() {
  std::array<size_t, sizeof...(T) + 1> o{};
  size_t at = 0, i = 0;
  ((at = (at + alignof(T) - 1) / alignof(T) * alignof(T), o[i++] = at, at += sizeof(T)), ...);
  o[i] = at;
  return o;
}

template <class T>
void pack_arg(uint8_t* dst, T v) {
  static_assert(std::is_trivially_copyable<T>::value, "kernel arguments are copied as bytes");
  DFL_CLEAR_PADDING(&v);
  std::memcpy(dst, &v, sizeof v);
}

// How a recorded op is issued: fn (a kernel or null), its packed arguments, the launch shape.
using IssueFn = void (*)(const void* fn, const uint8_t* args, dim3 grid, dim3 block, size_t smem, cudaStream_t s);

template <class... P>
void issue_kernel(const void* fn, const uint8_t* args, dim3 grid, dim3 block, size_t smem, cudaStream_t s) {
  constexpr auto L = arg_layout<std::decay_t<P>...>();
#ifdef DFL_EMU
  std::tuple<std::decay_t<P>...> t;
  size_t i = 0;
  std::apply([&](auto&... e) { ((std::memcpy(&e, args + L[i++], sizeof e)), ...); }, t);
  auto kernel = reinterpret_cast<void (*)(P...)>(const_cast<void*>(fn));
  ::emu::launch(grid, block, smem, [kernel, t] { std::apply(kernel, t); }, fn);
  (void)s;
#else
  void* argv[sizeof...(P) + 1];
  for (size_t i = 0; i < sizeof...(P); ++i) argv[i] = const_cast<uint8_t*>(args) + L[i];
  CUDA_CHECK(cudaLaunchKernel(fn, grid, block, argv, smem, s));
#endif
}

struct CopyArgs {  // a device-to-device copy of `height` rows
  void* dst;
  size_t dpitch;
  const void* src;
  size_t spitch, width, height;
};
inline void issue_copy(const void*, const uint8_t* args, dim3, dim3, size_t, cudaStream_t s) {
  CopyArgs c;
  std::memcpy(&c, args, sizeof c);
  if (c.height == 1)
    CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDeviceToDevice, s));
  else
    CUDA_CHECK(cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, cudaMemcpyDeviceToDevice, s));
}
struct ZeroArgs {
  void* dst;
  size_t bytes;
};
inline void issue_zero(const void*, const uint8_t* args, dim3, dim3, size_t, cudaStream_t s) {
  ZeroArgs z;
  std::memcpy(&z, args, sizeof z);
  CUDA_CHECK(cudaMemsetAsync(z.dst, 0, z.bytes, s));
}

// dfl_cuda_graph_mode: -1 each context as DFLASH27B_CUDA_GRAPHS set it at its creation, 0 off, 1 on —
// for every context of the process at once, so a benchmark compares the two in one run.
inline std::atomic<int>& graph_mode_override() {
  static std::atomic<int> m{-1};
  return m;
}

// What the recorders of the process did (dfl_cuda_graph_stats).
struct GraphCounters {
  std::atomic<int64_t> direct_ops{0}, replayed_ops{0}, graph_launches{0}, captures{0};
};
inline GraphCounters& graph_counters() {
  static GraphCounters c;
  return c;
}

// One backend's recorded segment and its graphs.
class LaunchRecorder {
 public:
  static constexpr int kSegmentOps = 128;
  static constexpr size_t kMaxGraphs = 256, kMaxSeen = 4096;

  LaunchRecorder() = default;
  LaunchRecorder(const LaunchRecorder&) = delete;
  LaunchRecorder& operator=(const LaunchRecorder&) = delete;
  ~LaunchRecorder() { drop_graphs(); }

  void bind(cudaStream_t s) { stream_ = s; }

  // The recorder this thread's ops on stream s go to, or null: issue directly.
  static LaunchRecorder*& current() {
    static thread_local LaunchRecorder* r = nullptr;
    return r;
  }
  static LaunchRecorder* for_stream(cudaStream_t s) {
    LaunchRecorder* r = current();
    return r && r->stream_ == s ? r : nullptr;
  }
  // Makes `r` (may be null) this thread's recorder for the scope.
  struct Scope {
    LaunchRecorder* prev;
    explicit Scope(LaunchRecorder* r) : prev(current()) { current() = r; }
    ~Scope() { current() = prev; }
  };

  // Appends an op; returns where its arg_bytes (zeroed) go.  close() after writing them.
  uint8_t* open(IssueFn issue, const void* fn, dim3 grid, dim3 block, size_t smem, size_t arg_bytes) {
    Header h{};
    h.issue = issue;
    h.fn = fn;
    h.dims[0] = grid.x, h.dims[1] = grid.y, h.dims[2] = grid.z;
    h.dims[3] = block.x, h.dims[4] = block.y, h.dims[5] = block.z;
    h.smem = smem;
    h.arg_bytes = (arg_bytes + 15) / 16 * 16;
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof h + h.arg_bytes, 0);
    std::memcpy(bytes_.data() + at, &h, sizeof h);
    return bytes_.data() + at + sizeof h;
  }
  void close() {
    if (++n_ops_ >= kSegmentOps) flush();
  }

  // Issues the recorded segment: its graph when these bytes were captured, a
  // capture when they were seen once before, else each op directly.
  void flush() {
    if (bytes_.empty()) return;
    struct Done {  // the segment is gone however this ends: a failure must not issue it twice
      LaunchRecorder& r;
      ~Done() {
        r.bytes_.clear();  // keeps its capacity: no allocation per segment
        r.n_ops_ = 0;
      }
    } done{*this};
    const std::vector<uint8_t>& seg = bytes_;
    const int64_t ops = n_ops_;
    GraphCounters& gc = graph_counters();
    const uint64_t h = hash(seg);
    auto g = graphs_.find(h);
    if (g != graphs_.end() && g->second.sig == seg) {
      CUDA_CHECK(cudaGraphLaunch(g->second.exec, stream_));
      g->second.last_use = ++tick_;
      gc.replayed_ops += ops;
      gc.graph_launches += 1;
      return;
    }
    if (!seen_.count(h) || broken_) {
      if (seen_.size() >= kMaxSeen) seen_.clear();
      seen_[h] = 1;
      issue_all(seg);
      gc.direct_ops += ops;
      return;
    }
    cudaGraphExec_t exec = capture(seg);
    if (!exec) {  // the stream cannot capture (a driver limit): issue directly from now on
      broken_ = true;
      issue_all(seg);
      gc.direct_ops += ops;
      return;
    }
    if (g != graphs_.end()) {  // a hash collision: the newer segment takes the slot
      cudaGraphExecDestroy(g->second.exec);
      graphs_.erase(g);
    }
    if (graphs_.size() >= kMaxGraphs) evict_oldest();
    CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    graphs_[h] = Graph{seg, exec, ++tick_};
    gc.captures += 1;
    gc.replayed_ops += ops;
    gc.graph_launches += 1;
  }

  void drop_graphs() {
    for (auto& e : graphs_) cudaGraphExecDestroy(e.second.exec);
    graphs_.clear();
    seen_.clear();
  }

 private:
  struct Header {  // 64 bytes, no padding: part of the segment's bytes
    IssueFn issue;
    const void* fn;
    uint32_t dims[6];
    uint64_t smem, arg_bytes;
    uint64_t reserved;
  };
  static_assert(sizeof(Header) == 64, "the op header is part of the compared bytes");

  struct Graph {
    std::vector<uint8_t> sig;
    cudaGraphExec_t exec;
    uint64_t last_use;
  };

  static uint64_t hash(const std::vector<uint8_t>& b) {  // 8 bytes a step (segments are 16-byte multiples)
    uint64_t h = 0x9e3779b97f4a7c15ull ^ b.size();
    for (size_t i = 0; i < b.size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, b.data() + i, 8);
      h = (h ^ w) * 0xff51afd7ed558ccdull;
      h ^= h >> 29;
    }
    return h;
  }

  void issue_all(const std::vector<uint8_t>& seg) const {
    for (size_t at = 0; at < seg.size();) {
      Header h;
      std::memcpy(&h, seg.data() + at, sizeof h);
      h.issue(h.fn, seg.data() + at + sizeof h, dim3(h.dims[0], h.dims[1], h.dims[2]),
              dim3(h.dims[3], h.dims[4], h.dims[5]), (size_t)h.smem, stream_);
      at += sizeof h + h.arg_bytes;
    }
  }

  // The segment captured and instantiated; null when the runtime refuses (nothing was issued then).
  cudaGraphExec_t capture(const std::vector<uint8_t>& seg) {
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    try {
      issue_all(seg);
    } catch (...) {
      cudaGraph_t dropped = nullptr;
      cudaStreamEndCapture(stream_, &dropped);
      if (dropped) cudaGraphDestroy(dropped);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream_, &graph) != cudaSuccess || !graph) {
      cudaGetLastError();
      return nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return exec;
  }

  void evict_oldest() {
    auto old = graphs_.begin();
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
      if (it->second.last_use < old->second.last_use) old = it;
    cudaGraphExecDestroy(old->second.exec);
    graphs_.erase(old);
  }

  cudaStream_t stream_ = nullptr;
  std::vector<uint8_t> bytes_;  // the open segment: [Header | args] per op
  int64_t n_ops_ = 0;
  std::unordered_map<uint64_t, Graph> graphs_;
  std::unordered_map<uint64_t, uint8_t> seen_;  // segments issued once, by hash
  uint64_t tick_ = 0;
  bool broken_ = false;
};

// A copy or fill (no kernel) on stream s: recorded when s is being recorded, else issued now.
template <class Args>
void record_or_issue(cudaStream_t s, IssueFn issue, const Args& args) {
  if (LaunchRecorder* r = LaunchRecorder::for_stream(s)) {
    pack_arg(r->open(issue, nullptr, dim3(), dim3(), 0, sizeof args), args);
    return r->close();
  }
  alignas(16) uint8_t b[sizeof args];
  pack_arg(b, args);
  issue(nullptr, b, dim3(), dim3(), 0, s);
}
inline void device_copy(cudaStream_t s, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                        size_t height) {
  record_or_issue(s, issue_copy, CopyArgs{dst, dpitch, src, spitch, width, height});
}
inline void device_zero(cudaStream_t s, void* dst, size_t bytes) { record_or_issue(s, issue_zero, ZeroArgs{dst, bytes}); }

}  // namespace cuda
}  // namespace dfl
