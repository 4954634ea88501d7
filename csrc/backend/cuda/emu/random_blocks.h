// random_blocks.h — random weight bytes of any block format for the kernel
// tests (emu_matmul.cpp, tests/cpp/backend_ops.cpp): random quants, finite
// scale fields (|d| <= 0.05) or finite float values (|v| <= float_scale).
#pragma once
#include <cstring>
#include <random>
#include <vector>

#include "quant/blocks.h"

namespace dfl {

inline std::vector<uint8_t> random_block_bytes(DType t, int64_t rows, int64_t cols, std::mt19937& rng,
                                               float float_scale) {
  const TypeTraits* tt = type_traits((uint32_t)t);
  const int64_t nb = rows * (cols / tt->block_elems);
  std::vector<uint8_t> b((size_t)(nb * tt->block_bytes));
  for (auto& v : b) v = (uint8_t)(rng() & 0xff);
  std::uniform_real_distribution<float> U(-1, 1);
  auto put16 = [&](size_t o, uint16_t h) { b[o] = (uint8_t)h; b[o + 1] = (uint8_t)(h >> 8); };
  for (int64_t i = 0; i < nb; ++i) {
    const size_t o = (size_t)(i * tt->block_bytes);
    switch (t) {
      case DType::F32: { float v = U(rng) * float_scale; std::memcpy(&b[o], &v, 4); break; }
      case DType::F16: put16(o, f32_to_f16(U(rng) * float_scale)); break;
      case DType::BF16: {
        float v = U(rng) * float_scale;
        uint32_t u;
        std::memcpy(&u, &v, 4);
        put16(o, (uint16_t)(u >> 16));
        break;
      }
      case DType::Q4_0: case DType::Q8_0: put16(o, f32_to_f16(U(rng) * 0.05f)); break;
      case DType::Q4_K: case DType::Q5_K:
        put16(o, f32_to_f16(U(rng) * 0.05f)); put16(o + 2, f32_to_f16(U(rng) * 0.05f)); break;
      case DType::Q6_K: put16(o + 208, f32_to_f16(U(rng) * 0.05f)); break;
    }
  }
  return b;
}

}  // namespace dfl
