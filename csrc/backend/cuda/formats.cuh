// formats.cuh — per-format device decoding for the matmul kernels.
//
// Each weight format is split into *tasks*: a task is the slice of a block
// that one lane decodes from one 16-byte load of its quant bytes (plus the
// block's scale fields), giving P values.  For a format F:
//
//   F::BE, F::BB     elements and bytes of one (pseudo-)block; F32/F16/BF16
//                    use a 16-byte pseudo-block so every format has tasks
//   F::TPB, F::P     tasks per block, values per task (TPB * P == BE)
//   F::load(b, j, r) issue the loads of task j of the block at b into r
//   F::deq4(r, g, w) values 4g..4g+3 of the task (g constant after unrolling)
//   F::elem(j, i)    the element of the block that the task's value i is;
//                    runs of 4 stay together: elem(j, 4g + m) == elem(j, 4g) + m
//                    and elem(j, 4g) % 4 == 0 (activations move as float4s)
//
// The matvec kernel stores activations in shared memory in task order
// (elem), so each lane reads its task's P activations as consecutive float4s.
//
// `deq8<F>(row, k, v)` is the plain path for the tiled kernel: elements
// k..k+7 of a row (k a multiple of 8), scalar loads, written like the
// reference dequantizers in csrc/quant/quant.cpp.
#pragma once
#include "common.cuh"

namespace dfl {
namespace cuda {

// ---------------------------------------------------------------- F32
struct FmtF32 {
  static constexpr bool kAffine = false, kMin = false;
  static constexpr DType T = DType::F32;
  static constexpr int BE = 4, BB = 16, TPB = 1, P = 4;
  struct Raw { uint4 v; };
  __device__ static void load(const uint8_t* b, int, Raw& r) { r.v = ld16(b); }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    w[0] = __uint_as_float(r.v.x); w[1] = __uint_as_float(r.v.y);
    w[2] = __uint_as_float(r.v.z); w[3] = __uint_as_float(r.v.w);
  }
  __host__ __device__ static int elem(int, int i) { return i; }
};

// ---------------------------------------------------------------- F16 / BF16
struct FmtF16 {
  static constexpr bool kAffine = false, kMin = false;
  static constexpr DType T = DType::F16;
  static constexpr int BE = 8, BB = 16, TPB = 1, P = 8;
  struct Raw { uint4 v; };
  __device__ static void load(const uint8_t* b, int, Raw& r) { r.v = ld16(b); }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t a = u4_word(r.v, 2 * g), c = u4_word(r.v, 2 * g + 1);
    w[0] = f16_bits_to_f32(a); w[1] = f16_bits_to_f32(a >> 16);
    w[2] = f16_bits_to_f32(c); w[3] = f16_bits_to_f32(c >> 16);
  }
  __host__ __device__ static int elem(int, int i) { return i; }
};

struct FmtBF16 {
  static constexpr bool kAffine = false, kMin = false;
  static constexpr DType T = DType::BF16;
  static constexpr int BE = 8, BB = 16, TPB = 1, P = 8;
  struct Raw { uint4 v; };
  __device__ static void load(const uint8_t* b, int, Raw& r) { r.v = ld16(b); }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t a = u4_word(r.v, 2 * g), c = u4_word(r.v, 2 * g + 1);
    w[0] = __uint_as_float(a << 16); w[1] = __uint_as_float(a & 0xffff0000u);
    w[2] = __uint_as_float(c << 16); w[3] = __uint_as_float(c & 0xffff0000u);
  }
  __host__ __device__ static int elem(int, int i) { return i; }
};

// ---------------------------------------------------------------- Q4_0
// One task per block: value i < 16 is the low nibble of qs[i] (element i),
// value i >= 16 the high nibble of qs[i-16] (element i).
struct FmtQ4_0 {
  static constexpr bool kAffine = false, kMin = false;
  static constexpr DType T = DType::Q4_0;
  static constexpr int BE = QK4_0, BB = sizeof(block_q4_0), TPB = 1, P = 32;
  struct Raw { uint4 q; float d; };
  __device__ static void load(const uint8_t* b, int, Raw& r) {
    r.d = ld_f16(b + kQ4_0_d);
    r.q = ld16_u(b + kQ4_0_qs);
  }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t v = g < 4 ? (u4_word(r.q, g & 3) & 0x0F0F0F0Fu) : ((u4_word(r.q, g & 3) >> 4) & 0x0F0F0F0Fu);
#pragma unroll
    for (int m = 0; m < 4; ++m) w[m] = (byte_as_f(v, m) - (kTwo23 + 8.f)) * r.d;
  }
  __host__ __device__ static int elem(int, int i) { return i; }
};

// ---------------------------------------------------------------- Q8_0
// Two tasks per block: task j covers qs[16j .. 16j+15].
struct FmtQ8_0 {
  static constexpr bool kAffine = false, kMin = false;
  static constexpr DType T = DType::Q8_0;
  static constexpr int BE = QK8_0, BB = sizeof(block_q8_0), TPB = 2, P = 16;
  struct Raw { uint4 q; float d; };
  __device__ static void load(const uint8_t* b, int j, Raw& r) {
    r.d = ld_f16(b + kQ8_0_d);
    r.q = ld16_u(b + kQ8_0_qs + 16 * j);
  }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t v = u4_word(r.q, g) ^ 0x80808080u;  // int8 -> uint8 + 128
#pragma unroll
    for (int m = 0; m < 4; ++m) w[m] = (byte_as_f(v, m) - (kTwo23 + 128.f)) * r.d;
  }
  __host__ __device__ static int elem(int j, int i) { return 16 * j + i; }
};

// ---------------------------------------------------------------- Q4_K / Q5_K
// Eight tasks per block: task j (c = j/2, h = j%2) covers qs[32c+16h .. +15];
// low nibbles are sub-block 2c (elements 64c+16h+i), high nibbles sub-block
// 2c+1 (elements 64c+32+16h+i).
__device__ __forceinline__ uint32_t kq_byte(const uint4& hdr, int k) {  // scales[k], k in [0, 12)
  const uint32_t w = k < 4 ? hdr.y : (k < 8 ? hdr.z : hdr.w);
  return (w >> (8 * (k & 3))) & 0xffu;
}
// Sub-block s's 6-bit scale and min (blocks.h kquant_scale_min).
__device__ __forceinline__ void kq_scale_min_bits(const uint4& hdr, int s, uint32_t& sc, uint32_t& mn) {
  if (s < 4) {
    sc = kq_byte(hdr, s) & 63u;
    mn = kq_byte(hdr, s + 4) & 63u;
  } else {
    sc = (kq_byte(hdr, s + 4) & 15u) | ((kq_byte(hdr, s - 4) >> 6) << 4);
    mn = (kq_byte(hdr, s + 4) >> 4) | ((kq_byte(hdr, s) >> 6) << 4);
  }
}
__device__ __forceinline__ void kq_scale_min(const uint4& hdr, int s, float d, float dmin, float& ds, float& dm) {
  uint32_t sc, mn;
  kq_scale_min_bits(hdr, s, sc, mn);
  ds = d * (float)sc;
  dm = dmin * (float)mn;
}

__host__ __device__ inline int kq45_elem(int j, int i) {
  const int c = j >> 1, h = j & 1;
  return i < 16 ? 64 * c + 16 * h + i : 64 * c + 32 + 16 * h + (i - 16);
}

struct FmtQ4_K {
  static constexpr DType T = DType::Q4_K;
  static constexpr int BE = QK_K, BB = sizeof(block_q4_K), TPB = 8, P = 32;
  struct Raw { uint4 q; float d0, m0, d1, m1; };
  __device__ static void load(const uint8_t* b, int j, Raw& r) {
    const uint4 hdr = ld16(b);  // d, dmin, scales[12]
    r.q = ld16(b + kQ4_K_qs + 16 * j);
    const float d = f16_bits_to_f32(hdr.x), dmin = f16_bits_to_f32(hdr.x >> 16);
    kq_scale_min(hdr, (j >> 1) * 2, d, dmin, r.d0, r.m0);
    kq_scale_min(hdr, (j >> 1) * 2 + 1, d, dmin, r.d1, r.m1);
  }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t word = u4_word(r.q, g & 3);
    const uint32_t v = g < 4 ? (word & 0x0F0F0F0Fu) : ((word >> 4) & 0x0F0F0F0Fu);
    const float ds = g < 4 ? r.d0 : r.d1, dm = g < 4 ? r.m0 : r.m1;
#pragma unroll
    for (int m = 0; m < 4; ++m) w[m] = ds * (byte_as_f(v, m) - kTwo23) - dm;
  }
  // Factored form for the matvec (value = ds * q - dm, q = qf4's exact
  // integer).  Off: on an H100 it gained nothing at n = 1 and lost ~30% at
  // n = 8 (register pressure); Q6_K, with no min, gains and uses it.
  static constexpr bool kAffine = false, kMin = true;
  __device__ __forceinline__ static void qf4(const Raw& r, const int g, float q[4]) {
    const uint32_t word = u4_word(r.q, g & 3);
    const uint32_t v = g < 4 ? (word & 0x0F0F0F0Fu) : ((word >> 4) & 0x0F0F0F0Fu);
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = byte_as_f(v, m) - kTwo23;
  }
  __device__ __forceinline__ static void half_scale(const Raw& r, const int hf, float& ds, float& dm) {
    ds = hf ? r.d1 : r.d0;
    dm = hf ? r.m1 : r.m0;
  }
  __host__ __device__ static int elem(int j, int i) { return kq45_elem(j, i); }
};

// As Q4_K plus a fifth bit: bit 2c (low nibble) / 2c+1 (high nibble) of
// qh[16h + i]; the task keeps qh[16h .. 16h+15] shifted right by 2c.
struct FmtQ5_K {
  static constexpr DType T = DType::Q5_K;
  static constexpr int BE = QK_K, BB = sizeof(block_q5_K), TPB = 8, P = 32;
  struct Raw { uint4 q, qh; float d0, m0, d1, m1; };
  __device__ static void load(const uint8_t* b, int j, Raw& r) {
    const int c = j >> 1, h = j & 1;
    const uint4 hdr = ld16(b);
    uint4 qh = ld16(b + kQ5_K_qh + 16 * h);
    r.q = ld16(b + kQ5_K_qs + 16 * j);
    const uint32_t sh = 2 * c;
    r.qh = make_uint4(qh.x >> sh, qh.y >> sh, qh.z >> sh, qh.w >> sh);
    const float d = f16_bits_to_f32(hdr.x), dmin = f16_bits_to_f32(hdr.x >> 16);
    kq_scale_min(hdr, 2 * c, d, dmin, r.d0, r.m0);
    kq_scale_min(hdr, 2 * c + 1, d, dmin, r.d1, r.m1);
  }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t word = u4_word(r.q, g & 3), hb = u4_word(r.qh, g & 3);
    const uint32_t v = g < 4 ? ((word & 0x0F0F0F0Fu) | ((hb << 4) & 0x10101010u))
                             : (((word >> 4) & 0x0F0F0F0Fu) | ((hb << 3) & 0x10101010u));
    const float ds = g < 4 ? r.d0 : r.d1, dm = g < 4 ? r.m0 : r.m1;
#pragma unroll
    for (int m = 0; m < 4; ++m) w[m] = ds * (byte_as_f(v, m) - kTwo23) - dm;
  }
  static constexpr bool kAffine = false, kMin = true;  // as Q4_K: n = 1..4 gained 10-30%, n = 8 lost 22%
  __device__ __forceinline__ static void qf4(const Raw& r, const int g, float q[4]) {
    const uint32_t word = u4_word(r.q, g & 3), hb = u4_word(r.qh, g & 3);
    const uint32_t v = g < 4 ? ((word & 0x0F0F0F0Fu) | ((hb << 4) & 0x10101010u))
                             : (((word >> 4) & 0x0F0F0F0Fu) | ((hb << 3) & 0x10101010u));
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = byte_as_f(v, m) - kTwo23;
  }
  __device__ __forceinline__ static void half_scale(const Raw& r, const int hf, float& ds, float& dm) {
    ds = hf ? r.d1 : r.d0;
    dm = hf ? r.m1 : r.m0;
  }
  __host__ __device__ static int elem(int j, int i) { return kq45_elem(j, i); }
};

// ---------------------------------------------------------------- Q6_K
// Eight tasks per block: half n = j/4, k = j%4 covers ql[64n + 16k .. +15].
// With l = 16(k&1) + (i&15) and hi = k>>1: low nibbles are q1 (hi=0) or q2
// (hi=1), element 128n + l + 32hi; high nibbles are q3 / q4, element
// 128n + l + 64 + 32hi.  The two high bits come from qh[32n + l], shifted
// right by 2hi so the low value's bits sit at 0-1 and the high value's at 4-5.
struct FmtQ6_K {
  static constexpr DType T = DType::Q6_K;
  static constexpr int BE = QK_K, BB = sizeof(block_q6_K), TPB = 8, P = 32;
  struct Raw { uint4 ql, qh; float s0, s1; };
  __device__ static void load(const uint8_t* b, int j, Raw& r) {
    const int n = j >> 2, k = j & 3, hi = k >> 1, kk = k & 1;
    r.ql = ld16_u(b + kQ6_K_ql + 64 * n + 16 * k);
    const uint4 qh = ld16_u(b + kQ6_K_qh + 32 * n + 16 * kk);
    const uint32_t sh = 2 * hi;
    r.qh = make_uint4(qh.x >> sh, qh.y >> sh, qh.z >> sh, qh.w >> sh);
    const float d = ld_f16(b + kQ6_K_d);
    const int sc0 = (int8_t)ld_u8(b + kQ6_K_scales + 8 * n + kk + 2 * hi);
    const int sc1 = (int8_t)ld_u8(b + kQ6_K_scales + 8 * n + kk + 4 + 2 * hi);
    r.s0 = d * (float)sc0;
    r.s1 = d * (float)sc1;
  }
  __device__ __forceinline__ static void deq4(const Raw& r, const int g, float w[4]) {
    const uint32_t word = u4_word(r.ql, g & 3), hb = u4_word(r.qh, g & 3);
    const uint32_t v = g < 4 ? ((word & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u))
                             : (((word >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u));
    const float s = g < 4 ? r.s0 : r.s1;
#pragma unroll
    for (int m = 0; m < 4; ++m) w[m] = s * (byte_as_f(v, m) - (kTwo23 + 32.f));
  }
  // Factored form for the matvec: value = s * q, q = qf4's exact integer.
  static constexpr bool kAffine = true, kMin = false;
  __device__ __forceinline__ static void qf4(const Raw& r, const int g, float q[4]) {
    const uint32_t word = u4_word(r.ql, g & 3), hb = u4_word(r.qh, g & 3);
    const uint32_t v = g < 4 ? ((word & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u))
                             : (((word >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u));
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = byte_as_f(v, m) - (kTwo23 + 32.f);
  }
  __device__ __forceinline__ static void half_scale(const Raw& r, const int hf, float& ds, float& dm) {
    ds = hf ? r.s1 : r.s0;
    dm = 0.f;
  }
  __host__ __device__ static int elem(int j, int i) {
    const int n = j >> 2, k = j & 3, hi = k >> 1, l = 16 * (k & 1) + (i & 15);
    return i < 16 ? 128 * n + l + 32 * hi : 128 * n + l + 64 + 32 * hi;
  }
};

// ---------------------------------------------------------------- plain path
// Elements k..k+7 (k % 8 == 0) of a row of format F.
template <class F>
__device__ void deq8(const uint8_t* row, int64_t k, float v[8]);

template <>
__device__ inline void deq8<FmtF32>(const uint8_t* row, int64_t k, float v[8]) {
  const float4* p = reinterpret_cast<const float4*>(row) + k / 4;
  const float4 a = __ldg(p), b = __ldg(p + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <>
__device__ inline void deq8<FmtF16>(const uint8_t* row, int64_t k, float v[8]) {
  const uint4 q = ld16(row + 2 * k);
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = f16_bits_to_f32(w[i]); v[2 * i + 1] = f16_bits_to_f32(w[i] >> 16); }
}
template <>
__device__ inline void deq8<FmtBF16>(const uint8_t* row, int64_t k, float v[8]) {
  const uint4 q = ld16(row + 2 * k);
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = bf16_bits_to_f32(w[i]); v[2 * i + 1] = bf16_bits_to_f32(w[i] >> 16); }
}
template <>
__device__ inline void deq8<FmtQ4_0>(const uint8_t* row, int64_t k, float v[8]) {
  const uint8_t* b = row + (k / QK4_0) * FmtQ4_0::BB;
  const int j0 = (int)(k % QK4_0);
  const float d = ld_f16(b + kQ4_0_d);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int j = j0 + i;
    const uint32_t q = ld_u8(b + kQ4_0_qs + (j & 15));
    v[i] = d * (float)((int)(j < 16 ? (q & 15u) : (q >> 4)) - 8);
  }
}
template <>
__device__ inline void deq8<FmtQ8_0>(const uint8_t* row, int64_t k, float v[8]) {
  const uint8_t* b = row + (k / QK8_0) * FmtQ8_0::BB;
  const int j0 = (int)(k % QK8_0);
  const float d = ld_f16(b + kQ8_0_d);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = d * (float)(int8_t)ld_u8(b + kQ8_0_qs + j0 + i);
}
// Q4_K/Q5_K: QH < 0 for Q4_K (no fifth bit).
template <int QS, int QH>
__device__ inline void deq8_k45(const uint8_t* b, int e0, float v[8]) {
  const int c = e0 / 64, l0 = e0 % 64, sub = 2 * c + (l0 >= 32), l = l0 & 31;
  const uint4 hdr = ld16(b);  // d, dmin, scales[12] (Q4_K/Q5_K blocks are 16-byte multiples)
  float ds, dm;
  kq_scale_min(hdr, sub, f16_bits_to_f32(hdr.x), f16_bits_to_f32(hdr.x >> 16), ds, dm);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t q = ld_u8(b + QS + 32 * c + l + i);
    int x = (int)(sub & 1 ? q >> 4 : q & 15u);
    if (QH >= 0) x += (int)((ld_u8(b + QH + l + i) >> sub) & 1u) << 4;
    v[i] = ds * (float)x - dm;
  }
}
template <>
__device__ inline void deq8<FmtQ4_K>(const uint8_t* row, int64_t k, float v[8]) {
  deq8_k45<kQ4_K_qs, -1>(row + (k / QK_K) * FmtQ4_K::BB, (int)(k % QK_K), v);
}
template <>
__device__ inline void deq8<FmtQ5_K>(const uint8_t* row, int64_t k, float v[8]) {
  deq8_k45<kQ5_K_qs, kQ5_K_qh>(row + (k / QK_K) * FmtQ5_K::BB, (int)(k % QK_K), v);
}
template <>
__device__ inline void deq8<FmtQ6_K>(const uint8_t* row, int64_t k, float v[8]) {
  const uint8_t* b = row + (k / QK_K) * FmtQ6_K::BB;
  const int e0 = (int)(k % QK_K), n = e0 / 128, r = e0 % 128, quarter = r / 32, l0 = r % 32;
  const float d = ld_f16(b + kQ6_K_d);
  const float s = d * (float)(int8_t)ld_u8(b + kQ6_K_scales + 8 * n + l0 / 16 + 2 * quarter);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int l = l0 + i;
    const uint32_t ql = ld_u8(b + kQ6_K_ql + 64 * n + (quarter & 1) * 32 + l);
    const uint32_t qh = ld_u8(b + kQ6_K_qh + 32 * n + l);
    const int q = (int)((quarter < 2 ? ql & 15u : ql >> 4) | (((qh >> (2 * quarter)) & 3u) << 4)) - 32;
    v[i] = s * (float)q;
  }
}

}  // namespace cuda
}  // namespace dfl
