// launch.cuh — every kernel launch of the backend goes through `launch`.
//
// On the GPU it is cudaLaunchKernel with the arguments converted to the
// kernel's parameter types; under the CPU emulator (DFL_EMU, cuda/emu) the
// same call runs the kernel's CTAs as fibers, so the whole backend's source
// can be executed where there is no GPU.
#pragma once
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.cuh"

namespace dfl {
namespace cuda {

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
#ifdef DFL_EMU
  (void)stream;
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
  ::emu::launch(grid, block, smem, [&] { std::apply(kernel, args); });
#else
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
  std::apply(
      [&](auto&... e) {
        void* argv[] = {static_cast<void*>(&e)...};
        CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, smem, stream));
      },
      args);
#endif
}

}  // namespace cuda
}  // namespace dfl
