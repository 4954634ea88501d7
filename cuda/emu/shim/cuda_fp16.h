// CPU emulation shim (see cuda_runtime.h): f16 via blocks.h's exact conversion.
#pragma once
#include "quant/blocks.h"
struct __half { unsigned short b; };
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline float __half2float(__half h) { return dfl::f16_to_f32(h.b); }
