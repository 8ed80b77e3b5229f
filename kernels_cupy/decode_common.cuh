// Device helpers both decode kernels use (int2_decode.cu, vq_decode.cu): element conversions, the
// warp's Hadamard transform of a D-vector, the tensor-core pieces (mma, 8x8 transpose, half2 packing), and
// the bulk-copy engine's copy into shared memory and the mbarrier it completes on (sm_90; a kernel that does
// not call them, as on the cp.async loaders, compiles without them).
// Included textually: kernels_cupy/loader.py inlines `#include "..."` of this folder before hashing and
// compiling, so a change here changes every including kernel's cache key. Needs D defined (64 or 128).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void from_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// y = x H over one vector of D floats held by a warp (lane l holds elements l + 32 e, e < D/32), with H
// the normalized Sylvester-Hadamard matrix of kvcalib/hadamard.py, H[j][c] = (-1)^popcount(j & c) / sqrt(D):
// the butterflies of the fast transform, strides 1..16 across lanes by shuffles, 32 and 64 within a
// lane's registers; float32 sums of +-x, then one scaling (D is a power of two: 64 or 128).
#define HADAMARD_SCALE (D == 64 ? 0.125f : 0.0883883476483184405f)  // 1 / sqrt(D)
__device__ __forceinline__ void warp_hadamard(float* x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int s = 1; s < 32; s *= 2)
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const float o = __shfl_xor_sync(0xffffffff, x[e], s);
      x[e] = (lane & s) ? o - x[e] : x[e] + o;
    }
#pragma unroll
  for (int s = 1; s < D / 32; s *= 2)
#pragma unroll
    for (int e = 0; e < D / 32; ++e)
      if (!(e & s)) {
        const float a = x[e], b = x[e + s];
        x[e] = a + b;
        x[e + s] = a - b;
      }
#pragma unroll
  for (int e = 0; e < D / 32; ++e) x[e] *= HADAMARD_SCALE;
}

// c += a b on the tensor cores: mma.m16n8k16, fp16 operands (a: 4 half2 registers, b: 2), fp32 accumulators.
__device__ __forceinline__ void mma16816(float* c, const uint4 a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// The transpose of an 8x8 fp16 matrix held one half2 per lane (row lane/4, columns 2(lane%4)+{0,1}).
__device__ __forceinline__ unsigned transpose8x8(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// A shared-memory address as the PTX instructions below take it.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// One bulk copy (the tensor memory accelerator) of `bytes` contiguous bytes from global to shared memory, its
// completion counted on the mbarrier `bar` (which the issuing block set to expect the bytes).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// The mbarrier a block's bulk copies complete on: set up for one arriving thread, told the bytes to expect (the
// issuing thread's arrival), and waited on for the given phase (a barrier's use u completes phase u % 2).
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned phase) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(phase) : "memory");
}
