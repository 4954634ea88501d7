// emu_matmul.cpp — runs the CUDA matmul kernels on the CPU, so a machine
// without a GPU (CI) still checks the kernel source: every format's task
// decoders (bit-exact against csrc/quant's reference dequantizers, rows at
// every 2-byte misalignment), then the matvec and tiled kernels themselves
// (CUDA threads as fibers; see shim/cuda_runtime.h) against an f64
// reference, with batch invariance for n <= 8.
//
// tests/test_cuda_ops.py builds and runs it: g++ -std=c++20 -DDFL_EMU
// -I csrc/backend/cuda/emu/shim -I cuda -I csrc -I include, plus csrc/quant/quant.cpp.
// Prints one line per case and "ALL OK" (exit 0) or "FAIL" (exit 1).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_runtime.h"
#include "matmul_kernels.cuh"
#include "quant/quant.h"
#include "random_blocks.h"

using namespace dfl;
using namespace dfl::cuda;
using namespace dfl::cuda::kern;

namespace {

std::mt19937 rng(7);

template <class K>
void emu_launch(dim3 grid, int threads, size_t smem, K kernel) {
  emu::launch(grid, dim3((unsigned)threads), smem, kernel);
}

template <class F, int NT>
void matvec(const uint8_t* w, int64_t rows, int64_t cols, int64_t rb, const float* x, int n, float* y) {
  using C = MatvecCfg<F, NT>;
  if constexpr (C::gx) {
    dim3 g;
    g.x = (unsigned)matvec_gx_ctas(rows, C::RW);
    emu_launch(g, kWarps * 32, 0, [&] { matvec_gx_kernel<F, NT, C::RW, C::U, C::MINB>(w, rows, cols, rb, x, n, y); });
    return;
  }
  const int chunk = Layout<F>::chunk_cols(NT, cols);
  dim3 g;
  g.x = (unsigned)matvec_ctas(rows);
  emu_launch(g, kWarps * 32, Layout<F>::smem_bytes(NT, chunk), [&] { matvec_kernel<F, NT, kRowsPerWarp>(w, rows, cols, rb, x, n, y, chunk); });
}

// The same choice of kernel as matmul.cu's launch().
template <class F>
void emu_matmul(const uint8_t* w, int64_t rows, int64_t cols, const float* x, int n, float* y) {
  const int64_t rb = cols / F::BE * F::BB;
  if (n <= 8) {
    switch (matvec_nt(n)) {
      case 1: return matvec<F, 1>(w, rows, cols, rb, x, n, y);
      case 2: return matvec<F, 2>(w, rows, cols, rb, x, n, y);
      case 4: return matvec<F, 4>(w, rows, cols, rb, x, n, y);
      default: return matvec<F, 8>(w, rows, cols, rb, x, n, y);
    }
  }
  dim3 g;
  g.x = (unsigned)((rows + kTileM - 1) / kTileM);
  g.y = (unsigned)((n + kTileN - 1) / kTileN);
  emu_launch(g, 256, 0, [&] { tiled_kernel<F>(w, rows, cols, rb, x, n, y); });
}

// Random blocks (random_blocks.h) copied `shift` bytes past a 16-byte aligned address.
struct Weights {
  std::vector<uint4> store;
  const uint8_t* p;
};
Weights random_weights(DType t, int64_t rows, int64_t cols, int shift) {
  const std::vector<uint8_t> b = random_block_bytes(t, rows, cols, rng, 3.f);
  Weights w;
  w.store.resize(b.size() / 16 + 3);
  uint8_t* dst = reinterpret_cast<uint8_t*>(w.store.data()) + shift;
  std::memcpy(dst, b.data(), b.size());
  w.p = dst;
  return w;
}

template <class F>
int check_decoders(int64_t rows, int64_t cols, int shift) {
  const TypeTraits* tt = type_traits((uint32_t)F::T);
  Weights W = random_weights(F::T, rows, cols, shift);
  const int64_t rb = cols / F::BE * F::BB;
  std::vector<float> ref(cols), fast(cols), slow(cols);
  int bad = 0;
  // The matvec kernel copies activations as float4: runs of 4 values are 4 consecutive elements.
  for (int j = 0; j < F::TPB; ++j)
    for (int i = 0; i < F::P; ++i) bad += F::elem(j, i) != F::elem(j, i & ~3) + (i & 3) || F::elem(j, i & ~3) % 4;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = W.p + r * rb;
    dequantize_row(F::T, row, ref.data(), cols);
    std::fill(fast.begin(), fast.end(), NAN);
    for (int64_t b = 0; b < cols / F::BE; ++b)
      for (int j = 0; j < F::TPB; ++j) {
        typename F::Raw raw;
        F::load(row + b * F::BB, j, raw);
        for (int g = 0; g < F::P / 4; ++g) {
          float v[4];
          F::deq4(raw, g, v);
          for (int m = 0; m < 4; ++m) fast[b * F::BE + F::elem(j, 4 * g + m)] = v[m];
        }
      }
    for (int64_t k = 0; k < cols; k += 8) deq8<F>(row, k, &slow[k]);
    bad += std::memcmp(ref.data(), fast.data(), cols * 4) != 0;
    bad += std::memcmp(ref.data(), slow.data(), cols * 4) != 0;
  }
  std::printf("decode %-5s cols %5lld shift %2d: %s\n", tt->name, (long long)cols, shift, bad ? "FAIL" : "bit-exact");
  return bad != 0;
}

template <class F>
int check_kernels(int64_t rows, int64_t cols, const std::vector<int>& ns) {
  const TypeTraits* tt = type_traits((uint32_t)F::T);
  Weights W = random_weights(F::T, rows, cols, 0);
  const int64_t rb = cols / F::BE * F::BB;
  std::vector<float> wf((size_t)(rows * cols));
  for (int64_t r = 0; r < rows; ++r) dequantize_row(F::T, W.p + r * rb, wf.data() + r * cols, cols);
  const int nmax = *std::max_element(ns.begin(), ns.end());
  std::uniform_real_distribution<float> U(-1, 1);
  std::vector<float> x((size_t)(nmax * cols));
  for (auto& v : x) v = U(rng);
  // Every run ends with the same token (x's last row): its result must not depend on n (n <= 8).
  std::vector<float> alone((size_t)rows);
  emu_matmul<F>(W.p, rows, cols, x.data() + (nmax - 1) * cols, 1, alone.data());
  int bad = 0;
  for (int n : ns) {
    const float* xs = x.data() + (nmax - n) * cols;
    std::vector<float> y((size_t)(n * rows), NAN);
    emu_matmul<F>(W.p, rows, cols, xs, n, y.data());
    double maxref = 0, maxerr = 0;
    for (int t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0;
        for (int64_t c = 0; c < cols; ++c) s += (double)wf[r * cols + c] * xs[t * cols + c];
        const double e = std::fabs(s - y[t * rows + r]);
        maxref = std::max(maxref, std::fabs(s));
        maxerr = std::isnan(e) ? INFINITY : std::max(maxerr, e);
      }
    const bool inv = n > 8 || std::memcmp(&y[(size_t)((n - 1) * rows)], alone.data(), rows * 4) == 0;
    const bool ok = maxerr <= 1e-5 * maxref && inv;
    std::printf("kernel %-5s %lld x %lld n %3d: max err / max|y| %.1e%s: %s\n", tt->name, (long long)rows,
                (long long)cols, n, maxerr / maxref, inv ? "" : ", not batch-invariant", ok ? "ok" : "FAIL");
    bad += !ok;
  }
  return bad;
}

template <class F>
int check_format(int64_t cols) {
  int bad = 0;
  // Formats whose blocks are not 16-byte multiples are read at any 2-byte alignment.
  for (int shift : {0, 2, 6, 14})
    if (shift == 0 || F::BB % 16) bad += check_decoders<F>(3, cols, shift);
  bad += check_kernels<F>(37, cols, {1, 2, 3, 8, 9, 23});
  return bad;
}

}  // namespace

int main() {
  int bad = 0;
  // 2-byte misaligned reads at every offset
  alignas(16) uint8_t b[64];
  for (int i = 0; i < 64; ++i) b[i] = (uint8_t)(i * 7 + 3);
  for (int s = 0; s < 32; s += 2) {
    const uint4 v = ld16_u(b + s);
    if (std::memcmp(&v, b + s, 16)) { std::printf("ld16_u wrong at offset %d\n", s); ++bad; }
  }
  // cols: several chunks at n = 1 (4096 columns per chunk) and a partial last chunk
  bad += check_format<FmtF32>(4384);
  bad += check_format<FmtF16>(4384);
  bad += check_format<FmtBF16>(4384);
  bad += check_format<FmtQ4_0>(4384);
  bad += check_format<FmtQ8_0>(4384);
  bad += check_format<FmtQ4_K>(4352);
  bad += check_format<FmtQ5_K>(4352);
  bad += check_format<FmtQ6_K>(4352);
  bad += check_kernels<FmtQ8_0>(3, 32, {1, 5, 9});  // tiny: one block per row, fewer rows than a warp's
  std::printf(bad ? "FAIL\n" : "ALL OK\n");
  return bad ? 1 : 0;
}
