// Fused decode attention over the packed INT2 cache of kvcalib.quant (KIVI, OScaR).
//
// Computes, for one new query per (batch, query head), softmax(q K^T * scale) V over
//   - T flushed tokens stored packed: keys per-channel (2-bit codes packed 16 tokens per int32 word
//     along tokens, fp16 scale/zero per G tokens and channel), optional fp16 per-token key norms
//     (OScaR: key = norm * dequant), values per-token (2-bit codes packed 16 channels per word along
//     channels, fp16 scale/zero per GV channels and token);
//   - r < R residual tokens in fp16 (kernel `residual_partial`).
// Dequantization happens in registers from shared memory; nothing full-size is written back.
//
// Memory layout (capacity-strided, so the runtime appends in place; see kvcalib/quant.py):
//   q        (B, HKV*GQ, D)            QT (half or bf16), already rotated when keys are (OScaR)
//   kcodes   (B, HKV, CAPW, D)  int32  word w of channel c holds tokens 16w..16w+15, token j at bits 2(j%16)
//   kscale,kzero (B, HKV, CAPG, D) fp16   group g covers tokens G*g..G*g+G-1
//   knorm    (B, HKV, CAPT)     fp16   only when HAS_NORM
//   vcodes   (B, HKV, CAPT, D/16) int32 word w of token t holds channels 16w..16w+15
//   vscale,vzero (B, HKV, CAPT, D/GV) fp16
//   kres,vres (B, HKV, CAPR, D) fp16   residual window
// Parallel split (flash-decoding): block (split, kv head, batch) handles SPLIT_LEN flushed tokens for
// all GQ query heads sharing that KV head, so each packed byte is read once per block. Partial
// results (unnormalised accumulator, running max in log2 units, running sum) go to `part_*`; split
// index `num_splits` holds the residual window; `merge` combines them and adds KVLinC's correction
// terms (num, den in exp units, optional) before normalising.
// Bytes that must move per (batch, kv head): T*D/4 (key codes) + T*D/4 (value codes) +
// 4*T*D/G (key scale+zero) + 4*T*D/GV (value scale+zero) + 2*T (norms) + 4*r*D (residual).
//
// Compile-time parameters (#define, set by kernels_cupy/loader.py): D, G, GV, GQ, HAS_NORM, QT.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define NT 128       // threads per block
#define TILE 128     // tokens per tile (one per thread in the score phase)
#define PER_WORD 16  // 2-bit codes per 32-bit word
#define KROWS (TILE / PER_WORD)
#define KPAD (D + 4)  // padded row of key words: keeps 16-byte alignment, shifts banks between rows
#define NGT ((TILE + G - 1) / G)  // key groups per tile (G divides TILE or equals a multiple of it)
#define VW (D / PER_WORD)
#define VG (D / GV)
#define REP (NT / D)  // threads per channel in the value phase

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void from_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

struct Softmax {
  float m[GQ];  // running max (log2 units)
  float l[GQ];  // running sum of 2^(s - m)
};

// Online-softmax step over one tile of scores s[h][t] (log2 units, -inf for absent tokens):
// warp w owns heads w, w+4, ...; turns scores into probabilities in place, stores the rescale
// factor of the old accumulator in alpha[h].
__device__ __forceinline__ void softmax_tile(float (*s)[TILE], float* m, float* l, float* alpha) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int h = warp; h < GQ; h += NT / 32) {
    float mx = -INFINITY;
    for (int t = lane; t < TILE; t += 32) mx = fmaxf(mx, s[h][t]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    const float m_new = fmaxf(m[h], mx);
    float sum = 0.f;
    for (int t = lane; t < TILE; t += 32) {
      const float p = m_new == -INFINITY ? 0.f : exp2f(s[h][t] - m_new);
      s[h][t] = p;
      sum += p;
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) {
      const float a = m[h] == -INFINITY ? 0.f : exp2f(m[h] - m_new);
      alpha[h] = a;
      l[h] = l[h] * a + sum;
      m[h] = m_new;
    }
  }
}

// Writes this block's partial result: acc[h] per channel from every thread (REP replicas summed).
__device__ __forceinline__ void write_partial(float (*acc)[GQ], float* red, const float* m, const float* l,
                                              float* part_acc, float* part_ml, int b, int kvh, int split,
                                              int num_parts) {
  const int c = threadIdx.x % D, rep = threadIdx.x / D;
  // red: (REP, GQ, D) scratch
  for (int h = 0; h < GQ; ++h) red[(rep * GQ + h) * D + c] = (*acc)[h];
  __syncthreads();
  if (rep == 0) {
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
      for (int r = 0; r < REP; ++r) v += red[(r * GQ + h) * D + c];
      const long hq = (long)kvh * GQ + h;
      const long row = ((long)b * gridDim.y * GQ + hq) * num_parts + split;
      part_acc[row * D + c] = v;
      if (c == 0) {
        part_ml[row * 2] = m[h];
        part_ml[row * 2 + 1] = l[h];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT) packed_partial(
    const QT* __restrict__ q, const int* __restrict__ kcodes, const __half* __restrict__ kscale,
    const __half* __restrict__ kzero, const __half* __restrict__ knorm, const int* __restrict__ vcodes,
    const __half* __restrict__ vscale, const __half* __restrict__ vzero, int T, int capw, int capg, int capt,
    int split_len, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml, int num_parts) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y;
  const int tid = threadIdx.x;
  const long bh = (long)b * hkv + kvh;

  __shared__ __align__(16) float qs[GQ][D];           // query * scale * log2(e)
  __shared__ __align__(16) int kw[KROWS][KPAD];       // key words of the tile
  __shared__ float ks[NGT][D], kz[NGT][D];            // key scale / zero of the tile's groups
  __shared__ float qz[GQ][NGT];                       // sum_c q[c] * zero[g][c]
  __shared__ float kn[TILE];                          // key norms
  __shared__ int vw[TILE][VW];                        // value words
  __shared__ float vs[TILE][VG], vz[TILE][VG];        // value scale / zero
  __shared__ float s[GQ][TILE];                       // scores, then probabilities
  __shared__ float m[GQ], l[GQ], alpha[GQ];
  __shared__ float red[REP * GQ * D];

  for (int i = tid; i < GQ * D; i += NT) {
    const int h = i / D, c = i % D;
    qs[h][c] = to_float(q[(bh * GQ + h) * D + c]) * scale_log2;
  }
  if (tid < GQ) { m[tid] = -INFINITY; l[tid] = 0.f; }
  float acc[GQ];
  for (int h = 0; h < GQ; ++h) acc[h] = 0.f;

  const int start = split * split_len;
  const int stop = min(start + split_len, T);
  for (int t0 = start; t0 < stop; t0 += TILE) {
    __syncthreads();
    // Load the tile: key words (coalesced along channels), key groups, norms, value words and groups.
    for (int i = tid; i < KROWS * D; i += NT) {
      const int row = i / D, c = i % D, w = t0 / PER_WORD + row;
      kw[row][c] = (w * PER_WORD < stop) ? kcodes[(bh * capw + w) * D + c] : 0;
    }
    for (int i = tid; i < NGT * D; i += NT) {
      const int g = i / D, c = i % D, gi = t0 / G + g;
      const bool ok = gi * G < stop;
      ks[g][c] = ok ? __half2float(kscale[(bh * capg + gi) * D + c]) : 0.f;
      kz[g][c] = ok ? __half2float(kzero[(bh * capg + gi) * D + c]) : 0.f;
    }
    for (int i = tid; i < TILE * VW; i += NT) {
      const int t = i / VW, w = i % VW;
      vw[t][w] = (t0 + t < stop) ? vcodes[(bh * capt + t0 + t) * VW + w] : 0;
    }
    for (int i = tid; i < TILE * VG; i += NT) {
      const int t = i / VG, g = i % VG;
      const bool ok = t0 + t < stop;
      vs[t][g] = ok ? __half2float(vscale[(bh * capt + t0 + t) * VG + g]) : 0.f;
      vz[t][g] = ok ? __half2float(vzero[(bh * capt + t0 + t) * VG + g]) : 0.f;
    }
#if HAS_NORM
    kn[tid] = (t0 + tid < stop) ? __half2float(knorm[bh * capt + t0 + tid]) : 0.f;
#endif
    __syncthreads();
    // sum_c q[c] * zero[g][c] once per group and head: warp per (h, g) pair.
    for (int pair = tid / 32; pair < GQ * NGT; pair += NT / 32) {
      const int h = pair / NGT, g = pair % NGT;
      float v = 0.f;
      for (int c = tid % 32; c < D; c += 32) v += qs[h][c] * kz[g][c];
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
      if (tid % 32 == 0) qz[h][g] = v;
    }
    __syncthreads();
    // Scores: thread = token. score = sum_c q[c] * (zero + scale * code) = qz + sum_c (q*scale)[c] * code.
    {
      const int t = tid, g = t / G, row = t / PER_WORD, shift = 2 * (t % PER_WORD);
      float sc[GQ];
      for (int h = 0; h < GQ; ++h) sc[h] = 0.f;
      for (int c = 0; c < D; c += 4) {
        const int4 w4 = *reinterpret_cast<const int4*>(&kw[row][c]);
        const float k0 = (float)((w4.x >> shift) & 3) * ks[g][c];
        const float k1 = (float)((w4.y >> shift) & 3) * ks[g][c + 1];
        const float k2 = (float)((w4.z >> shift) & 3) * ks[g][c + 2];
        const float k3 = (float)((w4.w >> shift) & 3) * ks[g][c + 3];
        for (int h = 0; h < GQ; ++h) {
          const float4 q4 = *reinterpret_cast<const float4*>(&qs[h][c]);
          sc[h] += q4.x * k0 + q4.y * k1 + q4.z * k2 + q4.w * k3;
        }
      }
      const bool valid = t0 + t < stop;
      for (int h = 0; h < GQ; ++h) {
        float v = sc[h] + qz[h][g];
#if HAS_NORM
        v *= kn[t];
#endif
        s[h][t] = valid ? v : -INFINITY;
      }
    }
    __syncthreads();
    softmax_tile(s, m, l, alpha);
    __syncthreads();
    // Values: thread = (channel, replica). acc += p[t] * (zero[t] + scale[t] * code[t][c]).
    {
      const int c = tid % D, rep = tid / D, word = c / PER_WORD, shift = 2 * (c % PER_WORD), gv = c / GV;
      for (int h = 0; h < GQ; ++h) acc[h] *= alpha[h];
      for (int t = rep; t < TILE; t += REP) {
        const float v = vz[t][gv] + vs[t][gv] * (float)((vw[t][word] >> shift) & 3);
        for (int h = 0; h < GQ; ++h) acc[h] += s[h][t] * v;
      }
    }
  }
  __syncthreads();
  write_partial(&acc, red, m, l, part_acc, part_ml, b, kvh, split, num_parts);
}

// The fp16 residual window (r < R tokens), written as partial number `split` = num_splits.
extern "C" __global__ void __launch_bounds__(NT) residual_partial(
    const QT* __restrict__ q, const __half* __restrict__ kres, const __half* __restrict__ vres, int r, int capr,
    float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml, int num_parts) {
  const int kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, tid = threadIdx.x;
  const long bh = (long)b * hkv + kvh;
  __shared__ float qs[GQ][D];
  __shared__ float s[GQ][TILE];
  __shared__ float m[GQ], l[GQ], alpha[GQ];
  __shared__ float red[REP * GQ * D];
  for (int i = tid; i < GQ * D; i += NT) qs[i / D][i % D] = to_float(q[(bh * GQ + i / D) * D + i % D]) * scale_log2;
  if (tid < GQ) { m[tid] = -INFINITY; l[tid] = 0.f; }
  float acc[GQ];
  for (int h = 0; h < GQ; ++h) acc[h] = 0.f;
  for (int t0 = 0; t0 < r; t0 += TILE) {
    __syncthreads();
    const int t = t0 + tid;
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
      if (t < r)
        for (int c = 0; c < D; ++c) v += qs[h][c] * __half2float(kres[(bh * capr + t) * D + c]);
      s[h][tid] = t < r ? v : -INFINITY;
    }
    __syncthreads();
    softmax_tile(s, m, l, alpha);
    __syncthreads();
    const int c = tid % D, rep = tid / D;
    for (int h = 0; h < GQ; ++h) acc[h] *= alpha[h];
    for (int tt = rep; tt < TILE && t0 + tt < r; tt += REP) {
      const float v = __half2float(vres[(bh * capr + t0 + tt) * D + c]);
      for (int h = 0; h < GQ; ++h) acc[h] += s[h][tt] * v;
    }
  }
  __syncthreads();
  write_partial(&acc, red, m, l, part_acc, part_ml, b, kvh, num_parts - 1, num_parts);
}

// Combine the partials of one (batch, query head): out = (sum_s 2^(m_s-M) acc_s + 2^-M num)
//                                                        / (sum_s 2^(m_s-M) l_s + 2^-M den),
// where num (D) and den (1) are KVLinC's correction terms in exp units (null when absent).
extern "C" __global__ void merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                 const float* __restrict__ corr_num, const float* __restrict__ corr_den,
                                 int num_parts, QT* __restrict__ out) {
  const long row = blockIdx.x;
  const int c = threadIdx.x;
  float M = -INFINITY;
  for (int p = 0; p < num_parts; ++p) M = fmaxf(M, part_ml[(row * num_parts + p) * 2]);
  float num = 0.f, den = 0.f;
  for (int p = 0; p < num_parts; ++p) {
    const float mp = part_ml[(row * num_parts + p) * 2];
    if (mp == -INFINITY) continue;
    const float w = exp2f(mp - M);
    num += w * part_acc[(row * num_parts + p) * D + c];
    den += w * part_ml[(row * num_parts + p) * 2 + 1];
  }
  if (corr_num != nullptr) {
    const float w = exp2f(-M);
    num += w * corr_num[row * D + c];
    den += w * corr_den[row];
  }
  from_float(&out[row * D + c], num / den);
}
