// launch.cuh — every kernel launch of the backend goes through `launch`.
//
// The arguments are converted to the kernel's parameter types and packed as
// bytes (graph.cuh).  While the calling thread records the stream (a backend
// op in graph mode) the launch joins the recorded segment; otherwise it is
// issued now: cudaLaunchKernel on the GPU, and under the CPU emulator
// (DFL_EMU, csrc/backend/cuda/emu) the kernel's CTAs run as fibers, so the whole backend's
// source can be executed where there is no GPU.
#pragma once
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "graph.cuh"

namespace dfl {
namespace cuda {

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  constexpr auto L = arg_layout<std::decay_t<P>...>();
  static_assert(L[sizeof...(P)] <= 4096, "kernel arguments over 4 KiB");
  const IssueFn issue = issue_kernel<P...>;
  const void* fn = reinterpret_cast<const void*>(kernel);
  LaunchRecorder* r = LaunchRecorder::for_stream(stream);
  alignas(16) uint8_t local[L[sizeof...(P)] + 1];
  uint8_t* args = r ? r->open(issue, fn, grid, block, smem, L[sizeof...(P)]) : local;
  size_t i = 0;
  (pack_arg<std::decay_t<P>>(args + L[i++], std::decay_t<P>(std::forward<A>(a))), ...);
  if (r) return r->close();
  issue(fn, local, grid, block, smem, stream);
}

}  // namespace cuda
}  // namespace dfl
