// gemm_kquant.cpp — K-quant weights (Q4_K, Q5_K, Q6_K) times int8 activations.
//
// The arithmetic of one output, whatever the batch (`reference` below):
//   for each super-block i (256 values), in order:
//     isum = sum_v  scale(group(v)) * q(v) * xq(v)      exact int32
//     msum = sum_g  m(g) * bsum(g)                      exact int32 (16-value groups g)
//     acc  = fma(d_i  * xd_i, float(isum), acc)
//     accm = fma(dm_i * xd_i, float(msum), accm)
//   out = acc - accm
// q are the weight's unsigned quants and scale its sub-block scales; (m, dm)
// carry its offsets: Q4_K / Q5_K mins with dmin, Q6_K's -32 as m = 32 * scale
// with dm = d.  Integer sums are exact in any order, so each kernel adds them
// however is fastest, and the float steps are the same for every output: a
// token's result is bit-identical alone, in a verify batch or in a prefill
// chunk, and the AVX2 build computes the scalar reference's bits.
//
// Two kernels, one arithmetic:
//  - few tokens (decode): `fused` unpacks each weight super-block into
//    registers and uses it at once; 8 outputs' sums reduce together.
//  - 3+ tokens (prefill, verify; 2+ on AVX-512, below): 4 weight rows are unpacked once per block of
//    tokens into an interleaved panel (`PanelSB`): one 32-byte vector holds 8
//    values of each of the 4 rows, so a broadcast 8-byte activation piece
//    multiplies all 4 rows, and the 4 pieces of a 32-value sub-block add up in
//    int16 before the one scale multiply.  The multiply pipes are the limit on
//    AVX2 (pmaddubsw and pmaddwd share them), and this takes 5 multiplies per
//    128 products where one row at a time takes 8.  A batch of one quad (3 or 4
//    tokens: 4 slots' AR step, a short chain) uses each chunk where it is made
//    (`quad_direct`) instead: no tile would read a stored panel twice.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant/quant.h"
#include "quant/simd.h"
#include "quant/weight.h"
#include "util/error.h"


namespace dfl {

namespace {

size_t block_bytes(DType t) {
  return t == DType::Q4_K ? sizeof(block_q4_K) : t == DType::Q5_K ? sizeof(block_q5_K) : sizeof(block_q6_K);
}

// ---- the one reading of each layout: a super-block in natural order ----------
// q[v] for v < 256 (unsigned), sg[g] the scale and mg[g] the offset weight of
// the 16-value group g, d / dm the float scales of isum / msum.
//   Q4_K / Q5_K: value 64c + l is the low nibble of qs[32c + l], value 64c + 32 + l
//   the high one (+16 from qh bit 2c / 2c+1 for Q5_K); sub-block j = v / 32 has
//   scale sc[j] and min mn[j].
//   Q6_K: value 128h + 32s + l has low bits from ql[64h + 32(s & 1) + l] (low
//   nibble for s < 2, high for s >= 2) and high bits (qh[32h + l] >> 2s) & 3; the
//   stored quant 0..63 is the value q - 32; group g has the signed scale scales[g].
struct SuperBlock {
  uint8_t q[256];
  int16_t sg[16], mg[16];
  float d, dm;
};

void read_super_block(DType t, const uint8_t* blk, SuperBlock& s) {
  if (t == DType::Q6_K) {
    const block_q6_K* b = (const block_q6_K*)blk;
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int src = b->ql[64 * h + 32 * (k & 1) + l];
          const int low = k < 2 ? (src & 15) : (src >> 4);
          s.q[128 * h + 32 * k + l] = (uint8_t)(low | (((b->qh[32 * h + l] >> (2 * k)) & 3) << 4));
        }
    for (int g = 0; g < 16; ++g) {
      s.sg[g] = b->scales[g];
      s.mg[g] = (int16_t)(32 * b->scales[g]);
    }
    s.d = s.dm = fp16(b->d);
    return;
  }
  const bool q5 = t == DType::Q5_K;
  const uint8_t* qs = blk + (q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
  const uint8_t* qh = blk + offsetof(block_q5_K, qh);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      int a = qs[32 * c + l] & 15, b = qs[32 * c + l] >> 4;
      if (q5) {
        a |= ((qh[l] >> (2 * c)) & 1) << 4;
        b |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      s.q[64 * c + l] = (uint8_t)a;
      s.q[64 * c + 32 + l] = (uint8_t)b;
    }
  for (int g = 0; g < 16; ++g) {
    uint8_t sc, mn;
    kquant_scale_min(blk + 4, g / 2, &sc, &mn);
    s.sg[g] = sc;
    s.mg[g] = mn;
  }
  uint16_t dh, mh;
  std::memcpy(&dh, blk, 2);
  std::memcpy(&mh, blk + 2, 2);
  s.d = fp16(dh);
  s.dm = fp16(mh);
}

// The definition, one output at a time.
void reference(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  const int64_t nb = W.cols / QK_K;
  const size_t bs = block_bytes(W.type);
  SuperBlock s;
  for (int64_t r = r0; r < r1; ++r)
    for (int t = 0; t < n; ++t) {
      float acc = 0.f, accm = 0.f;
      for (int64_t i = 0; i < nb; ++i) {
        read_super_block(W.type, W.row(r) + i * bs, s);
        const int8_t* xq = x[t].q + 256 * i;
        int32_t isum = 0, msum = 0;
        for (int v = 0; v < 256; ++v) isum += s.sg[v / 16] * s.q[v] * xq[v];
        for (int g = 0; g < 16; ++g) msum += s.mg[g] * x[t].bsum[16 * i + g];
        acc = std::fma(s.d * x[t].d[i], (float)isum, acc);
        accm = std::fma(s.dm * x[t].d[i], (float)msum, accm);
      }
      y[(int64_t)t * W.rows + r] = acc - accm;
    }
}

#ifdef DFL_AVX2
// ---- AVX2 ------------------------------------------------------------------
inline __m256i bcast8(const void* p) {  // 8 bytes repeated 4 times
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}
// [sum(v0), ..., sum(v7)] as one int32 vector, v: 8 vectors of 8 int32 in a row.
inline __m256i reduce8(const int32_t* v) {
  auto V = [&](int k) { return load256(v + 8 * k); };
  __m256i s01 = _mm256_hadd_epi32(V(0), V(1)), s23 = _mm256_hadd_epi32(V(2), V(3));
  __m256i s45 = _mm256_hadd_epi32(V(4), V(5)), s67 = _mm256_hadd_epi32(V(6), V(7));
  __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
// pshufb masks: within each 128-bit half, int16 element 2j in the low half's lanes
// and 2j + 1 in the high half's (a 32-value chunk's two group scales).
struct PairMasks {
  __m256i m[4];
  PairMasks() {
    alignas(32) int8_t b[32];
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 32; ++i) b[i] = (int8_t)(4 * j + (i >= 16 ? 2 : 0) + (i & 1));
      m[j] = _mm256_load_si256((const __m256i*)b);
    }
  }
};
const PairMasks kPair;

// A super-block in registers: chunk j (values 32j..32j+31) of quants, the 16
// group scales and offsets as int16 vectors, the float scales.  Same values as
// read_super_block.
struct SuperBlockRegs {
  __m256i q[8], sg, mg;
  float d, dm;
};

inline __m256i dup16(uint64_t eight_u8) {  // 8 bytes -> 16 int16, each twice
  const __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)eight_u8));
  return _mm256_set_m128i(_mm_unpackhi_epi16(w, w), _mm_unpacklo_epi16(w, w));
}

template <DType T>
inline void load_super_block(const uint8_t* blk, SuperBlockRegs& s) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if constexpr (T == DType::Q6_K) {
    const block_q6_K* b = (const block_q6_K*)blk;
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load256(b->ql + 64 * h), ql1 = load256(b->ql + 64 * h + 32), qh = load256(b->qh + 32 * h);
      s.q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      s.q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      s.q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      s.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
    }
    s.sg = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b->scales));
    s.mg = _mm256_slli_epi16(s.sg, 5);
    s.d = s.dm = fp16(b->d);
  } else {
    constexpr bool Q5 = T == DType::Q5_K;
    const uint8_t* qs = blk + (Q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
    const __m256i qhv = Q5 ? load256(blk + offsetof(block_q5_K, qh)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (Q5) {
        const __m256i b16 = _mm256_set1_epi8(16);
        const __m256i bl = _mm256_set1_epi8((char)(1 << (2 * c))), bh = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bl), bl), b16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bh), bh), b16));
      }
      s.q[2 * c] = lo;
      s.q[2 * c + 1] = hi;
    }
    uint8_t s8[8], m8[8];
    kquant_scales_mins(blk + 4, s8, m8);
    uint64_t sv, mv;
    std::memcpy(&sv, s8, 8);
    std::memcpy(&mv, m8, 8);
    s.sg = dup16(sv);
    s.mg = dup16(mv);
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    s.d = fp16(dh);
    s.dm = fp16(mh);
  }
}

// The next rows' bytes prefetched a slice at a time, spread over this work on the current ones: each
// super-block unpacked (a panel's, or a few-token group's) and each tile of tokens issues its share.  Left
// to the hardware prefetcher, or issued as one burst before a tile, they arrived late: on a 2-vCPU Zen 3 the
// synthetic 0.8B's 1- and 2-token forwards (the few-token kernel) took 1.1-1.2x as long as with these
// slices, its 3- and 4-token ones (one quad) 1.2-1.3x (5 to 64 tokens: the same within 4%); a panel
// further ahead was slower still.
struct Trickle {
  const char* p = nullptr;
  size_t left = 0, per = 0;
  // bytes at p, in `steps` slices
  void start(const char* at, size_t bytes, int steps) {
    p = at, left = at ? bytes : 0;
    per = left ? (left / (size_t)std::max(steps, 1) + 63) / 64 * 64 : 0;
  }
  void step() {
    const size_t b = std::min(per, left);
    for (size_t off = 0; off < b; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    p += b, left -= b;
  }
  void rest() { per = left, step(); }
  // rows [first, min(first + count, end)) of W (none when first >= end)
  void start_rows(const Weight& W, int64_t first, int64_t end, int64_t count, int steps) {
    const int64_t n = std::max<int64_t>(0, std::min(count, end - first));
    start(n ? (const char*)W.row(first) : nullptr, (size_t)n * W.row_bytes, steps);
  }
};

// ---- few tokens: R rows x NT tokens = 8 outputs, lane p = r * NT + t ----------
// Each row is read start to end, the next group's rows prefetched meanwhile (Trickle); its per-super-block
// integer sums wait in FusedSums until all 8 outputs have theirs, then reduce together.
struct FusedSums {
  std::vector<int32_t> is, ms;  // [super-block][output][8]
  std::vector<float> d, dm;     // [super-block][output]
};

template <DType T, int NT>
void fused(const Weight& W, const int64_t* rows, const ActRow* x, int32_t* __restrict is, int32_t* __restrict ms,
           float* __restrict dd, float* __restrict dmm, float* out, Trickle& next) {
  constexpr int R = 8 / NT;
  const int64_t nb = W.cols / QK_K;
  const size_t bs = block_bytes(T);
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = W.row(rows[r]);
    for (int64_t i = 0; i < nb; ++i) {
      next.step();
      SuperBlockRegs s;
      load_super_block<T>(row + i * bs, s);
      const __m256i glo = _mm256_permute2x128_si256(s.sg, s.sg, 0x00), ghi = _mm256_permute2x128_si256(s.sg, s.sg, 0x11);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = x[t].q + 256 * i;
        __m256i a = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i sc = _mm256_shuffle_epi8(j < 4 ? glo : ghi, kPair.m[j & 3]);
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(s.q[j], load256(xq + 32 * j)), sc));
        }
        const int64_t k = i * 8 + r * NT + t;
        _mm256_storeu_si256((__m256i*)(is + 8 * k), a);
        _mm256_storeu_si256((__m256i*)(ms + 8 * k), _mm256_madd_epi16(s.mg, load256(x[t].bsum + 16 * i)));
        dd[k] = s.d;
        dmm[k] = s.dm;
      }
    }
  }
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
#define DFL_XD(p) x[(p) % NT].d[i]
    const __m256 xd = _mm256_setr_ps(DFL_XD(0), DFL_XD(1), DFL_XD(2), DFL_XD(3), DFL_XD(4), DFL_XD(5), DFL_XD(6), DFL_XD(7));
#undef DFL_XD
    const __m256 d = _mm256_loadu_ps(dd + i * 8), dm = _mm256_loadu_ps(dmm + i * 8);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(reduce8(is + i * 64)), acc);
    accm = _mm256_fmadd_ps(_mm256_mul_ps(dm, xd), _mm256_cvtepi32_ps(reduce8(ms + i * 64)), accm);
  }
  _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}

// ---- 3+ tokens: the interleaved panel --------------------------------------
// One super-block of 4 rows.  Row r's values 32j + 8p .. +7 are bytes 8r.. of
// q[j][p]; sc[j][h] holds in int16 lanes 4r..4r+3 row r's scale of group 2j + h;
// m[k] holds in lanes 4r + l row r's offset weight of group 4k + l; d, dm are in
// the lane order of the kernel's outputs (rows 0 1 0 1 2 3 2 3).
struct alignas(32) PanelSB {
  uint8_t q[8][4][32];
  int16_t sc[8][2][16];
  int16_t m[4][16];
  float d[8], dm[8];
};

// A 4x4 transpose of 8-byte pieces: out[p] = [a.p, b.p, c.p, d.p].
inline void transpose_pieces(__m256i a, __m256i b, __m256i c, __m256i d, __m256i out[4]) {
  const __m256i ab_lo = _mm256_unpacklo_epi64(a, b), ab_hi = _mm256_unpackhi_epi64(a, b);
  const __m256i cd_lo = _mm256_unpacklo_epi64(c, d), cd_hi = _mm256_unpackhi_epi64(c, d);
  out[0] = _mm256_permute2x128_si256(ab_lo, cd_lo, 0x20);
  out[1] = _mm256_permute2x128_si256(ab_hi, cd_hi, 0x20);
  out[2] = _mm256_permute2x128_si256(ab_lo, cd_lo, 0x31);
  out[3] = _mm256_permute2x128_si256(ab_hi, cd_hi, 0x31);
}

// pshufb masks that spread bytes of [row0 row1 | row2 row3] (8 bytes a row) to int16
// lanes: mask k's lane 4r + l (r the row within its 128-bit half) takes byte
// 8r + src(k, l), zero-extended.
template <int N>
struct Masks {
  __m256i m[N];
  __m256i operator[](int k) const { return m[k]; }
};
template <int N, typename Src>
Masks<N> spread_masks(Src src) {
  Masks<N> m;
  alignas(32) int8_t b[32];
  for (int k = 0; k < N; ++k) {
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 8; ++q) {
        b[16 * h + 2 * q] = (int8_t)(8 * (q / 4) + src(k, q % 4));
        b[16 * h + 2 * q + 1] = (int8_t)0x80;
      }
    m.m[k] = _mm256_load_si256((const __m256i*)b);
  }
  return m;
}
// scales: chunk j's lanes take each row's scale j
const auto kChunkScale = spread_masks<8>([](int j, int) { return j; });
// mins: offsets piece k's lane 4r + l takes the row's min of group 4k + l (a min covers two groups)
const auto kGroupMin = spread_masks<4>([](int k, int l) { return (4 * k + l) / 2; });

// The 4 rows' f16 scales as 8 floats in the kernel's output lane order (rows 0 1 0 1 2 3 2 3).
inline __m256 lane_scales(uint16_t h0, uint16_t h1, uint16_t h2, uint16_t h3) {
  const __m128 v = _mm_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3, 0, 0, 0, 0));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3));
}

// The 6-bit scales and mins of 4 rows' Q4_K / Q5_K super-blocks as bytes, decoded as
// kquant_scales_mins does, in vector registers (building them from bytes stored on the
// stack stalled on store forwarding): S byte 8r + j is row r's scale of sub-block j, M its min.
inline void scales_mins_4rows(const uint8_t* const blk[4], __m256i& S, __m256i& M) {
  // the 12 scale bytes of each row (16 loaded, inside the block), transposed to words
  const __m128i r0 = _mm_loadu_si128((const __m128i*)(blk[0] + 4)), r1 = _mm_loadu_si128((const __m128i*)(blk[1] + 4));
  const __m128i r2 = _mm_loadu_si128((const __m128i*)(blk[2] + 4)), r3 = _mm_loadu_si128((const __m128i*)(blk[3] + 4));
  const __m128i a = _mm_unpacklo_epi32(r0, r1), b = _mm_unpacklo_epi32(r2, r3);
  const __m128i c = _mm_unpackhi_epi32(r0, r1), d = _mm_unpackhi_epi32(r2, r3);
  const __m128i w0 = _mm_unpacklo_epi64(a, b), w1 = _mm_unpackhi_epi64(a, b), w2 = _mm_unpacklo_epi64(c, d);
  const __m128i k3f = _mm_set1_epi8(0x3f), k0f = _mm_set1_epi8(0x0f), k03 = _mm_set1_epi8(0x03);
  const __m128i s_lo = _mm_and_si128(w0, k3f), m_lo = _mm_and_si128(w1, k3f);
  const __m128i s_hi = _mm_or_si128(_mm_and_si128(w2, k0f),
                                    _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w0, 6), k03), 4));
  const __m128i m_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(w2, 4), k0f),
                                    _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w1, 6), k03), 4));
  S = _mm256_set_m128i(_mm_unpackhi_epi32(s_lo, s_hi), _mm_unpacklo_epi32(s_lo, s_hi));
  M = _mm256_set_m128i(_mm_unpackhi_epi32(m_lo, m_hi), _mm_unpacklo_epi32(m_lo, m_hi));
}

// What a tile reads of a super-block besides its chunks: m[k] holds in lanes 4r + l row r's offset weight of
// group 4k + l; d, dm the float scales in the tile's output lane order.
struct PanelTail {
  __m256i m[4];
  __m256 d, dm;
};

// Q6_K's chunks 4h .. 4h + 3 of 4 rows from their bytes transposed in 8-byte pieces (pieces(k, out): k = -1 the
// high bits qh + 32h, k = 0 / 1 the low nibbles ql + 64h + 32k; asked for as they are needed, so that few are
// live at once), each handed to chunk(j, w, sc0, sc1) with scale(j, 0 / 1): the one decode of the GGUF order's
// panels and the pre-transposed ones.  The high bits 2k, 2k+1 of qh land on bits 4, 5 of chunk k's bytes: a
// 16-bit shift is bytewise once masked to 0x30 (bits crossing a byte edge are cleared).
template <class Pieces, class Chunk, class Scale>
inline void q6_chunks(int h, Pieces&& pieces, Chunk&& chunk, Scale&& scale) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i l[4], hh[4], w[4];
  pieces(-1, hh);
  pieces(0, l);  // chunks 4h and 4h + 2: its low and high nibbles
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_or_si256(_mm256_and_si256(l[p], m4), _mm256_and_si256(_mm256_slli_epi16(hh[p], 4), m30));
  chunk(4 * h, w, scale(4 * h, 0), scale(4 * h, 1));
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l[p], 4), m4), _mm256_and_si256(hh[p], m30));
  chunk(4 * h + 2, w, scale(4 * h + 2, 0), scale(4 * h + 2, 1));
  pieces(1, l);  // chunks 4h + 1 and 4h + 3
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_or_si256(_mm256_and_si256(l[p], m4), _mm256_and_si256(_mm256_slli_epi16(hh[p], 2), m30));
  chunk(4 * h + 1, w, scale(4 * h + 1, 0), scale(4 * h + 1, 1));
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l[p], 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(hh[p], 2), m30));
  chunk(4 * h + 3, w, scale(4 * h + 3, 0), scale(4 * h + 3, 1));
}

// The 4 rows' super-blocks (blk[r]: row r's) in the panel's layout, handed over as they are made, straight
// from the packed bytes: they are transposed in 8-byte pieces first (the bit operations that make quants are
// bytewise, so they commute with it).  chunk(j, w, sc0, sc1) gets chunk j (in any order): w[p] holds in
// bytes 8r.. row r's values 32j + 8p .. +7, sc0 in int16 lanes 4r..4r+3 row r's scale of the chunk's first
// group and sc1 of its second (Q6_K's groups are 16 values; Q4_K / Q5_K have one scale a chunk: sc1 = sc0).
template <DType T, class Chunk>
inline void panel_sb(const uint8_t* const blk[4], Chunk&& chunk, PanelTail& tail) {
  const __m256i m4 = _mm256_set1_epi8(15);
  auto transposed = [&](size_t off, __m256i out[4]) {  // out[p] = piece p of the 4 rows' 32 bytes at off
    transpose_pieces(load256(blk[0] + off), load256(blk[1] + off), load256(blk[2] + off), load256(blk[3] + off), out);
  };
  if constexpr (T == DType::Q6_K) {
    // group scales (signed) of each row as int16; offsets m = 32 * scale in pieces of 4 groups
    __m256i sg[4];
    for (int r = 0; r < 4; ++r)
      sg[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk[r] + offsetof(block_q6_K, scales))));
    transpose_pieces(_mm256_slli_epi16(sg[0], 5), _mm256_slli_epi16(sg[1], 5), _mm256_slli_epi16(sg[2], 5),
                     _mm256_slli_epi16(sg[3], 5), tail.m);
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,  //
                                            4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
    const __m256i a = _mm256_unpacklo_epi16(sg[0], sg[1]), c = _mm256_unpackhi_epi16(sg[0], sg[1]);
    const __m256i bb = _mm256_unpacklo_epi16(sg[2], sg[3]), d = _mm256_unpackhi_epi16(sg[2], sg[3]);
    // e[k]: pieces of groups 2k, 2k+1 (low half) and 8+2k, 9+2k (high half)
    const __m256i e[4] = {_mm256_unpacklo_epi32(a, bb), _mm256_unpackhi_epi32(a, bb), _mm256_unpacklo_epi32(c, d),
                          _mm256_unpackhi_epi32(c, d)};
    // chunk j's groups 2j, 2j + 1: e[j % 4]'s qword 0 / 1 (j < 4) or 2 / 3 in both halves, spread to lanes
    auto scale = [&](int j, int second) {
      const __m256i q = j < 4 ? (second ? _mm256_permute4x64_epi64(e[j % 4], 0x55) : _mm256_permute4x64_epi64(e[j % 4], 0x00))
                              : (second ? _mm256_permute4x64_epi64(e[j % 4], 0xff) : _mm256_permute4x64_epi64(e[j % 4], 0xaa));
      return _mm256_shuffle_epi8(q, spread);
    };
    for (int h = 0; h < 2; ++h)
      q6_chunks(h, [&](int k, __m256i out[4]) {
        transposed(k < 0 ? offsetof(block_q6_K, qh) + 32 * h : offsetof(block_q6_K, ql) + 64 * h + 32 * k, out);
      }, chunk, scale);
    uint16_t dh[4];
    for (int r = 0; r < 4; ++r) std::memcpy(&dh[r], blk[r] + offsetof(block_q6_K, d), 2);
    tail.d = tail.dm = lane_scales(dh[0], dh[1], dh[2], dh[3]);
  } else {
    constexpr bool Q5 = T == DType::Q5_K;
    const size_t qs_off = Q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
    // 6-bit scales and mins of the 4 rows as bytes: [row0 row1 | row2 row3] (S, M)
    __m256i S, M;
    scales_mins_4rows(blk, S, M);
    for (int k = 0; k < 4; ++k) tail.m[k] = _mm256_shuffle_epi8(M, kGroupMin[k]);
    __m256i qh[4];
    if (Q5) transposed(offsetof(block_q5_K, qh), qh);
    const __m256i b16 = _mm256_set1_epi8(16);
    for (int c = 0; c < 4; ++c) {
      __m256i v[4], w[4];
      transposed(qs_off + 32 * c, v);
      const __m256i bl = _mm256_set1_epi8((char)(1 << (2 * c))), bh = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
      for (int p = 0; p < 4; ++p) {
        w[p] = _mm256_and_si256(v[p], m4);
        if (Q5) w[p] = _mm256_or_si256(w[p], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[p], bl), bl), b16));
      }
      const __m256i sc_lo = _mm256_shuffle_epi8(S, kChunkScale[2 * c]);
      chunk(2 * c, w, sc_lo, sc_lo);
      for (int p = 0; p < 4; ++p) {
        w[p] = _mm256_and_si256(_mm256_srli_epi16(v[p], 4), m4);
        if (Q5) w[p] = _mm256_or_si256(w[p], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[p], bh), bh), b16));
      }
      const __m256i sc_hi = _mm256_shuffle_epi8(S, kChunkScale[2 * c + 1]);
      chunk(2 * c + 1, w, sc_hi, sc_hi);
    }
    uint16_t dh[4], mh[4];
    for (int r = 0; r < 4; ++r) {
      std::memcpy(&dh[r], blk[r], 2);
      std::memcpy(&mh[r], blk[r] + 2, 2);
    }
    tail.d = lane_scales(dh[0], dh[1], dh[2], dh[3]);
    tail.dm = lane_scales(mh[0], mh[1], mh[2], mh[3]);
  }
}

inline void panel_rows(const Weight& W, const int64_t* rows, int64_t i, size_t bs, const uint8_t* blk[4]) {
  for (int r = 0; r < 4; ++r) blk[r] = W.row(rows[r]) + i * bs;
}

// A panel's nb super-blocks, as sb(i, chunk, tail) makes them (from the GGUF order, or the stored Q6_K
// panels), in memory for several tiles of tokens to read.
template <bool G16, class Sb>
inline void unpack_into(PanelSB* P, int64_t nb, Sb&& sb) {
  for (int64_t i = 0; i < nb; ++i) {
    PanelSB& b = P[i];
    PanelTail tail;
    sb(i, [&](int j, const __m256i* w, __m256i sc0, __m256i sc1) {
      for (int p = 0; p < 4; ++p) _mm256_store_si256((__m256i*)b.q[j][p], w[p]);
      _mm256_store_si256((__m256i*)b.sc[j][0], sc0);
      if (G16) _mm256_store_si256((__m256i*)b.sc[j][1], sc1);  // else the tile reads sc[j][0] only
    }, tail);
    for (int k = 0; k < 4; ++k) _mm256_store_si256((__m256i*)b.m[k], tail.m[k]);
    _mm256_store_ps(b.d, tail.d);
    _mm256_store_ps(b.dm, tail.dm);
  }
}

// The GGUF order's super-blocks of 4 rows, i by i, the next rows' bytes prefetched a slice with each.
template <DType T>
inline auto gguf_sb(const Weight& W, const int64_t* rows, Trickle& next) {
  return [&W, rows, &next](int64_t i, auto&& chunk, PanelTail& tail) {
    next.step();
    const uint8_t* blk[4];
    panel_rows(W, rows, i, block_bytes(T), blk);
    panel_sb<T>(blk, chunk, tail);
  };
}

// A whole row range's panel in memory, for several tiles of tokens to read.
template <DType T>
void unpack_panel(const Weight& W, const int64_t* rows, PanelSB* P, Trickle& next) {
  unpack_into<T == DType::Q6_K>(P, W.cols / QK_K, gguf_sb<T>(W, rows, next));
}

// The tile's arithmetic, shared by the panel in memory and the panel in registers.  One chunk of 4 rows
// against token x's 32 values xp: the 4 pieces add up in int16 before the one scale multiply (pieces 0-1 and
// 2-3 apart for 16-value groups).
template <bool G16>
inline __m256i tile_chunk(const __m256i w[4], __m256i sc0, __m256i sc1, const int8_t* xp, __m256i is) {
  const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast8(xp)), _mm256_maddubs_epi16(w[1], bcast8(xp + 8)));
  const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast8(xp + 16)), _mm256_maddubs_epi16(w[3], bcast8(xp + 24)));
  if (G16) return _mm256_add_epi32(is, _mm256_add_epi32(_mm256_madd_epi16(a, sc0), _mm256_madd_epi16(c, sc1)));
  return _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_add_epi16(a, c), sc0));
}

// 4 rows x 4 tokens' accumulators: lanes rows 0 1 0 1 2 3 2 3, tokens 0 0 1 1 0 0 1 1 of a pair.
struct TileAcc {
  __m256 acc0 = _mm256_setzero_ps(), accm0 = acc0, acc1 = acc0, accm1 = acc0;
  // super-block i's float steps, from its integer sums is[t] and its tail
  void add(const __m256i* m, __m256 d, __m256 dm, const ActRow* x, int64_t i, const float* xd2, const __m256i is[4]) {
    __m256i ms[4];
    for (int t = 0; t < 4; ++t) {
      const int16_t* bsum = x[t].bsum + 16 * i;
      __m256i a = _mm256_madd_epi16(m[0], bcast8(bsum));
      for (int k = 1; k < 4; ++k) a = _mm256_add_epi32(a, _mm256_madd_epi16(m[k], bcast8(bsum + 4 * k)));
      ms[t] = a;
    }
    const __m256 x0 = _mm256_loadu_ps(xd2 + 16 * i), x1 = _mm256_loadu_ps(xd2 + 16 * i + 8);
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, x0), _mm256_cvtepi32_ps(_mm256_hadd_epi32(is[0], is[1])), acc0);
    accm0 = _mm256_fmadd_ps(_mm256_mul_ps(dm, x0), _mm256_cvtepi32_ps(_mm256_hadd_epi32(ms[0], ms[1])), accm0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, x1), _mm256_cvtepi32_ps(_mm256_hadd_epi32(is[2], is[3])), acc1);
    accm1 = _mm256_fmadd_ps(_mm256_mul_ps(dm, x1), _mm256_cvtepi32_ps(_mm256_hadd_epi32(ms[2], ms[3])), accm1);
  }
  // each token's 4 rows side by side, as y holds them: out[4t + r] row r, token t
  void store(float* out) const {
    const __m256i to_token_major = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(_mm256_sub_ps(acc0, accm0), to_token_major));
    _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(_mm256_sub_ps(acc1, accm1), to_token_major));
  }
};

// 4 panel rows x 4 tokens.  xd2[16 i + 8 k ..] holds, for super-block i and token
// pair k, the activation scales in output lane order (tokens 0 0 1 1 0 0 1 1 of the pair).
// out[4t + r]: row r, token t.
template <bool G16>
void panel_tile(const PanelSB* P, int64_t nb, const ActRow* x, const float* xd2, float* out) {
  TileAcc acc;
  for (int64_t i = 0; i < nb; ++i) {
    const PanelSB& b = P[i];
    __m256i is[4];
    for (int t = 0; t < 4; ++t) is[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      // the chunk's 4 pieces stay in registers while each token passes over them
      __m256i w[4];
      for (int p = 0; p < 4; ++p) w[p] = _mm256_load_si256((const __m256i*)b.q[j][p]);
      const __m256i sc0 = _mm256_load_si256((const __m256i*)b.sc[j][0]);
      const __m256i sc1 = G16 ? _mm256_load_si256((const __m256i*)b.sc[j][1]) : sc0;
      for (int t = 0; t < 4; ++t) is[t] = tile_chunk<G16>(w, sc0, sc1, x[t].q + 256 * i + 32 * j, is[t]);
    }
    __m256i m[4];
    for (int k = 0; k < 4; ++k) m[k] = _mm256_load_si256((const __m256i*)b.m[k]);
    acc.add(m, _mm256_load_ps(b.d), _mm256_load_ps(b.dm), x, i, xd2, is);
  }
  acc.store(out);
}

// One quad of tokens (3 or 4): no tile would read a stored panel twice, so each chunk is used where it is
// made, in registers (storing and reloading the panel was half of a quad's time on AVX2).
// sb(i, chunk, tail): super-block i of the panel, from the GGUF order or the stored Q6_K panels.
template <bool G16, class Sb>
inline void quad_direct(int64_t nb, const ActRow* x, const float* xd2, float* out, Sb&& sb) {
  TileAcc acc;
  for (int64_t i = 0; i < nb; ++i) {
    __m256i is[4];
    for (int t = 0; t < 4; ++t) is[t] = _mm256_setzero_si256();
    PanelTail tail;
    sb(i, [&](int j, const __m256i* w, __m256i sc0, __m256i sc1) {
      for (int t = 0; t < 4; ++t) is[t] = tile_chunk<G16>(w, sc0, sc1, x[t].q + 256 * i + 32 * j, is[t]);
    }, tail);
    acc.add(tail.m, tail.d, tail.dm, x, i, xd2, is);
  }
  acc.store(out);
}

// A tile's outputs, out[4t + r] (row r, token t), to y: each token's live rows side by side.
inline void store_tile(const float* out, int tokens, int live_rows, float* y, int64_t y_stride) {
  for (int t = 0; t < tokens; ++t, y += y_stride) {
    if (live_rows == 4) std::memcpy(y, out + 4 * t, 16);
    else for (int r = 0; r < live_rows; ++r) y[r] = out[4 * t + r];
  }
}

// A batch's tokens as the panel tiles read them: padded to quads with copies of the
// last token, and each quad's activation scales as 16 floats per super-block
// (xd[(q * nb + i) * 16 + lane]) in a tile's output lane order: lane l is token
// token_of_lane(l) of the quad.
struct PanelInputs {
  std::vector<ActRow> xs;
  std::vector<float> xd;
  int n4 = 0;
  template <class LaneToken>
  void prepare(const ActRow* x, int n, int64_t nb, LaneToken token_of_lane) {
    n4 = (n + 3) / 4 * 4;
    xs.resize(n4);
    for (int t = 0; t < n4; ++t) xs[t] = x[std::min(t, n - 1)];
    xd.resize((size_t)(n4 / 4) * nb * 16);
    for (int q = 0; q < n4 / 4; ++q)
      for (int64_t i = 0; i < nb; ++i)
        for (int l = 0; l < 16; ++l) xd[((size_t)q * nb + i) * 16 + l] = xs[4 * q + token_of_lane(l)].d[i];
  }
  const float* quad_scales(int t0, int64_t nb) const { return xd.data() + (size_t)(t0 / 4) * nb * 16; }
};

struct PanelScratch {
  std::vector<PanelSB> panel;
  PanelInputs in;
};

// From this many tokens the panel's unpacking pays for itself.
constexpr int kPanelMinTokens = 3;
// Tokens in blocks that stay in L2 while every panel of the row range passes over them.
constexpr int kTokenBlock = 64;

// The prefetch of the rows after the panel at p0 (up to r1), a slice in each of `steps` (the panel loops'
// start_next for the GGUF order: its next panel's rows are contiguous with this one's).
inline auto next_rows(const Weight& W, int64_t r1) {
  return [&W, r1](int64_t p0, int steps) {
    Trickle t;
    t.start_rows(W, p0 + 4, r1, 4, steps);
    return t;
  };
}

// The loop every panel kind shares.  Tokens go in blocks that stay in L2 while every
// panel of the row range passes over them; each 4-row panel is unpacked once per
// block (unpack(rows, next)) and tiles of tokens run over it (tile(t0, te, out) fills
// out[4t + r] for the tokens it takes, up to tile_max, and returns how many).  The
// next panel's bytes are prefetched while this one's super-blocks are unpacked and its
// tiles run (start_next(p0, steps): a Trickle or two, next_rows for the GGUF order).
template <class StartNext, class Unpack, class Tile>
inline void panel_loop(const Weight& W, int64_t r0, int64_t r1, float* y, int n, int n4, int tile_max,
                       StartNext start_next, Unpack unpack, Tile tile) {
  alignas(64) float out[4 * 8];
  const int nb = (int)(W.cols / QK_K);
  for (int tb = 0; tb < n4; tb += kTokenBlock) {
    const int te = std::min(n4, tb + kTokenBlock);
    const int n_tiles = (te - tb + tile_max - 1) / tile_max;
    for (int64_t p0 = r0; p0 < r1; p0 += 4) {
      int64_t rows[4];
      for (int r = 0; r < 4; ++r) rows[r] = std::min(p0 + r, r1 - 1);  // a short panel repeats its last row
      auto next = start_next(p0, nb + n_tiles);
      unpack(rows, next);
      for (int t0 = tb; t0 < te;) {
        next.step();
        const int nt = tile(t0, te, out);
        store_tile(out, std::min(nt, n - t0), (int)std::min<int64_t>(4, r1 - p0), y + (int64_t)t0 * W.rows + p0, W.rows);
        t0 += nt;
      }
      next.rest();
    }
  }
}

// One quad of tokens (3 or 4, n) over every panel of rows [r0, r1): quad(rows, next, out) fills out[4t + r] in
// registers (quad_direct), the next panel prefetched meanwhile (start_next as panel_loop's).
template <class StartNext, class Quad>
inline void quad_loop(const Weight& W, int64_t r0, int64_t r1, int n, float* y, StartNext start_next, Quad quad) {
  alignas(32) float out[16];
  for (int64_t p0 = r0; p0 < r1; p0 += 4) {
    int64_t rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = std::min(p0 + r, r1 - 1);  // a short panel repeats its last row
    auto next = start_next(p0, (int)(W.cols / QK_K));  // a slice with each super-block
    quad(rows, next, out);
    next.rest();
    store_tile(out, n, (int)std::min<int64_t>(4, r1 - p0), y + p0, W.rows);
  }
}

template <DType T>
void gemm_panels(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  thread_local PanelScratch S;
  const int64_t nb = W.cols / QK_K;
  if ((int64_t)S.panel.size() < nb) S.panel.resize(nb);
  // the tile's lanes: pair k of the quad at 8k.., tokens 2k 2k 2k+1 2k+1 2k 2k 2k+1 2k+1
  S.in.prepare(x, n, nb, [](int l) { return 2 * (l / 8) + ((l >> 1) & 1); });
  PanelSB* panel = S.panel.data();
  const PanelInputs& in = S.in;
  if (T != DType::Q6_K && in.n4 == 4) {  // one quad: the panel in registers (Q6_K's spill: 1.2-1.4x slower)
    quad_loop(W, r0, r1, n, y, next_rows(W, r1), [&](const int64_t* rows, Trickle& next, float* out) {
      quad_direct<false>(nb, in.xs.data(), in.quad_scales(0, nb), out, gguf_sb<T>(W, rows, next));
    });
    return;
  }
  panel_loop(W, r0, r1, y, n, in.n4, 4, next_rows(W, r1),
             [&](const int64_t* rows, Trickle& next) { unpack_panel<T>(W, rows, panel, next); },
             [&](int t0, int, float* out) {
               panel_tile<T == DType::Q6_K>(panel, nb, in.xs.data() + t0, in.quad_scales(t0, nb), out);
               return 4;
             });
}

template <DType T>
void gemm_fused(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  thread_local FusedSums S;
  const size_t need = (size_t)(W.cols / QK_K) * 8;
  if (S.d.size() < need) {
    S.is.resize(need * 8);
    S.ms.resize(need * 8);
    S.d.resize(need);
    S.dm.resize(need);
  }
  int32_t *is = S.is.data(), *ms = S.ms.data();
  float *dd = S.d.data(), *dm = S.dm.data();
  float out[8];
  for (int t0 = 0; t0 < n;) {
    const int nt = n - t0 >= 2 ? 2 : 1;
    const int R = 8 / nt;
    for (int64_t p0 = r0; p0 < r1; p0 += R) {
      int64_t rows[8];
      for (int r = 0; r < R; ++r) rows[r] = std::min(p0 + r, r1 - 1);
      Trickle next;  // the next group's rows, a slice with each super-block
      next.start_rows(W, p0 + R, r1, R, (int)(R * (W.cols / QK_K)));
      if (nt == 2) fused<T, 2>(W, rows, x + t0, is, ms, dd, dm, out, next);
      else fused<T, 1>(W, rows, x + t0, is, ms, dd, dm, out, next);
      for (int p = 0; p < 8; ++p) {
        const int64_t r = p0 + p / nt;
        if (r < r1) y[(int64_t)(t0 + p % nt) * W.rows + r] = out[p];
      }
    }
    t0 += nt;
  }
}

// ---- 3+ tokens on AVX-512 (chosen at run time): 16-byte row pieces ---------
// The same panel idea with 512-bit vectors: a vector holds 16 values of each of
// 4 rows (one row per 128-bit lane), so one broadcast 16-byte activation piece
// multiplies all 4 rows, a 32-value sub-block takes 2 pmaddubsw and 1 vpdpwssd
// (VNNI: the scale multiply and the add in one; the AVX2 panel takes 4 + 1 + adds
// for half the products), and only the integer sums change hands: the float
// steps of each output are the reference's.
DFL_AVX512_BEGIN

// One super-block of 4 rows.  q[j][h] holds in 128-bit lane r row r's values
// 32j + 16h .. +15; sc[j][h] in int16 lanes 8r..8r+7 row r's scale of group 2j + h;
// m[k] in lanes 8r + e row r's offset weight of group 8k + e; d / dm in lane 4r + t
// row r's float scales (t: the 4 tokens of a quad).
struct alignas(64) Panel16 {
  uint8_t q[8][2][64];
  int16_t sc[8][2][32];
  int16_t m[2][32];
  float d[16], dm[16];
};

DFL_AVX512 inline __m512i load_pair256(const uint8_t* a, const uint8_t* b) {  // [32 bytes at a | 32 at b]
  return _mm512_inserti64x4(_mm512_castsi256_si512(load256(a)), load256(b), 1);
}

// Chunk j (values 32j..32j+31) of two rows' super-blocks as [row a | row b]: the
// bit operations of load_super_block, two rows at once.
template <DType T>
DFL_AVX512 inline void chunks_of_two(const uint8_t* a, const uint8_t* b, __m512i c[8]) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if constexpr (T == DType::Q6_K) {
    const __m512i m2 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const size_t ql = offsetof(block_q6_K, ql) + 64 * h, qh = offsetof(block_q6_K, qh) + 32 * h;
      const __m512i l0 = load_pair256(a + ql, b + ql), l1 = load_pair256(a + ql + 32, b + ql + 32);
      const __m512i hb = load_pair256(a + qh, b + qh);
      c[4 * h + 0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4));
      c[4 * h + 1] = _mm512_or_si512(_mm512_and_si512(l1, m4),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2), m2), 4));
      c[4 * h + 2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), m2), 4));
      c[4 * h + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 6), m2), 4));
    }
  } else {
    constexpr bool Q5 = T == DType::Q5_K;
    const size_t qs = Q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
    const size_t qh = offsetof(block_q5_K, qh);
    const __m512i hb = Q5 ? load_pair256(a + qh, b + qh) : _mm512_setzero_si512();
    const __m512i b16 = _mm512_set1_epi8(16);
    for (int k = 0; k < 4; ++k) {
      const __m512i v = load_pair256(a + qs + 32 * k, b + qs + 32 * k);
      __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if (Q5) {
        lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << (2 * k)))), b16));
        hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << (2 * k + 1)))), b16));
      }
      c[2 * k] = lo;
      c[2 * k + 1] = hi;
    }
  }
}

// Index vectors of vpermt2w over [rows 0 1] ++ [rows 2 3] (16 int16 a row): lane 8r + e
// takes row r's element scale[g][..]: group g; offset[k][..]: group 8k + e.
// sub_scale / sub_min: vpermw over 8 values a row (Q4_K / Q5_K sub-blocks): lane 8r + e takes
// row r's sub-block j / the sub-block of group 8k + e.
struct Spread16 {
  alignas(64) int16_t scale[16][32], offset[2][32], sub_scale[8][32], sub_min[2][32];
  Spread16() {
    for (int l = 0; l < 32; ++l) {
      const int r = l / 8, e = l % 8;
      for (int g = 0; g < 16; ++g) scale[g][l] = (int16_t)(16 * r + g);
      for (int k = 0; k < 2; ++k) offset[k][l] = (int16_t)(16 * r + 8 * k + e);
      for (int j = 0; j < 8; ++j) sub_scale[j][l] = (int16_t)(8 * r + j);
      for (int k = 0; k < 2; ++k) sub_min[k][l] = (int16_t)(8 * r + (8 * k + e) / 2);
    }
  }
};
const Spread16 kSpread16;

// 4 rows' f16 scales as 16 floats, lane 4r + t = row r's (the tile's lane order).
DFL_AVX512 inline __m512 row_scales16(const uint16_t h[4]) {
  const __m128 v = _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v));
}

template <DType T>
DFL_AVX512 void unpack_panel16(const Weight& W, const int64_t* rows, Panel16* P, Trickle& next) {
  const int64_t nb = W.cols / QK_K;
  const size_t bs = block_bytes(T);
  for (int64_t i = 0; i < nb; ++i) {
    next.step();
    Panel16& p = P[i];
    const uint8_t* blk[4];
    for (int r = 0; r < 4; ++r) blk[r] = W.row(rows[r]) + i * bs;
    __m512i c01[8], c23[8];
    chunks_of_two<T>(blk[0], blk[1], c01);
    chunks_of_two<T>(blk[2], blk[3], c23);
    for (int j = 0; j < 8; ++j) {  // 128-bit lanes 0, 2 of each pair: values 0..15; lanes 1, 3: 16..31
      _mm512_store_si512(p.q[j][0], _mm512_shuffle_i64x2(c01[j], c23[j], 0x88));
      _mm512_store_si512(p.q[j][1], _mm512_shuffle_i64x2(c01[j], c23[j], 0xdd));
    }
    if constexpr (T == DType::Q6_K) {
      // signed group scales as int16 (rows 0 1 | rows 2 3), offsets m = 32 * scale
      const __m512i s01 = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)(blk[1] + offsetof(block_q6_K, scales))),
                                                                _mm_loadu_si128((const __m128i*)(blk[0] + offsetof(block_q6_K, scales)))));
      const __m512i s23 = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)(blk[3] + offsetof(block_q6_K, scales))),
                                                                _mm_loadu_si128((const __m128i*)(blk[2] + offsetof(block_q6_K, scales)))));
      for (int g = 0; g < 16; ++g)
        _mm512_store_si512(p.sc[g / 2][g % 2], _mm512_permutex2var_epi16(s01, _mm512_load_si512(kSpread16.scale[g]), s23));
      for (int k = 0; k < 2; ++k)
        _mm512_store_si512(p.m[k], _mm512_slli_epi16(_mm512_permutex2var_epi16(s01, _mm512_load_si512(kSpread16.offset[k]), s23), 5));
      uint16_t dh[4];
      for (int r = 0; r < 4; ++r) std::memcpy(&dh[r], blk[r] + offsetof(block_q6_K, d), 2);
      const __m512 d = row_scales16(dh);
      _mm512_store_ps(p.d, d);
      _mm512_store_ps(p.dm, d);
    } else {
      // S16 / M16 lane 8r + j: row r's scale / min of sub-block j (groups 2j and 2j + 1)
      __m256i S, M;
      scales_mins_4rows(blk, S, M);
      const __m512i S16 = _mm512_cvtepu8_epi16(S), M16 = _mm512_cvtepu8_epi16(M);
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(p.sc[j][0], _mm512_permutexvar_epi16(_mm512_load_si512(kSpread16.sub_scale[j]), S16));
      for (int k = 0; k < 2; ++k)
        _mm512_store_si512(p.m[k], _mm512_permutexvar_epi16(_mm512_load_si512(kSpread16.sub_min[k]), M16));
      uint16_t dh[4], mh[4];
      for (int r = 0; r < 4; ++r) {
        std::memcpy(&dh[r], blk[r], 2);
        std::memcpy(&mh[r], blk[r] + 2, 2);
      }
      _mm512_store_ps(p.d, row_scales16(dh));
      _mm512_store_ps(p.dm, row_scales16(mh));
    }
  }
}

// The 4 tokens' sums in lane 4r + t from is[t] (4 int32 of row r in 128-bit lane r).
DFL_AVX512 inline __m512i reduce_quad(__m512i i0, __m512i i1, __m512i i2, __m512i i3) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(i2, i3), _mm512_unpackhi_epi32(i2, i3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// acc += pairwise int16 products of a and b (vpdpwssd), written so that the
// accumulator stays in its register: GCC 12's intrinsic copies it out and back
// around every instruction.
DFL_AVX512 inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

DFL_AVX512 inline __m512i bcast16(const void* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)); }

// 4 panel rows x 4Q tokens.  xd4[(q * nb + i) * 16 + 4r + t]: token 4q + t's activation
// scale of super-block i.  out[16q + 4t + r]: row r, token 4q + t.
template <bool G16, int Q>
DFL_AVX512 __attribute__((noinline)) void panel16_tile(const Panel16* P, int64_t nb, const ActRow* x, const float* xd4, float* out) {
  constexpr int NT = 4 * Q;
  __m512 acc[Q], accm[Q];
  for (int q = 0; q < Q; ++q) acc[q] = accm[q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const Panel16& b = P[i];
    __m512i is[NT];
    for (int t = 0; t < NT; ++t) is[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i w0 = _mm512_load_si512(b.q[j][0]), w1 = _mm512_load_si512(b.q[j][1]);
      const __m512i s0 = _mm512_load_si512(b.sc[j][0]);
      const __m512i s1 = G16 ? _mm512_load_si512(b.sc[j][1]) : s0;
      for (int t = 0; t < NT; ++t) {
        const int8_t* xp = x[t].q + 256 * i + 32 * j;
        const __m512i p0 = _mm512_maddubs_epi16(w0, bcast16(xp)), p1 = _mm512_maddubs_epi16(w1, bcast16(xp + 16));
        if (G16) {  // a scale per 16 values: one per piece
          is[t] = dpwssd(is[t], p0, s0);
          is[t] = dpwssd(is[t], p1, s1);
        } else {  // the sub-block's two pieces share a scale (two pair sums < 2^15 in int16)
          is[t] = dpwssd(is[t], _mm512_add_epi16(p0, p1), s0);
        }
      }
    }
    const __m512i m0 = _mm512_load_si512(b.m[0]), m1 = _mm512_load_si512(b.m[1]);
    const __m512 d = _mm512_load_ps(b.d), dm = _mm512_load_ps(b.dm);
    for (int q = 0; q < Q; ++q) {
      __m512i ms[4];
      for (int t = 0; t < 4; ++t) {
        const int16_t* bs = x[4 * q + t].bsum + 16 * i;
        ms[t] = _mm512_add_epi32(_mm512_madd_epi16(m0, bcast16(bs)), _mm512_madd_epi16(m1, bcast16(bs + 8)));
      }
      const __m512 xd = _mm512_loadu_ps(xd4 + ((size_t)q * nb + i) * 16);
      const __m512i isum = reduce_quad(is[4 * q], is[4 * q + 1], is[4 * q + 2], is[4 * q + 3]);
      const __m512i msum = reduce_quad(ms[0], ms[1], ms[2], ms[3]);
      acc[q] = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(isum), acc[q]);
      accm[q] = _mm512_fmadd_ps(_mm512_mul_ps(dm, xd), _mm512_cvtepi32_ps(msum), accm[q]);
    }
  }
  // lane 4r + t -> 4t + r: each token's 4 rows side by side, as y holds them
  const __m512i to_token_major = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int q = 0; q < Q; ++q)
    _mm512_storeu_ps(out + 16 * q, _mm512_permutexvar_ps(to_token_major, _mm512_sub_ps(acc[q], accm[q])));
}

struct Panel16Scratch {
  std::vector<Panel16> panel;
  PanelInputs in;
};

template <DType T>
DFL_AVX512 void gemm_panels16(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  thread_local Panel16Scratch S;
  const int64_t nb = W.cols / QK_K;
  if ((int64_t)S.panel.size() < nb) S.panel.resize(nb);
  S.in.prepare(x, n, nb, [](int l) { return l % 4; });  // the tile's lanes 4r + t
  Panel16* panel = S.panel.data();
  const PanelInputs& in = S.in;
  panel_loop(W, r0, r1, y, n, in.n4, 8, next_rows(W, r1),
             [&](const int64_t* rows, Trickle& next) { unpack_panel16<T>(W, rows, panel, next); },
             [&](int t0, int te, float* out) {
               const ActRow* xs = in.xs.data() + t0;
               if (te - t0 >= 8) {
                 panel16_tile<T == DType::Q6_K, 2>(panel, nb, xs, in.quad_scales(t0, nb), out);
                 return 8;
               }
               panel16_tile<T == DType::Q6_K, 1>(panel, nb, xs, in.quad_scales(t0, nb), out);
               return 4;
             });
}

DFL_AVX512_END

// ---- Q6_K panels pre-transposed (CpuLayout, made on the first CPU matmul) -----------------------------
// What panel_sb<Q6_K> computes before its bit operations, stored once: the low nibbles and high bits of 4 rows
// transposed in 8-byte pieces, the group scales in the order the quad spreads them, the 4 f16 scales -- 840
// bytes a 4-row super-block, as the GGUF blocks.  The quad's 4-row transposes were half its unpacking
// (docs/research/cpu-q6k-quads.md): from cache a 4-token quad takes 1.36-1.42x less time, one token 57 -> 46 ns
// a super-block (bench/q6k_layout.cpp).  The integer sums are the same numbers and the float steps the same
// operations in the same order, so every output is bit for bit the GGUF order's.  Every quant block first
// (768 bytes, 32-byte aligned), then every scale block (72 bytes), both in panel order.
struct Q6Quant {
  uint8_t ql[2][2][4][32];  // [h][half][piece]: the transposed ql + 64h + 32 half
  uint8_t qh[2][4][32];     // [h][piece]: the transposed qh + 32h
};
struct Q6Scales {
  int8_t sp[4][16];  // [k]: byte 4r + l is row r's scale of group 4k + l
  uint16_t d[4];
};
static_assert(sizeof(Q6Quant) == 768 && sizeof(Q6Scales) == 72, "Q6_K panel blocks");

struct Q6Panels {
  const Q6Quant* q;
  const Q6Scales* s;
  int64_t nb;
  explicit Q6Panels(const Weight& W) : nb(W.cols / QK_K) {
    const uint8_t* base = align64(W.cpu_layout->bytes.data());
    q = reinterpret_cast<const Q6Quant*>(base);
    s = reinterpret_cast<const Q6Scales*>(base + (size_t)(W.rows / 4) * nb * sizeof(Q6Quant));
  }
  static const uint8_t* align64(const uint8_t* p) { return (const uint8_t*)(((uintptr_t)p + 63) & ~(uintptr_t)63); }
  // The prefetch of the panel after the one at row p0 (up to row r1): both its runs, a slice in each of `steps`.
  struct Next {
    Trickle q, s;
    void step() { q.step(), s.step(); }
    void rest() { q.rest(), s.rest(); }
  };
  auto next_panel(int64_t r1) const {
    return [this, r1](int64_t p0, int steps) {
      const int64_t p = p0 / 4 + 1;
      const bool more = 4 * p < r1;
      Next n;
      n.q.start(more ? (const char*)(q + p * nb) : nullptr, (size_t)nb * sizeof(Q6Quant), steps);
      n.s.start(more ? (const char*)(s + p * nb) : nullptr, (size_t)nb * sizeof(Q6Scales), steps);
      return n;
    };
  }
  // the super-blocks of the panel at row p0, as quad_direct and unpack_into take them
  auto sb(int64_t p0, Next& next) const;
};

// Q6_K: lane 4r + l of a piece of 4 groups (int16 lanes 4r + l: row r, group 4k + l) to all 4 lanes of row r,
// within each 128-bit half: chunk j's group 2j + h from piece (2j + h) / 4
const auto kGroupScale = [] {
  Masks<4> m;
  alignas(32) int8_t b[32];
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 8; ++i) {  // int16 lane i of the half: row i / 4 of the half
        const int src = 4 * (i / 4) + l;
        b[16 * h + 2 * i] = (int8_t)(2 * src);
        b[16 * h + 2 * i + 1] = (int8_t)(2 * src + 1);
      }
    m.m[l] = _mm256_load_si256((const __m256i*)b);
  }
  return m;
}();

void q6_fill_panel(const uint8_t* const blk[4], Q6Quant& q, Q6Scales& s) {
  auto tr = [&](size_t off, uint8_t out[4][32]) {
    __m256i v[4];
    transpose_pieces(load256(blk[0] + off), load256(blk[1] + off), load256(blk[2] + off), load256(blk[3] + off), v);
    for (int p = 0; p < 4; ++p) _mm256_storeu_si256((__m256i*)out[p], v[p]);
  };
  for (int h = 0; h < 2; ++h) {
    tr(offsetof(block_q6_K, qh) + 32 * h, q.qh[h]);
    for (int half = 0; half < 2; ++half) tr(offsetof(block_q6_K, ql) + 64 * h + 32 * half, q.ql[h][half]);
  }
  for (int k = 0; k < 4; ++k)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 4; ++l) s.sp[k][4 * r + l] = (int8_t)blk[r][offsetof(block_q6_K, scales) + 4 * k + l];
  for (int r = 0; r < 4; ++r) std::memcpy(&s.d[r], blk[r] + offsetof(block_q6_K, d), 2);
}

// panel_sb<Q6_K>'s chunks and tail from the stored panel: its bit operations without the transposes.
template <class Chunk>
inline void q6_panel_sb(const Q6Quant& q, const Q6Scales& s, Chunk&& chunk, PanelTail& tail) {
  __m256i sp[4];
  for (int k = 0; k < 4; ++k) sp[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)s.sp[k]));
  for (int k = 0; k < 4; ++k) tail.m[k] = _mm256_slli_epi16(sp[k], 5);
  auto scale = [&](int j, int second) {
    const int g = 2 * j + second;
    return _mm256_shuffle_epi8(sp[g / 4], kGroupScale[g % 4]);
  };
  for (int h = 0; h < 2; ++h)
    q6_chunks(h, [&](int k, __m256i out[4]) {
      const uint8_t(*src)[32] = k < 0 ? q.qh[h] : q.ql[h][k];
      for (int p = 0; p < 4; ++p) out[p] = _mm256_load_si256((const __m256i*)src[p]);
    }, chunk, scale);
  tail.d = tail.dm = lane_scales(s.d[0], s.d[1], s.d[2], s.d[3]);
}

// 1 or 2 tokens (NT) on one stored panel: the lanes of a quad tile's first pair (rows 0 1 0 1 2 3 2 3, tokens
// 0 0 1 1 0 0 1 1; one token fills both), the same float steps as `fused` gives each output.  out[4t + r].
template <int NT>
void q6_pair(const Q6Panels& P, int64_t p0, const ActRow* x, float* out, Q6Panels::Next& next) {
  __m256 acc = _mm256_setzero_ps(), accm = acc;
  const ActRow& x1 = x[NT - 1];
  const auto sb = P.sb(p0, next);
  for (int64_t i = 0; i < P.nb; ++i) {
    __m256i is0 = _mm256_setzero_si256(), is1 = is0;
    PanelTail tail;
    sb(i, [&](int j, const __m256i* w, __m256i sc0, __m256i sc1) {
      is0 = tile_chunk<true>(w, sc0, sc1, x[0].q + 256 * i + 32 * j, is0);
      if (NT == 2) is1 = tile_chunk<true>(w, sc0, sc1, x1.q + 256 * i + 32 * j, is1);
    }, tail);
    auto offsets = [&](const ActRow& xt) {
      const int16_t* bsum = xt.bsum + 16 * i;
      __m256i a = _mm256_madd_epi16(tail.m[0], bcast8(bsum));
      for (int k = 1; k < 4; ++k) a = _mm256_add_epi32(a, _mm256_madd_epi16(tail.m[k], bcast8(bsum + 4 * k)));
      return a;
    };
    const __m256i ms0 = offsets(x[0]), ms1 = NT == 2 ? offsets(x1) : ms0;
    const float a = x[0].d[i], b = x1.d[i];
    const __m256 xd = _mm256_setr_ps(a, a, b, b, a, a, b, b);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(tail.d, xd), _mm256_cvtepi32_ps(_mm256_hadd_epi32(is0, NT == 2 ? is1 : is0)), acc);
    accm = _mm256_fmadd_ps(_mm256_mul_ps(tail.dm, xd), _mm256_cvtepi32_ps(_mm256_hadd_epi32(ms0, ms1)), accm);
  }
  const __m256i to_token_major = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(_mm256_sub_ps(acc, accm), to_token_major));
}

auto Q6Panels::sb(int64_t p0, Next& next) const {
  return [this, p0, &next](int64_t i, auto&& chunk, PanelTail& tail) {
    next.step();
    const int64_t k = p0 / 4 * nb + i;
    q6_panel_sb(q[k], s[k], chunk, tail);
  };
}

// Rows [r0, r1) (whole panels) for n tokens from the stored panels: 1-2 tokens a pair at a time, a quad in
// registers, more in tiles over an unpacked panel -- the GGUF order's kernels, without its transposes.
std::atomic<int64_t> g_q6_panel_rows{0};

void gemm_q6_panels(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  g_q6_panel_rows.fetch_add(r1 - r0, std::memory_order_relaxed);
  const Q6Panels P(W);
  const int64_t nb = P.nb;
  if (n < kPanelMinTokens) {
    alignas(32) float out[8];
    for (int t0 = 0; t0 < n;) {
      const int nt = n - t0 >= 2 ? 2 : 1;
      for (int64_t p0 = r0; p0 < r1; p0 += 4) {
        auto next = P.next_panel(r1)(p0, (int)nb);
        if (nt == 2) q6_pair<2>(P, p0, x + t0, out, next);
        else q6_pair<1>(P, p0, x + t0, out, next);
        store_tile(out, nt, 4, y + (int64_t)t0 * W.rows + p0, W.rows);
      }
      t0 += nt;
    }
    return;
  }
  thread_local PanelScratch S;
  if ((int64_t)S.panel.size() < nb) S.panel.resize(nb);
  S.in.prepare(x, n, nb, [](int l) { return 2 * (l / 8) + ((l >> 1) & 1); });
  const PanelInputs& in = S.in;
  if (in.n4 == 4) {  // (the stored panels do not spill: a quad in registers)
    quad_loop(W, r0, r1, n, y, P.next_panel(r1), [&](const int64_t* rows, Q6Panels::Next& next, float* out) {
      quad_direct<true>(nb, in.xs.data(), in.quad_scales(0, nb), out, P.sb(rows[0], next));
    });
    return;
  }
  PanelSB* panel = S.panel.data();
  panel_loop(W, r0, r1, y, n, in.n4, 4, P.next_panel(r1),
             [&](const int64_t* rows, Q6Panels::Next& next) { unpack_into<true>(panel, nb, P.sb(rows[0], next)); },
             [&](int t0, int, float* out) {
               panel_tile<true>(panel, nb, in.xs.data() + t0, in.quad_scales(t0, nb), out);
               return 4;
             });
}

bool q6_panels_ready(const Weight& W) {
  return W.type == DType::Q6_K && W.cpu_layout && !W.cpu_layout->bytes.empty() && q6_panels_wanted(W);
}

template <DType T>
void gemm_avx2(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  if (T == DType::Q6_K && r0 % 4 == 0 && r1 % 4 == 0 && q6_panels_ready(W)) return gemm_q6_panels(W, r0, r1, x, n, y);
  // AVX-512 panels pay from 2 tokens (a pair padded to a quad still beats the register kernel)
  if (n >= 2 && cpu_avx512_active()) {
    gemm_panels16<T>(W, r0, r1, x, n, y);
  } else if (n >= kPanelMinTokens) {
    gemm_panels<T>(W, r0, r1, x, n, y);
  } else {
    gemm_fused<T>(W, r0, r1, x, n, y);
  }
}
#endif

}  // namespace

bool gemm_kquant_supported(DType t) { return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K; }

Weight with_cpu_layout(Weight w) {
  if (w.type == DType::Q6_K && w.rows % 4 == 0 && w.cols % QK_K == 0) w.cpu_layout = std::make_shared<CpuLayout>();
  return w;
}

bool q6_panels_wanted(const Weight& W) {
#ifdef DFL_AVX2
  static const bool off = [] {  // read once: this is asked on every K-quant matmul
    const char* e = std::getenv("DFLASH27B_CPU_Q6K_PANELS");
    return e && !std::strcmp(e, "0");
  }();
  return W.type == DType::Q6_K && W.cpu_layout && !off && !cpu_avx512_active();
#else
  (void)W;
  return false;  // the portable build reads the GGUF order
#endif
}

int64_t q6_panel_rows_read() {
#ifdef DFL_AVX2
  return g_q6_panel_rows.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

size_t q6_panels_bytes(const Weight& W) {  // (+63: the start aligned to 64 bytes in the vector)
  return (size_t)(W.rows / 4) * (size_t)(W.cols / QK_K) * (sizeof(block_q6_K) * 4) + 63;
}

void q6_panels_fill(const Weight& W, int64_t p0, int64_t p1, uint8_t* bytes) {
#ifdef DFL_AVX2
  const int64_t nb = W.cols / QK_K;
  uint8_t* base = const_cast<uint8_t*>(Q6Panels::align64(bytes));
  Q6Quant* q = reinterpret_cast<Q6Quant*>(base);
  Q6Scales* s = reinterpret_cast<Q6Scales*>(base + (size_t)(W.rows / 4) * nb * sizeof(Q6Quant));
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk[4];
      for (int r = 0; r < 4; ++r) blk[r] = W.row(4 * p + r) + i * sizeof(block_q6_K);
      q6_fill_panel(blk, q[p * nb + i], s[p * nb + i]);
    }
#else
  (void)W, (void)p0, (void)p1, (void)bytes;
#endif
}

void gemm_kquant(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
#ifdef DFL_AVX2
  switch (W.type) {
    case DType::Q4_K: return gemm_avx2<DType::Q4_K>(W, r0, r1, x, n, y);
    case DType::Q5_K: return gemm_avx2<DType::Q5_K>(W, r0, r1, x, n, y);
    case DType::Q6_K: return gemm_avx2<DType::Q6_K>(W, r0, r1, x, n, y);
    default: break;
  }
  fail("gemm_kquant: %s is not a K-quant", type_traits((uint32_t)W.type)->name);
#else
  if (!gemm_kquant_supported(W.type)) fail("gemm_kquant: %s is not a K-quant", type_traits((uint32_t)W.type)->name);
  reference(W, r0, r1, x, n, y);
#endif
}

void gemm_kquant_reference(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y) {
  if (!gemm_kquant_supported(W.type)) fail("gemm_kquant: %s is not a K-quant", type_traits((uint32_t)W.type)->name);
  reference(W, r0, r1, x, n, y);
}

}  // namespace dfl
