// bench/q6k_layout.cpp: Q6_K on a CPU, the GGUF layout against a load-time pre-transposed one (4 rows a super-block,
// the 8-byte pieces of the quad kernel's panel already interleaved), from cache, one thread: ns per 4-row super-block
// for the 4-token quad (panel_direct) and 1 token (fused).  Build and run (docs/research/cpu-q6k-quads.md):
//   g++ -std=c++17 -O2 -mavx2 -mfma -mf16c -ffp-contract=off -I csrc bench/q6k_layout.cpp csrc/quant/quant.cpp \
//       csrc/quant/dot_cpu.cpp -o /tmp/q6k_layout && /tmp/q6k_layout 1024
#include "quant/gemm_kquant.cpp"
#include <chrono>
#include <cstdio>
#include <random>
using namespace dfl;
namespace dfl { namespace {
// 4 rows' super-block pre-transposed: what panel_sb<Q6_K> computes before its bit operations
struct alignas(32) Q6x4 {
  uint8_t ql[2][2][4][32];   // [h][half][piece]: transposed(ql + 64h + 32 half)
  uint8_t qh[2][4][32];      // [h][piece]: transposed(qh + 32h)
  int8_t sp[4][16];          // [k]: byte 4r + l = row r's scale of group 4k + l
  uint16_t d[4];
  uint8_t pad[24];
};
void repack(const uint8_t* const blk[4], Q6x4& o) {
  auto tr = [&](size_t off, uint8_t out[4][32]) {
    __m256i v[4];
    transpose_pieces(load256(blk[0] + off), load256(blk[1] + off), load256(blk[2] + off), load256(blk[3] + off), v);
    for (int p = 0; p < 4; ++p) _mm256_store_si256((__m256i*)out[p], v[p]);
  };
  for (int h = 0; h < 2; ++h) {
    tr(offsetof(block_q6_K, qh) + 32 * h, o.qh[h]);
    for (int half = 0; half < 2; ++half) tr(offsetof(block_q6_K, ql) + 64 * h + 32 * half, o.ql[h][half]);
  }
  for (int k = 0; k < 4; ++k)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 4; ++l) o.sp[k][4 * r + l] = (int8_t)blk[r][offsetof(block_q6_K, scales) + 4 * k + l];
  for (int r = 0; r < 4; ++r) std::memcpy(&o.d[r], blk[r] + offsetof(block_q6_K, d), 2);
}
const auto kGS = [] {
  Masks<4> m;
  alignas(32) int8_t b[32];
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 8; ++i) { const int src = 4 * (i / 4) + l; b[16 * h + 2 * i] = (int8_t)(2 * src); b[16 * h + 2 * i + 1] = (int8_t)(2 * src + 1); }
    m.m[l] = _mm256_load_si256((const __m256i*)b);
  }
  return m;
}();
template <class Chunk>
inline void panel_pre(const Q6x4& b, Chunk&& chunk, PanelTail& tail) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i sp[4];
  for (int k = 0; k < 4; ++k) sp[k] = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i*)b.sp[k]));
  for (int k = 0; k < 4; ++k) tail.m[k] = _mm256_slli_epi16(sp[k], 5);
  auto scale = [&](int j, int second) { const int g = 2 * j + second; return _mm256_shuffle_epi8(sp[g / 4], kGS[g % 4]); };
  for (int h = 0; h < 2; ++h) {
    __m256i l[4], hh[4], w[4];
    for (int p = 0; p < 4; ++p) hh[p] = _mm256_load_si256((const __m256i*)b.qh[h][p]);
    for (int p = 0; p < 4; ++p) l[p] = _mm256_load_si256((const __m256i*)b.ql[h][0][p]);
    for (int p = 0; p < 4; ++p) w[p] = _mm256_or_si256(_mm256_and_si256(l[p], m4), _mm256_and_si256(_mm256_slli_epi16(hh[p], 4), m30));
    chunk(4 * h, w, scale(4 * h, 0), scale(4 * h, 1));
    for (int p = 0; p < 4; ++p) w[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l[p], 4), m4), _mm256_and_si256(hh[p], m30));
    chunk(4 * h + 2, w, scale(4 * h + 2, 0), scale(4 * h + 2, 1));
    for (int p = 0; p < 4; ++p) l[p] = _mm256_load_si256((const __m256i*)b.ql[h][1][p]);
    for (int p = 0; p < 4; ++p) w[p] = _mm256_or_si256(_mm256_and_si256(l[p], m4), _mm256_and_si256(_mm256_slli_epi16(hh[p], 2), m30));
    chunk(4 * h + 1, w, scale(4 * h + 1, 0), scale(4 * h + 1, 1));
    for (int p = 0; p < 4; ++p) w[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l[p], 4), m4), _mm256_and_si256(_mm256_srli_epi16(hh[p], 2), m30));
    chunk(4 * h + 3, w, scale(4 * h + 3, 0), scale(4 * h + 3, 1));
  }
  tail.d = tail.dm = lane_scales(b.d[0], b.d[1], b.d[2], b.d[3]);
}
void direct_pre(const Q6x4* P, int64_t nb, const ActRow* x, const float* xd2, float* out) {
  TileAcc acc;
  for (int64_t i = 0; i < nb; ++i) {
    __m256i is[4];
    for (int t = 0; t < 4; ++t) is[t] = _mm256_setzero_si256();
    PanelTail tail;
    panel_pre(P[i], [&](int j, const __m256i* w, __m256i sc0, __m256i sc1) {
      for (int t = 0; t < 4; ++t) is[t] = tile_chunk<true>(w, sc0, sc1, x[t].q + 256 * i + 32 * j, is[t]);
    }, tail);
    acc.add(tail.m, tail.d, tail.dm, x, i, xd2, is);
  }
  acc.store(out);
}
// 1 token on the pre-transposed layout: the quad's unpack, one token's tile (timing only: the float steps as
// the quad's, on hadd'ed lanes)
void one_pre(const Q6x4* P, int64_t nb, const ActRow& x, float* out) {
  __m256 acc = _mm256_setzero_ps(), accm = acc;
  for (int64_t i = 0; i < nb; ++i) {
    __m256i is = _mm256_setzero_si256();
    PanelTail tail;
    panel_pre(P[i], [&](int j, const __m256i* w, __m256i sc0, __m256i sc1) {
      is = tile_chunk<true>(w, sc0, sc1, x.q + 256 * i + 32 * j, is);
    }, tail);
    const int16_t* bsum = x.bsum + 16 * i;
    __m256i ms = _mm256_madd_epi16(tail.m[0], bcast8(bsum));
    for (int k = 1; k < 4; ++k) ms = _mm256_add_epi32(ms, _mm256_madd_epi16(tail.m[k], bcast8(bsum + 4 * k)));
    const __m256 xd = _mm256_set1_ps(x.d[i]);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(tail.d, xd), _mm256_cvtepi32_ps(_mm256_hadd_epi32(is, is)), acc);
    accm = _mm256_fmadd_ps(_mm256_mul_ps(tail.dm, xd), _mm256_cvtepi32_ps(_mm256_hadd_epi32(ms, ms)), accm);
  }
  _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}
}}  // namespace
int main(int argc, char** argv) {
  const int64_t rows = 64, cols = argc > 1 ? atoi(argv[1]) : 1024, nb = cols / 256;
  std::mt19937 rng(1);
  std::vector<uint8_t> wb(rows * nb * sizeof(block_q6_K));
  for (auto& b : wb) b = rng();
  for (int64_t r = 0; r < rows; ++r) for (int64_t i = 0; i < nb; ++i) { uint16_t h = 0x2000 + (rng() & 0x3ff); std::memcpy(&wb[(r * nb + i) * sizeof(block_q6_K) + offsetof(block_q6_K, d)], &h, 2); }
  Weight W; W.type = DType::Q6_K; W.data = wb.data(); W.cols = cols; W.rows = rows; W.row_bytes = nb * sizeof(block_q6_K);
  std::vector<int8_t> q(4 * cols); std::vector<float> d(4 * nb); std::vector<int16_t> bs(4 * cols / 16);
  for (auto& v : q) v = (int8_t)(rng() % 255 - 127);
  for (auto& v : d) v = 0.01f;
  for (int t = 0; t < 4; ++t) for (int g = 0; g < cols / 16; ++g) { int s = 0; for (int k = 0; k < 16; ++k) s += q[t * cols + 16 * g + k]; bs[t * cols / 16 + g] = (int16_t)s; }
  ActRow x[4]; for (int t = 0; t < 4; ++t) x[t] = {q.data() + t * cols, d.data() + t * nb, bs.data() + t * cols / 16};
  PanelInputs in; in.prepare(x, 4, nb, [](int l) { return 2 * (l / 8) + ((l >> 1) & 1); });
  std::vector<Q6x4> pre(rows / 4 * nb);
  for (int64_t p = 0; p < rows / 4; ++p) for (int64_t i = 0; i < nb; ++i) { const uint8_t* blk[4]; for (int r = 0; r < 4; ++r) blk[r] = W.row(4 * p + r) + i * sizeof(block_q6_K); repack(blk, pre[p * nb + i]); }
  alignas(32) float oa[16], ob[16];
  double best_a = 1e9, best_b = 1e9; float cs_a = 0, cs_b = 0; bool same = true;
  for (int rep = 0; rep < 30; ++rep) {
    for (int v = 0; v < 2; ++v) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 2000; ++it)
        for (int64_t p = 0; p < rows / 4; ++p) {
          int64_t rr[4] = {4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3};
          if (v == 0) { Trickle nx; panel_direct<DType::Q6_K>(W, rr, nb, in.xs.data(), in.quad_scales(0, nb), oa, nx); cs_a += oa[it % 16]; }
          else { direct_pre(pre.data() + p * nb, nb, in.xs.data(), in.quad_scales(0, nb), ob); cs_b += ob[it % 16];
                 if (it == 0) { Trickle nx; panel_direct<DType::Q6_K>(W, rr, nb, in.xs.data(), in.quad_scales(0, nb), oa, nx); same &= !std::memcmp(oa, ob, sizeof oa); } }
        }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double ns = s * 1e9 / (2000.0 * rows / 4 * nb);
      (v ? best_b : best_a) = std::min(v ? best_b : best_a, ns);
    }
  }
  // 1 token: fused<Q6_K, 1> (8 rows a call) against the pre-transposed quad's unpack with one token
  {
    FusedSums S; S.is.resize(nb * 64); S.ms.resize(nb * 64); S.d.resize(nb * 8); S.dm.resize(nb * 8);
    double bf = 1e9, bp = 1e9; float o8[8]; float cs = 0;
    for (int rep = 0; rep < 30; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 2000; ++it)
        for (int64_t p = 0; p < rows / 8; ++p) {
          int64_t rr[8]; for (int r = 0; r < 8; ++r) rr[r] = 8 * p + r;
          Trickle nx; fused<DType::Q6_K, 1>(W, rr, x, S.is.data(), S.ms.data(), S.d.data(), S.dm.data(), o8, nx); cs += o8[it % 8];
        }
      bf = std::min(bf, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9 / (2000.0 * rows / 4 * nb));
      t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 2000; ++it)
        for (int64_t p = 0; p < rows / 4; ++p) { one_pre(pre.data() + p * nb, nb, x[0], o8); cs += o8[it % 8]; }
      bp = std::min(bp, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9 / (2000.0 * rows / 4 * nb));
    }
    std::printf("1 token, ns per 4-row super-block: fused (GGUF layout) %.2f, pre-transposed quad unpack %.2f (%g)\n", bf, bp, cs);
  }
  std::printf("cols %lld: ns per 4-row super-block, 4 tokens: GGUF layout %.2f, pre-transposed %.2f (x%.2f); same bits %d (%g %g)\n", (long long)cols, best_a, best_b, best_a / best_b, same, cs_a, cs_b);
}
