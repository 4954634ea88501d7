// weight.h — a weight matrix as the kernels see it: rows of one block format, in memory someone else owns.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "quant/blocks.h"

namespace dfl {

// The weight in a CPU kernel's own order, made by the CPU backend on first use and shared by every copy of the
// Weight (so it lives as long as they do): Q6_K's 4-row panels pre-transposed (gemm_kquant.cpp, Q6Panels).  Empty
// until made; never made where the kernels that read it do not run (the CUDA backend, AVX-512, the portable
// build), so a weight used only there costs nothing.
struct CpuLayout {
  std::once_flag made;
  std::vector<uint8_t> bytes;
};

// A 2-D weight matrix: `rows` outputs of `cols` inputs, each row `row_bytes`.
struct Weight {
  DType type = DType::F32;
  const uint8_t* data = nullptr;
  int64_t cols = 0;
  int64_t rows = 0;
  size_t row_bytes = 0;
  std::shared_ptr<CpuLayout> cpu_layout;  // where a CPU kernel may keep its own order (with_cpu_layout)
  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};

}  // namespace dfl
