// Fused VecInfer decode attention over codebook codes (issue 18), first version: correct before fast.
//
// Reads the layout of kvcalib/vq_layout.py (its module docstring has the table), for one new query per
// head, q~ = (q lambda) H in the codec basis (float32, (B, Hq, D)):
//   kcodes, vcodes (B, HKV, CAPT, RK | RV) uint8   each flushed token's codes, LSB-first bitstream rows
//   kbook (G, 2^MK, NK), vbook (G, 2^MV, NV) fp16   codebooks, G = 1 (shared) or HKV (one per KV head)
//   ksink, vsink (B, HKV, CAPS, D) fp16             the first `sinks` tokens, read instead of their codes
//   kres, vres (B, HKV, CAPR, D) fp16               the residual window (keys in the codec basis)
// Block (part, kv head, batch), NT threads: parts below num_splits take split_len flushed tokens each,
// the last part the residual window. Both codebooks of the block's KV head are copied to shared memory;
// each warp takes every NW-th token, a lane D / 32 channels: the lane rebuilds its channels of the key and
// the value from the codebooks (the code of the sub-vector its channel lies in), the warp sums q~ . k per
// query head of the group (GQ of them), and keeps an online softmax per head. The warps' partials are
// combined in shared memory and written as `merge` of quant_decode.cu reads them: the unnormalised sum of
// exp2(s - m) v, m and the sum of exp2(s - m), s the score in log2 units; an empty part writes m = -inf.
//
// Not yet the issue's kernel: no lookup table of q~ . centroid (every key is rebuilt and dotted: D
// multiply-adds per token and head, where the table needs c = D / NK additions), no asynchronous copies,
// codes read a byte at a time. It fixes the arithmetic the faster kernel must reproduce.
//
// Defines: D, NK, MK, RK, NV, MV, RV, GQ.
#include <cuda_fp16.h>

#define NT 128
#define NW (NT / 32)
#define DPL (D / 32)  // channels per lane
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ unsigned code_at(const unsigned char* __restrict__ row, int j, int bits, int row_bytes) {
  const int bit = j * bits, byte = bit >> 3, off = bit & 7;
  unsigned w = row[byte];
  if (byte + 1 < row_bytes) w |= (unsigned)row[byte + 1] << 8;
  if (byte + 2 < row_bytes) w |= (unsigned)row[byte + 2] << 16;
  return (w >> off) & ((1u << bits) - 1u);
}

extern "C" __global__ void __launch_bounds__(NT) vq_partial(
    const float* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const __half* __restrict__ kbook, const __half* __restrict__ vbook, int kbook_groups, int vbook_groups,
    const __half* __restrict__ ksink, const __half* __restrict__ vsink, int sinks, int caps,
    const __half* __restrict__ kres, const __half* __restrict__ vres, int residual, int capr, int T, int capt,
    int split_len, int num_splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, num_parts = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long bh = (long)b * hkv + kvh;
  __half* kb = (__half*)smem;
  __half* vb = kb + (1 << MK) * NK;
  float* red_m = (float*)(vb + (1 << MV) * NV);  // (NW, GQ)
  float* red_l = red_m + NW * GQ;                // (NW, GQ)
  float* red_acc = red_l + NW * GQ;              // (NW, GQ, D)
  const bool res_part = part >= num_splits;
  if (!res_part) {
    const __half* kg = kbook + (kbook_groups > 1 ? (long)kvh * (1 << MK) * NK : 0);
    const __half* vg = vbook + (vbook_groups > 1 ? (long)kvh * (1 << MV) * NV : 0);
    for (int i = threadIdx.x; i < (1 << MK) * NK; i += NT) kb[i] = kg[i];
    for (int i = threadIdx.x; i < (1 << MV) * NV; i += NT) vb[i] = vg[i];
  }
  __syncthreads();
  const int start = res_part ? 0 : part * split_len;
  const int stop = res_part ? residual : min(T, start + split_len);

  float qr[GQ][DPL], m[GQ], l[GQ], acc[GQ][DPL];
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    m[h] = NEG_INF;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      qr[h][i] = q[(bh * GQ + h) * D + lane * DPL + i];
      acc[h][i] = 0.f;
    }
  }
  for (int t = start + warp; t < stop; t += NW) {
    float kv[DPL], vv[DPL];
    if (res_part || t < sinks) {
      const __half* kp = res_part ? kres + (bh * capr + t) * D : ksink + (bh * caps + t) * D;
      const __half* vp = res_part ? vres + (bh * capr + t) * D : vsink + (bh * caps + t) * D;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        kv[i] = __half2float(kp[lane * DPL + i]);
        vv[i] = __half2float(vp[lane * DPL + i]);
      }
    } else {
      const unsigned char* krow = kcodes + (bh * capt + t) * RK;
      const unsigned char* vrow = vcodes + (bh * capt + t) * RV;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int c = lane * DPL + i;
        kv[i] = __half2float(kb[code_at(krow, c / NK, MK, RK) * NK + c % NK]);
        vv[i] = __half2float(vb[code_at(vrow, c / NV, MV, RV) * NV + c % NV]);
      }
    }
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) s += qr[h][i] * kv[i];
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
      s *= scale_log2;
      const float mn = fmaxf(m[h], s);
      const float c = exp2f(m[h] - mn), p = exp2f(s - mn);  // m = -inf at first: c = 0
      l[h] = l[h] * c + p;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[h][i] = acc[h][i] * c + p * vv[i];
      m[h] = mn;
    }
  }
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    if (lane == 0) {
      red_m[warp * GQ + h] = m[h];
      red_l[warp * GQ + h] = l[h];
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) red_acc[(warp * GQ + h) * D + lane * DPL + i] = acc[h][i];
  }
  __syncthreads();
  for (int x = threadIdx.x; x < GQ * D; x += NT) {
    const int h = x / D, c = x % D;
    float M = NEG_INF;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w * GQ + h]);
    float num = 0.f, den = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float mw = red_m[w * GQ + h];
      const float wt = mw == NEG_INF ? 0.f : exp2f(mw - M);
      num += wt * red_acc[(w * GQ + h) * D + c];
      den += wt * red_l[w * GQ + h];
    }
    const long row = bh * GQ + h;  // query head kvh * GQ + h of batch b
    part_acc[(row * num_parts + part) * D + c] = num;
    if (c == 0) {
      part_ml[(row * num_parts + part) * 2] = M;
      part_ml[(row * num_parts + part) * 2 + 1] = den;
    }
  }
}
