// The emulator refuses the launches a GPU refuses (tests/test_emu_launch_checks.py runs each case by name):
// a case that should fail aborts with the emulator's message; one that should pass prints "ran N".
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_runtime.h"
#include "common.cuh"  // DFL_STATIC_SMEM, as the backend's kernels declare static shared arrays

__global__ void count_threads(int* n) { __syncthreads(); if (threadIdx.x == 0) ++*n; }

// Compiled for at most 64 threads a block, as the backend's kernels declare their bounds.
__global__ void __launch_bounds__(64) bounded_count(int* n) {
  DFL_LAUNCH_BOUND(64);
  __syncthreads();
  if (threadIdx.x == 0) ++*n;
}

// Each of 32 threads copies src[t] into shared memory by cp.async; thread 0 then sums the tile.  `wait_first`:
// every thread waits for its copy before the barrier (the tiled kernels' order); otherwise after it, so
// thread 0 reads the parts of threads that have not waited yet: the old bytes (zeros).
__global__ void cp_async_sum(const int* src, int* out, bool wait_first) {
  __shared__ __align__(16) int tile[32];
  if (threadIdx.x == 0) *out = -1;
  tile[threadIdx.x] = 0;
  __syncthreads();
  emu::cp_async(&tile[threadIdx.x], &src[threadIdx.x], 4, 4);
  if (wait_first) emu::cp_async_wait_all();
  __syncthreads();
  if (!wait_first) emu::cp_async_wait_all();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += tile[i];
    *out = sum;
  }
}

// Each thread writes its slot, then reads its neighbour's with no barrier between (`synced` puts one there):
// counts the threads that read the neighbour's slot before it was written.  Racy, the count depends on the
// order the threads run in (DFL_EMU_SCHEDULE); synced, it is 0 in every order.
__global__ void neighbour_read(int* unwritten, bool synced) {
  __shared__ int slot[64];
  slot[threadIdx.x] = 0;
  __syncthreads();
  slot[threadIdx.x] = (int)threadIdx.x + 1;
  if (synced) __syncthreads();
  if (slot[(threadIdx.x + 1) % 64] == 0) ++*unwritten;
}

// Two block sums in a row, each thread adding `call` (so 64 * call), through one `red` array.  Without the
// barrier before the write (`guarded`), a warp that gets ahead writes call 2's partial sum while the other
// warp still reads call 1's: a write-after-read race.  fifo hides it (a warp released from a shuffle queues
// behind every thread still reading); `reverse` runs the released higher warp first and shows it.
__global__ void two_block_sums(int* wrong, bool guarded) {
  __shared__ float red[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int call = 1; call <= 2; ++call) {
    float v = (float)call;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (guarded) __syncthreads();  // red may still be read by the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (red[0] + red[1] != 64.f * call) ++*wrong;
  }
}

// CTA 0 leaves 7 in dynamic shared memory; every later CTA must see garbage (0xff bytes), not 7.
__global__ void smem_left_over(int* seen) {
  int* buf = static_cast<int*>(emu::dynamic_smem());  // the kernels' DFL_DYNAMIC_SMEM under DFL_EMU
  if (threadIdx.x != 0) return;
  if (blockIdx.x > 0) *seen += buf[0] == -1 ? 1 : 100;
  buf[0] = 7;
}

// The same for a static shared array: every CTA, the first included, must find garbage where the last left 7
// (a function static would start the first with zeros and each later one with the last one's values).
__global__ void static_smem_left_over(int* seen) {
  DFL_STATIC_SMEM(int, buf, [4]);
  if (threadIdx.x == 0) *seen += buf[0] == -1 ? 1 : 100;
  __syncthreads();
  buf[threadIdx.x % 4] = 7;
}
// Static shared arrays of `kib` KiB in all: each thread touches them once the CTA has declared both.
template <int KIB>
__global__ void static_smem_of(int* n) {
  DFL_STATIC_SMEM(char, a, [KIB * 512]);
  DFL_STATIC_SMEM(char, b, [KIB * 512]);
  a[threadIdx.x] = b[threadIdx.x] = 1;
  __syncthreads();
  if (threadIdx.x == 0) ++*n;
}

// A warp sum over the full mask after lane 31 returned (or in a 48-thread block's second warp): undefined on the GPU.
__global__ void sum_after_exit(int* out, bool exit_one) {
  if (exit_one && threadIdx.x == 31) return;
  float v = 1.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) *out = (int)v;
}

// Half the block waits at one __syncthreads, half at another: undefined on the GPU (a hang where the two never
// meet); the emulator stops naming both lines.  The warp case: lanes split between two shuffles.
__global__ void split_barrier(int* n) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  if (threadIdx.x == 0) ++*n;
}
__global__ void split_shuffle(int* n) {
  float v = 1.f;
  if (threadIdx.x < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  else v += __shfl_xor_sync(0xffffffffu, v, 2);
  if (threadIdx.x == 0) *n = (int)v;
}

// For the sanitizer build: each thread fills a stack array, keeps it across a barrier (its frame live while the
// other fibers run on their own stacks), and sums it in a deeper call that has an array of its own; *sum gets
// every thread's total.  Run over many CTAs, each reusing the fiber stacks the last one finished on, this
// reports nothing when the emulator leaves no stale poison on the stacks.  `past` reads one element beyond
// the array: AddressSanitizer's stack-buffer-overflow.
__attribute__((noinline)) int deeper(const int* a, int n, int past) {
  volatile int b[96];
  for (int i = 0; i < 96; ++i) b[i] = i;
  int t = 0;
  for (int i = 0; i < n + past; ++i) t += a[i] + b[i % 96] - (i % 96);
  return t;
}
__global__ void stack_arrays(int* sum, int past) {
  int a[64];
  for (int i = 0; i < 64; ++i) a[i] = (int)threadIdx.x + i;
  __syncthreads();
  const int t = deeper(a, 64, past);
  __syncthreads();
  if (t == 64 * (int)threadIdx.x + 2016) ++*sum;
}
// Writes one float past the end of a 64-float device allocation when `past`: heap-buffer-overflow under ASan.
__global__ void write_row(float* row, int past) { row[threadIdx.x + past] = 1.f; }
// The same past a static shared array (the CTA's own allocation in the emulator), then reads it back.
__global__ void static_smem_row(int* n, int past) {
  DFL_STATIC_SMEM(float, row, [64]);
  row[threadIdx.x + past] = 1.f;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < 64; ++i) *n += row[i] == 1.f;
}

// ---- the race check (built with -fsanitize=thread: tests/test_emu_launch_checks.py) ----
// Thread t writes s[t] and reads s[t + 1]: `synced` puts a barrier between, else a read of another thread's
// write that nothing orders.  Over `ctas` CTAs reusing the array (a CTA's shared memory is new to the check).
__global__ void rc_neighbour(int* out, bool synced) {
  DFL_STATIC_SMEM(int, s, [64]);
  s[threadIdx.x] = (int)threadIdx.x;
  if (synced) __syncthreads();
  out[64 * blockIdx.x + threadIdx.x] = s[(threadIdx.x + 1) % 64];
}
// A shuffle exchanges registers and orders no memory: lane l reads s[l ^ 1] after one; `syncwarp` orders it.
__global__ void rc_after_shuffle(int* out, bool syncwarp) {
  DFL_STATIC_SMEM(int, s, [32]);
  s[threadIdx.x] = (int)threadIdx.x;
  const int v = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
  if (syncwarp) __syncwarp();
  out[threadIdx.x] = s[threadIdx.x ^ 1] + v;
}
// CTA b's thread b writes out[0]: the CTAs of a launch are unordered (`own` gives each its own element).
__global__ void rc_ctas(int* out, bool own) {
  if ((int)threadIdx.x == (int)blockIdx.x) out[own ? blockIdx.x : 0] = (int)blockIdx.x;
}
// What a GPU orders, all of it: a block sum in dynamic shared memory through shuffles and barriers, twice (the
// second guarded against the first's readers), with the upper half of the block gone after writing its part
// (an exited thread counts as arrived); cp.async tiles waited for before the barrier; a launch reading what
// the last one wrote.  Over many CTAs.
__global__ void rc_clean(const int* in, int* out) {
  DFL_DYNAMIC_SMEM(int, part);
  DFL_STATIC_SMEM(__align__(16) int, tile, [128]);
  const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
  emu::cp_async(&tile[t], &in[128 * blockIdx.x + t], 4, 4);
  emu::cp_async_wait_all();
  part[4 + t] = t;
  __syncthreads();
  if (t >= 64) return;
  int total = 0;
  for (int call = 0; call < 2; ++call) {
    int v = tile[(t + 64 * call) % 128] + part[4 + t + 64];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (call) __syncthreads();  // part[0..1] may still be read by the last call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    total += part[0] + part[1];
  }
  if (t == 0) out[blockIdx.x] = total;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const char* c = argv[1];
  int n = 0;
  auto run = [&](dim3 grid, dim3 block, size_t smem) {
    emu::launch(grid, block, smem, [&] { count_threads(&n); }, (const void*)count_threads);
  };
  if (!std::strcmp(c, "smem48k")) run(1, 32, 48u << 10);            // at the default limit: runs
  else if (!std::strcmp(c, "smem64k")) run(1, 32, 64u << 10);       // over it without the opt-in: refused
  else if (!std::strcmp(c, "smem64k_opt_in")) {
    if (cudaFuncSetAttribute(count_threads, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10) != cudaSuccess)
      return 3;
    run(1, 32, 64u << 10);
  } else if (!std::strcmp(c, "smem_opt_in_too_big"))
    return cudaFuncSetAttribute(count_threads, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10) == cudaSuccess
               ? 0 : 4;
  else if (!std::strcmp(c, "block1025")) run(1, 1025, 0);
  else if (!std::strcmp(c, "bound64")) emu::launch(2, 64, 0, [&] { bounded_count(&n); });   // at the bound: runs
  else if (!std::strcmp(c, "bound64_over")) emu::launch(1, 96, 0, [&] { bounded_count(&n); });  // over it: refused
  else if (!std::strcmp(c, "capture_async")) {  // launches and async copies join the graph
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, 0);
    int a = 1, b = 0;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    run(1, 32, 0);
    cudaMemcpyAsync(&b, &a, sizeof a, cudaMemcpyDeviceToDevice, s);
    cudaGraph_t g;
    cudaStreamEndCapture(s, &g);
    cudaGraphExec_t e;
    cudaGraphInstantiate(&e, g);
    if (n != 0 || b != 0) return 5;  // nothing ran while captured
    cudaGraphLaunch(e, s);
    n += 10 * b;
  } else if (!std::strcmp(c, "capture_sync")) {  // a synchronous copy while capturing: refused
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, 0);
    int a = 1, b = 0;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    cudaMemcpy(&b, &a, sizeof a, cudaMemcpyHostToDevice);
  } else if (!std::strcmp(c, "capture_malloc")) {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, 0);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    void* p;
    cudaMalloc(&p, 64);
  }
  else if (!std::strcmp(c, "grid_y")) run(dim3(1, 70000), 32, 0);
  else if (!std::strcmp(c, "cp_async_waited") || !std::strcmp(c, "cp_async_early")) {  // n = thread 0's sum
    int src[32];
    for (int i = 0; i < 32; ++i) src[i] = i + 1;
    const bool waited = !std::strcmp(c, "cp_async_waited");
    emu::launch(1, 32, 0, [&] { cp_async_sum(src, &n, waited); });
  } else if (!std::strcmp(c, "cp_async_misaligned")) {
    alignas(16) char a[32] = {}, b[32] = {};
    emu::launch(1, 1, 0, [&] { emu::cp_async(a + 4, b, 16, 16); });
  }
  else if (!std::strcmp(c, "race") || !std::strcmp(c, "race_synced")) {
    const bool synced = !std::strcmp(c, "race_synced");
    emu::launch(1, 64, 0, [&] { neighbour_read(&n, synced); });
  } else if (!std::strcmp(c, "war_race") || !std::strcmp(c, "war_guarded")) {
    const bool guarded = !std::strcmp(c, "war_guarded");
    emu::launch(1, 64, 0, [&] { two_block_sums(&n, guarded); });
  } else if (!std::strcmp(c, "smem_garbage")) {  // n = the later CTAs that saw garbage (3)
    emu::launch(4, 32, 64, [&] { smem_left_over(&n); });
  } else if (!std::strcmp(c, "static_smem_garbage")) {  // n = the CTAs that saw garbage (all 4, in any order)
    emu::launch(4, 32, 0, [&] { static_smem_left_over(&n); });
  } else if (!std::strcmp(c, "static_smem48k")) {  // at the limit: runs
    emu::launch(2, 32, 0, [&] { static_smem_of<48>(&n); }, (const void*)static_smem_of<48>);
  } else if (!std::strcmp(c, "static_smem49k")) {  // static arrays over 48 KiB: refused
    emu::launch(1, 32, 0, [&] { static_smem_of<49>(&n); }, (const void*)static_smem_of<49>);
  } else if (!std::strcmp(c, "static_dynamic_smem")) {  // 16 KiB static + 40 KiB dynamic, no opt-in: refused
    emu::launch(1, 32, 40u << 10, [&] { static_smem_of<16>(&n); }, (const void*)static_smem_of<16>);
  } else if (!std::strcmp(c, "static_dynamic_opt_in")) {  // the same with the dynamic limit raised: runs
    if (cudaFuncSetAttribute(static_smem_of<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, 40 << 10) != cudaSuccess) return 3;
    emu::launch(1, 32, 40u << 10, [&] { static_smem_of<16>(&n); }, (const void*)static_smem_of<16>);
  } else if (!std::strcmp(c, "cta_order")) {  // n = the first CTA run, of 8
    int first = -1;
    emu::launch(8, 1, 0, [&] { if (first < 0) first = (int)blockIdx.x; });
    n = first;
  }
  else if (!std::strcmp(c, "shfl_full_warp")) emu::launch(1, 64, 0, [&] { sum_after_exit(&n, false); });
  else if (!std::strcmp(c, "shfl_after_exit")) emu::launch(1, 64, 0, [&] { sum_after_exit(&n, true); });
  else if (!std::strcmp(c, "shfl_partial_warp")) emu::launch(1, 48, 0, [&] { sum_after_exit(&n, false); });
  else if (!std::strcmp(c, "split_barrier")) emu::launch(1, 64, 0, [&] { split_barrier(&n); });
  else if (!std::strcmp(c, "split_shuffle")) emu::launch(1, 32, 0, [&] { split_shuffle(&n); });
  else if (!std::strcmp(c, "stack_arrays")) {  // n = threads whose sum came out right: 2 x 16 CTAs x 64
    for (int round = 0; round < 2; ++round) emu::launch(16, 64, 0, [&] { stack_arrays(&n, 0); });
  } else if (!std::strcmp(c, "stack_past_end")) emu::launch(2, 32, 0, [&] { stack_arrays(&n, 1); });
  else if (!std::strcmp(c, "device_in_bounds") || !std::strcmp(c, "device_past_end")) {
    float* row = nullptr;
    if (cudaMalloc(reinterpret_cast<void**>(&row), 64 * sizeof(float)) != cudaSuccess) return 3;
    const int past = !std::strcmp(c, "device_past_end");
    emu::launch(1, 64, 0, [&] { write_row(row, past); });
    for (int i = 0; i < 64; ++i) n += row[i] == 1.f;
    cudaFree(row);
  }
  else if (!std::strcmp(c, "static_smem_in_bounds")) emu::launch(2, 64, 0, [&] { static_smem_row(&n, 0); });
  else if (!std::strcmp(c, "static_smem_past_end")) emu::launch(1, 64, 0, [&] { static_smem_row(&n, 1); });
  else if (!std::strncmp(c, "rc_", 3)) {  // the race check's cases; n = a checksum of what they wrote
    std::vector<int> in(128 * 64), out(64 * 64, 0);
    for (size_t i = 0; i < in.size(); ++i) in[i] = (int)(i % 7);
    int *d_in = nullptr, *d_out = nullptr;
    if (cudaMalloc(reinterpret_cast<void**>(&d_in), in.size() * 4) != cudaSuccess ||
        cudaMalloc(reinterpret_cast<void**>(&d_out), out.size() * 4) != cudaSuccess)
      return 3;
    cudaMemcpy(d_in, in.data(), in.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_out, out.data(), out.size() * 4, cudaMemcpyHostToDevice);
    if (!std::strcmp(c, "rc_neighbour_race")) emu::launch(8, 64, 0, [&] { rc_neighbour(d_out, false); });
    else if (!std::strcmp(c, "rc_neighbour_synced")) emu::launch(8, 64, 0, [&] { rc_neighbour(d_out, true); });
    else if (!std::strcmp(c, "rc_shuffle_race")) emu::launch(1, 32, 0, [&] { rc_after_shuffle(d_out, false); });
    else if (!std::strcmp(c, "rc_shuffle_synced")) emu::launch(1, 32, 0, [&] { rc_after_shuffle(d_out, true); });
    else if (!std::strcmp(c, "rc_cta_race")) emu::launch(4, 32, 0, [&] { rc_ctas(d_out, false); });
    else if (!std::strcmp(c, "rc_cta_own")) emu::launch(4, 32, 0, [&] { rc_ctas(d_out, true); });
    else if (!std::strcmp(c, "rc_clean")) {
      for (int round = 0; round < 2; ++round) {  // the second launch reads what the first wrote
        emu::launch(64, 128, (4 + 128) * 4, [&] { rc_clean(d_in, d_out); });
        std::swap(d_in, d_out);
      }
    } else return 2;
    cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost);
    for (int v : out) n += v;
    cudaFree(d_in);
    cudaFree(d_out);
  }
  else return 2;
  std::printf("ran %d\n", n);
  return 0;
}
