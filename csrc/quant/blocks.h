// blocks.h — the one definition of every tensor storage format the engine reads.
//
// Each quantised format is a packed struct laid out exactly as in GGUF files
// (ggml's block layouts), followed by a static_assert on its size, so a pointer
// into an mmapped file can be read as an array of blocks.  This header is
// plain C++ with no intrinsics so the CPU kernels, the CUDA kernels and the
// tests all include the same definitions.  The per-type facts (block size,
// bytes per block, name) live in one table, `type_traits()`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dfl {

// ggml type ids as stored in GGUF tensor infos.
enum class DType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int QK4_0 = 32;
constexpr int QK8_0 = 32;
constexpr int QK_K = 256;

#pragma pack(push, 1)
struct block_q4_0 {
  uint16_t d;                // f16 scale
  uint8_t qs[QK4_0 / 2];     // x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8)
};
static_assert(sizeof(block_q4_0) == 18, "q4_0 block size");

struct block_q8_0 {
  uint16_t d;                // f16 scale
  int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == 34, "q8_0 block size");

struct block_q4_K {
  uint16_t d;                // f16 super-block scale for the 6-bit scales
  uint16_t dmin;             // f16 super-block scale for the 6-bit mins
  uint8_t scales[12];        // 8 (scale, min) pairs, 6 bits each
  uint8_t qs[QK_K / 2];      // 4-bit quants, two 32-element sub-blocks per 32 bytes
};
static_assert(sizeof(block_q4_K) == 144, "q4_K block size");

struct block_q5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[QK_K / 8];      // 5th bit of each quant
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176, "q5_K block size");

struct block_q6_K {
  uint8_t ql[QK_K / 2];      // low 4 bits
  uint8_t qh[QK_K / 4];      // high 2 bits
  int8_t scales[QK_K / 16];  // 16 signed 8-bit sub-block scales
  uint16_t d;                // f16 super-block scale (stored last)
};
static_assert(sizeof(block_q6_K) == 210, "q6_K block size");
#pragma pack(pop)

// One activation row quantised for the integer dot products.  K-quant
// weights take one f32 scale per 256 values (so a super-block's sub-block
// sums accumulate in integers, as llama.cpp's Q8_K); 32-value formats take one
// per 32.  Either way `bsum` holds the integer sum of q per 16 values for the
// weights' min / offset terms.
// Scales live in their own arrays so kernels load 8 of them as one vector.
struct ActRow {
  const int8_t* q;   // n values
  const float* d;    // n / act_block(type) scales
  const int16_t* bsum;  // n / 16 integer sums of q
};

// n activation rows of `cols` values quantised for the CUDA exact matmul, as
// one buffer: q (n x cols int8), then d (one f32 per act block), then the sums
// the weight's offset term needs, each part 16-byte aligned.  K-quants: blocks
// of 256 and an int16 sum of q per 16 (bsum); Q8_0 / Q4_0: blocks of 32 and
// the sum of q per 32 as int32.  Byte offsets and the total size.
struct ExactActLayout {
  size_t q, d, sums, total;
  ExactActLayout(int64_t cols, int n, bool kquant) {
    auto up = [](size_t b) { return (b + 15) / 16 * 16; };
    const size_t rows = (size_t)n;
    q = 0;
    d = up(rows * (size_t)cols);
    sums = d + up(rows * (size_t)(cols / (kquant ? 256 : 32)) * sizeof(float));
    total = sums + up(rows * (kquant ? (size_t)(cols / 16) * sizeof(int16_t) : (size_t)(cols / 32) * sizeof(int32_t)));
  }
};

// The CUDA exact matmul's scratch for n rows of `cols` values, whatever the weight format.
inline size_t exact_act_bytes(int64_t cols, int n) {
  const size_t k = ExactActLayout(cols, n, true).total, b = ExactActLayout(cols, n, false).total;
  return k > b ? k : b;
}

struct TypeTraits {
  const char* name;
  int block_elems;   // elements per block
  int block_bytes;   // bytes per block
};

// Returns nullptr for a type this engine does not implement.
const TypeTraits* type_traits(uint32_t type);

inline size_t row_bytes(DType t, int64_t n) {
  const TypeTraits* tt = type_traits(static_cast<uint32_t>(t));
  return static_cast<size_t>(n / tt->block_elems) * tt->block_bytes;
}

// ---- scalar half / bfloat conversions (exact, no intrinsics) ----
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while ((man & 0x400) == 0);
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round-to-nearest-even f32 -> f16, as IEEE conversion (and F16C) does.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
  if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds to inf
  if (ax < 0x38800000) {                                   // subnormal or zero in f16
    if (ax < 0x33000000) return (uint16_t)sign;
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;  // 14 + (113 - e) ... maps to f16 subnormal
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t r = ax + 0xfff + ((ax >> 13) & 1);  // round to nearest even on the 13 dropped bits
  return (uint16_t)(sign | ((r - 0x38000000) >> 13));
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// K-quant 6-bit (scale, min) unpack for sub-block s in [0, 8).
inline void kquant_scale_min(const uint8_t* sc, int s, uint8_t* scale, uint8_t* min) {
  if (s < 4) {
    *scale = sc[s] & 63;
    *min = sc[s + 4] & 63;
  } else {
    *scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
    *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// All 8 (scale, min) pairs at once: the same bits as kquant_scale_min for s = 0..7
// (the kernels' form; tests/test_quant.py checks the kernels against the reference,
// which reads the pairs with kquant_scale_min).
inline void kquant_scales_mins(const uint8_t* sc, uint8_t scales[8], uint8_t mins[8]) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, sc, 4);
  std::memcpy(&w1, sc + 4, 4);
  std::memcpy(&w2, sc + 8, 4);
  const uint32_t s_lo = w0 & 0x3f3f3f3f, m_lo = w1 & 0x3f3f3f3f;
  const uint32_t s_hi = (w2 & 0x0f0f0f0f) | (((w0 >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0f) | (((w1 >> 6) & 0x03030303) << 4);
  std::memcpy(scales, &s_lo, 4);
  std::memcpy(scales + 4, &s_hi, 4);
  std::memcpy(mins, &m_lo, 4);
  std::memcpy(mins + 4, &m_hi, 4);
}

}  // namespace dfl
