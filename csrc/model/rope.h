// rope.h — rotary position embedding: one definition for the CPU ops and the
// CUDA kernels (this header compiles under nvcc and the emulator as it is).
//
// NeoX rotate-half over the first n_rot dims of a head: pair p rotates dims
// (p, p + n_rot/2) by the angle pos * inv_freq(p).  Unscaled RoPE has
// inv_freq(p) = base^(-2p/n_rot).  Scaled RoPE as transformers computes it
// ("linear", "yarn"): each pair's frequency is a mix of that extrapolated
// value and the interpolated one (divided by `factor`), weighted by a ramp over
// the pair index that is 0 below `ramp_lo` and 1 above `ramp_hi`; yarn then
// multiplies cos and sin by `attn_factor`.  Linear scaling is the ramp at 1 for
// every pair (ramp_lo = -1, ramp_hi = 0).  The config readers
// (dflash_draft.cpp for drafters, qwen35_load.cpp for targets) fill it.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DFL_HOST_DEVICE __host__ __device__
#else
#define DFL_HOST_DEVICE
#endif

namespace dfl {

struct RopeSpec {
  int n_rot = 0;           // rotated dims per head (even)
  float base = 10000.f;    // theta
  float factor = 1.f;      // 1: unscaled (inv_freq exactly base^(-2p/n_rot))
  float ramp_lo = 0.f, ramp_hi = 0.f;  // pair-index range of the ramp (scaled only)
  float attn_factor = 1.f;             // multiplies cos and sin
};

// Frequency of pair p in [0, n_rot/2), in double as the angles are.
DFL_HOST_DEVICE inline double rope_inv_freq(const RopeSpec& r, int p) {
  const double extrap = pow((double)r.base, -2.0 * p / r.n_rot);
  if (r.factor == 1.f) return extrap;
  // transformers nudges an empty ramp open by 0.001 so it never divides by zero
  const double lo = r.ramp_lo, hi = r.ramp_hi == r.ramp_lo ? (double)r.ramp_hi + 0.001 : (double)r.ramp_hi;
  double ramp = ((double)p - lo) / (hi - lo);
  ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
  return extrap / (double)r.factor * ramp + extrap * (1.0 - ramp);
}

// cos and sin of pair p's angle at position pos, each times attn_factor.
DFL_HOST_DEVICE inline void rope_cos_sin(const RopeSpec& r, int p, long long pos, float* c, float* s) {
  const double theta = (double)pos * rope_inv_freq(r, p);
  *c = (float)cos(theta);
  *s = (float)sin(theta);
  if (r.attn_factor != 1.f) {
    *c *= r.attn_factor;
    *s *= r.attn_factor;
  }
}

}  // namespace dfl
