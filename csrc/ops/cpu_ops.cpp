// cpu_ops.cpp — CPU implementations of the row ops used by the forward.
#include "ops/cpu_ops.h"

#include <cmath>
#include <vector>

#include "quant/quant.h"

namespace dfl {

void matmul(ThreadPool& pool, const Weight& W, const float* x, int n, float* y, block_q8_act* act) {
  const bool q = dtype_is_quantized(W.type);
  const int64_t nblk = W.cols / 32;
  if (q) {
    pool.parallel_for(n, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) quantize_act_row(x + t * W.cols, act + t * nblk, W.cols);
    });
  }
  // Rows in groups of 16 so a group's weights stay in L1 while every token
  // of the batch passes over them.
  const int64_t group = 16;
  pool.parallel_for(W.rows, group, [&](int64_t r0, int64_t r1) {
    for (int64_t g = r0; g < r1; g += group) {
      int64_t ge = g + group < r1 ? g + group : r1;
      for (int t = 0; t < n; ++t) {
        const void* xt = q ? (const void*)(act + t * nblk) : (const void*)(x + t * W.cols);
        float* yt = y + (int64_t)t * W.rows;
        for (int64_t r = g; r < ge; ++r) yt[r] = vec_dot(W.type, W.row(r), xt, W.cols);
      }
    }
  });
}

void rmsnorm_rows(const float* x, const float* w, int n, int dim, float eps, float* y) {
  for (int t = 0; t < n; ++t) {
    const float* xr = x + (int64_t)t * dim;
    float* yr = y + (int64_t)t * dim;
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += (double)xr[i] * xr[i];
    float scale = (float)(1.0 / std::sqrt(ss / dim + (double)eps));
    if (w)
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] * scale * w[i];
    else
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] * scale;
  }
}

void rope_neox(float* v, int n_rot, int64_t pos, float base) {
  const int half = n_rot / 2;
  for (int p = 0; p < half; ++p) {
    double theta = (double)pos * std::pow((double)base, -2.0 * p / n_rot);
    float c = (float)std::cos(theta), s = (float)std::sin(theta);
    float a = v[p], b = v[p + half];
    v[p] = a * c - b * s;
    v[p + half] = a * s + b * c;
  }
}

void embed_row(const Weight& W, int32_t token, float* out) {
  dequantize_row(W.type, W.row(token), out, W.cols);
}

void delta_rule_step(float* S, const float* k, const float* v, const float* q, float decay, float beta,
                     int dk, int dv, float* out) {
  // u = S^T k after decay; delta = beta (v - u); S += k delta^T; out = S^T q.
  float u[512], delta[512];
  for (int j = 0; j < dv; ++j) u[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    float* Si = S + (int64_t)i * dv;
    const float ki = k[i];
    for (int j = 0; j < dv; ++j) {
      Si[j] *= decay;
      u[j] += Si[j] * ki;
    }
  }
  for (int j = 0; j < dv; ++j) {
    delta[j] = beta * (v[j] - u[j]);
    out[j] = 0.f;
  }
  for (int i = 0; i < dk; ++i) {
    float* Si = S + (int64_t)i * dv;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < dv; ++j) {
      Si[j] += ki * delta[j];
      out[j] += Si[j] * qi;
    }
  }
}

}  // namespace dfl
