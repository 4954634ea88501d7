// weight.h — a weight matrix as the kernels see it: rows of one block format, in memory someone else owns.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"

namespace dfl {

// A 2-D weight matrix: `rows` outputs of `cols` inputs, each row `row_bytes`.
struct Weight {
  DType type = DType::F32;
  const uint8_t* data = nullptr;
  int64_t cols = 0;
  int64_t rows = 0;
  size_t row_bytes = 0;
  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};

}  // namespace dfl
