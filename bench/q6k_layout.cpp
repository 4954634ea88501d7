// bench/q6k_layout.cpp: Q6_K on a CPU, the GGUF order against the panels pre-transposed at load (gemm_kquant.cpp,
// Q6Panels: the quad kernel's 8-byte pieces already interleaved, 840 bytes a 4-row super-block as the GGUF
// blocks), from cache, one thread: ns per 4-row super-block for 1 and 2 tokens and a quad of 4, and whether the
// bits agree.  Build and run (docs/research/cpu-q6k-quads.md):
//   g++ -std=c++17 -O2 -mavx2 -mfma -mf16c -ffp-contract=off -I csrc bench/q6k_layout.cpp csrc/quant/quant.cpp \
//       csrc/quant/dot_cpu.cpp -o /tmp/q6k_layout && /tmp/q6k_layout 1024
#include "quant/gemm_kquant.cpp"

#include <chrono>
#include <cstdio>
#include <random>

using namespace dfl;

int main(int argc, char** argv) {
  const int64_t rows = 64, cols = argc > 1 ? std::atoi(argv[1]) : 1024, nb = cols / QK_K;
  if (cols <= 0 || cols % QK_K) return std::fprintf(stderr, "cols: a multiple of 256\n"), 2;
  std::mt19937 rng(1);
  std::vector<uint8_t> wb((size_t)rows * nb * sizeof(block_q6_K));
  for (auto& b : wb) b = (uint8_t)rng();
  for (int64_t b = 0; b < rows * nb; ++b) {  // small f16 scales
    const uint16_t h = (uint16_t)(0x2000 + (rng() & 0x3ff));
    std::memcpy(&wb[(size_t)b * sizeof(block_q6_K) + offsetof(block_q6_K, d)], &h, 2);
  }
  Weight gguf;
  gguf.type = DType::Q6_K, gguf.data = wb.data(), gguf.cols = cols, gguf.rows = rows;
  gguf.row_bytes = (size_t)nb * sizeof(block_q6_K);
  Weight panels = with_cpu_layout(gguf);
  panels.cpu_layout->bytes.resize(q6_panels_bytes(panels));
  q6_panels_fill(panels, 0, rows / 4, panels.cpu_layout->bytes.data());
  // 4 tokens of int8 activations with their scales and 16-value sums
  std::vector<int8_t> q(4 * cols);
  std::vector<float> d(4 * nb, 0.01f);
  std::vector<int16_t> bsum(4 * cols / 16);
  for (auto& v : q) v = (int8_t)(rng() % 255 - 127);
  for (int t = 0; t < 4; ++t)
    for (int64_t g = 0; g < cols / 16; ++g) {
      int s = 0;
      for (int k = 0; k < 16; ++k) s += q[t * cols + 16 * g + k];
      bsum[t * cols / 16 + g] = (int16_t)s;
    }
  ActRow x[4];
  for (int t = 0; t < 4; ++t) x[t] = {q.data() + t * cols, d.data() + t * nb, bsum.data() + t * cols / 16};
  std::printf("Q6_K %lld x %lld from cache, 1 thread: ns per 4-row super-block\n", (long long)rows, (long long)cols);
  for (int n : {1, 2, 4}) {
    std::vector<float> ya(n * rows), yb(n * rows);
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 30; ++rep)
      for (int v = 0; v < 2; ++v) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int it = 0; it < 1000; ++it) {
          if (v == 1) gemm_q6_panels(panels, 0, rows, x, n, yb.data());
          else if (n < kPanelMinTokens) gemm_fused<DType::Q6_K>(gguf, 0, rows, x, n, ya.data());
          else gemm_panels<DType::Q6_K>(gguf, 0, rows, x, n, ya.data());
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best[v] = std::min(best[v], s * 1e9 / (1000.0 * rows / 4 * nb));
      }
    std::printf("  %d token%s: GGUF order %6.2f, pre-transposed %6.2f (%.2fx); the same bits: %s\n", n, n > 1 ? "s" : " ",
                best[0], best[1], best[0] / best[1], ya == yb ? "yes" : "NO");
  }
}
