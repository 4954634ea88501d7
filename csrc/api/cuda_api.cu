// api.cu — the CUDA backend's C entry points for tests and tools.
//
// Host-pointer wrappers around dfl::cuda::matmul (upload, run, download) and
// timing entry points (one matmul, copy bandwidth, the per-op profile).  Every failure, a CUDA runtime error included, is
// DFL_ERROR plus a message for dfl_last_error(), through api_guard; nothing
// aborts, and a machine without a driver or GPU just reports 0 devices.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "api/last_error.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/launch.cuh"
#include "dflash27b_dev.h"  // the public ABI and the tool entry points
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/matmul_exact.cuh"
#include "backend/cuda/graph.cuh"
#include "backend/cuda/profile.cuh"
#include "quant/quant.h"

namespace dfl {
namespace cuda {
namespace {

struct Event {
  cudaEvent_t e = nullptr;
  Event() { CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
};

const TypeTraits& check_matmul_args(uint32_t type, int64_t rows, int64_t cols, int32_t n) {
  const TypeTraits* t = type_traits(type);
  if (!t) fail("unsupported tensor type %u", type);
  if (rows <= 0) fail("rows must be positive (got %lld)", (long long)rows);
  if (cols <= 0 || cols % 32 || cols % t->block_elems)
    fail("cols must be a positive multiple of 32 and of the %s block size (got %lld)", t->name, (long long)cols);
  if (n <= 0) fail("n must be positive (got %d)", n);
  return *t;
}

// A matmul entry point's host arrays through the device: uploads w and x, runs
// run(dw, dx, dy) on the default stream, downloads y (the caller has checked the device).
template <class Run>
void matmul_on_host_arrays(const TypeTraits& t, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n,
                           float* y, Run run) {
  const size_t wbytes = (size_t)rows * (size_t)(cols / t.block_elems) * (size_t)t.block_bytes;
  DevBuf dw(wbytes), dx((size_t)n * cols * sizeof(float)), dy((size_t)n * rows * sizeof(float));
  CUDA_CHECK(cudaMemcpy(dw.p, w, wbytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dx.p, x, (size_t)n * cols * sizeof(float), cudaMemcpyHostToDevice));
  run(static_cast<const void*>(dw.p), dx.as<const float>(), dy.as<float>());
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(y, dy.p, (size_t)n * rows * sizeof(float), cudaMemcpyDeviceToHost));
}

// Random weights of any format, made on the device: random bytes, then
// finite f16 scales (|d| <= 0.05) or finite float values, so no NaN reaches
// the timed kernels.
__global__ void fill_random(uint8_t* w, int64_t nbytes, uint32_t seed) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed;
    h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; h *= 0x297A2D39u; h ^= h >> 15;
    w[i] = (uint8_t)h;
  }
}
// Overwrites 2-byte field `off` of each block with a finite f16 / bf16 / f32 value.
__global__ void fix_fields(uint8_t* w, int64_t nblocks, int block_bytes, int off, int kind) {
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += (int64_t)gridDim.x * blockDim.x) {
    uint8_t* p = w + b * block_bytes + off;
    const uint32_t r = (uint32_t)(b * 2654435761u) >> 8;
    const float v = ((float)(r & 0xffff) / 65535.f - 0.5f) * (kind == 0 ? 0.1f : 4.f);
    if (kind == 2) {  // f32
      std::memcpy(p, &v, 4);
    } else if (kind == 3) {  // bf16
      const uint32_t u = __float_as_uint(v) >> 16;
      p[0] = (uint8_t)u; p[1] = (uint8_t)(u >> 8);
    } else {  // f16
      const uint32_t u = __half_as_ushort(__float2half(v));
      p[0] = (uint8_t)u; p[1] = (uint8_t)(u >> 8);
    }
  }
}

void fill_weights(DType t, uint8_t* w, int64_t rows, int64_t cols, uint32_t seed) {
  const TypeTraits& tt = *type_traits((uint32_t)t);
  const int64_t nblocks = rows * (cols / tt.block_elems);
  const int64_t nbytes = nblocks * tt.block_bytes;
  launch(fill_random, dim3(1024), dim3(256), 0, nullptr, w, nbytes, seed);
  auto fix = [&](int off, int kind) {
    launch(fix_fields, dim3(1024), dim3(256), 0, nullptr, w, nblocks, tt.block_bytes, off, kind);
  };
  switch (t) {
    case DType::F32: fix(0, 2); break;
    case DType::F16: fix(0, 1); break;
    case DType::BF16: fix(0, 3); break;
    case DType::Q4_0: fix(kQ4_0_d, 0); break;
    case DType::Q8_0: fix(kQ8_0_d, 0); break;
    case DType::Q4_K: fix(0, 0); fix(2, 0); break;
    case DType::Q5_K: fix(0, 0); fix(2, 0); break;
    case DType::Q6_K: fix(kQ6_K_d, 0); break;
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace cuda
}  // namespace dfl

#pragma GCC visibility push(default)
extern "C" {

int dfl_cuda_device_count(void) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: no driver / no device is not an error here
    return 0;
  }
  return n;
}

int dfl_cuda_matmul(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n, float* y) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (!w || !x || !y) dfl::fail("w, x and y must not be NULL");
    const dfl::TypeTraits& t = check_matmul_args(type, rows, cols, n);
    require_device();
    matmul_on_host_arrays(t, w, rows, cols, x, n, y, [&](const void* dw, const float* dx, float* dy) {
      matmul((dfl::DType)type, dw, rows, cols, dx, n, dy, 0);
    });
  });
}

int dfl_cuda_matmul_exact(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n,
                          float* y) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (!w || !x || !y) dfl::fail("w, x and y must not be NULL");
    const dfl::TypeTraits& t = check_matmul_args(type, rows, cols, n);
    if (!matmul_exact_supported((dfl::DType)type))
      dfl::fail("the exact matmul takes Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, F16 or BF16, not %s", t.name);
    require_device();
    DevBuf scratch(matmul_exact_scratch_bytes(cols, n));
    matmul_on_host_arrays(t, w, rows, cols, x, n, y, [&](const void* dw, const float* dx, float* dy) {
      matmul_exact((dfl::DType)type, dw, rows, cols, dx, n, dy, scratch.p, 0);
    });
  });
}

double dfl_cuda_bench_matmul(uint32_t type, int64_t rows, int64_t cols, int32_t n, int32_t iters, int32_t exact) {
  using namespace dfl::cuda;
  double ms = -1.0;
  dfl::api_guard([&] {
    const dfl::TypeTraits& t = check_matmul_args(type, rows, cols, n);
    if (iters <= 0) dfl::fail("iters must be positive (got %d)", iters);
    if (exact && !matmul_exact_supported((dfl::DType)type))
      dfl::fail("the exact matmul takes Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, F16 or BF16, not %s", t.name);
    require_device();
    const size_t wbytes = (size_t)rows * (size_t)(cols / t.block_elems) * (size_t)t.block_bytes;
    // Enough copies of the weights to stream >= 256 MiB per round, so that
    // the timed calls read DRAM rather than a warm L2 (50 MB on an H100).
    int copies = (int)((256u << 20) / (wbytes ? wbytes : 1)) + 1;
    if (copies > 8) copies = 8;
    std::vector<std::unique_ptr<DevBuf>> ws;
    for (int c = 0; c < copies; ++c) {
      ws.push_back(std::make_unique<DevBuf>(wbytes));
      fill_weights((dfl::DType)type, ws.back()->as<uint8_t>(), rows, cols, 1234u + c);
    }
    DevBuf dx((size_t)n * cols * sizeof(float)), dy((size_t)n * rows * sizeof(float));
    DevBuf scratch(exact ? matmul_exact_scratch_bytes(cols, n) : 16);
    fill_weights(dfl::DType::F32, dx.as<uint8_t>(), n, cols, 99u);
    auto run = [&](int i) {  // the exact path's time includes quantising the activations, as in the forward
      if (exact)
        matmul_exact((dfl::DType)type, ws[i % copies]->p, rows, cols, dx.as<float>(), n, dy.as<float>(), scratch.p, 0);
      else
        matmul((dfl::DType)type, ws[i % copies]->p, rows, cols, dx.as<float>(), n, dy.as<float>(), 0);
    };
    for (int i = 0; i < 3; ++i) run(i);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    Event e0, e1;
    CUDA_CHECK(cudaEventRecord(e0.e, 0));
    for (int i = 0; i < iters; ++i) run(i);
    CUDA_CHECK(cudaEventRecord(e1.e, 0));
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventSynchronize(e1.e));
    float total = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&total, e0.e, e1.e));
    ms = (double)total / iters;
  });
  return ms;
}

double dfl_cuda_bench_copy(int64_t bytes, int32_t iters) {
  using namespace dfl::cuda;
  double gbs = -1.0;
  dfl::api_guard([&] {
    if (bytes < 1024 || iters <= 0) dfl::fail("bench_copy needs bytes >= 1024 and iters > 0 (got %lld, %d)",
                                              (long long)bytes, iters);
    require_device();
    DevBuf a((size_t)bytes), b((size_t)bytes);
    CUDA_CHECK(cudaMemsetAsync(a.p, 1, (size_t)bytes, 0));
    for (int i = 0; i < 2; ++i) CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, (size_t)bytes, cudaMemcpyDeviceToDevice, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    Event e0, e1;
    CUDA_CHECK(cudaEventRecord(e0.e, 0));
    for (int i = 0; i < iters; ++i)
      CUDA_CHECK(cudaMemcpyAsync(i & 1 ? a.p : b.p, i & 1 ? b.p : a.p, (size_t)bytes, cudaMemcpyDeviceToDevice, 0));
    CUDA_CHECK(cudaEventRecord(e1.e, 0));
    CUDA_CHECK(cudaEventSynchronize(e1.e));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0.e, e1.e));
    gbs = 2.0 * (double)bytes * iters / (ms > 0.f ? ms * 1e-3 : 1e-9) / 1e9;
  });
  return gbs;
}

int dfl_cuda_memory_stats(dfl_cuda_memory* out, int32_t reset_peak) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (!out) dfl::fail("out is NULL");
    require_device();
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    DeviceMemoryCounter& c = device_memory_counter();
    std::lock_guard<std::mutex> lock(c.mu);
    *out = dfl_cuda_memory{c.now, c.peak, free_b, total_b};
    if (reset_peak) c.peak = c.now;
  });
}

int dfl_cuda_profile(int32_t on) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    OpProfileTable& t = op_profile();
    std::lock_guard<std::mutex> lock(t.mu);
    if (on) t.rows.clear();
    t.on.store(on != 0);
  });
}

int dfl_cuda_graph_stats(dfl_cuda_graphs* out, int32_t reset) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (!out) dfl::fail("out is NULL");
    GraphCounters& c = graph_counters();
    *out = dfl_cuda_graphs{c.direct_ops.load(), c.replayed_ops.load(), c.graph_launches.load(), c.captures.load()};
    if (reset) c.direct_ops = c.replayed_ops = c.graph_launches = c.captures = 0;
  });
}

int dfl_cuda_graph_mode(int32_t mode) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (mode < -1 || mode > 1) dfl::fail("graph mode %d: use 1 (on), 0 (off) or -1 (as DFLASH27B_CUDA_GRAPHS)", mode);
    if (mode == 1 && !kGraphsPossible) dfl::fail("graph mode: this build cannot zero argument padding");
    graph_mode_override().store(mode);
  });
}

int dfl_cuda_attention_rows(int32_t toks, int32_t heads) {
  return dfl::api_guard([&] {
    if (toks < 0 || heads < 0 || (toks == 0) != (heads == 0))
      dfl::fail("attention rows %d x %d: use two positive counts (tokens, query heads per CTA), or 0, 0 for the "
                "automatic choice", toks, heads);
    dfl::cuda::set_attention_rows(toks, heads);
  });
}

int dfl_cuda_attention_kernel(int32_t kind) {
  return dfl::api_guard([&] {
    if (kind < -1 || kind > 1)
      dfl::fail("attention kernel %d: use 1 (tensor cores where the head allows), -1 (f32) or 0 (as "
                "DFLASH27B_CUDA_ATTN)", kind);
    dfl::cuda::set_attention_kernel(kind);
  });
}

int dfl_cuda_matvec_rows(int32_t rows_per_cta) {
  return dfl::api_guard([&] { dfl::cuda::set_matvec_rows(rows_per_cta); });
}

int dfl_cuda_mma_split(int32_t warps) {
  return dfl::api_guard([&] { dfl::cuda::set_mma_split(warps); });
}

int dfl_cuda_profile_report(char* buf, int64_t cap, int64_t* len) {
  using namespace dfl::cuda;
  return dfl::api_guard([&] {
    if (!len) dfl::fail("len is NULL");
    std::vector<std::pair<std::string, OpProfileRow>> rows;
    {
      OpProfileTable& t = op_profile();
      std::lock_guard<std::mutex> lock(t.mu);
      rows.assign(t.rows.begin(), t.rows.end());
    }
    std::stable_sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.ms > b.second.ms; });
    std::string out = "{\"ops\": [";
    char item[256];
    for (size_t i = 0; i < rows.size(); ++i) {
      std::snprintf(item, sizeof item, "%s{\"op\": \"%s\", \"calls\": %lld, \"ms\": %.6f, \"bytes\": %.0f}",
                    i ? ", " : "", rows[i].first.c_str(), (long long)rows[i].second.calls, rows[i].second.ms,
                    rows[i].second.bytes);
      out += item;
    }
    out += "]}";
    *len = (int64_t)out.size();
    if (!buf || cap <= *len)
      dfl::fail("the profile report needs %lld bytes, the buffer has %lld", (long long)out.size() + 1,
                (long long)(buf ? cap : 0));
    std::memcpy(buf, out.c_str(), out.size() + 1);
  });
}

}  // extern "C"
#pragma GCC visibility pop
