// memtrace.cpp — the memory traffic of the emulated kernels, instruction by instruction, as a GPU would see it.
//
// The emulator build with -DDFLASH27B_CUDA_EMU_MEMTRACE=ON compiles the backend's sources with GCC's
// ThreadSanitizer instrumentation (every load and store calls __tsan_readN / __tsan_writeN) and links this
// file in place of libtsan's runtime.  An access counts when a CUDA thread makes it (not the host, not the
// emulator's own bookkeeping) to device memory (cudaMalloc) or shared memory; the stacks (registers and
// local arrays on a GPU) and host memory are left out.  cp.async reports its copy where it is issued.
//
// A warp's instruction is the accesses its lanes make at one place in the code (the instrumented call's
// return address) for the k-th time, so lanes that skip a load in a branch still line up by place.  For each:
//  - global memory: the 32-byte sectors it touches against the fewest that could hold its distinct bytes
//    (a coalesced instruction touches no more; a strided one touches up to 32x more), and its bytes;
//  - shared memory: its wavefronts, the most distinct 4-byte words any one of the 32 banks must serve
//    (lanes reading one word share it), against its distinct bytes / 128 (a conflict-free instruction).
// Per launch, the distinct global sectors read and written: what DRAM must move at least when nothing is
// re-read from it, to set beside the kernel's time on a GPU; and the warps' mma.sync instructions.
//
// What this cannot see: timing, occupancy, caches beyond that floor, and how nvcc splits or merges loads.
// One host thread launches at a time (the trace is one global record, as the emulator runs a launch on its
// caller's thread): a diagnostic build for bench/emu_memtrace.py, not for serving.
// GCC may fuse neighbouring scalar accesses a thread makes, so the build turns off its vectorizers; a
// kernel's explicit 8- and 16-byte loads (uint2 / uint4 / float4) stay as written.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define DFL_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
int dfl_emu_trace_thread = -1;
}

namespace {

struct Rec {
  uint32_t warp, occ;
  uintptr_t site, addr;
  uint32_t bytes;
  uint8_t write, shared;
};

// Summed over a kernel's (or a site's) instructions of one kind.
struct Counts {
  uint64_t instructions = 0, lane_accesses = 0, bytes = 0;
  uint64_t units = 0, ideal = 0;  // global: sectors; shared: wavefronts
  void add(const Counts& o) {
    instructions += o.instructions, lane_accesses += o.lane_accesses, bytes += o.bytes;
    units += o.units, ideal += o.ideal;
  }
};
// [shared][write]
struct Kinds {
  Counts c[2][2];
};
struct Kernel {
  uint64_t launches = 0, ctas = 0, threads = 0;
  uint64_t dram_sectors[2] = {0, 0};  // distinct global sectors per launch, summed over launches
  uint64_t mma[2] = {0, 0};           // warp mma.sync instructions: int8 m16n8k32, tf32 m16n8k8
  Kinds all;
  std::unordered_map<uintptr_t, Kinds> sites;
};

struct Trace {
  std::map<uintptr_t, std::pair<uintptr_t, int>> regions;  // start -> (end, kind)
  bool in_launch = false;
  uintptr_t fn = 0, smem_lo = 0, smem_hi = 0;
  std::vector<int> quiet;  // per CUDA thread of the CTA, [0] the host's
  std::vector<std::unordered_map<uintptr_t, uint32_t>> occ;
  std::vector<Rec> recs;
  std::unordered_set<uint64_t> sectors[2];
  std::map<uintptr_t, Kernel> kernels;
};

Trace& T() {
  static Trace* t = new Trace;  // never destroyed: the instrumented code may run during exit
  return *t;
}

int& quiet_of(Trace& t, int thread) {
  const size_t i = (size_t)(thread + 1);
  if (t.quiet.size() <= i) t.quiet.resize(i + 1, 0);
  return t.quiet[i];
}

// 0: not traced; 1: device memory; 2: shared memory
int space_of(Trace& t, uintptr_t a) {
  if (a >= t.smem_lo && a < t.smem_hi) return 2;
  auto it = t.regions.upper_bound(a);
  if (it == t.regions.begin()) return 0;
  --it;
  return a < it->second.first ? it->second.second : 0;
}

void record(uintptr_t addr, size_t bytes, bool write, uintptr_t site) {
  Trace& t = T();
  const int th = dfl_emu_trace_thread;
  if (!t.in_launch || th < 0 || bytes == 0 || quiet_of(t, th) > 0) return;
  const int space = space_of(t, addr);
  if (!space) return;
  if (t.occ.size() <= (size_t)th) t.occ.resize((size_t)th + 1);
  const uint32_t k = t.occ[(size_t)th][site * 2 + write]++;
  t.recs.push_back({(uint32_t)th / 32u, k, site, addr, (uint32_t)bytes, (uint8_t)write, (uint8_t)(space == 2)});
}

// One warp instruction: recs [b, e) share warp, site, occurrence, kind.
Counts instruction(const Rec* b, const Rec* e, std::unordered_set<uint64_t>* launch_sectors) {
  Counts c;
  c.instructions = 1;
  c.lane_accesses = (uint64_t)(e - b);
  // distinct bytes: the lanes' byte ranges merged
  std::vector<std::pair<uintptr_t, uintptr_t>> r;
  for (const Rec* p = b; p != e; ++p) r.push_back({p->addr, p->addr + p->bytes});
  std::sort(r.begin(), r.end());
  uint64_t distinct = 0;
  uintptr_t hi = 0;
  for (const auto& [lo, end] : r) {
    const uintptr_t s = std::max(lo, hi);
    if (end > s) distinct += end - s;
    hi = std::max(hi, end);
  }
  c.bytes = distinct;
  if (!b->shared) {
    std::vector<uint64_t> sec;
    for (const auto& [lo, end] : r)
      for (uint64_t s = lo >> 5; s <= (end - 1) >> 5; ++s) sec.push_back(s);
    std::sort(sec.begin(), sec.end());
    sec.erase(std::unique(sec.begin(), sec.end()), sec.end());
    c.units = sec.size();
    c.ideal = (distinct + 31) / 32;
    launch_sectors->insert(sec.begin(), sec.end());
  } else {
    std::vector<uint64_t> words;
    for (const auto& [lo, end] : r)
      for (uint64_t w = lo >> 2; w <= (end - 1) >> 2; ++w) words.push_back(w);
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    uint32_t per_bank[32] = {};
    for (uint64_t w : words) ++per_bank[w & 31];
    c.units = *std::max_element(per_bank, per_bank + 32);
    c.ideal = std::max<uint64_t>(1, (distinct + 127) / 128);
  }
  return c;
}

std::string hex(uintptr_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%lx", (unsigned long)v);
  return b;
}

// "object":..., "offset": the address as addr2line takes it for that object
std::string where(uintptr_t a) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(a), &info) || !info.dli_fname) return "\"object\": null, \"offset\": \"" + hex(a) + "\"";
  return std::string("\"object\": \"") + info.dli_fname + "\", \"offset\": \"" +
         hex(a - reinterpret_cast<uintptr_t>(info.dli_fbase)) + "\"";
}

void counts_json(std::string& o, const Kinds& k) {
  static const char* names[2][2] = {{"global_read", "global_write"}, {"shared_read", "shared_write"}};
  bool first = true;
  for (int sh = 0; sh < 2; ++sh)
    for (int w = 0; w < 2; ++w) {
      const Counts& c = k.c[sh][w];
      if (!c.instructions) continue;
      char b[320];
      std::snprintf(b, sizeof b,
                    "%s\"%s\": {\"instructions\": %llu, \"lane_accesses\": %llu, \"bytes\": %llu, \"%s\": %llu, "
                    "\"ideal\": %llu}",
                    first ? "" : ", ", names[sh][w], (unsigned long long)c.instructions,
                    (unsigned long long)c.lane_accesses, (unsigned long long)c.bytes, sh ? "wavefronts" : "sectors",
                    (unsigned long long)c.units, (unsigned long long)c.ideal);
      o += b;
      first = false;
    }
}

}  // namespace

extern "C" {

void dfl_emu_trace_launch(const void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned threads, const void* smem,
                          size_t smem_bytes) {
  Trace& t = T();
  t.in_launch = true;
  t.fn = reinterpret_cast<uintptr_t>(fn);
  t.smem_lo = reinterpret_cast<uintptr_t>(smem);
  t.smem_hi = t.smem_lo + smem_bytes;
  Kernel& k = t.kernels[t.fn];
  ++k.launches;
  k.ctas += (uint64_t)gx * gy * gz;
  k.threads = threads;
}

void dfl_emu_trace_cta_end(void) {
  Trace& t = T();
  if (!t.in_launch) return;
  std::vector<Rec>& v = t.recs;
  auto key = [](const Rec& a) { return std::make_tuple(a.warp, a.site, a.write, a.shared, a.occ); };
  std::sort(v.begin(), v.end(), [&](const Rec& a, const Rec& b) { return key(a) < key(b); });
  Kernel& k = t.kernels[t.fn];
  for (size_t i = 0; i < v.size();) {
    size_t j = i + 1;
    while (j < v.size() && key(v[j]) == key(v[i])) ++j;
    const Counts c = instruction(&v[i], &v[j], &t.sectors[v[i].write]);
    k.all.c[v[i].shared][v[i].write].add(c);
    k.sites[v[i].site * 2 + v[i].write].c[v[i].shared][v[i].write].add(c);
    i = j;
  }
  v.clear();
  for (auto& m : t.occ) m.clear();
}

void dfl_emu_trace_launch_end(void) {
  Trace& t = T();
  Kernel& k = t.kernels[t.fn];
  for (int w = 0; w < 2; ++w) {
    k.dram_sectors[w] += t.sectors[w].size();
    t.sectors[w].clear();
  }
  t.in_launch = false;
  t.smem_lo = t.smem_hi = 0;
}

void dfl_emu_trace_region(const void* p, size_t bytes, int kind) {
  Trace& t = T();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (kind == 0) t.regions.erase(a);
  else t.regions[a] = {a + bytes, kind};
}

void dfl_emu_trace_access(const void* p, size_t bytes, int write, const void* site) {
  record(reinterpret_cast<uintptr_t>(p), bytes, write != 0, reinterpret_cast<uintptr_t>(site));
}

void dfl_emu_trace_quiet(int delta) { quiet_of(T(), dfl_emu_trace_thread) += delta; }

void dfl_emu_trace_mma(int kind) {
  Trace& t = T();
  if (t.in_launch) ++t.kernels[t.fn].mma[kind & 1];
}

// ---- the report ----
DFL_EXPORT void dfl_emu_memtrace_reset(void) { T().kernels.clear(); }

// JSON: {"kernels": [{"object", "offset" (the kernel's entry), launches, ctas, threads, dram_read_bytes,
// dram_write_bytes, mma_int8, mma_tf32 (warp instructions), global_read / global_write {instructions, lane_accesses, bytes, sectors, ideal},
// shared_read / shared_write {..., wavefronts, ideal}, "sites": [{"object", "offset", ...} x each place]}]}
DFL_EXPORT int dfl_emu_memtrace_dump(const char* path) {
  Trace& t = T();
  std::string o = "{\"kernels\": [";
  bool first = true;
  for (const auto& [fn, k] : t.kernels) {
    char b[384];
    std::snprintf(b, sizeof b,
                  ", \"launches\": %llu, \"ctas\": %llu, \"threads\": %llu, \"dram_read_bytes\": %llu, "
                  "\"dram_write_bytes\": %llu, \"mma_int8\": %llu, \"mma_tf32\": %llu, ",
                  (unsigned long long)k.launches, (unsigned long long)k.ctas, (unsigned long long)k.threads,
                  (unsigned long long)(k.dram_sectors[0] * 32), (unsigned long long)(k.dram_sectors[1] * 32),
                  (unsigned long long)k.mma[0], (unsigned long long)k.mma[1]);
    o += std::string(first ? "\n" : ",\n") + "{" + where(fn) + b;
    counts_json(o, k.all);
    o += ", \"sites\": [";
    bool fs = true;
    for (const auto& [site, kinds] : k.sites) {
      o += std::string(fs ? "" : ", ") + "{" + where(site / 2) + ", ";
      counts_json(o, kinds);
      o += "}";
      fs = false;
    }
    o += "]}";
    first = false;
  }
  o += "\n]}\n";
  FILE* f = std::fopen(path, "w");
  if (!f) return -1;
  const bool ok = std::fwrite(o.data(), 1, o.size(), f) == o.size();
  return std::fclose(f) == 0 && ok ? 0 : -1;
}

// ---- ThreadSanitizer's entry points, as GCC's instrumentation calls them ----
void __tsan_init(void) {}
#define DFL_TSAN_RW(n)                                                                                        \
  void __tsan_read##n(void* p) { record(reinterpret_cast<uintptr_t>(p), n, false, (uintptr_t)__builtin_return_address(0)); } \
  void __tsan_write##n(void* p) { record(reinterpret_cast<uintptr_t>(p), n, true, (uintptr_t)__builtin_return_address(0)); } \
  void __tsan_unaligned_read##n(void* p) { record(reinterpret_cast<uintptr_t>(p), n, false, (uintptr_t)__builtin_return_address(0)); } \
  void __tsan_unaligned_write##n(void* p) { record(reinterpret_cast<uintptr_t>(p), n, true, (uintptr_t)__builtin_return_address(0)); }
DFL_TSAN_RW(1)
DFL_TSAN_RW(2)
DFL_TSAN_RW(4)
DFL_TSAN_RW(8)
DFL_TSAN_RW(16)
#undef DFL_TSAN_RW
void __tsan_read_range(void* p, unsigned long n) {
  record(reinterpret_cast<uintptr_t>(p), n, false, (uintptr_t)__builtin_return_address(0));
}
void __tsan_write_range(void* p, unsigned long n) {
  record(reinterpret_cast<uintptr_t>(p), n, true, (uintptr_t)__builtin_return_address(0));
}
void __tsan_vptr_update(void** p, void* v) { (void)p, (void)v; }
void __tsan_vptr_read(void** p) { (void)p; }
void __tsan_func_entry(void* pc) { (void)pc; }
void __tsan_func_exit(void) {}

// Atomics (the host's: graph and profile counters); done as asked, not traced.
#define DFL_TSAN_ATOMIC(bits, T)                                                                              \
  T __tsan_atomic##bits##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); }    \
  void __tsan_atomic##bits##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }    \
  T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); } \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                    \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
  }                                                                                                           \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                      \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                    \
  }
DFL_TSAN_ATOMIC(8, char)
DFL_TSAN_ATOMIC(16, short)
DFL_TSAN_ATOMIC(32, int)
DFL_TSAN_ATOMIC(64, long)
#undef DFL_TSAN_ATOMIC
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
