// Asymmetric round-to-nearest quantization and bit-packing of kvcalib.quant (its `quantize` is the
// spec; the GPU tests compare the two bit for bit): what a runtime flush does to a residual block.
//
// x (N, T, C) float32, groups of G elements along the quantized axis:
//   AXIS_TOKENS 1: G tokens of one channel; codes (N, ceil(T/PER_WORD), C), scale/zero (N, T/G, C)
//   AXIS_TOKENS 0: G channels of one token; codes (N, T, ceil(C/PER_WORD)), scale/zero (N, T, C/G)
// scale = half(min((max - min) / (2^BITS - 1), 65504)), zero = half(min), code = clamp(rint((x - zero) / scale))
// (0 where scale is 0), in float32 exactly as torch on CUDA computes it: a division by a Python
// number is a multiplication by its float32 reciprocal there, a division by a tensor is IEEE
// division (__fdiv_rn here, which --use_fast_math does not touch); rintf rounds half to even like
// torch.round. (torch on the CPU divides by the number, so a scale can differ from it by one ulp.)
// Two launches: `group_stats` (thread per group) writes scale and zero; `pack_codes` (thread per
// word) reads them back, so a word may span groups (PER_WORD need not divide G).
// Compile-time parameters: BITS (1..8), G, AXIS_TOKENS.

#include <cuda_fp16.h>

#define LEVELS ((1 << BITS) - 1)
#define PER_WORD (32 / BITS)

__device__ __forceinline__ long element(long n, long t, long c, int T, int C) { return (n * T + t) * C + c; }

extern "C" __global__ void group_stats(const float* __restrict__ x, __half* __restrict__ scale,
                                       __half* __restrict__ zero, int N, int T, int C) {
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
#if AXIS_TOKENS
  const long groups = (long)N * (T / G) * C;  // (n, group, channel), channel fastest: coalesced reads
  if (idx >= groups) return;
  const long c = idx % C, gi = idx / C % (T / G), n = idx / C / (T / G);
  float lo = x[element(n, gi * G, c, T, C)], hi = lo;
  for (int j = 1; j < G; ++j) {
    const float v = x[element(n, gi * G + j, c, T, C)];
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
#else
  const long groups = (long)N * T * (C / G);  // (n, token, group)
  if (idx >= groups) return;
  const long gi = idx % (C / G), t = idx / (C / G) % T, n = idx / (C / G) / T;
  float lo = x[element(n, t, gi * G, T, C)], hi = lo;
  for (int j = 1; j < G; ++j) {
    const float v = x[element(n, t, gi * G + j, T, C)];
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
#endif
  // at most float16's largest number, as kvcalib.quant._codes clamps it (NaN kept): an inf scale would decode its
  // codes of 0 as NaN
  const float s = __fmul_rn(__fsub_rn(hi, lo), __frcp_rn((float)LEVELS));
  scale[idx] = __float2half_rn(s > 65504.f ? 65504.f : s);
  zero[idx] = __float2half_rn(lo);
}

extern "C" __global__ void pack_codes(const float* __restrict__ x, const __half* __restrict__ scale,
                                      const __half* __restrict__ zero, unsigned* __restrict__ codes, int N, int T,
                                      int C) {
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
#if AXIS_TOKENS
  const int W = (T + PER_WORD - 1) / PER_WORD;
  if (idx >= (long)N * W * C) return;
  const long c = idx % C, w = idx / C % W, n = idx / C / W;
#else
  const int W = (C + PER_WORD - 1) / PER_WORD;
  if (idx >= (long)N * T * W) return;
  const long w = idx % W, t = idx / W % T, n = idx / W / T;
#endif
  unsigned word = 0;
#pragma unroll
  for (int j = 0; j < PER_WORD; ++j) {
#if AXIS_TOKENS
    const long tt = w * PER_WORD + j, cc = c;
    if (tt >= T) break;  // the last word is zero-padded
    const long g = (n * (T / G) + tt / G) * C + cc;
#else
    const long tt = t, cc = w * PER_WORD + j;
    if (cc >= C) break;
    const long g = (n * T + tt) * (C / G) + cc / G;
#endif
    const float s = __half2float(scale[g]);
    float q = 0.f;  // a constant group has scale 0: zero alone reconstructs it
    if (s > 0.f) q = fminf(fmaxf(rintf(__fdiv_rn(x[element(n, tt, cc, T, C)] - __half2float(zero[g]), s)), 0.f), LEVELS);
    word |= (unsigned)q << (BITS * j);
  }
  codes[idx] = word;
}
