// cuda_stubs.cpp — the CUDA entry points of a build without the CUDA backend.
//
// CMake compiles this file only when no csrc/backend/cuda/*.cu is built, so each entry
// point of include/dflash27b.h's CUDA section has exactly one definition.
#include "api/last_error.h"
#include "dflash27b_dev.h"  // the public ABI and the tool entry points
#include "backend/backend.h"
#include "util/error.h"

#pragma GCC visibility push(default)
extern "C" {

int dfl_cuda_device_count(void) { return 0; }

int dfl_cuda_matmul(uint32_t, const void*, int64_t, int64_t, const float*, int32_t, float*) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_matmul_exact(uint32_t, const void*, int64_t, int64_t, const float*, int32_t, float*) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

double dfl_cuda_bench_matmul(uint32_t, int64_t, int64_t, int32_t, int32_t, int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return -1.0;
}

double dfl_cuda_bench_copy(int64_t, int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return -1.0;
}

int dfl_cuda_memory_stats(dfl_cuda_memory*, int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_profile(int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_graph_stats(dfl_cuda_graphs*, int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_graph_mode(int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_attention_rows(int32_t, int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_attention_kernel(int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_matvec_rows(int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_mma_split(int32_t) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

int dfl_cuda_profile_report(char*, int64_t, int64_t*) {
  dfl::set_last_error("CUDA backend not built");
  return DFL_ERROR;
}

}  // extern "C"
#pragma GCC visibility pop

namespace dfl {
std::unique_ptr<Backend> make_cuda_backend(const Model&, const MemoryPlan&) {
  fail("device 'cuda' requested but this build of dflash27b has no CUDA backend (nvcc was not found at build "
       "time; dflash27b --version shows what was built)");
}
}  // namespace dfl
