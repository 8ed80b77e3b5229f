// The floor under a decode kernel (benchmarks/decode.py): one launch that reads `n16` 16-byte words
// once, with nothing else to do. Each thread keeps four streaming loads in flight and XORs what it
// read; each block writes the XOR of its words to sink[block], so the loads cannot be optimised
// away and a test can check that every word was read exactly once (the XOR of the sinks is the
// XOR of the buffer). Bytes moved: 16 * n16 + 4 * blocks. Launched as one wave of 512-thread blocks.

extern "C" __global__ void __launch_bounds__(512) stream_read(const uint4* __restrict__ src, long n16,
                                                              unsigned* __restrict__ sink) {
  const long stride = (long)gridDim.x * blockDim.x;
  unsigned x = 0;
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = __ldcs(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) x ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o /= 2) x ^= __shfl_xor_sync(0xffffffff, x, o);
  __shared__ unsigned warps[16];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < blockDim.x / 32; ++w) x ^= warps[w];
    sink[blockIdx.x] = x;
  }
}
