// CPU emulation shim: lets g++ compile the CUDA backend's source (kernels and
// host code) as plain C++ (-DDFL_EMU), so a machine without a GPU runs it.
//
// A launch runs its CTAs one after another on the calling thread.  Each CUDA
// thread of a CTA is a fiber with its own stack; `__syncthreads`
// and the warp shuffles are barriers that switch to the next fiber until all
// live threads of the CTA (or warp) have arrived, so the kernels' barrier
// and shuffle logic runs exactly as written.  `__shared__` variables become
// function statics (one CTA runs at a time; DFL_STATIC_SMEM arrays the CTA's own).  "Device memory" is host memory;
// streams and events are no-ops because every launch completes before it
// returns.  Only what the backend uses is here.
//
// DFL_EMU_SCHEDULE picks which ready thread of a CTA runs next (a thread runs until it blocks on a barrier)
// and the order of a grid's CTAs: `fifo` (the default: threads in the order they became ready, CTAs x
// fastest), `reverse` (always the ready thread of the highest index, so a warp released from a shuffle runs
// ahead of lower warps still between barriers; the last CTA first) or `random[:SEED]` (the same with the
// warps ranked in a random order, and the lanes within each, drawn afresh at every CTA-wide barrier; the
// CTAs permuted).  A GPU promises no order, so a kernel whose results change with it
// reads shared memory another thread writes without a barrier between (a race) or relies on CTA order: run
// the op tests under each.
// Dynamic shared memory starts every CTA as 0xff bytes (NaN floats, -1 ints), as garbage would on a GPU, and so
// does each static shared array (DFL_STATIC_SMEM: filled when the CTA's first thread declares it).
//
// Built with -fsanitize=thread, the emulator is a race checker (compute-sanitizer racecheck's stand-in; see
// emu::race below): every CUDA thread is a ThreadSanitizer fiber, ordered with the others only by what
// orders them on a GPU, so a shared- or global-memory access that no barrier orders against another
// thread's write is reported whatever order the schedule ran them in.
#pragma once
// -DDFL_EMU_MEMTRACE (with -fsanitize=thread on the backend's sources, linked with emu/memtrace.cpp instead of
// libtsan): ThreadSanitizer's instrumentation reports every load and store to memtrace.cpp, which counts a
// warp's global-memory sectors and shared-memory wavefronts per instruction (docs/GPU.md); the race check is off.
#if defined(__SANITIZE_THREAD__) && !defined(DFL_EMU_MEMTRACE)
#define DFL_EMU_RACE 1
#endif
#if defined(DFL_EMU_MEMTRACE)
#include <cstddef>
extern "C" {  // emu/memtrace.cpp
extern int dfl_emu_trace_thread;  // the running CUDA thread of the CTA (-1: the host)
void dfl_emu_trace_launch(const void* fn, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned threads,
                          const void* smem, size_t smem_bytes);
void dfl_emu_trace_cta_end(void);
void dfl_emu_trace_launch_end(void);
void dfl_emu_trace_region(const void* p, size_t bytes, int kind);  // kind 1: device memory, 2: shared; 0: gone
void dfl_emu_trace_access(const void* p, size_t bytes, int write, const void* site);
void dfl_emu_trace_quiet(int delta);
void dfl_emu_trace_mma(int kind);  // a warp's mma.sync: 0 int8 m16n8k32, 1 tf32 m16n8k8
}
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#if defined(DFL_EMU_RACE)
#include <sanitizer/tsan_interface.h>
extern "C" {  // ThreadSanitizer's annotations (exported by libtsan)
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}
#endif
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __restrict__ __restrict

// Aligned as CUDA's own vector types are, so structs holding them are laid out as on the GPU, and a
// misaligned dereference is one (the sanitizer build checks alignment: tests/test_cuda_emulated.py).
#if defined(DFL_EMU_MEMTRACE)
// Copied whole, as the GPU moves them (one 8- or 16-byte ld / st): GCC would store a computed vector a field
// at a time, and the memory trace would count four instructions where nvcc emits one.
template <class T>
struct alignas(8) Vec2 {
  T x, y;
  Vec2() = default;
  constexpr Vec2(T a, T b) : x(a), y(b) {}
  Vec2(const Vec2& o) { std::memcpy(static_cast<void*>(this), &o, 8); }
  Vec2& operator=(const Vec2& o) { std::memcpy(static_cast<void*>(this), &o, 8); return *this; }
};
using uint2 = Vec2<uint32_t>;
using float2 = Vec2<float>;
template <class T>
struct alignas(16) Vec4 {
  T x, y, z, w;
  Vec4() = default;
  constexpr Vec4(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  Vec4(const Vec4& o) { std::memcpy(static_cast<void*>(this), &o, 16); }
  Vec4& operator=(const Vec4& o) { std::memcpy(static_cast<void*>(this), &o, 16); return *this; }
};
using uint4 = Vec4<uint32_t>;
using float4 = Vec4<float>;
#else
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
#endif
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
using std::max;
using std::min;

// Vector loads trap on misalignment, as the GPU would fault.
inline uint4 __ldg(const uint4* p) {
  if ((uintptr_t)p & 15) std::abort();
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline uint2 __ldg(const uint2* p) {
  if ((uintptr_t)p & 7) std::abort();
  uint2 v;
  std::memcpy(&v, p, 8);
  return v;
}
inline float4 __ldg(const float4* p) {
  if ((uintptr_t)p & 15) std::abort();
  float4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline unsigned short __ldg(const unsigned short* p) {
  if ((uintptr_t)p & 1) std::abort();
  return *p;
}
inline unsigned int __ldg(const unsigned int* p) {
  if ((uintptr_t)p & 3) std::abort();
  return *p;
}
inline uint8_t __ldg(const uint8_t* p) { return *p; }
inline float __ldg(const float* p) { return *p; }
// IEEE round-to-nearest multiply: one rounding, never fused (as on the GPU).
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}

inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}

// Four signed int8 products of a and b added to c (the GPU's dp4a.s32.s32).
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
  return c;
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t sh) {
  return (uint32_t)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- threads as fibers ----
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

// Stream capture: while a graph is being captured, launches, copies and memsets are recorded into it
// instead of run; launching the graph runs them in order (the argument values as they were captured).
struct Graph {
  std::vector<std::function<void()>> work;
};
inline thread_local Graph* capturing = nullptr;

// Where in the source a thread reached a barrier: the threads meeting at one must all be at the same call
// (a __syncthreads in code some threads skip, or a full-warp shuffle in a branch only some lanes take, is
// undefined on the GPU: a hang or garbage), so the emulator stops when two sites meet.
struct Site {
  const char* file = nullptr;
  int line = 0;
  bool operator==(const Site& o) const {
    return line == o.line && (file == o.file || (file && o.file && !std::strcmp(file, o.file)));
  }
};
// A barrier's arrivals and the fibers blocked on it.
struct Barrier {
  int arrived = 0;
  Site site;  // of the first arrival
  std::vector<int> waiters;
  unsigned gen = 0;      // releases so far
  char* sync = nullptr;  // the race check's two sync addresses, one for each parity of gen (see barrier_wait)
};
// A fiber's saved stack pointer.  On x86-64 the switch is a dozen instructions (the callee-saved
// registers); ucontext's swapcontext would make a signal-mask syscall per switch.  The floating-point
// control state (MXCSR, the x87 control word) is not switched: no kernel changes it, so every fiber runs
// under the launching thread's, and saving and restoring it was 16% of an emulated decode.
struct PendingCopy {  // a cp.async the thread issued and has not waited for
  void* dst;
  const void* src;
  int bytes, size;  // bytes read from src; the rest of size zero-filled
};
struct Fiber {
  void* sp = nullptr;
  dim3 tid;  // its threadIdx, set at every switch to it
  bool done = false;
  unsigned shuffles = 0;  // warp shuffles done (selects the slot buffer)
  std::vector<PendingCopy> copies;
};

// The emulator's own bookkeeping (the schedule, the barriers, the mma tiles) is left out of the sanitizer
// build's instrumentation: it is not what that build checks, and instrumented it took half a sanitized run.
// (Under ThreadSanitizer its accesses would be races between fibers: they are the GPU's hardware.)
#if defined(__SANITIZE_THREAD__)
#define EMU_INTERNAL __attribute__((no_sanitize_address, no_sanitize_thread))
#else
#define EMU_INTERNAL __attribute__((no_sanitize_address))
#endif

// ---- the race check (a -fsanitize=thread build) ----
// What orders two threads' memory accesses on a GPU, told to ThreadSanitizer, and nothing else:
//  - a CTA-wide barrier (__syncthreads) and __syncwarp: each thread's accesses before it happen before every
//    other participant's after it (a release by each arrival, an acquire by each as it leaves, on a sync
//    address of the barrier's generation);
//  - a launch: whatever the host did before it happens before every thread of the launch, and every thread
//    before what the host does after it (the stream's order);
//  - not a warp shuffle or mma.sync: they exchange registers, and order no memory on a GPU (independent
//    thread scheduling), so a lane reading shared memory another lane wrote before a shuffle is reported;
//  - not CTA order: the CTAs of a launch are unordered, so one CTA reading or writing what another wrote is
//    reported.  Thread i of every CTA is one fiber (its stack is one buffer): CTAs' threads of the same index
//    stay in program order, a race between only those goes unseen.
// Every fiber switch tells ThreadSanitizer it synchronises nothing.  A CTA's shared memory is new heap memory
// (allocated Untracked: its history starts there), so what the last CTA did there is not compared with this
// one.  The emulator's own bookkeeping (the scheduler, the copy queues, the shuffle slots) is Untracked.
namespace race {
#if defined(DFL_EMU_RACE)
struct Untracked {
  Untracked() { AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__); }
  ~Untracked() { AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
  Untracked(const Untracked&) = delete;
  Untracked& operator=(const Untracked&) = delete;
};
inline void release(char* a) { __tsan_release(a); }
inline void acquire(char* a) { __tsan_acquire(a); }
// Thread slot i's fiber (created once, as its stack is allocated once: by the launch, before its threads run).
inline void* fiber(int i) {
  Untracked quiet;
  static std::vector<void*> f;
  while ((int)f.size() <= i) f.push_back(__tsan_create_fiber(0));
  return f[(size_t)i];
}
inline void* current() { return __tsan_get_current_fiber(); }
inline void switch_to(void* to) { __tsan_switch_to_fiber(to, __tsan_switch_to_fiber_no_sync); }
#else
#if defined(DFL_EMU_MEMTRACE)
struct Untracked {  // the emulator's own accesses are not the kernel's traffic
  Untracked() { dfl_emu_trace_quiet(1); }
  ~Untracked() { dfl_emu_trace_quiet(-1); }
  Untracked(const Untracked&) = delete;
  Untracked& operator=(const Untracked&) = delete;
};
#else
struct Untracked {};
#endif
inline void release(char*) {}
inline void acquire(char*) {}
inline void* fiber(int) { return nullptr; }
inline void* current() { return nullptr; }
inline void switch_to(void*) {}
#endif
}  // namespace race

// One warp-wide mma.sync: what each lane posted (A: 4 registers, B: 2, C: 4) and the tile's result per lane.
struct MmaRound {
  uint32_t reg[32][10];
  uint32_t d[32][4];
  bool computed = false;
};

#if defined(__x86_64__)
__attribute__((naked, noinline)) inline void switch_stack(void** /*save_sp*/, void* /*to_sp*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
// A fresh stack whose first switch_stack "returns" into entry(); it starts `skew` bytes below the end of its
// buffer (see launch).
inline void* prepare_stack(char* stack, size_t size, size_t skew, void (*entry)()) {
  size -= skew;
#if defined(__SANITIZE_ADDRESS__)
  // A finished fiber never returns from fiber_entry, so AddressSanitizer would still mark whatever frames
  // that call chain poisoned (the emulator runs under ASan as a stand-in for compute-sanitizer memcheck).
  // The chain is uninstrumented (EMU_INTERNAL) and every kernel frame below it returned, unpoisoning
  // itself; clearing the top 8 KiB is a margin.  Clearing all 256 KiB, for every thread of every CTA,
  // was a third of a sanitized decode.
  const size_t top_bytes = size < (8u << 10) ? size : (8u << 10);
  __asan_unpoison_memory_region(stack + size - top_bytes, top_bytes);
#endif
  uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
  uint64_t* p = reinterpret_cast<uint64_t*>(top);
  *--p = 0;                                 // entry's (never used) return address: rsp % 16 == 8 at entry
  *--p = reinterpret_cast<uint64_t>(entry);
  for (int i = 0; i < 6; ++i) *--p = 0;     // rbp rbx r12 r13 r14 r15
  return p;
}
#else
#error "the CUDA emulator's fibers are written for x86-64"
#endif

// One CTA in flight.  Only runnable fibers are ever switched to: a fiber that
// blocks on a barrier hands control straight to the next ready fiber, and the
// last arrival makes the waiters ready again.
enum class Schedule { fifo, reverse, random };
struct Cta {
  Schedule kind = Schedule::fifo;  // DFL_EMU_SCHEDULE's, kept here for the switch path
  std::vector<Fiber> fibers;
  std::vector<int> ready;  // fifo: a queue from `head`
  size_t head = 0;
  // reverse / random: the ready thread of the highest rank runs next.  rank: thread -> rank (distinct, below 32 x
  // warps), by_rank its inverse; bit r of ready_ranks is set while the thread of rank r is ready.
  std::vector<int> rank, by_rank;
  uint64_t ready_ranks[16] = {};
  int n_ready = 0;
  int cur = 0, live = 0;
  std::vector<int> warp_live;
  Barrier bar;
  std::vector<Barrier> warp_bar;
  float slot[2][32][32];
  std::vector<MmaRound> mma;  // two a warp, used in turn (see mma_round)
  void* sched_sp = nullptr;
  const std::function<void()>* body = nullptr;
  dim3 block;
  // the launch's dynamic shared memory and what static + dynamic may total (see static_smem); the static
  // shared arrays this CTA has declared (each declaration's tag, the CTA's array), their bytes
  size_t dyn_smem = 0, smem_total_limit = 0;
  std::vector<std::pair<const void*, void*>> statics;
  size_t static_bytes = 0;
  unsigned char* smem = nullptr;  // the CTA's dynamic shared memory
  // the race check: the launching thread's fiber; `launch_sync` [0] released by the host before the launch's
  // threads start, [1] by each thread as it ends (see emu::race)
  void* host_fiber = nullptr;
  char* launch_sync = nullptr;
};
inline Cta* cta = nullptr;
// A fiber's stack: 256 KiB usable, plus the skew that staggers the stacks' tops (see launch).
constexpr size_t kStackSkewMax = 64 << 10, kStack = (256 << 10) + kStackSkewMax;

// The dynamic shared memory a CTA may have on sm_90 (227 KiB); see kSmemOptInMax.
inline unsigned char* dynamic_smem_buffer() {
  alignas(16) static unsigned char buf[227u << 10];
  return buf;
}
inline void* dynamic_smem() { return cta->smem; }

// DFL_EMU_SCHEDULE (see the top of this file), read once.
struct ScheduleChoice {
  Schedule kind = Schedule::fifo;
  uint64_t state = 0;  // splitmix64 state for `random`: the seed
};
inline ScheduleChoice& schedule() {
  static ScheduleChoice s = [] {
    ScheduleChoice c;
    const char* e = std::getenv("DFL_EMU_SCHEDULE");
    if (!e || !*e || !std::strcmp(e, "fifo")) return c;
    if (!std::strcmp(e, "reverse")) {
      c.kind = Schedule::reverse;
    } else if (!std::strncmp(e, "random", 6) && (e[6] == 0 || e[6] == ':')) {
      c.kind = Schedule::random;
      if (e[6] == ':') c.state = std::strtoull(e + 7, nullptr, 10);
    } else {
      std::fprintf(stderr, "emu: DFL_EMU_SCHEDULE=%s: expected fifo, reverse or random[:SEED]\n", e);
      std::abort();
    }
    return c;
  }();
  return s;
}
inline uint64_t schedule_next() {  // splitmix64
  uint64_t z = (schedule().state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline void schedule_shuffle(std::vector<int>& v) {  // a random permutation of v (Fisher-Yates)
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[schedule_next() % i]);
}
// Orders v (a grid's CTA indices, ascending) as the schedule says; fifo leaves it as it is.
inline void schedule_order(std::vector<int>& v) {
  if (schedule().kind == Schedule::reverse) std::reverse(v.begin(), v.end());
  if (schedule().kind == Schedule::random) schedule_shuffle(v);
}

EMU_INTERNAL inline void set_thread(int i) {
  threadIdx = cta->fibers[i].tid;
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_thread = i;
#endif
}

// The threads' ranks: reverse, the thread index; random, warps in a random order and lanes in a random order
// within each.  Drawn while no thread is ready (a CTA's start, the release of a CTA-wide barrier).
EMU_INTERNAL inline void rank_threads() {
  Cta& c = *cta;
  const int nt = (int)c.fibers.size();
  c.rank.resize(nt);
  c.by_rank.resize(32 * ((nt + 31) / 32));  // ranks lie below 32 x warps (a partial last warp leaves gaps)
  if (schedule().kind != Schedule::random) {
    for (int i = 0; i < nt; ++i) c.rank[i] = i;
  } else {
    std::vector<int> warps((nt + 31) / 32), lanes(32);
    for (size_t w = 0; w < warps.size(); ++w) warps[w] = (int)w;
    for (int l = 0; l < 32; ++l) lanes[l] = l;
    schedule_shuffle(warps);
    for (int w = 0; w < (int)warps.size(); ++w) {
      schedule_shuffle(lanes);
      for (int l = 0; l < 32 && 32 * w + l < nt; ++l) c.rank[32 * w + l] = 32 * warps[w] + lanes[l];
    }
  }
  for (int i = 0; i < nt; ++i) c.by_rank[c.rank[i]] = i;
}
EMU_INTERNAL inline void push_ready(int f) {
  Cta& c = *cta;
  if (cta->kind == Schedule::fifo) return c.ready.push_back(f);
  const int r = c.rank[f];
  c.ready_ranks[r >> 6] |= 1ull << (r & 63);
  ++c.n_ready;
}
// The ready fiber the schedule runs next (taken out of the ready set), or -1 when none is ready.
EMU_INTERNAL inline int pop_ready() {
  Cta& c = *cta;
  if (cta->kind == Schedule::fifo) return c.head < c.ready.size() ? c.ready[c.head++] : -1;
  if (c.n_ready == 0) return -1;
  int w = 15;
  while (!c.ready_ranks[w]) --w;
  const int bit = 63 - __builtin_clzll(c.ready_ranks[w]);
  c.ready_ranks[w] &= ~(1ull << bit);
  --c.n_ready;
  return c.by_rank[64 * w + bit];
}

EMU_INTERNAL inline void release(Barrier& b) {
  b.arrived = 0;
  ++b.gen;
  if (&b == &cta->bar && cta->kind == Schedule::random && cta->n_ready == 0) rank_threads();
  for (int w : b.waiters) push_ready(w);
  b.waiters.clear();
}

// Switches from the current fiber (whose stack pointer goes to *save) to fiber nx, or back to the launch
// loop when nx is -1 (none ready).
EMU_INTERNAL inline void switch_to(void** save, int nx) {
  Cta& c = *cta;
  if (nx >= 0) {
    c.cur = nx;
    set_thread(nx);
    race::switch_to(race::fiber(nx));
    switch_stack(save, c.fibers[nx].sp);
  } else {
#if defined(DFL_EMU_MEMTRACE)
    dfl_emu_trace_thread = -1;
#endif
    race::switch_to(c.host_fiber);
    switch_stack(save, c.sched_sp);
  }
}
EMU_INTERNAL inline void run_next(void** save) { switch_to(save, pop_ready()); }

// Arrive; block until all live threads of the group have arrived.
EMU_INTERNAL inline void barrier_meet(Barrier& b, const int* live, Site at) {
  [[maybe_unused]] race::Untracked quiet;  // (this fiber's, kept across its switches)
  Cta& c = *cta;
  const int me = c.cur;
  if (b.arrived == 0) {
    b.site = at;
  } else if (!(b.site == at)) {
    std::fprintf(stderr,
                 "emu: divergent barrier: thread %d of CTA (%u,%u,%u) reached one at %s:%d while others wait at "
                 "%s:%d\n", me, blockIdx.x, blockIdx.y, blockIdx.z, at.file, at.line, b.site.file, b.site.line);
    std::abort();
  }
  if (++b.arrived >= *live) {
    if (cta->kind == Schedule::fifo) {  // the last arrival runs on
      release(b);
      return;
    }
    // Otherwise the last arrival becomes ready with the others, and the schedule picks who runs.
    b.waiters.push_back(me);
    release(b);
    const int nx = pop_ready();
    if (nx != me) switch_to(&c.fibers[me].sp, nx);
    return;
  }
  b.waiters.push_back(me);
  run_next(&c.fibers[me].sp);
  // resumed by run_next of another fiber, which set cur and threadIdx
}

// Arrive; block until all live threads of the group have arrived.  orders_memory: a barrier (__syncthreads,
// __syncwarp), not a register exchange (a shuffle, mma.sync), for the race check: each arrival releases on the
// generation's sync address and each thread acquires it as it leaves.  A thread can be one generation ahead
// of one still leaving the last (never two: the next release needs every thread), so two addresses alternate.
EMU_INTERNAL inline void barrier_wait(Barrier& b, const int* live, Site at, bool orders_memory) {
  char* const sync = orders_memory && b.sync ? b.sync + (b.gen & 1) : nullptr;
  if (sync) race::release(sync);
  barrier_meet(b, live, at);
  if (sync) race::acquire(sync);
}

EMU_INTERNAL inline void fiber_entry() {
  race::acquire(cta->launch_sync);  // what the host did before the launch comes before the thread
  (*cta->body)();
  Cta& c = *cta;
  const int me = c.cur, w = me >> 5;
  // the thread comes before what the host does after the launch, and (counted as arrived) before what the
  // others do after their next barrier
  race::release(c.launch_sync + 1);
  if (c.bar.sync) race::release(c.bar.sync + (c.bar.gen & 1));
  if (c.warp_bar[w].sync) race::release(c.warp_bar[w].sync + (c.warp_bar[w].gen & 1));
  {
    race::Untracked quiet;
    c.fibers[me].done = true;
    --c.live;
    --c.warp_live[w];
    // Threads that exit count as arrived, as on the GPU.
    if (c.bar.arrived > 0 && c.bar.arrived >= c.live) release(c.bar);
    if (c.warp_bar[w].arrived > 0 && c.warp_bar[w].arrived >= c.warp_live[w]) release(c.warp_bar[w]);
  }
  void* dead = nullptr;
  run_next(&dead);  // never resumed
  std::abort();
}

// Dynamic shared memory a kernel may ask for: 48 KiB unless cudaFuncSetAttribute raised it (up to 227 KiB
// on sm_90). The GPU refuses such a launch; the emulator stops there, so it is found without one.
inline constexpr size_t kSmemDefault = 48u << 10, kSmemOptInMax = 227u << 10;
// DFL_EMU_SMEM_OPTIN_KIB=99 makes the emulator an sm_86 / sm_89 card (99 KiB a CTA at most), so the code that
// sizes kernels to the device is tested for those too.
inline size_t smem_optin_max() {
  static const size_t v = [] {
    const char* e = std::getenv("DFL_EMU_SMEM_OPTIN_KIB");
    const long k = e && *e ? std::strtol(e, nullptr, 10) : 0;
    return k > 48 && (size_t)k << 10 <= kSmemOptInMax ? (size_t)k << 10 : kSmemOptInMax;
  }();
  return v;
}
inline std::vector<std::pair<const void*, size_t>>& smem_opt_in() {
  static std::vector<std::pair<const void*, size_t>> v;
  return v;
}
// The dynamic limit cudaFuncSetAttribute gave the kernel, or null when it gave none.
inline size_t* smem_opted_in(const void* fn) {
  for (auto& e : smem_opt_in())
    if (e.first == fn) return &e.second;
  return nullptr;
}
inline size_t smem_limit(const void* fn) {
  const size_t* v = fn ? smem_opted_in(fn) : nullptr;
  return v ? *v : kSmemDefault;
}

// The running CTA's static shared array of a declaration (DFL_STATIC_SMEM; `tag`: the declaration's function
// static, its identity): the CTA's first thread there allocates it, exactly its size (a sanitizer build sees an
// access past its end; the race check, new memory), and fills it with garbage; the CTA's end frees it.  Its
// bytes count against the CTA's shared memory as on the GPU: static arrays at most 48 KiB, and with the
// dynamic part at most 48 KiB, or the device's opt-in maximum once cudaFuncSetAttribute gave the kernel a
// dynamic limit (its dynamic part is checked against that at launch); a launch over it is refused there.
inline void* static_smem(const void* tag, size_t bytes, size_t align) {
  race::Untracked quiet;
  Cta& c = *cta;
  for (const auto& [t, p] : c.statics)
    if (t == tag) return p;
  c.static_bytes += bytes;
  if (c.static_bytes > kSmemDefault || c.static_bytes + c.dyn_smem > c.smem_total_limit) {
    std::fprintf(stderr, "emu: launch refused: static shared memory %zu bytes + dynamic %zu over the limit %zu\n",
                 c.static_bytes, c.dyn_smem, c.static_bytes > kSmemDefault ? kSmemDefault : c.smem_total_limit);
    std::abort();
  }
  void* p = align <= 16 ? std::malloc(bytes) : std::aligned_alloc(align, (bytes + align - 1) / align * align);
  std::memset(p, 0xff, bytes);
  c.statics.push_back({tag, p});
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_region(p, bytes, 2);
#endif
  return p;
}

// The launch configurations the GPU refuses (cudaErrorInvalidConfiguration / ...OutOfResources) stop here.
inline void check_launch(dim3 grid, dim3 block, size_t smem, const void* fn) {
  const unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
  const char* bad = nt == 0 || nt > 1024 ? "threads per block (max 1024)"
                    : block.z > 64 ? "block.z (max 64)"
                    : grid.y > 65535 || grid.z > 65535 ? "grid.y / grid.z (max 65535)"
                    : fn && smem > smem_limit(fn) ? "dynamic shared memory over the kernel's limit (48 KiB unless "
                                                    "cudaFuncAttributeMaxDynamicSharedMemorySize raised it)"
                    : smem > kSmemOptInMax ? "dynamic shared memory (max 227 KiB)"
                    : nullptr;
  if (bad) {
    std::fprintf(stderr, "emu: launch refused: %s: grid (%u,%u,%u) block (%u,%u,%u) dynamic smem %zu\n", bad, grid.x,
                 grid.y, grid.z, block.x, block.y, block.z, smem);
    std::abort();
  }
}

// A kernel compiled with __launch_bounds__(bound) (DFL_LAUNCH_BOUND, common.cuh): the GPU refuses a launch of
// more threads a block (too many resources requested); each thread of such a launch stops the run here.
inline void check_launch_bound(unsigned bound, const char* kernel) {
  const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
  if (nt <= bound) return;
  std::fprintf(stderr, "emu: launch refused: %u threads per block over %s's __launch_bounds__ (%u)\n", nt, kernel,
               bound);
  std::abort();
}

// fn: the kernel (for its shared-memory opt-in); null for the emulator's own launches
inline void launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body, const void* fn = nullptr) {
  if (capturing) {
    capturing->work.push_back([grid, block, smem, body, fn] { launch(grid, block, smem, body, fn); });
    return;
  }
  check_launch(grid, block, smem, fn);
  const int nt = (int)(block.x * block.y * block.z);
  static std::vector<char*> stacks;
  while ((int)stacks.size() < nt) stacks.push_back(static_cast<char*>(std::malloc(kStack)));
  Cta c;
  cta = &c;
  c.host_fiber = race::current();
  race::fiber(nt - 1);
  c.launch_sync = static_cast<char*>(std::malloc(2));
  c.kind = schedule().kind;
  c.body = &body;
  c.block = block;
  c.dyn_smem = smem;
  c.smem_total_limit = fn && smem_opted_in(fn) ? smem_optin_max() : kSmemDefault;
  gridDim = grid;
  blockDim = block;
  const long long n_cta = (long long)grid.x * grid.y * grid.z;
  std::vector<int> order;
  if (schedule().kind != Schedule::fifo) {
    order.resize(n_cta);
    for (long long i = 0; i < n_cta; ++i) order[i] = (int)i;
    schedule_order(order);
  }
  // Dynamic shared memory: one buffer for every CTA, or under the race check a new one for each.
  unsigned char* smem_buf = dynamic_smem_buffer();
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_launch(fn, grid.x, grid.y, grid.z, (unsigned)nt, smem_buf, smem);
#endif
#if defined(__SANITIZE_ADDRESS__)
  // Past the launch's dynamic shared memory: a read or write there is an AddressSanitizer report.
  __asan_unpoison_memory_region(smem_buf, kSmemOptInMax);
  __asan_poison_memory_region(smem_buf + smem, kSmemOptInMax - smem);
#endif
  for (long long ci = 0; ci < n_cta; ++ci) {
    const unsigned lin = order.empty() ? (unsigned)ci : (unsigned)order[ci];
    const unsigned bx = lin % grid.x, by = (lin / grid.x) % grid.y, bz = lin / (grid.x * grid.y);
    // the race check's barrier sync addresses, new for each CTA (freed below with what they held), so that no
    // barrier orders one CTA's threads after another's
    char* const bar_sync = static_cast<char*>(std::malloc(2 + 2 * ((nt + 31) / 32)));
    race::Untracked quiet;  // (the host's; its fiber's until the CTA's threads are done)
#if defined(DFL_EMU_RACE)
    c.smem = static_cast<unsigned char*>(std::malloc(smem > 0 ? smem : 1));
#else
    c.smem = smem_buf;
#endif
    blockIdx = dim3(bx, by, bz);
    std::memset(c.smem, 0xff, smem);  // a CTA's shared memory starts as garbage (static arrays: as declared)
    c.static_bytes = 0;
    c.fibers.assign(nt, Fiber{});
    c.live = nt;
    c.warp_live.assign((nt + 31) / 32, 0);
    for (int i = 0; i < nt; ++i) ++c.warp_live[i >> 5];
    c.bar = Barrier{};
    c.warp_bar.assign(c.warp_live.size(), Barrier{});
    c.bar.sync = bar_sync;
    for (size_t w = 0; w < c.warp_bar.size(); ++w) c.warp_bar[w].sync = bar_sync + 2 + 2 * w;
    c.mma.resize(2 * c.warp_live.size());
    c.ready.clear();
    c.head = 0;
    std::fill(std::begin(c.ready_ranks), std::end(c.ready_ranks), 0);
    c.n_ready = 0;
    // The stacks are allocated alike (same offset within a page), so unskewed their tops, where the threads'
    // frames live, would all map to one L1 / L2 cache set and every switch would miss; thread i's top sits
    // (11 i mod 1024) cache lines lower instead, a different set for each of up to 1024 threads.
    for (int i = 0; i < nt; ++i)
      c.fibers[i].tid = dim3((unsigned)i % block.x, ((unsigned)i / block.x) % block.y, (unsigned)i / (block.x * block.y));
    for (int i = 0; i < nt; ++i)
      c.fibers[i].sp = prepare_stack(stacks[i], kStack, (size_t)(11 * i % 1024) * 64, fiber_entry);
    rank_threads();
    for (int i = 0; i < nt; ++i) push_ready(i);
    race::release(c.launch_sync);  // (the host's clock: it has taken nothing from the launch's threads yet)
    run_next(&c.sched_sp);  // returns when no fiber is ready
    if (c.live > 0) {
      std::fprintf(stderr, "emu: deadlock: %d threads of CTA (%u,%u,%u) wait on a barrier forever\n", c.live,
                   bx, by, bz);
      std::abort();
    }
    std::free(bar_sync);
#if defined(DFL_EMU_MEMTRACE)
    dfl_emu_trace_cta_end();
    for (const auto& st : c.statics) dfl_emu_trace_region(st.second, 0, 0);
#endif
    for (const auto& st : c.statics) std::free(st.second);
    c.statics.clear();
#if defined(DFL_EMU_RACE)
    std::free(c.smem);
#endif
  }
  race::acquire(c.launch_sync + 1);
  std::free(c.launch_sync);
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_launch_end();
#endif
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(smem_buf, kSmemOptInMax);
#endif
  cta = nullptr;
}

}  // namespace emu

namespace emu {
// cp.async as the GPU may run it: a copy has landed only once the issuing thread's cp.async.wait_group
// returned, so the emulator queues it and copies at that wait.  A kernel that reads a tile before its
// wait, or another thread's part of it before the barrier after every thread's wait, reads the buffer's
// old bytes here as it could on the GPU, and its results are wrong.  A misaligned address stops the
// run (the GPU faults).
inline void cp_async(void* dst, const void* src, int size, int src_bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % (uintptr_t)size || src_bytes < 0 ||
      src_bytes > size) {
    std::fprintf(stderr, "emu: cp.async of %d bytes (%d from the source): misaligned or bad size\n", size,
                 src_bytes);
    std::abort();
  }
#if defined(DFL_EMU_MEMTRACE)
  // the copy's traffic is at its issue (as one instruction of the warp), not at the wait, where it lands
  dfl_emu_trace_access(src, (size_t)src_bytes, 0, __builtin_return_address(0));
  dfl_emu_trace_access(dst, (size_t)size, 1, __builtin_return_address(0));
#endif
  race::Untracked quiet;
  cta->fibers[cta->cur].copies.push_back({dst, src, src_bytes, size});
}
inline void cp_async_wait_all() {
  std::vector<PendingCopy>& q = cta->fibers[cta->cur].copies;
  for (const PendingCopy& c : q) {  // the copies' reads and writes are the thread's, checked
    std::memcpy(c.dst, c.src, (size_t)c.bytes);
    std::memset(static_cast<char*>(c.dst) + c.bytes, 0, (size_t)(c.size - c.bytes));
  }
  race::Untracked quiet;
  q.clear();
}
}  // namespace emu

namespace emu {
inline void syncthreads_at(Site at) { barrier_wait(cta->bar, &cta->live, at, true); }
// The warp's live lanes meet (the mask is the full warp wherever the kernels call it).
inline void syncwarp_at(Site at) {
  Cta& c = *cta;
  const int w = c.cur >> 5;
  barrier_wait(c.warp_bar[w], &c.warp_live[w], at, true);
}
}  // namespace emu
// Macros, so each barrier knows its call site (emu::Site).
#define __syncthreads() ::emu::syncthreads_at(::emu::Site{__FILE__, __LINE__})
#define __syncwarp(...) ::emu::syncwarp_at(::emu::Site{__FILE__, __LINE__})
#define __shfl_xor_sync(mask, v, o) ::emu::shfl_xor_at(::emu::Site{__FILE__, __LINE__}, mask, v, o)
// Values pass through a per-warp slot buffer; the buffer alternates between
// consecutive shuffles, so one barrier per shuffle suffices (a lane can only
// rewrite a buffer after every lane has arrived at the next shuffle, i.e.
// finished reading this one).
namespace emu {
// The kernels' shuffles and mma.sync name the whole warp: a lane that has exited, or that the block does not
// have (a partial last warp), makes them undefined on the GPU (garbage or a hang).  The emulator stops there.
inline void require_full_warp(const char* what) {
  const Cta& c = *cta;
  const int w = c.cur >> 5;
  if (c.warp_live[w] == 32) return;
  std::fprintf(stderr, "emu: %s over the full warp with %d of warp %d's 32 lanes live (exited, or a partial warp)\n",
               what, c.warp_live[w], w);
  std::abort();
}
}  // namespace emu

namespace emu {
template <class T>
EMU_INTERNAL inline T shfl_xor_at(Site at, unsigned, T v, int o) {
  static_assert(sizeof(T) == 4, "4-byte shuffles only");
  require_full_warp("__shfl_xor_sync");
  Cta& c = *cta;
  const int me = c.cur, lane = me & 31, w = me >> 5;
  float (&slot)[32][32] = c.slot[c.fibers[me].shuffles++ & 1];
  __builtin_memcpy(&slot[w % 32][lane], &v, 4);
  barrier_wait(c.warp_bar[w], &c.warp_live[w], at, false);
  T out;
  __builtin_memcpy(&out, &slot[w % 32][lane ^ o], 4);
  return out;
}
}  // namespace emu

namespace emu {
// A warp-wide mma.sync: every lane posts its A, B and C registers (the round's buffer alternates as the
// shuffles' slots do, with the same counter), and once all have arrived the first lane past the barrier
// computes the whole 16x8 tile for the warp; each lane takes its own four D elements.  One tile a warp
// rather than four elements a lane: the same arithmetic in the same order, once, in loops the compiler
// vectorises (the attention tests spent 70% of their time here when each lane gathered its own).
EMU_INTERNAL inline uint32_t (&mma_round(const uint32_t (&a)[4], const uint32_t (&b)[2], const uint32_t (&c)[4],
                            void (*tile)(MmaRound&)))[4] {
  require_full_warp("mma.sync");
  Cta& cx = *cta;
  const int me = cx.cur, lane = me & 31, w = me >> 5;
  MmaRound& r = cx.mma[2 * w + (cx.fibers[me].shuffles++ & 1)];
  if (cx.warp_bar[w].arrived == 0) r.computed = false;  // the first lane here opens the round
  for (int i = 0; i < 4; ++i) r.reg[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) r.reg[lane][4 + i] = b[i];
  for (int i = 0; i < 4; ++i) r.reg[lane][6 + i] = c[i];
  barrier_wait(cx.warp_bar[w], &cx.warp_live[w], Site{"mma.sync", 0}, false);
  if (!r.computed) {
    tile(r);
    r.computed = true;
  }
  return r.d[lane];
}
// Lane (g = lane / 4, t = lane % 4) holds D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1], and C likewise.
inline int d_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
inline int d_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (fragment maps in csrc/backend/cuda/mma.cuh), in exact
// integer arithmetic (int32 wrapping, as the instruction without .satfinite).
EMU_INTERNAL inline void mma_tile_s8(MmaRound& r) {
  int32_t A[16][32], B[32][8];
  uint32_t D[16][8];
  for (int row = 0; row < 16; ++row)
    for (int k = 0; k < 32; ++k)  // A[row][k]: lane 4 * row%8 + (k%16)/4, register (row >= 8) + 2 * (k >= 16), byte k % 4
      A[row][k] = (int8_t)(r.reg[4 * (row & 7) + ((k & 15) >> 2)][(row >= 8) + 2 * (k >= 16)] >> (8 * (k & 3)));
  for (int k = 0; k < 32; ++k)
    for (int col = 0; col < 8; ++col)  // B[k][col]: lane 4 * col + (k%16)/4, register 4 + (k >= 16), byte k % 4
      B[k][col] = (int8_t)(r.reg[4 * col + ((k & 15) >> 2)][4 + (k >= 16)] >> (8 * (k & 3)));
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) D[d_row(lane, i)][d_col(lane, i)] = r.reg[lane][6 + i];
  for (int row = 0; row < 16; ++row)
    for (int k = 0; k < 32; ++k)
      for (int col = 0; col < 8; ++col) D[row][col] += (uint32_t)(A[row][k] * B[k][col]);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) r.d[lane][i] = D[d_row(lane, i)][d_col(lane, i)];
}
inline void mma_m16n8k32_s8(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const int32_t (&c)[4]) {
  uint32_t cu[4];
  std::memcpy(cu, c, 16);
  std::memcpy(d, mma_round(a, b, cu, mma_tile_s8), 16);
#if defined(DFL_EMU_MEMTRACE)
  if ((threadIdx.x & 31) == 0) dfl_emu_trace_mma(0);
#endif
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (fragment maps in csrc/backend/cuda/mma.cuh): each D element
// is c + the 8 products in k order, summed in double and truncated toward zero to f32, the operands read as
// tf32 (low 13 bits ignored, as the instruction does).  A tf32 x tf32 product is exact in f32, so only the sum
// rounds: in double, and once more to f32.  The ISA leaves the sum's order and rounding open; published
// measurements of the tensor cores show products summed wide and truncated, which this models (the
// pessimistic side of round-to-nearest: truncation errors all lean one way), not the GPU's bits.
EMU_INTERNAL inline void mma_tile_tf32(MmaRound& r) {
  auto tf32 = [](uint32_t u) {
    float f;
    u &= 0xffffe000u;
    std::memcpy(&f, &u, 4);
    return (double)f;
  };
  double A[16][8], B[8][8], D[16][8];
  for (int row = 0; row < 16; ++row)
    for (int k = 0; k < 8; ++k)  // A[row][k]: lane 4 * row%8 + k%4, register (row >= 8) + 2 * (k >= 4)
      A[row][k] = tf32(r.reg[4 * (row & 7) + (k & 3)][(row >= 8) + 2 * (k >= 4)]);
  for (int k = 0; k < 8; ++k)
    for (int col = 0; col < 8; ++col)  // B[k][col]: lane 4 * col + k%4, register 4 + (k >= 4)
      B[k][col] = tf32(r.reg[4 * col + (k & 3)][4 + (k >= 4)]);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      float f;
      std::memcpy(&f, &r.reg[lane][6 + i], 4);
      D[d_row(lane, i)][d_col(lane, i)] = f;
    }
  for (int k = 0; k < 8; ++k)
    for (int row = 0; row < 16; ++row)
      for (int col = 0; col < 8; ++col) D[row][col] += A[row][k] * B[k][col];
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const double acc = D[d_row(lane, i)][d_col(lane, i)];
      float f = (float)acc;  // to nearest; the hardware truncates: one step toward zero when it rounded up
      uint32_t u;
      std::memcpy(&u, &f, 4);
      if (std::fabs((double)f) > std::fabs(acc)) --u;
      r.d[lane][i] = u;
    }
}
inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  uint32_t cu[4];
  std::memcpy(cu, c, 16);
  std::memcpy(d, mma_round(a, b, cu, mma_tile_tf32), 16);
#if defined(DFL_EMU_MEMTRACE)
  if ((threadIdx.x & 31) == 0) dfl_emu_trace_mma(1);
#endif
}
}  // namespace emu

// ---- runtime API ----
typedef int cudaError_t;
typedef void* cudaStream_t;
typedef void* cudaEvent_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
#define cudaSuccess 0
#define cudaStreamNonBlocking 1
struct cudaDeviceProp {
  char name[256];
  int multiProcessorCount;
  size_t sharedMemPerBlockOptin;
};
inline const char* cudaGetErrorName(int) { return "emulated"; }
inline const char* cudaGetErrorString(int) { return "emulated"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// While this thread captures a stream (cudaStreamCaptureModeThreadLocal), the runtime refuses calls that
// may synchronise or allocate (and invalidates the capture); the emulator stops on them instead.
namespace emu {
inline void unsafe_during_capture(const char* api) {
  if (!capturing) return;
  std::fprintf(stderr, "emu: %s is not allowed while this thread captures a stream\n", api);
  std::abort();
}
}  // namespace emu
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class F>
inline cudaError_t cudaFuncSetAttribute(F* fn, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || (size_t)value > emu::smem_optin_max()) return 1;  // cudaErrorInvalidValue
  if (size_t* v = emu::smem_opted_in((const void*)fn)) *v = (size_t)value;
  else emu::smem_opt_in().push_back({(const void*)fn, (size_t)value});
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::snprintf(p->name, sizeof p->name, "CPU emulator");
  p->multiProcessorCount = 4;  // small: the kernels that size their grids by it take their largest groupings
  p->sharedMemPerBlockOptin = emu::smem_optin_max();
  return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  *free_b = (size_t)8 << 30;
  *total_b = (size_t)8 << 30;
  return cudaSuccess;
}
// Exactly n bytes (256-aligned), so a sanitizer sees any read past the end.
inline cudaError_t cudaMalloc(void** p, size_t n) {
  emu::unsafe_during_capture("cudaMalloc");
  if (posix_memalign(p, 256, n ? n : 1) != 0) {
    *p = nullptr;
    return 2;
  }
  std::memset(*p, 0xff, n);  // fresh device memory is not zero: poison it
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_region(*p, n, 1);
#endif
  return cudaSuccess;
}
template <class T>
inline cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaFree(void* p) {
  emu::unsafe_during_capture("cudaFree");
#if defined(DFL_EMU_MEMTRACE)
  dfl_emu_trace_region(p, 0, 0);
#endif
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, size_t n) {  // pinned host memory: plain memory here
  emu::unsafe_during_capture("cudaMallocHost");
  *p = std::malloc(n ? n : 1);
  return *p ? cudaSuccess : 2;
}
inline cudaError_t cudaFreeHost(void* p) {
  emu::unsafe_during_capture("cudaFreeHost");
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  emu::unsafe_during_capture("cudaMemcpy (synchronous)");
  std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t = nullptr) {
  if (emu::capturing) return emu::capturing->work.push_back([=] { std::memmove(d, s, n); }), cudaSuccess;
  std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* d, size_t dpitch, const void* s, size_t spitch, size_t width, size_t height,
                                     cudaMemcpyKind, cudaStream_t = nullptr) {
  auto copy = [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(d) + r * dpitch, static_cast<const char*>(s) + r * spitch, width);
  };
  if (emu::capturing) return emu::capturing->work.push_back(copy), cudaSuccess;
  copy();
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t = nullptr) {
  if (emu::capturing) return emu::capturing->work.push_back([=] { std::memset(d, v, n); }), cudaSuccess;
  std::memset(d, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { *s = nullptr; return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  emu::unsafe_during_capture("cudaStreamSynchronize");
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  emu::unsafe_during_capture("cudaDeviceSynchronize");
  return cudaSuccess;
}
// Events hold the host time they were recorded at (launches are synchronous).
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = new double(0.0); return cudaSuccess; }
#define cudaEventDisableTiming 2
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete static_cast<double*>(e); return cudaSuccess; }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  *static_cast<double*>(e) =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) {
  emu::unsafe_during_capture("cudaEventSynchronize");
  return cudaSuccess;
}
// Graphs (see emu::Graph): capture on any stream records; an instantiated graph is a copy of the record.
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed };
typedef emu::Graph* cudaGraph_t;
typedef emu::Graph* cudaGraphExec_t;
inline cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
  if (emu::capturing) return 900;  // cudaErrorStreamCaptureUnsupported-like: no nested capture
  emu::capturing = new emu::Graph;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* g) {
  if (!emu::capturing) return 901;
  *g = emu::capturing;
  emu::capturing = nullptr;
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long = 0) {
  *e = new emu::Graph(*g);
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t) {
  for (auto& w : e->work) w();
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = (float)(*static_cast<double*>(b) - *static_cast<double*>(a));
  return cudaSuccess;
}
