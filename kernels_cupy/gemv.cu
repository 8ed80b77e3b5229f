// The decode step's weight products at a few rows (kvcalib/runtime/gemv_kernel.py): y (M, N) = x (M, K) W (N, K)^T
// (+ bias), sums in float32, one rounding to the output type. A warp takes RPW rows of W; its 32 lanes read
// 16-byte words of a row side by side (512 contiguous bytes a load), CHUNK words a lane in flight, streamed past
// L1 (W is read once); every x row is read through L1 once per word and used for the warp's RPW rows.
// Defines: KDIM (a multiple of 8), MROWS, RPW, WARPS, CHUNK, BF16 (0: float16). W, x: contiguous rows, 16-byte
// aligned; bias: N values or a null pointer. Bytes moved: 2 N K (W, the whole cost at one row) + 2 M K (x, from
// L1 after the first block) + 2 N (bias) + 2 M N (y).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if BF16
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
__device__ __forceinline__ float2 to_float2(T2 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ T from_float(float v) { return __float2bfloat16(v); }
#else
typedef __half T;
typedef __half2 T2;
__device__ __forceinline__ float2 to_float2(T2 v) { return __half22float2(v); }
__device__ __forceinline__ T from_float(float v) { return __float2half(v); }
#endif

__device__ __forceinline__ float dot8(const uint4 a, const uint4 b, float s) {
  const T2* pa = reinterpret_cast<const T2*>(&a);
  const T2* pb = reinterpret_cast<const T2*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = to_float2(pa[i]), fb = to_float2(pb[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv(const uint4* __restrict__ w, const uint4* __restrict__ x,
                                                              const T* __restrict__ bias, T* __restrict__ y, int n) {
  constexpr int WORDS = KDIM / 8;
  constexpr int PER_LANE = (WORDS + 31) / 32;
  const int lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * WARPS + threadIdx.x / 32) * RPW;
  if (row0 >= n) return;
  float acc[RPW][MROWS];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < MROWS; ++m) acc[r][m] = 0.f;
#pragma unroll 1
  for (int base = 0; base < PER_LANE; base += CHUNK) {
    uint4 wv[RPW][CHUNK];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) {
        const int word = (base + c) * 32 + lane;
        wv[r][c] = (base + c < PER_LANE && word < WORDS && row0 + r < n) ? __ldcs(w + (long)(row0 + r) * WORDS + word)
                                                                         : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int word = (base + c) * 32 + lane;
      if (base + c < PER_LANE && word < WORDS) {
#pragma unroll
        for (int m = 0; m < MROWS; ++m) {
          const uint4 xv = __ldg(x + m * WORDS + word);
#pragma unroll
          for (int r = 0; r < RPW; ++r) acc[r][m] = dot8(wv[r][c], xv, acc[r][m]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < MROWS; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
      if (lane == 0 && row0 + r < n) {
        if (bias != nullptr) s += float(bias[row0 + r]);
        y[(long)m * n + row0 + r] = from_float(s);
      }
    }
}
