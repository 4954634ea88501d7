// The emulator refuses the launches a GPU refuses (tests/test_emu_launch_checks.py runs each case by name):
// a case that should fail aborts with the emulator's message; one that should pass prints "ran N".
#include <cstdio>
#include <cstring>

#include "cuda_runtime.h"

__global__ void count_threads(int* n) { __syncthreads(); if (threadIdx.x == 0) ++*n; }

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
  else return 2;
  std::printf("ran %d\n", n);
  return 0;
}
