// backend_ops.cpp — every Backend op on the CUDA backend against the CPU backend.
//
// Fresh random (non-zero) inputs per case; every output buffer on the CUDA
// side is poisoned with NaN bytes before the op, so an element the op fails
// to write shows up as NaN.  Batch sizes 1, 2, 7, 16, 23, 64, 512; every
// weight format for matmul and embed, every KV type for the attention ops,
// chain (commit) and tree (verify) forms of attention and delta-net; two
// model shapes (the tiny test model's heads, and Qwen3.5-27B's head sizes).
//
// Built by CMake with -DDFLASH27B_BUILD_TESTS=ON, against the GPU (nvcc) or
// the CPU emulator (-DDFLASH27B_CUDA_EMU=ON); tests/test_cuda_emulated.py
// builds and runs it.  Prints one line per case, then "ALL OK" (exit 0) or
// "FAIL" (exit 1).  Usage: dfl_backend_ops [--only FAMILY,...] [--shard I/N] [max_batch]
#include <algorithm>
#include <numeric>
#include <cctype>
#include <chrono>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dflash27b_dev.h"  // the public ABI and the tool entry points
#include "backend/backend.h"
#include "runtime/context.h"
#include "quant/quant.h"
#include "random_blocks.h"

namespace dfl {
void set_last_error(const char*) {}  // api.cpp's, for the CUDA objects' C entry points
namespace cuda {
int mma_selftest(int M, int N, int K, uint32_t seed);       // csrc/backend/cuda/mma.cuh: the int8 tensor-core instruction
int mma_tf32_selftest(int M, int N, int K, uint32_t seed);  // and the tf32 one
void set_attention_rows(int toks, int heads);  // csrc/backend/cuda/backend.cu: pin the attention CTA grouping (0 = auto)
void set_attention_kernel(int kind);           // and the kernel (1 tensor cores where the cache allows, -1 f32, 0 auto)
}
}

using namespace dfl;

namespace {

// The formats the CUDA backend's matmul takes through the batch-invariant kernels (csrc/backend/cuda/matmul_exact.cuh):
// every n gives a token the same bits.  The quantised ones are also the CPU's bits (cuda_cpu_bits).
bool cuda_exact_matmul(DType t) {
  return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::Q8_0 || t == DType::Q4_0 ||
         t == DType::F16 || t == DType::BF16;
}
bool cuda_cpu_bits(DType t) {
  return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::Q8_0 || t == DType::Q4_0;
}

std::mt19937 rng(1234);
int failures = 0;

// Op families (--only a,b runs those; --list names them); --time prints each family's wall time, both backends
// and the checks included (on a GPU the CPU side dominates: a smoke timing, not a benchmark).
const char* const kFamilies[] = {"mma", "graph", "embed", "rmsnorm", "matmul", "row_topk", "elementwise",
                                 "attention", "kv_commit", "gdn", "grouped_conv"};
std::vector<std::string> only;  // empty: every family
// --shard I/N: this process runs every N-th unit of work from the I-th, so N processes share one run (the
// emulator runs a launch on one core).  A unit is one family's pass at one batch size and model shape, or
// one attention case (a KV type at a model shape: attention is most of an emulated run).
int shard_i = 0, shard_n = 1;
long shard_unit = 0;
bool shard_mine() { return shard_unit++ % shard_n == shard_i; }
std::vector<std::pair<std::string, double>> family_ms;
struct Family {  // `if (Family f("matmul"); f.on) ...`: runs the statement when selected, timing it
  std::string name;
  bool on;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Family(const char* n)
      : name(n),
        on((only.empty() || std::find(only.begin(), only.end(), name) != only.end()) &&
           (name == "attention" || shard_mine())) {}  // attention shards by case
  ~Family() {
    if (!on) return;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (auto& e : family_ms)
      if (e.first == name) {
        e.second += ms;
        return;
      }
    family_ms.push_back({name, ms});
  }
};

std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = N(rng) * scale;
    if (x == 0.f) x = 1e-3f;
  }
  return v;
}

// Random weight bytes of format t, with room for the kernels' 16-byte reads past a row's end.
std::vector<uint8_t> random_weight_bytes(DType t, int64_t rows, int64_t cols) {
  std::vector<uint8_t> b = random_block_bytes(t, rows, cols, rng, 1.f);
  b.resize(b.size() + 64);
  return b;
}

const DType kFormats[] = {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q5_K,
                          DType::Q6_K};
const DType kKvTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0};
const char* tname(DType t) { return type_traits((uint32_t)t)->name; }

// A Model whose weights are random: layer i's ffn_gate (rows x n_embd) and
// ffn_up (an 'embedding table' of 50 rows) are in format kFormats[i]; layer
// 0 also carries the norm / conv / delta-net vectors.
struct Fixture {
  Model m;
  std::vector<std::vector<uint8_t>> store;
  Weight weight(DType t, int64_t rows, int64_t cols) {
    store.push_back(random_weight_bytes(t, rows, cols));
    Weight w;
    w.type = t;
    w.data = store.back().data();
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = row_bytes(t, cols);
    return w;
  }
};

void make_model(Fixture& f, const Qwen35Config& c) {
  f.m.cfg = c;
  f.m.layers.resize(8);
  for (int i = 0; i < 8; ++i) {
    f.m.layers[i].ffn_gate = f.weight(kFormats[i], 67, c.n_embd);
    f.m.layers[i].ffn_up = f.weight(kFormats[i], 50, c.n_embd);
  }
  LayerWeights& l = f.m.layers[0];
  l.attn_norm = randn(c.n_embd, 0.5f);
  for (auto& x : l.attn_norm) x += 1.f;
  l.q_norm = randn(c.head_dim, 0.3f);
  l.k_norm = randn(c.head_dim, 0.3f);
  for (auto& x : l.q_norm) x += 1.f;
  for (auto& x : l.k_norm) x += 1.f;
  l.conv1d = randn((size_t)c.conv_channels() * c.conv_kernel, 0.5f);
  l.dt_bias = randn(c.ssm_nv, 0.5f);
  l.ssm_a = randn(c.ssm_nv, 0.5f);
  for (auto& x : l.ssm_a) x = -std::fabs(x) - 0.1f;  // decays below 1, as the real -exp(A_log)
  l.ssm_norm = randn(c.ssm_dv, 0.3f);
  for (auto& x : l.ssm_norm) x += 1.f;
}

// Memory on one backend, filled from / read back to the host.
struct Buf {
  Backend* be;
  void* p;
  size_t bytes;
  Buf(Backend& b, size_t n) : be(&b), p(b.alloc(n)), bytes(n) {}
  ~Buf() { be->release(p); }
  Buf(const Buf&) = delete;
  float* f() const { return static_cast<float*>(p); }
  uint8_t* u8() const { return static_cast<uint8_t*>(p); }
  void put(const void* h, size_t n) { be->upload(p, h, n); }
  void put(const std::vector<float>& v) { put(v.data(), v.size() * 4); }
  void poison() {
    std::vector<uint8_t> nan(bytes, 0xff);
    put(nan.data(), bytes);
  }
  std::vector<float> get(size_t n) const {
    std::vector<float> v(n);
    be->download(v.data(), p, n * 4);
    return v;
  }
  std::vector<uint8_t> bytes_back(size_t n) const {
    std::vector<uint8_t> v(n);
    be->download(v.data(), p, n);
    return v;
  }
};

// max |got - ref| / max |ref|; NaN in got (an unwritten element) fails.
bool check(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, double tol) {
  double mref = 0, merr = 0;
  bool nan = false;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) && !std::isnan(ref[i])) nan = true;
    mref = std::max(mref, (double)std::fabs(ref[i]));
    merr = std::max(merr, (double)std::fabs((double)got[i] - ref[i]));
  }
  const double rel = mref > 0 ? merr / mref : merr;
  const bool ok = !nan && rel <= tol;
  std::printf("%-58s rel err %.1e (tol %.0e)%s: %s\n", what.c_str(), rel, tol, nan ? ", unwritten (NaN)" : "",
              ok ? "ok" : "FAIL");
  if (!ok) {  // where it fails: how many elements, the first few and the worst (a GPU log must explain itself)
    size_t n_bad = 0, worst = 0;
    double worst_err = -1;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = std::fabs((double)got[i] - ref[i]);
      const bool bad = (std::isnan(got[i]) && !std::isnan(ref[i])) || (mref > 0 ? e / mref : e) > tol;
      if (!bad) continue;
      if (n_bad < 4) std::printf("    [%zu] got %.9g ref %.9g\n", i, got[i], ref[i]);
      if (e > worst_err) worst_err = e, worst = i;
      ++n_bad;
    }
    std::printf("    %zu of %zu elements off; worst [%zu] got %.9g ref %.9g\n", n_bad, ref.size(), worst, got[worst],
                ref[worst]);
  }
  failures += !ok;
  return ok;
}

std::vector<float> dequant_rows(DType t, const std::vector<uint8_t>& b, size_t rows, int64_t cols) {
  std::vector<float> out(rows * cols);
  const size_t rb = row_bytes(t, cols);
  for (size_t r = 0; r < rows; ++r) dequantize_row(t, b.data() + r * rb, out.data() + r * cols, cols);
  return out;
}

// A chunk plan: commit = a chain after n_past committed slots; else a random tree after them.
ChunkPlan make_plan(int n, bool commit, int n_past, int vocab) {
  ChunkPlan P;
  P.n = n;
  P.commit = commit;
  P.kv_slot0 = n_past;
  std::vector<int32_t> parent(n);
  for (int i = 0; i < n; ++i)
    parent[i] = commit || i == 0 ? i - 1 : (int32_t)(rng() % (unsigned)(i + 1)) - 1;  // -1 .. i-1
  for (int t = 0; t < n; ++t) {
    P.tokens.push_back((int32_t)(rng() % (unsigned)vocab));
    int depth = 0;
    for (int a = parent[t]; a >= 0; a = parent[a]) ++depth;
    P.pos.push_back(n_past + (commit ? t : depth));
    P.extra_begin.push_back((int32_t)P.extra_slots.size());
    P.parent.push_back(parent[t]);
    if (commit) {
      P.n_prefix.push_back(n_past + t + 1);
      P.extra_count.push_back(0);
    } else {
      P.n_prefix.push_back(n_past);
      const size_t first = P.extra_slots.size();
      for (int a = t; a >= 0; a = parent[a]) P.extra_slots.push_back(n_past + a);
      std::reverse(P.extra_slots.begin() + first, P.extra_slots.end());
      P.extra_count.push_back((int32_t)(P.extra_slots.size() - first));
    }
    P.max_visible = std::max(P.max_visible, P.n_prefix.back() + P.extra_count.back());
  }
  return P;
}

void run_shape(const char* shape, const Qwen35Config& c, const std::vector<int>& sizes) {
  Fixture fx;
  make_model(fx, c);
  const Model& M = fx.m;
  ThreadPool pool(2);
  auto cpu = make_cpu_backend(M, pool);
  auto cud = make_cuda_backend(M, MemoryPlan{});
  const int H = c.n_embd;
  auto label = [&](const char* op, const std::string& what, int n) {
    return std::string(shape) + " " + op + " " + what + " n=" + std::to_string(n);
  };

  // graph mode (on unless DFLASH27B_CUDA_GRAPHS=0): a recorded segment is replayed only while its bytes
  // repeat — it reads the device's data as it is now, and a changed argument is issued anew
  if (Family f("graph"); f.on && !std::strcmp(shape, "tiny")) {
    const char* env = std::getenv("DFLASH27B_CUDA_GRAPHS");
    const bool on = !env || std::strcmp(env, "0");
    dfl_cuda_graphs g{};
    dfl_cuda_graph_stats(&g, 1);
    const size_t cnt = 1000;
    Buf xb(*cud, cnt * 4);
    for (int round = 0; round < 4; ++round) {
      const float s = round < 3 ? 2.f : 3.f;  // rounds 0..2 the same bytes, round 3 a new scalar
      auto x = randn(cnt);
      xb.put(x);
      cud->scale(xb.f(), s, cnt);
      for (float& v : x) v *= s;
      check(label("graph mode", "scale, round " + std::to_string(round), 1), xb.get(cnt), x, 0.0);
    }
    dfl_cuda_graph_stats(&g, 1);
    // round 0 issued directly, round 1 captured and launched, round 2 replayed, round 3 issued directly
    const bool ok = on ? g.direct_ops == 2 && g.replayed_ops == 2 && g.graph_launches == 2 && g.captures == 1
                       : g.direct_ops == 0 && g.replayed_ops == 0;
    std::printf("%-58s %s (direct %lld, replayed %lld, launches %lld, captures %lld)\n",
                label("graph mode", "replays only repeated bytes", 1).c_str(), ok ? "ok" : "FAIL",
                (long long)g.direct_ops, (long long)g.replayed_ops, (long long)g.graph_launches, (long long)g.captures);
    failures += !ok;
  }

  for (int n : sizes) {
    ChunkPlan P = make_plan(n, true, 3, 50);
    cpu->begin_chunk(P);
    cud->begin_chunk(P);

    // embed, every format
    if (Family f("embed"); f.on) for (int i = 0; i < 8; ++i) {
      Buf a(*cpu, (size_t)n * H * 4), b(*cud, (size_t)n * H * 4);
      b.poison();
      cpu->embed(M.layers[i].ffn_up, a.f());
      cud->embed(M.layers[i].ffn_up, b.f());
      check(label("embed", tname(kFormats[i]), n), b.get((size_t)n * H), a.get((size_t)n * H), 0.0);
    }
    // rmsnorm with and without weights, and in place
    if (Family f("rmsnorm"); f.on) {
      auto x = randn((size_t)n * H, 2.f);
      for (int with_w = 0; with_w < 2; ++with_w) {
        Buf xa(*cpu, x.size() * 4), xb(*cud, x.size() * 4), ya(*cpu, x.size() * 4), yb(*cud, x.size() * 4);
        xa.put(x), xb.put(x), yb.poison();
        const float* wa = with_w ? cpu->vec(M.layers[0].attn_norm) : nullptr;
        const float* wb = with_w ? cud->vec(M.layers[0].attn_norm) : nullptr;
        cpu->rmsnorm(xa.f(), wa, n, H, c.rms_eps, ya.f());
        cud->rmsnorm(xb.f(), wb, n, H, c.rms_eps, yb.f());
        check(label("rmsnorm", with_w ? "weighted" : "plain", n), yb.get(x.size()), ya.get(x.size()), 2e-6);
      }
      Buf xa(*cpu, x.size() * 4), xb(*cud, x.size() * 4);
      xa.put(x), xb.put(x);
      cpu->rmsnorm(xa.f(), cpu->vec(M.layers[0].attn_norm), n, H, c.rms_eps, xa.f());
      cud->rmsnorm(xb.f(), cud->vec(M.layers[0].attn_norm), n, H, c.rms_eps, xb.f());
      check(label("rmsnorm", "in place", n), xb.get(x.size()), xa.get(x.size()), 2e-6);
      // add_rmsnorm (a sublayer's residual and the next norm, fused on CUDA): x == add's bits, out == rmsnorm's
      // bits on the sums (CUDA's own two ops), and within rmsnorm's tolerance of the CPU
      for (int with_w = 0; with_w < 2; ++with_w) {
        auto res = randn(x.size(), 1.f);
        const float* wa = with_w ? cpu->vec(M.layers[0].post_norm) : nullptr;
        const float* wb = with_w ? cud->vec(M.layers[0].post_norm) : nullptr;
        Buf xa2(*cpu, x.size() * 4), xb2(*cud, x.size() * 4), xs(*cud, x.size() * 4), ra(*cpu, x.size() * 4),
            rb(*cud, x.size() * 4), oa(*cpu, x.size() * 4), ob(*cud, x.size() * 4), os(*cud, x.size() * 4);
        xa2.put(x), xb2.put(x), xs.put(x), ra.put(res), rb.put(res), ob.poison(), os.poison();
        cpu->add_rmsnorm(xa2.f(), ra.f(), wa, n, H, c.rms_eps, oa.f());
        cud->add_rmsnorm(xb2.f(), rb.f(), wb, n, H, c.rms_eps, ob.f());
        cud->add(xs.f(), rb.f(), x.size());
        cud->rmsnorm(xs.f(), wb, n, H, c.rms_eps, os.f());
        const std::string form = with_w ? "weighted" : "plain";
        check(label("add_rmsnorm", form + " x == add", n), xb2.get(x.size()), xs.get(x.size()), 0.0);
        check(label("add_rmsnorm", form + " == add, rmsnorm", n), ob.get(x.size()), os.get(x.size()), 0.0);
        check(label("add_rmsnorm", form + " x vs CPU", n), xb2.get(x.size()), xa2.get(x.size()), 0.0);
        check(label("add_rmsnorm", form + " vs CPU", n), ob.get(x.size()), oa.get(x.size()), 2e-6);
      }
    }
    // matmul, every format (the CPU quantises activations to int8 for quantised weights; K-quants, Q8_0
    // and Q4_0 on CUDA take the exact kernels, which do the same: bit for bit the CPU's result on every
    // CPU build; F16 / BF16 the tf32 tensor cores, within f32 rounding)
    if (Family f("matmul"); f.on) for (int i = 0; i < 8; ++i) {
      const Weight& W = M.layers[i].ffn_gate;
      auto x = randn((size_t)n * H);
      Buf xa(*cpu, x.size() * 4), xb(*cud, x.size() * 4), ya(*cpu, (size_t)n * W.rows * 4),
          yb(*cud, (size_t)n * W.rows * 4);
      xa.put(x), xb.put(x), yb.poison();
      cpu->matmul(W, xa.f(), n, ya.f());
      cud->matmul(W, xb.f(), n, yb.f());
      const double tol = cuda_cpu_bits(W.type) ? 0.0 : dtype_is_quantized(W.type) ? 2e-2 : 1e-5;
      check(label("matmul", tname(W.type), n), yb.get((size_t)n * W.rows), ya.get((size_t)n * W.rows), tol);
    }
    // a verify batch's matmul gives each token exactly its n = 1 (AR step) result
    if (Family f("matmul"); f.on) for (int i = 0; i < 8; ++i) {
      const Weight& W = M.layers[i].ffn_gate;
      auto x = randn((size_t)n * H);
      Buf xb(*cud, x.size() * 4), yb(*cud, (size_t)n * W.rows * 4), y1(*cud, (size_t)W.rows * 4);
      xb.put(x), yb.poison();
      ChunkPlan T = make_plan(n, false, 3, 50), one = make_plan(1, true, 3, 50), pre = make_plan(n, true, 3, 50);
      cud->begin_chunk(T);
      cud->matmul(W, xb.f(), n, yb.f());
      auto batch = yb.get((size_t)n * W.rows);
      std::vector<float> prefill;  // the exact kernels' formats: a prefill chunk too (they serve every n)
      const bool exact = cuda_exact_matmul(W.type);
      if (exact) {
        yb.poison();
        cud->begin_chunk(pre);
        cud->matmul(W, xb.f(), n, yb.f());
        prefill = yb.get((size_t)n * W.rows);
      }
      cud->begin_chunk(one);
      std::vector<float> alone((size_t)n * W.rows);
      for (int t = 0; t < n; ++t) {
        cud->matmul(W, xb.f() + (size_t)t * H, 1, y1.f());
        auto r = y1.get((size_t)W.rows);
        std::copy(r.begin(), r.end(), alone.begin() + (size_t)t * W.rows);
      }
      check(label("matmul", std::string(tname(W.type)) + " verify == AR steps", n), batch, alone, 0.0);
      if (exact) check(label("matmul", std::string(tname(W.type)) + " prefill == AR steps", n), prefill, alone, 0.0);
      cud->begin_chunk(P);
    }
    // consecutive matmuls of one input quantise it once (CudaBackend::act_q_of_); an op that changes the
    // input (here an add) makes the next matmul quantise it again
    if (Family f("matmul"); f.on) for (int i = 0; i < 8; ++i) {
      const Weight& W = M.layers[i].ffn_gate;
      if (!cuda_exact_matmul(W.type)) continue;
      auto x = randn((size_t)n * H), z = randn((size_t)n * H);
      const size_t ny = (size_t)n * W.rows;
      Buf xa(*cpu, x.size() * 4), za(*cpu, z.size() * 4), ya(*cpu, ny * 4), yc(*cpu, ny * 4);
      Buf xb(*cud, x.size() * 4), zb(*cud, z.size() * 4), y1(*cud, ny * 4), y2(*cud, ny * 4), y3(*cud, ny * 4),
          y4(*cud, ny * 4);  // every buffer first: an allocation or upload would forget the quantised input
      xa.put(x), za.put(z), xb.put(x), zb.put(z), y1.poison(), y2.poison(), y3.poison(), y4.poison();
      cpu->matmul(W, xa.f(), n, ya.f());
      const auto first_cpu = ya.get(ny);
      cpu->add(xa.f(), za.f(), x.size());
      cpu->matmul(W, xa.f(), n, yc.f());
      cud->matmul(W, xb.f(), n, y1.f());
      cud->matmul(W, xb.f(), n, y2.f());  // the quantised x of the first
      cud->add(xb.f(), zb.f(), x.size());
      cud->matmul(W, xb.f(), n, y3.f());  // x + z, quantised anew
      // a matmul (BF16: no quantised input of its own) writing over part of x makes it stale too
      const Weight& Wb = M.layers[2].ffn_gate;  // BF16, fewer rows than x has columns
      cpu->matmul(Wb, za.f(), n, xa.f());
      cpu->matmul(W, xa.f(), n, ya.f());
      cud->matmul(Wb, zb.f(), n, xb.f());
      cud->matmul(W, xb.f(), n, y4.f());
      const double tol = cuda_cpu_bits(W.type) ? 0.0 : dtype_is_quantized(W.type) ? 2e-2 : 1e-5;
      const std::string f = tname(W.type);
      const auto first = y1.get(ny);
      check(label("matmul", f + " input reused", n), y2.get(ny), first, 0.0);
      check(label("matmul", f + " input reused vs CPU", n), first, first_cpu, tol);
      check(label("matmul", f + " input changed vs CPU", n), y3.get(ny), yc.get(ny), tol);
      check(label("matmul", f + " input overwritten vs CPU", n), y4.get(ny), ya.get(ny),
            W.type == DType::BF16 || W.type == DType::F16 ? tol : 2e-2);
    }
    // row top-k (ids exact, ties to the lower id; log-probs within f32 rounding of the CPU's double lse).  The
    // second shape puts a row's top 22 in one stripe of the CUDA kernel's CTA (ids 17 + 1024 m), with ties and
    // -inf among them, so that thread refills its buffer of 4 several times
    if (Family f("row_topk"); f.on) for (int k : {1, 22, 65}) for (int cols : {3001, 30001}) {
      auto x = randn((size_t)n * cols, 3.f);
      for (int t = 0; t < n; ++t) x[(size_t)t * cols + 17] = x[(size_t)t * cols + 1500] = 50.f;  // a tie at the top
      if (cols > 3001)
        for (int t = 0; t < n; ++t)
          for (int m = 1; m < 26; ++m)
            x[(size_t)t * cols + 17 + 1024 * m] = m == 20 ? -INFINITY : 40.f - (float)(m / 3);
      Buf xa(*cpu, x.size() * 4), xb(*cud, x.size() * 4), ia(*cpu, (size_t)n * k * 4), ib(*cud, (size_t)n * k * 4),
          la(*cpu, (size_t)n * k * 4), lb(*cud, (size_t)n * k * 4);
      xa.put(x), xb.put(x), ib.poison(), lb.poison();
      cpu->row_topk(xa.f(), n, cols, k, reinterpret_cast<int32_t*>(ia.p), la.f());
      cud->row_topk(xb.f(), n, cols, k, reinterpret_cast<int32_t*>(ib.p), lb.f());
      auto ids_a = ia.bytes_back((size_t)n * k * 4), ids_b = ib.bytes_back((size_t)n * k * 4);
      // the definition: every index sorted by value descending, then id
      std::vector<uint8_t> ids_ref((size_t)n * k * 4);
      for (int t = 0; t < n; ++t) {
        std::vector<int32_t> idx(cols);
        std::iota(idx.begin(), idx.end(), 0);
        const float* row = x.data() + (size_t)t * cols;
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
        std::memcpy(ids_ref.data() + (size_t)t * k * 4, idx.data(), (size_t)k * 4);
      }
      // the CPU's log-probs: the definition's (the sum of exp in double, in index order), bit for bit
      std::vector<float> lp_ref((size_t)n * k);
      for (int t = 0; t < n; ++t) {
        const float* row = x.data() + (size_t)t * cols;
        float mx = -INFINITY;
        for (int i = 0; i < cols; ++i) mx = std::max(mx, row[i]);
        double sum = 0.0;
        for (int i = 0; i < cols; ++i) sum += std::exp((double)row[i] - mx);
        const float lse = mx + (float)std::log(sum);
        for (int j = 0; j < k; ++j) {
          int32_t id;
          std::memcpy(&id, ids_ref.data() + ((size_t)t * k + j) * 4, 4);
          lp_ref[(size_t)t * k + j] = row[id] - lse;
        }
      }
      check(label("row_topk", "k=" + std::to_string(k) + " cols=" + std::to_string(cols) + " CPU logp", n), la.get((size_t)n * k), lp_ref, 0.0);
      // the ids alone (no log-probs asked): the same ids on both
      ia.poison(), ib.poison();
      cpu->row_topk(xa.f(), n, cols, k, reinterpret_cast<int32_t*>(ia.p), nullptr);
      cud->row_topk(xb.f(), n, cols, k, reinterpret_cast<int32_t*>(ib.p), nullptr);
      const bool same = ids_a == ids_b && ids_a == ids_ref && ia.bytes_back((size_t)n * k * 4) == ids_a &&
                        ib.bytes_back((size_t)n * k * 4) == ids_a;
      int32_t first = 0;
      std::memcpy(&first, ids_b.data(), 4);
      std::printf("%-58s %s\n", label("row_topk", "k=" + std::to_string(k) + " cols=" + std::to_string(cols) + " ids", n).c_str(),
                  same && first == 17 ? "ok" : "FAIL");
      failures += !(same && first == 17);
      check(label("row_topk", "k=" + std::to_string(k) + " cols=" + std::to_string(cols) + " logp", n), lb.get((size_t)n * k), la.get((size_t)n * k), 1e-6);
    }
    // scale
    if (Family f("elementwise"); f.on) {
      auto x = randn((size_t)n * H);
      Buf xa(*cpu, x.size() * 4), xb(*cud, x.size() * 4);
      xa.put(x), xb.put(x);
      cpu->scale(xa.f(), 0.37f, x.size());
      cud->scale(xb.f(), 0.37f, x.size());
      check(label("scale", "", n), xb.get(x.size()), xa.get(x.size()), 0.0);
    }
    // add, swiglu
    if (Family f("elementwise"); f.on) {
      const size_t cnt = (size_t)n * c.n_ff;
      auto x = randn(cnt), y = randn(cnt);
      Buf xa(*cpu, cnt * 4), xb(*cud, cnt * 4), ya(*cpu, cnt * 4), yb(*cud, cnt * 4);
      xa.put(x), xb.put(x), ya.put(y), yb.put(y);
      cpu->add(xa.f(), ya.f(), cnt);
      cud->add(xb.f(), yb.f(), cnt);
      check(label("add", "", n), xb.get(cnt), xa.get(cnt), 0.0);
      cpu->swiglu(xa.f(), ya.f(), cnt);
      cud->swiglu(xb.f(), yb.f(), cnt);
      check(label("swiglu", "", n), xb.get(cnt), xa.get(cnt), 1e-6);
    }
    // DFlash2's grouped dynamic causal convolution, both sides, 2 and 3 taps: the same operations in the same
    // order on both backends (bit for bit), and the block's first row never reads a row before it
    if (Family f("grouped_conv"); f.on && n <= 64) {
      const int G = H / 16;
      for (int T : {2, 3}) {
        auto u = randn((size_t)n * H), base = randn((size_t)2 * T * H), delta = randn((size_t)n * 2 * T * G);
        Buf ua(*cpu, u.size() * 4), ub(*cud, u.size() * 4), da(*cpu, delta.size() * 4), db(*cud, delta.size() * 4);
        Buf ba(*cpu, base.size() * 4), bb(*cud, base.size() * 4), oa(*cpu, u.size() * 4), ob(*cud, u.size() * 4);
        ua.put(u), ub.put(u), da.put(delta), db.put(delta), ba.put(base), bb.put(base);
        ob.poison();
        for (int side = 0; side < 2; ++side) {
          cpu->grouped_conv(ua.f(), ba.f(), da.f(), side, n, H, T, G, oa.f());
          cud->grouped_conv(ub.f(), bb.f(), db.f(), side, n, H, T, G, ob.f());
          check(label("grouped_conv", "taps " + std::to_string(T) + " side " + std::to_string(side), n),
                ob.get(u.size()), oa.get(u.size()), 0.0);
        }
        std::vector<float> row0 = oa.get((size_t)H), want((size_t)H);
        for (int ch = 0; ch < H; ++ch)
          want[(size_t)ch] = (base[(size_t)(T + 0) * H + ch] + delta[(size_t)(T + 0) * G + ch / 16]) * u[(size_t)ch];
        check(label("grouped_conv", "row 0 is causal", n), row0, want, 0.0);
      }
    }
  }

  // attention ops per KV type, chain and tree, gated (target) and plain (drafter: f32 KV, full RoPE,
  // unscaled or YaRN-scaled)
  struct Case { DType kvt; bool gated; bool yarn; };
  std::vector<Case> cases;
  for (DType kvt : kKvTypes) cases.push_back({kvt, true, false});
  cases.push_back({DType::F32, false, false});
  cases.push_back({DType::F32, false, true});
  if (Family f("attention"); f.on) for (const Case& cs : cases) {
    if (!shard_mine()) continue;
    const DType kvt = cs.kvt;
    Backend* cpu_k = cpu.get();
    Backend* cud_k = cud.get();
    RopeSpec rope = c.rope();
    if (!cs.gated) rope.n_rot = c.head_dim;
    if (cs.yarn) rope.factor = 8.f, rope.ramp_lo = 3.f, rope.ramp_hi = 11.f, rope.attn_factor = 1.2079f;
    const AttnShape shape{c.n_head, c.n_head_kv, c.head_dim, rope, c.rms_eps, cs.gated, kvt};
    const int kvd = c.kv_dim(), qd2 = shape.q_stride() * c.n_head;
    const size_t kv_row = row_bytes(kvt, kvd);
    // short contexts, then long ones that take several attention splits (kSplit = 512 visible slots)
    std::vector<std::pair<int, int>> runs;
    for (int n : sizes) runs.push_back({n, 37});
    for (int n : {1, 7})
      if (n <= sizes.back()) runs.push_back({n, 1500});
    for (auto [n, n_past] : runs) {
      for (int commit = 1; commit >= 0; --commit) {
        const int n_ctx = n_past + n + 3;
        ChunkPlan P = make_plan(n, commit, n_past, 50);
        cpu_k->begin_chunk(P);
        cud_k->begin_chunk(P);
        // a cache already holding n_past random rows (identical bytes on both sides)
        std::vector<uint8_t> kc((size_t)n_ctx * kv_row), vc((size_t)n_ctx * kv_row);
        for (int s = 0; s < n_past; ++s) {
          auto kr = randn(kvd), vr = randn(kvd);
          quantize_row(kvt, kr.data(), kc.data() + (size_t)s * kv_row, kvd);
          quantize_row(kvt, vr.data(), vc.data() + (size_t)s * kv_row, kvd);
        }
        auto qg = randn((size_t)n * qd2), kk = randn((size_t)n * kvd), vv = randn((size_t)n * kvd);
        Buf qa(*cpu_k, qg.size() * 4), qb(*cud_k, qg.size() * 4), ka(*cpu_k, kk.size() * 4), kb(*cud_k, kk.size() * 4),
            va(*cpu_k, vv.size() * 4), vb(*cud_k, vv.size() * 4), kca(*cpu_k, kc.size()), kcb(*cud_k, kc.size()),
            vca(*cpu_k, vc.size()), vcb(*cud_k, vc.size());
        qa.put(qg), qb.put(qg), ka.put(kk), kb.put(kk), va.put(vv), vb.put(vv);
        kca.put(kc.data(), kc.size()), vca.put(vc.data(), vc.size());
        std::vector<uint8_t> poisoned = kc;  // the chunk's own rows start as NaN bytes on the CUDA side
        std::fill(poisoned.begin() + (size_t)n_past * kv_row, poisoned.end(), 0xff);
        kcb.put(poisoned.data(), poisoned.size());
        poisoned = vc;
        std::fill(poisoned.begin() + (size_t)n_past * kv_row, poisoned.end(), 0xff);
        vcb.put(poisoned.data(), poisoned.size());
        const AttnLayer La{shape, kca.u8(), vca.u8(), cpu_k->vec(M.layers[0].q_norm),
                           cpu_k->vec(M.layers[0].k_norm)};
        const AttnLayer Lb{shape, kcb.u8(), vcb.u8(), cud_k->vec(M.layers[0].q_norm),
                           cud_k->vec(M.layers[0].k_norm)};
        cpu_k->attn_store(qa.f(), ka.f(), va.f(), La);
        cud_k->attn_store(qb.f(), kb.f(), vb.f(), Lb);
        const std::string kvn = std::string(tname(kvt)) + (cs.gated ? "" : " plain") + (cs.yarn ? " yarn" : "");
        const std::string form = kvn + (commit ? " chain" : " tree");
        if (commit) {
          if (n_past > 512) goto attend;  // the store was covered with the short contexts
          check(label("attn_store", kvn + " q", n), qb.get(qg.size()), qa.get(qg.size()), 2e-6);
          check(label("attn_store", kvn + " k", n), kb.get(kk.size()), ka.get(kk.size()), 2e-6);
          const size_t rows = (size_t)n_past + n;
          // K rows are converted from values that differ in the last bits (norm, RoPE), so a
          // value on a rounding edge may land one step of the type apart: an f16/bf16 ulp, a
          // Q8_0 step (1/127 of the block max) or a Q4_0 step (1/8 of it).
          const double ktol = kvt == DType::Q4_0 ? 0.15 : kvt == DType::Q8_0 ? 1e-2 : kvt == DType::BF16 ? 1e-2 : 1e-3;
          check(label("attn_store", kvn + " K cache", n),
                dequant_rows(kvt, kcb.bytes_back(rows * kv_row), rows, kvd),
                dequant_rows(kvt, kca.bytes_back(rows * kv_row), rows, kvd), ktol);
          if (!check(label("attn_store", kvn + " V cache", n),
                     dequant_rows(kvt, vcb.bytes_back(rows * kv_row), rows, kvd),
                     dequant_rows(kvt, vca.bytes_back(rows * kv_row), rows, kvd), 0.0) &&
              kvt == DType::F16) {
            // the bytes of the first differing values, with the input they were converted from
            const auto gb = vcb.bytes_back(rows * kv_row), rb = vca.bytes_back(rows * kv_row);
            int shown = 0;
            for (size_t i = 0; i < rows * (size_t)kvd && shown < 6; ++i) {
              if (gb[2 * i] == rb[2 * i] && gb[2 * i + 1] == rb[2 * i + 1]) continue;
              const size_t r = i / kvd;
              std::printf("    row %zu col %zu input %.9g: gpu %02x%02x cpu %02x%02x\n", r, i % kvd,
                          r >= (size_t)n_past ? vv[(r - n_past) * kvd + i % kvd] : NAN, gb[2 * i + 1], gb[2 * i],
                          rb[2 * i + 1], rb[2 * i]);
              ++shown;
            }
          }
        }
      attend:
        // attention reads the same cache on both sides (the CPU's bytes), so only the op differs
        auto kcache = kca.bytes_back(kc.size()), vcache = vca.bytes_back(vc.size());
        kcb.put(kcache.data(), kcache.size());
        vcb.put(vcache.data(), vcache.size());
        auto qn = qa.get(qg.size());
        qb.put(qn);
        Buf oa(*cpu_k, (size_t)n * c.q_dim() * 4), ob(*cud_k, (size_t)n * c.q_dim() * 4);
        ob.poison();
        cpu_k->attention(qa.f(), La, oa.f());
        cud_k->attention(qb.f(), Lb, ob.f());
        check(label("attention", form + (n_past > 512 ? " long" : ""), n), ob.get((size_t)n * c.q_dim()),
              oa.get((size_t)n * c.q_dim()), 1e-5);
        // how the CUDA kernel groups (tokens x query heads of a KV head) into CTAs changes no bit: one
        // (token, head) a CTA, as an AR step at a short context runs, and larger groups
        const auto grouped = ob.get((size_t)n * c.q_dim());
        for (auto [toks, heads] : {std::pair{1, 1}, {2, 2}, {3, 99}, {64, 99}}) {
          cuda::set_attention_rows(toks, heads);
          ob.poison();
          cud_k->attention(qb.f(), Lb, ob.f());
          check(label("attention", form + (n_past > 512 ? " long" : "") + " rows " + std::to_string(toks) + "x" +
                                       std::to_string(heads) + " == auto",
                      n),
                ob.get((size_t)n * c.q_dim()), grouped, 0.0);
        }
        cuda::set_attention_rows(0, 0);
        // the f32 kernel (DFLASH27B_CUDA_ATTN=simt) where the tensor-core one took the cache: also within
        // the CPU's tolerance
        if (c.head_dim <= 256) {
          cuda::set_attention_kernel(-1);
          ob.poison();
          cud_k->attention(qb.f(), Lb, ob.f());
          check(label("attention", form + (n_past > 512 ? " long" : "") + " simt kernel", n),
                ob.get((size_t)n * c.q_dim()), oa.get((size_t)n * c.q_dim()), 1e-5);
          cuda::set_attention_kernel(0);
        }
      }
    }
  }

  // commit of a path's K/V rows (begin_commit + kv_commit): the same bytes on both sides, and the rows
  // where a sequential move puts them; the cache around them untouched
  if (Family f("kv_commit"); f.on) for (DType kvt : kKvTypes)
    for (int n : sizes) {
      const int base = 5;
      const size_t kv_row = row_bytes(kvt, c.kv_dim()), bytes = (size_t)(base + n + 2) * kv_row;
      const ChunkPlan T = make_plan(n, false, base, 50);
      std::vector<int32_t> path;
      for (int t = n - 1; t >= 0; t = T.parent[t]) path.insert(path.begin(), t);
      std::vector<uint8_t> kc(bytes), vc(bytes);
      for (auto& b : kc) b = (uint8_t)rng();
      for (auto& b : vc) b = (uint8_t)rng();
      std::vector<uint8_t> ke = kc, ve = vc;  // expected: moved one row at a time
      for (size_t k = 0; k < path.size(); ++k) {
        std::memmove(ke.data() + (base + k) * kv_row, ke.data() + (base + (size_t)path[k]) * kv_row, kv_row);
        std::memmove(ve.data() + (base + k) * kv_row, ve.data() + (base + (size_t)path[k]) * kv_row, kv_row);
      }
      for (Backend* be : {cpu.get(), cud.get()}) {
        Buf kb(*be, bytes), vb(*be, bytes);
        kb.put(kc.data(), bytes), vb.put(vc.data(), bytes);
        be->begin_commit(path.data(), (int)path.size(), base);
        be->kv_commit(kb.u8(), vb.u8(), kv_row);
        auto as_f = [](const std::vector<uint8_t>& b) { return std::vector<float>(b.begin(), b.end()); };
        const std::string what = std::string(be == cpu.get() ? "cpu " : "cuda ") + tname(kvt) + " path of " +
                                 std::to_string(path.size()) + " (bytes)";
        check(label("kv_commit", what + " K", n), as_f(kb.bytes_back(bytes)), as_f(ke), 0.0);
        check(label("kv_commit", what + " V", n), as_f(vb.bytes_back(bytes)), as_f(ve), 0.0);
      }
    }

  // the delta-net walks a tree in preorder (children in batch order), so only a node after a leaf reloads a
  // state: this tree in batch order would reload for nodes 2, 4, 5 and 6 and keep nodes 0, 1, 2 and 3; walked
  // 0 1 3 6 5 2 4 it reloads for 5 and 2 and keeps 1 and 0 (and the last node, 6, as always)
  if (Family f("gdn"); f.on) {
    const int32_t par[7] = {-1, 0, 0, 1, 2, 1, 3};
    const std::vector<int32_t> walk = gdn_walk_order(par, 7);
    const std::vector<uint8_t> keep = node_rec_kept(par, walk);
    check("gdn walk order of a 7-node tree", std::vector<float>(walk.begin(), walk.end()), {0, 1, 3, 6, 5, 2, 4}, 0.0);
    check("gdn kept states of a 7-node tree", std::vector<float>(keep.begin(), keep.end()), {1, 1, 0, 0, 0, 0, 1}, 0.0);
  }
  // gated delta-net, chain (commit) and tree (verify, per-node states), for each recurrent state type
  if (Family f("gdn"); f.on) for (DType st : {DType::F32, DType::BF16, DType::F16})
  for (int n : sizes) {
    if (st != DType::F32 && n > 64) continue;
    for (int commit = 1; commit >= 0; --commit) {
      ChunkPlan P = make_plan(n, commit, 11, 50);
      cpu->begin_chunk(P);
      cud->begin_chunk(P);
      const int Cc = c.conv_channels(), Cv = c.ssm_inner(), nv = c.ssm_nv;
      const size_t cs = (size_t)(c.conv_kernel - 1) * Cc, rs = (size_t)nv * c.ssm_dk * c.ssm_dv;
      const size_t es = row_bytes(st, 1);
      const GdnNodeLayout U(c);
      // a reduced state is compared after one rounding of either side: one ulp of its type
      const double stol = st == DType::F32 ? 1e-5 : st == DType::BF16 ? 1e-2 : 2e-3;
      const std::string sname = st == DType::F32 ? "" : std::string(" ") + tname(st);
      auto mm = randn((size_t)n * Cc), z = randn((size_t)n * Cv), bt = randn((size_t)n * nv), al = randn((size_t)n * nv);
      auto conv = randn(cs), rec0 = randn(rs, 0.2f);
      std::vector<uint8_t> rec_bytes(rs * es);
      quantize_row(st, rec0.data(), rec_bytes.data(), (int64_t)rs);
      std::vector<float> rec(rs);
      dequantize_row(st, rec_bytes.data(), rec.data(), (int64_t)rs);
      auto sget = [&](const Buf& b, size_t count, size_t off = 0) {  // states back as f32
        auto raw = b.bytes_back((off + count) * es);
        std::vector<float> v(count);
        dequantize_row(st, raw.data() + off * es, v.data(), (int64_t)count);
        return v;
      };
      Buf ma(*cpu, mm.size() * 4), mb(*cud, mm.size() * 4), za(*cpu, z.size() * 4), zb(*cud, z.size() * 4),
          ba(*cpu, bt.size() * 4), bb(*cud, bt.size() * 4), aa(*cpu, al.size() * 4), ab(*cud, al.size() * 4),
          ca(*cpu, cs * 4), cb(*cud, cs * 4), ra(*cpu, rs * es), rb(*cud, rs * es), nca(*cpu, n * cs * 4),
          ncb(*cud, n * cs * 4), nra(*cpu, n * rs * es), nrb(*cud, n * rs * es), ya(*cpu, z.size() * 4),
          yb(*cud, z.size() * 4), nua(*cpu, n * U.stride * 4), nub(*cud, n * U.stride * 4);
      ma.put(mm), mb.put(mm), za.put(z), zb.put(z), ba.put(bt), bb.put(bt), aa.put(al), ab.put(al);
      ca.put(conv), cb.put(conv), ra.put(rec_bytes.data(), rec_bytes.size()), rb.put(rec_bytes.data(), rec_bytes.size());
      yb.poison(), ncb.poison(), nrb.poison(), nub.poison();
      const LayerWeights& w = M.layers[0];
      const GdnLayer La{cpu->vec(w.conv1d), cpu->vec(w.dt_bias), cpu->vec(w.ssm_a), cpu->vec(w.ssm_norm), ca.f(), ra.p,
                        commit ? nullptr : nca.f(), commit ? nullptr : nra.p, commit ? nullptr : nua.f(), st};
      const GdnLayer Lb{cud->vec(w.conv1d), cud->vec(w.dt_bias), cud->vec(w.ssm_a), cud->vec(w.ssm_norm), cb.f(), rb.p,
                        commit ? nullptr : ncb.f(), commit ? nullptr : nrb.p, commit ? nullptr : nub.f(), st};
      cpu->gdn(ma.f(), za.f(), ba.f(), aa.f(), La, ya.f());
      cud->gdn(mb.f(), zb.f(), bb.f(), ab.f(), Lb, yb.f());
      const std::string form = (commit ? "chain" : "tree") + sname;
      check(label("gdn", form + " y", n), yb.get(z.size()), ya.get(z.size()), st == DType::F32 ? 1e-5 : stol);
      if (commit) {
        check(label("gdn", form + " conv state", n), cb.get(cs), ca.get(cs), 0.0);
        check(label("gdn", form + " recurrent state", n), sget(rb, rs), sget(ra, rs), stol);
        continue;
      }
      // every node's conv window and state on the CPU, by replaying its path's updates (gdn_commit on a copy
      // of the committed state): the kept states (node_rec_kept) bit-identical to those the CPU wrote, the
      // reference for CUDA's kept states and for all of its node windows (the CPU reads windows in place
      // and never writes node_conv)
      std::vector<float> replayed_win;
      {
        const auto kept = node_rec_kept(P.parent.data(), gdn_walk_order(P.parent.data(), n));
        const auto sa = sget(nra, n * rs);
        const auto sb = sget(nrb, n * rs);
        std::vector<float> kept_direct, kept_replayed, kept_cuda, last_replayed;
        Buf cw(*cpu, cs * 4), rw(*cpu, rs * es);
        for (int t = 0; t < n; ++t) {
          std::vector<int32_t> path;
          for (int a = t; a >= 0; a = P.parent[a]) path.insert(path.begin(), a);
          cw.put(conv), rw.put(rec_bytes.data(), rec_bytes.size());
          cpu->begin_commit(path.data(), (int)path.size(), 0);
          cpu->gdn_commit(cw.f(), rw.p, st, nua.f());
          const auto r = sget(rw, rs);
          const auto wv = cw.get(cs);
          replayed_win.insert(replayed_win.end(), wv.begin(), wv.end());
          if (kept[t]) {
            kept_direct.insert(kept_direct.end(), sa.begin() + (size_t)t * rs, sa.begin() + (size_t)(t + 1) * rs);
            kept_replayed.insert(kept_replayed.end(), r.begin(), r.end());
          }
          if (t == n - 1) {  // CUDA keeps the others in shared memory while they fit; the last in node_rec
            kept_cuda.insert(kept_cuda.end(), sb.begin() + (size_t)t * rs, sb.begin() + (size_t)(t + 1) * rs);
            last_replayed.insert(last_replayed.end(), r.begin(), r.end());
          }
        }
        check(label("gdn", form + " cpu kept node states == replay (bitwise)", n), kept_direct, kept_replayed, 0.0);
        // the CPU writes only the kept states (a chain: its last node's); the children of CUDA's kept ones read
        // them back from its shared memory or node_rec, so its node outputs above check them
        check(label("gdn", form + " last node recurrent state", n), kept_cuda, last_replayed, stol);
        check(label("gdn", form + " node conv states", n), ncb.get(n * cs), replayed_win, 0.0);
      }
      check(label("gdn", form + " committed state untouched", n), sget(rb, rs), rec, 0.0);
      // each node's update: conv inputs exactly, keys / deltas / decays as the states
      const auto ua = nua.get(n * U.stride), ub = nub.get(n * U.stride);
      auto part = [&](const std::vector<float>& u, size_t off, size_t len) {
        std::vector<float> out;
        for (int t = 0; t < n; ++t) out.insert(out.end(), u.begin() + t * U.stride + off, u.begin() + t * U.stride + off + len);
        return out;
      };
      check(label("gdn", form + " node conv inputs", n), part(ub, U.xin, U.k - U.xin), part(ua, U.xin, U.k - U.xin), 0.0);
      check(label("gdn", form + " node keys", n), part(ub, U.k, U.delta - U.k), part(ua, U.k, U.delta - U.k), 1e-6);
      check(label("gdn", form + " node deltas", n), part(ub, U.delta, U.decay - U.delta),
            part(ua, U.delta, U.decay - U.delta), st == DType::F32 ? 1e-5 : stol);
      check(label("gdn", form + " node decays", n), part(ub, U.decay, U.stride - U.decay),
            part(ua, U.decay, U.stride - U.decay), 1e-6);
      // commit of a root-to-leaf path by replaying its updates == that node's state from the verify (each
      // backend against itself, bitwise), and CUDA == CPU within the states' tolerance
      std::vector<int32_t> path;
      for (int t = n - 1; t >= 0; t = P.parent[t]) path.insert(path.begin(), t);
      for (Backend* be : {cpu.get(), cud.get()}) {
        const bool on_cpu = be == cpu.get();
        Buf& cw = on_cpu ? ca : cb;
        Buf& r = on_cpu ? ra : rb;
        Buf& nu = on_cpu ? nua : nub;
        Buf& nr = on_cpu ? nra : nrb;
        be->begin_commit(path.data(), (int)path.size(), 0);
        be->gdn_commit(cw.f(), r.p, st, nu.f());
        const std::string who = on_cpu ? "cpu " : "cuda ";
        const auto node_win = ncb.get(n * cs);  // CUDA's (checked against the CPU's replays above)
        check(label("gdn", who + form + " commit conv == cuda node window (bitwise)", n), cw.get(cs),
              std::vector<float>(node_win.begin() + (size_t)path.back() * cs,
                                 node_win.begin() + (size_t)(path.back() + 1) * cs), 0.0);
        check(label("gdn", who + form + " commit == node state (bitwise)", n), sget(r, rs),
              sget(nr, rs, (size_t)path.back() * rs), 0.0);
      }
      check(label("gdn", form + " commit cuda vs cpu", n), sget(rb, rs), sget(ra, rs), stol);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int max_batch = 512;
  bool timing = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--time") {
      timing = true;
    } else if (a == "--list") {
      for (const char* f : kFamilies) std::printf("%s\n", f);
      return 0;
    } else if (a == "--only" && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t p = 0, q; p <= list.size(); p = q + 1) {
        q = list.find(',', p);
        if (q == std::string::npos) q = list.size();
        const std::string fam = list.substr(p, q - p);
        if (std::find_if(std::begin(kFamilies), std::end(kFamilies), [&](const char* k) { return fam == k; }) ==
            std::end(kFamilies)) {
          std::fprintf(stderr, "unknown op family '%s' (--list names them)\n", fam.c_str());
          return 2;
        }
        only.push_back(fam);
      }
    } else if (a == "--shard" && i + 1 < argc) {
      const std::string v = argv[++i];
      const size_t slash = v.find('/');
      shard_i = std::atoi(v.c_str());
      shard_n = slash == std::string::npos ? 0 : std::atoi(v.c_str() + slash + 1);
      if (slash == std::string::npos || shard_n < 1 || shard_i < 0 || shard_i >= shard_n) {
        std::fprintf(stderr, "--shard %s: expected I/N with 0 <= I < N\n", v.c_str());
        return 2;
      }
    } else if (!a.empty() && std::isdigit((unsigned char)a[0])) {
      max_batch = std::atoi(a.c_str());
    } else {
      std::fprintf(stderr, "usage: dfl_backend_ops [--only FAMILY,...] [--shard I/N] [--list] [--time] [max_batch]\n");
      return 2;
    }
  }
  std::vector<int> sizes;
  for (int n : {1, 2, 7, 16, 23, 64, 512})
    if (n <= max_batch) sizes.push_back(n);
  try {
    // the MMA instructions the exact kernels build on, and their fragment maps, against the definition
    if (Family f("mma"); f.on) for (auto [M, N, K] : {std::array<int, 3>{16, 8, 32}, {48, 40, 128}, {64, 64, 512}}) {
      for (int tf32 = 0; tf32 < 2; ++tf32) {
        const uint32_t seed = (uint32_t)(M * N + K);
        const int bad = tf32 ? cuda::mma_tf32_selftest(M, N, K, seed) : cuda::mma_selftest(M, N, K, seed);
        std::printf("mma %s %dx%dx%d: %s\n", tf32 ? "m16n8k8 tf32" : "m16n8k32 s8", M, N, K, bad ? "MISMATCH" : "ok");
        if (bad) {
          std::printf("  %d of %d elements differ\n", bad, M * N);
          ++failures;
        }
      }
    }
    Qwen35Config tiny;
    tiny.n_embd = 256; tiny.n_ff = 512; tiny.n_head = 4; tiny.n_head_kv = 2; tiny.head_dim = 64; tiny.n_rot = 16;
    tiny.rope_base = 1e7f; tiny.rms_eps = 1e-6f; tiny.conv_kernel = 4; tiny.ssm_dk = 64; tiny.ssm_nk = 2;
    tiny.ssm_nv = 4; tiny.ssm_dv = 64; tiny.n_vocab = 50;
    run_shape("tiny", tiny, sizes);
    Qwen35Config q27 = tiny;  // Qwen3.5-27B's head sizes, fewer heads
    q27.n_embd = 512; q27.n_head = 4; q27.n_head_kv = 1; q27.head_dim = 256; q27.n_rot = 64; q27.ssm_dk = 128;
    q27.ssm_nk = 2; q27.ssm_nv = 4; q27.ssm_dv = 128;
    run_shape("27b-heads", q27, sizes);
  } catch (const std::exception& e) {
    std::printf("error: %s\nFAIL\n", e.what());
    return 1;
  }
  if (timing)
    for (auto& [name, ms] : family_ms) std::printf("time %-12s %10.1f ms\n", name.c_str(), ms);
  std::printf(failures ? "FAIL (%d cases)\n" : "ALL OK\n", failures);
  return failures ? 1 : 0;
}
