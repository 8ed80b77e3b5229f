// A block of vectors coded against codebooks, in one launch: what TurboQuant's `encode_vectors` does in torch ops
// (kvcalib/methods/turboquant.py is the spec; the GPU tests compare the two), for a static cache's flush, which runs
// eagerly inside the captured step, where those ops took some twenty launches a group of heads.
//
// x (B, H, T, D) float32, each (T, D) contiguous, batch and head strides SB, SH (elements): row r = (b H + h) T + t,
// which reads book g = h / (H / G):
//   ROTATE 1 (TurboQuant): u = x / max(|x|, tiny) in float64, y = Π u (RT: Π transposed, (D, D) float64 row-major,
//            so that a warp's threads, one coordinate each, read consecutive numbers), rounded once to float32 (as
//            `unit_rotated`), and the norm written: norms[r] = half(min(float(|x|), 65504));
//   ROTATE 0: y = x.
// Codes, then one bit stream a row, code j at bits [j BITS, (j + 1) BITS), least significant bit first, the last
// word (or byte) zero-padded: OUT_BYTES 0: int32 words (`quant.pack_stream`), 1: bytes (`quant.stream_bytes`):
//   XDIM 1: a code a coordinate, the number of the NB bounds below y_i: bounds (NB) shared (PER_COORD 0,
//           `torch.bucketize`, which puts a NaN past the last) or (G, D, NB) a coordinate (PER_COORD 1,
//           `nearest_per_coordinate`: a NaN is code 0);
//   XDIM n: a code a sub-vector of n coordinates, the first nearest of the NB centroids books (G, NB, n) float32 by
//           |c|^2 - 2 y.c (book_norms (G, NB): |c|^2), as `vq.encode` (its float32 sums in its own order: a
//           near-tie may pick the other centroid).
// A block takes RB consecutive rows, NT threads: a thread a coordinate (the norm's share, a row of Π u), then a code
// (its bounds or its book read from L1/L2), then an output element. Bytes that must move: 4 D a row read, the stream
// and a norm written, once each; Π (8 D^2, from L2) once a block of RB rows, the books once a code.
// Defines: D, XDIM, BITS, NB, ROTATE, PER_COORD, OUT_BYTES, RB, NT. Compiled with --use_fast_math, float32 subnormals
// flush to zero (x read, y rounded, compared): the rows come from float16 numbers, whose float32 copies are normal,
// and a unit vector's coordinate below 2^-126 is as good as 0 to its code.

#include <cuda_fp16.h>

#define NC (D / XDIM)                         // codes a row
#define UNIT ((OUT_BYTES) ? 8 : 32)           // bits an output element
#define NOUT ((NC * BITS + UNIT - 1) / UNIT)  // output elements a row

extern "C" __global__ void encode_rows(const float* __restrict__ x, const double* __restrict__ RT,
                                       const float* __restrict__ bounds, const float* __restrict__ books,
                                       const float* __restrict__ book_norms, void* __restrict__ out,
                                       __half* __restrict__ norms, int rows, int T, int H, int G, long SB,
                                       long SH) {
  __shared__ double xs[RB][D];
  __shared__ float ys[RB][D];
  __shared__ unsigned codes[RB][NC];
  __shared__ double partial[RB][NT / 32];
  const int tid = threadIdx.x;
  const long first = (long)blockIdx.x * RB;

  for (int k = tid; k < RB * D; k += NT) {
    const int r = k / D, i = k % D;
    const long row = first + r;
    const long at = row / T / H * SB + row / T % H * SH + row % T * D;
    xs[r][i] = row < rows ? (double)x[at + i] : 0.0;
  }
  __syncthreads();

#if ROTATE
  // |x|^2 a row: each thread's share, then the warps', then the block's (RB rows at once)
  for (int r = 0; r < RB; ++r) {
    double s = 0.0;
    for (int i = tid; i < D; i += NT) s += xs[r][i] * xs[r][i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((tid & 31) == 0) partial[r][tid >> 5] = s;
  }
  __syncthreads();
  __shared__ double scale[RB];
  if (tid < RB) {
    double s = 0.0;
    for (int w = 0; w < NT / 32; ++w) s += partial[tid][w];
    const double n = sqrt(s);
    const long row = first + tid;
    if (row < rows) {
      const float nf = (float)n;  // `norm.float().clamp(max=FLOAT16_MAX).half()`: NaN stays NaN
      norms[row] = __float2half_rn(nf > 65504.f ? 65504.f : nf);
    }
    scale[tid] = n > 2.2250738585072014e-308 ? n : 2.2250738585072014e-308;  // `clamp_min(tiny)`
  }
  __syncthreads();
  for (int k = tid; k < RB * D; k += NT) {
    const int r = k / D, i = k % D;
    xs[r][i] = xs[r][i] / scale[r];
  }
  __syncthreads();
  // y_i = sum_j u_j Π[i][j] = sum_j u_j RT[j][i], j in order, for the block's RB rows at once: each RT[j][i] read
  // once a block (a thread a coordinate i), where a thread a (row, coordinate) read all of RT once a row (RB x 8 D^2
  // bytes a block: 512 KiB a row at D = 256, past what L1 holds beside the blocks' shared memory).
  for (int i = tid; i < D; i += NT) {
    double y[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) y[r] = 0.0;
#pragma unroll 4
    for (int j = 0; j < D; ++j) {
      const double p = RT[(long)j * D + i];
#pragma unroll
      for (int r = 0; r < RB; ++r) y[r] = fma(xs[r][j], p, y[r]);
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) ys[r][i] = (float)y[r];
  }
#else
  for (int k = tid; k < RB * D; k += NT) ys[k / D][k % D] = (float)xs[k / D][k % D];
#endif
  __syncthreads();

  for (int k = tid; k < RB * NC; k += NT) {
    const int r = k / NC, s = k % NC;
    const long row = first + r;
    const int g = G == 1 ? 0 : (int)((row / T) % H) / (H / G);
#if XDIM == 1
    const float y = ys[r][s];
#if PER_COORD
    const float* b = bounds + ((long)g * D + s) * NB;
#else
    const float* b = bounds;
#endif
    unsigned c = 0;
#pragma unroll
    for (int l = 0; l < NB; ++l) c += y > b[l];
#if !PER_COORD
    if (isnan(y)) c = NB;  // `torch.bucketize`'s NaN
#endif
    codes[r][s] = c;
#else
    float p[XDIM];
#pragma unroll
    for (int e = 0; e < XDIM; ++e) p[e] = ys[r][s * XDIM + e];
    const float* bk = books + (long)g * NB * XDIM;
    const float* bn = book_norms + (long)g * NB;
    float best = __int_as_float(0x7f800000);
    unsigned at = 0;
    for (int c = 0; c < NB; ++c) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < XDIM; ++e) dot = fmaf(p[e], bk[c * XDIM + e], dot);
      const float dist = fmaf(-2.f, dot, bn[c]);
      if (dist < best) {
        best = dist;
        at = c;
      }
    }
    codes[r][s] = at;
#endif
  }
  __syncthreads();

  for (int k = tid; k < RB * NOUT; k += NT) {  // output element w of a row: the codes that overlap its bits
    const int r = k / NOUT, w = k % NOUT;
    const long row = first + r;
    if (row >= rows) continue;
    const int lo = w * UNIT, j0 = lo / BITS, j1 = min(NC - 1, (lo + UNIT - 1) / BITS);
    unsigned word = 0;
    for (int j = j0; j <= j1; ++j) {
      const int off = j * BITS - lo;  // < UNIT: the code's first bit in this element (negative: before it)
      word |= off >= 0 ? codes[r][j] << off : codes[r][j] >> -off;
    }
#if OUT_BYTES
    ((unsigned char*)out)[row * NOUT + w] = (unsigned char)(word & 0xffu);
#else
    ((unsigned*)out)[row * NOUT + w] = word;
#endif
  }
}
