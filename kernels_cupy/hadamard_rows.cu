// Rows rotated by the normalized Walsh-Hadamard matrix, block-diagonal with BLOCK x BLOCK blocks (`kvcalib.hadamard`'s
// rotation; `hadamard.rotate` is the spec, its product in float64 the GPU tests' reference): the fast transform,
// log2(BLOCK) butterfly stages of one add or subtract each, then one multiply by 1/sqrt(BLOCK), in float32.
// Every output element's sums are taken in one fixed order whatever rows are launched with it, so a row gets the same
// bits alone or among others: cuBLAS's product picks its kernel, and with it the order of the sums, by the count of
// rows, so that a slot flushed alone and the same slot flushed with the batch differed in the last bit.
//
//   x    (B, H, T, D) ELEM, element (b, h, t, i) at b S0 + h S1 + t S2 + i (the last stride one)
//   out  (B H T, D) ELEM, row after row
// A warp a row, lane l holding elements e 32 + l (e < ceil(D / 32)): the stages of stride below 32 go between lanes
// (shuffles), the others within a lane. A D that is no multiple of 32 has a BLOCK below 32 that divides 32, so the
// lanes past D make whole blocks of their own: they hold zeros and are neither read nor written. Bytes: each row read
// once and written once. Compiled as every kernel here is (`--use_fast_math`): float32 denormals are flushed to zero
// (float16 and bfloat16 ones are normal float32 numbers).
// Defines: D (even), BLOCK (the largest power of two dividing D), ELEM_KIND (0 float, 1 half, 2 bfloat16).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define PER_LANE ((D + 31) / 32)

#if ELEM_KIND == 0
typedef float elem;
__device__ __forceinline__ float load_elem(const elem* p) { return *p; }
__device__ __forceinline__ elem to_elem(float v) { return v; }
#elif ELEM_KIND == 1
typedef __half elem;
__device__ __forceinline__ float load_elem(const elem* p) { return __half2float(*p); }
__device__ __forceinline__ elem to_elem(float v) { return __float2half_rn(v); }
#else
typedef __nv_bfloat16 elem;
__device__ __forceinline__ float load_elem(const elem* p) { return __bfloat162float(*p); }
__device__ __forceinline__ elem to_elem(float v) { return __float2bfloat16_rn(v); }
#endif

extern "C" __global__ void hadamard_rows(const elem* __restrict__ x, elem* __restrict__ out, long long rows,
                                         long long H, long long T, long long S0, long long S1, long long S2,
                                         float scale) {
  const int lane = threadIdx.x & 31;
  const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;  // a whole warp returns: the shuffles below see every lane of the warps that stay
  const long long t = r % T, h = r / T % H, b = r / T / H;
  const elem* row = x + b * S0 + h * S1 + t * S2;
  float v[PER_LANE];
#pragma unroll
  for (int e = 0; e < PER_LANE; ++e)
    v[e] = ((e + 1) * 32 <= D || e * 32 + lane < D) ? load_elem(row + e * 32 + lane) : 0.f;
  // Element i pairs with i ^ s at the stage of stride s: the lower one becomes a + b, the upper a - b.
#pragma unroll
  for (int s = 1; s < 32 && s < BLOCK; s <<= 1) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, v[e], s);
      v[e] = (lane & s) ? other - v[e] : v[e] + other;
    }
  }
#pragma unroll
  for (int s = 1; s < PER_LANE && 32 * s < BLOCK; s <<= 1) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
      if (!(e & s)) {
        const float a = v[e], c = v[e + s];
        v[e] = a + c;
        v[e + s] = a - c;
      }
    }
  }
  elem* o = out + r * D;
#pragma unroll
  for (int e = 0; e < PER_LANE; ++e)
    if ((e + 1) * 32 <= D || e * 32 + lane < D) o[e * 32 + lane] = to_elem(v[e] * scale);
}
