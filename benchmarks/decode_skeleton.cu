// The least a fused decode over 1- or 2-bit codes costs on the tensor cores (benchmarks/decode_skeleton.py): a
// kernel that does only what every such format must do, to measure how near its read floor a fused decode can come.
// Not a format of the runtime: no sinks, no float16 window, no masks (whole 16-token tiles), no rotation, one
// affine map per channel for all tokens (y = zero + scale * level, as TurboQuant's two levels a coordinate are; KIVI
// moves its map every G tokens), a norm per token. Each level is taken from its bits by one AND as an fp16 subnormal
// (level 2^(e - 24), e its slot's shift), never gathered: one instruction a half2 of fragment.
//
// Layout (decode_skeleton.py `slots`), per (batch b, KV head h), tiles of 16 tokens, each a record of
//   512 BITS / 2 bytes of key words   lane L's WORDS words from byte 4 WORDS L: its 32 half2 of B fragments
//   512 BITS / 2 bytes of value words lane L's words likewise: its 32 half2 of A fragments
//   64 bytes of norms                  lane (g, t) reads 16 bytes at 16 t: fp16 key norms of tokens 2t, 2t+1, 2t+8,
//                                      2t+9, then the value norms of the same tokens
// half2 slot s of a lane is word s / PER, bits [p, p + BITS) and [16 + p, 16 + p + BITS), p = BITS j (j = s % PER
// < DIRECT) or 10 + BITS (j - DIRECT) (taken after a shift by 10): e = p or p - 10 (`channel_shift`).
//   key slot s = 16 nt + 2 ks + hb: tokens g + 8 nt, channels 16 ks + 2 t + 8 hb + {0, 1} (the scores' B fragment)
//   value slot s = 16 tp + 2 mt + r: channel 16 mt + g + 8 r, tokens 2 t + 8 tp + {0, 1} (O^T's A fragment)
// e depends on s % 16 only, so on the channel alone: a key's 2^-e rides in q's fragment, a value's 2^(24 - e) in
// `merge`'s per-channel scale.
//
// Kernels:
//   partial  block (split, KV head, batch), WARPS warps; warp w takes a contiguous run of the split's tiles, DEPTH
//            tiles' loads in flight. Scores S (heads x 16 tokens) = Q' (hi + lo rows) K^T, mma.m16n8k16;
//            s = norm (bias + 2^(24 - EMAX) S), bias = q~ . zero; online softmax over TILES tiles a step
//            (mma_tiles.cuh); O^T (D x heads) += L^T (p vnorm)^T, and lz = sum of p vnorm in the fp16 the mma takes
//            (the zeros' weight). Writes per warp m, l, lz and O^T.
//   merge    block (query head, batch), D threads: the partials weighed by exp2(m - M) (at most MAX_PARTS);
//            out = (vzero lz + vscale' O) / l, vscale' = vscale 2^(24 - e) per channel.
// Bytes per (batch, KV head): T / 16 records of 1024 BITS / 2 + 64 bytes; partials 4 (D + 3) GQ per warp.
// Defines: BITS (1 or 2), D (128), GQ (<= 4), WARPS, DEPTH, MINBLOCKS, TILES (tiles a softmax step; DEPTH a multiple).
#include "decode_common.cuh"

#define KS (D / 16)
#define NEG_INF __int_as_float(0xff800000)
#define RESCALE_SLACK 8.f
#include "mma_tiles.cuh"

#define WORDS (BITS * 2)           // words a lane holds of one part of a tile (32 half2 of BITS-bit pairs)
#define PER (16 / BITS)            // half2 slots a word
#define DIRECT (10 / BITS)         // slots a word gives without a shift (their bits in the fp16 mantissas)
#define EMAX (BITS == 2 ? 8 : 9)   // the largest shift e: q's fragment is q~ scale 2^(EMAX - e)
#define RECORD (1024 * BITS / 2 + 64)  // bytes a tile
static_assert(BITS == 1 || BITS == 2, "1- or 2-bit codes");
static_assert(DEPTH % TILES == 0, "whole softmax steps a ring");

#if BITS == 2
typedef uint4 words_t;
#else
typedef uint2 words_t;
#endif

// A lane's 32 half2 of one part from its words (slot s at h[s]): each one AND of a constant mask once unrolled.
__device__ __forceinline__ void unpack(const words_t wv, unsigned* h) {
  const unsigned* w = reinterpret_cast<const unsigned*>(&wv);
#pragma unroll
  for (int k = 0; k < WORDS; ++k) {
    const unsigned w10 = w[k] >> 10;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const unsigned mask = (((1u << BITS) - 1) << (BITS * (j < DIRECT ? j : j - DIRECT))) * 0x10001u;
      h[k * PER + j] = (j < DIRECT ? w[k] : w10) & mask;
    }
  }
}

// Lane's loads of the tile record at r: its key words, its value words, its slots' norms (lane (g, t): 16 bytes at 16 t).
__device__ __forceinline__ void load_tile(const unsigned char* r, int lane, words_t& k, words_t& v, uint4& n) {
  k = __ldcs(reinterpret_cast<const words_t*>(r) + lane);
  v = __ldcs(reinterpret_cast<const words_t*>(r + 512 * BITS / 2) + lane);
  n = __ldcs(reinterpret_cast<const uint4*>(r + 1024 * BITS / 2) + lane % 4);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MINBLOCKS)
partial(const float* __restrict__ qk,       // (B, H, GQ, D) float32: q~ scale 2^(EMAX - e), the scores' query
        const float* __restrict__ bias,     // (B, H, GQ) float32: q~ . zero
        const unsigned char* __restrict__ records, long tiles,  // (B, H, tiles, RECORD)
        int tiles_per_split, float score_scale,                 // 2^(24 - EMAX)
        float* __restrict__ part_acc, float* __restrict__ part_mlz) {  // (B, H, splits, WARPS, GQ, D), (.., 3, GQ)
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, H = gridDim.y, w = threadIdx.x / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long bh = (long)b * H + h;
  // The scores' A fragments: row g head g's hi, row g + 8 its lo; k-slice ks: channels 16 ks + 2t + {0, 1}, + 8.
  uint4 qa[KS];
  const float* q = qk + bh * GQ * D;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (g < GQ) {
      const float* r = q + g * D + 16 * ks + 2 * t;
      x[0] = r[0]; x[1] = r[1]; x[2] = r[8]; x[3] = r[9];
    }
    qa[ks] = hi_lo_fragment(x);
  }
  const float bias_g = g < GQ ? bias[bh * GQ + g] : 0.f;

  const long split_first = (long)split * tiles_per_split;
  const long split_end = min(split_first + tiles_per_split, tiles);
  const long per_warp = (split_end - split_first + WARPS - 1) / WARPS;
  const long first = min(split_first + w * per_warp, split_end), end = min(first + per_warp, split_end);
  const unsigned char* base = records + bh * tiles * RECORD;

  float acc[KS][4];
#pragma unroll
  for (int u = 0; u < KS; ++u)
    for (int i = 0; i < 4; ++i) acc[u][i] = 0.f;
  float m = NEG_INF, l = 0.f, lz = 0.f;

  words_t kw[DEPTH], vw[DEPTH];
  uint4 nw[DEPTH];
#pragma unroll
  for (int s = 0; s < DEPTH; ++s)
    if (first + s < end) load_tile(base + (first + s) * RECORD, lane, kw[s], vw[s], nw[s]);
  for (long i0 = first; i0 < end; i0 += DEPTH) {
#pragma unroll
    for (int s = 0; s < DEPTH; s += TILES) {
      if (i0 + s >= end) break;
      // TILES tiles scored, then one softmax step over them (a tile past the warp's end scores -inf)
      float sc[TILES][4], p[TILES][4];
      float2 vn[TILES][2];
#pragma unroll
      for (int u = 0; u < TILES; ++u) {
        unsigned kh[32];
        unpack(kw[s + u], kh);
        float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) mma16816(c[nt], qa[ks], kh[16 * nt + 2 * ks], kh[16 * nt + 2 * ks + 1]);
        const __half2* n = reinterpret_cast<const __half2*>(&nw[s + u].x);
        const float2 kn01 = __half22float2(n[0]), kn89 = __half22float2(n[1]);
        vn[u][0] = __half22float2(n[2]);
        vn[u][1] = __half22float2(n[3]);
        const bool live = i0 + s + u < end;
        sc[u][0] = live ? kn01.x * fmaf(score_scale, c[0][0] + c[0][2], bias_g) : NEG_INF;
        sc[u][1] = live ? kn01.y * fmaf(score_scale, c[0][1] + c[0][3], bias_g) : NEG_INF;
        sc[u][2] = live ? kn89.x * fmaf(score_scale, c[1][0] + c[1][2], bias_g) : NEG_INF;
        sc[u][3] = live ? kn89.y * fmaf(score_scale, c[1][1] + c[1][3], bias_g) : NEG_INF;
      }
      const float m_old = m;
      softmax_tiles<TILES>(sc, m, l, p, acc);
      if (m != m_old) lz *= exp2f(m_old - m);
#pragma unroll
      for (int u = 0; u < TILES; ++u) {
        const float p0 = p[u][0] * vn[u][0].x, p1 = p[u][1] * vn[u][0].y;
        const float p2 = p[u][2] * vn[u][1].x, p3 = p[u][3] * vn[u][1].y;
        const unsigned b0 = pack_half2(p0, p1), b1 = pack_half2(p2, p3);
        // the zeros' weight from the fp16 weights the mma takes: vzero lz and vscale O then cancel exactly
        const float2 r0 = __half22float2(*reinterpret_cast<const __half2*>(&b0));
        const float2 r1 = __half22float2(*reinterpret_cast<const __half2*>(&b1));
        lz += (r0.x + r0.y) + (r1.x + r1.y);
        unsigned vh[32];
        unpack(vw[s + u], vh);
        const long next = i0 + s + u + DEPTH;
        if (next < end) load_tile(base + next * RECORD, lane, kw[s + u], vw[s + u], nw[s + u]);  // DEPTH ahead
#pragma unroll
        for (int mt = 0; mt < KS; ++mt)
          mma16816(acc[mt], make_uint4(vh[2 * mt], vh[2 * mt + 1], vh[16 + 2 * mt], vh[16 + 2 * mt + 1]), b0, b1);
      }
    }
  }
  // Lane (g, t) holds a share of head g's l and lz (its tokens), and O^T rows 16 mt + g (+8), heads 2t, 2t+1.
  for (int o = 1; o < 4; o *= 2) {
    l += __shfl_xor_sync(0xffffffff, l, o);
    lz += __shfl_xor_sync(0xffffffff, lz, o);
  }
  const long part = (bh * gridDim.x + split) * WARPS + w;
  float* pa = part_acc + part * GQ * D;
  float* pm = part_mlz + part * 3 * GQ;
  if (t == 0 && g < GQ) {
    pm[g] = m;
    pm[GQ + g] = l;
    pm[2 * GQ + g] = lz;
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int head = 2 * t + (i & 1), ch = 16 * mt + g + 8 * (i >> 1);
      if (head < GQ) pa[head * D + ch] = acc[mt][i];
    }
}

#define MAX_PARTS 4096
extern "C" __global__ void __launch_bounds__(D) merge(const float* __restrict__ part_acc,
                                                    const float* __restrict__ part_mlz, int parts,
                                                    const float* __restrict__ vzero,   // (D,)
                                                    const float* __restrict__ vscale,  // (D,) vscale 2^(24 - e)
                                                    float* __restrict__ out) {         // (B, H GQ, D)
  // The parts' weights exp2(m - M) computed once, by the threads side by side (parts <= MAX_PARTS), then each
  // thread's channel summed over the parts with its loads independent of each other.
  __shared__ float wgt[MAX_PARTS];
  __shared__ float red[3][D / 32];
  const int qh = blockIdx.x, b = blockIdx.y, c = threadIdx.x, h = qh / GQ, g = qh % GQ;
  const int lane = c % 32, warp = c / 32;
  const long bh = (long)b * (gridDim.x / GQ) + h;
  const float* pm = part_mlz + bh * parts * 3 * GQ;
  float M = NEG_INF;
  for (int p = c; p < parts; p += D) M = fmaxf(M, pm[p * 3 * GQ + g]);
  for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
  if (lane == 0) red[0][warp] = M;
  __syncthreads();
  M = red[0][0];
  for (int w = 1; w < D / 32; ++w) M = fmaxf(M, red[0][w]);
  float L = 0.f, LZ = 0.f;
  for (int p = c; p < parts; p += D) {
    const float mp = pm[p * 3 * GQ + g];
    const float x = mp == NEG_INF ? 0.f : exp2f(mp - M);
    wgt[p] = x;
    L += x * pm[p * 3 * GQ + GQ + g];
    LZ += x * pm[p * 3 * GQ + 2 * GQ + g];
  }
  for (int o = 16; o > 0; o /= 2) {
    L += __shfl_xor_sync(0xffffffff, L, o);
    LZ += __shfl_xor_sync(0xffffffff, LZ, o);
  }
  __syncthreads();
  if (lane == 0) {
    red[1][warp] = L;
    red[2][warp] = LZ;
  }
  __syncthreads();
  L = 0.f;
  LZ = 0.f;
  for (int w = 0; w < D / 32; ++w) {
    L += red[1][w];
    LZ += red[2][w];
  }
  const float* pa = part_acc + (bh * parts * GQ + g) * D + c;
  float A[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int p = 0;
  for (; p + 8 <= parts; p += 8)
#pragma unroll
    for (int u = 0; u < 8; ++u) A[u] += wgt[p + u] * pa[(long)(p + u) * GQ * D];
  for (; p < parts; ++p) A[0] += wgt[p] * pa[(long)p * GQ * D];
  const float a = ((A[0] + A[1]) + (A[2] + A[3])) + ((A[4] + A[5]) + (A[6] + A[7]));
  out[((long)b * gridDim.x + qh) * D + c] = (vzero[c] * LZ + vscale[c] * a) / L;
}
