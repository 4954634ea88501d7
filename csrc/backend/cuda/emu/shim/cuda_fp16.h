// CPU emulation shim (see cuda_runtime.h): f16 via blocks.h's exact conversions.
#pragma once
#include "quant/blocks.h"
struct __half { unsigned short b; };
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.b; }
inline float __half2float(__half h) { return dfl::f16_to_f32(h.b); }
inline __half __float2half_rn(float f) { return {dfl::f32_to_f16(f)}; }
inline __half __float2half(float f) { return {dfl::f32_to_f16(f)}; }
