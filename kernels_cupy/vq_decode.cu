// Fused VecInfer decode attention over codebook codes (issue 18): the INT2 kernel's tensor-core pipeline
// (quant_decode.cu) with a codebook gather where that kernel unpacks 2-bit codes.
//
// Reads the layout of kvcalib/vq_layout.py (its module docstring has the table), for one new query per
// head q (B, Hq, D), QT (fp16 or bf16), in the model's basis:
//   kcodes, vcodes (B, HKV, CAPT, RK | RV) uint8   each flushed token's codes, LSB-first bitstream rows
//   kbook (G, 2^MK, NK), vbook (G, 2^MV, NV) fp16   codebooks, G = 1 (shared) or HKV (one per KV head)
//   smooth (HKV, D) fp16 or null                    the keys' smoothing lambda
//   ksink, vsink (B, HKV, CAPS, D) fp16             the first min(sinks, T) tokens, read instead of their codes
//   kres, vres (B, HKV, CAPR, D) fp16               the residual window
//   lengths, residuals (B,) int32 or null            per-sequence T and r read on the device (a captured step)
// Limit: q~'s fp16 pair needs |q lambda H| below 65504 (a bfloat16 query beyond it gives inf scores).
// The codes hold keys in the codec basis k~ = (k / lambda) H (H with HADAMARD, else the identity): the packed
// blocks take q~ = (q lambda) H, computed here in float32 (`warp_hadamard`), so that q~ . k~ = q . k; the
// sinks and the residual are held as they came in, in the model's basis, and meet q itself. Values are
// coded as they are.
//
// Blocks (part, kv head, batch): parts below num_splits take split_len flushed tokens each (the packed
// blocks), the others RT rows each of the float16 tokens: the sinks, then the residual window (the
// extra blocks, `extra_body`). Every part writes one partial as `merge` of quant_decode.cu reads it: the
// unnormalised sum of exp2(s - m) v, m and the sum of exp2(s - m), s the score in log2 units; an empty
// part writes m = -inf, which merge skips.
//
// Packed blocks. Both codebooks of the block's KV head sit in shared memory; code rows stream through a
// ring of NSTAGE stages (cp.async, ST tokens each). A warp takes TILES tiles of 16 tokens per stage:
//   scores  S^T (16 tokens x 8 heads)  = K (16 x D) . Q~^T   on mma.m16n8k16 (f16 in, f32 accumulate),
//   output  O^T (D x 8 heads)         += V^T (D x 16 tokens) . P^T,
// heads GQ..7 idle (or, with GQ <= 4, the fp16 remainders of q~: LO_COLUMNS). The A operands are the
// codebook's centroids themselves, gathered from shared memory straight into the mma fragments: the
// channels of a key and of a value are permuted so that each lane's share of a token is whole sub-vectors.
//   Keys: lane (g, t) holds, of tokens g and g + 8, the fragment columns 2t, 2t+1, 2t+8, 2t+9 of every
//   16-channel k-slice: D/4 numbers per token. Column k of slice ks stands for codec channel
//   (k % 8) / 2 * D/4 + 4 ks + 2 (k / 8) + k % 2, so lane t's D/4 numbers are the codec channels
//   t D/4 .. (t + 1) D/4 - 1: CK = D / (4 NK) whole sub-vectors, one gather of NK fp16 each, whose
//   half2 words are the fragment's registers as they are. q~'s B fragments follow the same permutation.
//   Values: lane (g, t) holds output rows g and g + 8 of every 16-row block u, of tokens 2t, 2t+1, 2t+8,
//   2t+9. Row g of block u stands for codec channel g D/8 + 2u, row g + 8 for g D/8 + 2u + 1: lane group
//   g's channels are g D/8 .. (g + 1) D/8 - 1, CV = D / (8 NV) whole sub-vectors per token; a byte
//   permute pairs two tokens' halves into each register. The partial is written back in codec order.
// Each (token, sub-vector) is gathered once per KV head, shared by its GQ query heads. The products are
// exact (fp16 x fp16 into fp32): the scores err only by q~'s rounding, which LO_COLUMNS / LO_MMA carry
// as an fp16 pair hi + lo; P is rounded to fp16 for the values' mma (benchmarks/vq_lut_emulated.py: 0.27x
// to 0.64x of SDPA's row error on diffuse rows, nothing on peaked ones).
//
// Defines: D, NK, MK, RK, NV, MV, RV, GQ (<= 8), QT, HADAMARD, WARPS, TILES, NSTAGE, BLOCKS_PER_SM, KUNIT, VUNIT (bytes
// a stage's rows are copied in: 16 or 4 with cp.async, 1 with plain loads, as the rows' alignment allows),
// KREPL, VREPL (copies of each book in shared memory: 1, or 128 / (2 NK) for conflict-free gathers).
#include "decode_common.cuh"

#define NT (32 * WARPS)
#define ST (16 * WARPS * TILES)  // tokens per stage
#define KS (D / 16)              // 16-channel k-slices of a key, 16-row blocks of the output
#define CK (D / (4 * NK))        // key sub-vectors per lane and token
#define CV (D / (8 * NV))        // value sub-vectors per lane and token
#define RT 16                    // float16 rows per extra block
#ifndef LO_PAIR  // 0: q~ rounded to fp16 alone (A/B only: the peer's own rounding, no margin left for P's)
#define LO_PAIR 1
#endif
#ifndef PREFETCH_V  // 1: measured no faster (benchmarks/vq_decode_plans.py), kept for A/B
#define PREFETCH_V 0
#endif
#define LO_COLUMNS (LO_PAIR && GQ <= 4)
#define LO_MMA (LO_PAIR && GQ > 4)
#define NEG_INF __int_as_float(0xff800000)
// A lane's code bits start on a word boundary in every row (and on an 8-byte one where it loads word pairs).
#define KALIGNED (RK % 8 == 0 && (CK * MK) % 64 == 0 || (RK % 4 == 0 && (CK * MK) % 32 == 0 && ((CK * MK + 31) / 32) % 2))
#define VALIGNED (RV % 8 == 0 && (CV * MV) % 64 == 0 || (RV % 4 == 0 && (CV * MV) % 32 == 0 && ((CV * MV + 31) / 32) % 2))

// Shared memory of one block, carved in this order (kvcalib/runtime/vq_kernel.py `shared_bytes` mirrors it).
#define KBOOK_BYTES (((1 << MK) * NK * 2 * KREPL + 15) / 16 * 16)
#define VBOOK_BYTES (((1 << MV) * NV * 2 * VREPL + 15) / 16 * 16)
#define KSTAGE_BYTES ((ST * RK + 15) / 16 * 16 + 16)  // + 16: the code reader loads a word past a row
#define VSTAGE_BYTES ((ST * RV + 15) / 16 * 16 + 16)
#define RING_BYTES (NSTAGE * (KSTAGE_BYTES + VSTAGE_BYTES))
#define COMBINE_BYTES (4 * WARPS * GQ * D)
#define EXTRA_BYTES (4 * (GQ * D + GQ * RT))
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define WORK_BYTES MAX2(RING_BYTES, MAX2(COMBINE_BYTES, EXTRA_BYTES))
#define QT_BYTES (4 * GQ * D)  // q~ of the block's heads, float32, while the fragments are taken
#define SHARED_BYTES (KBOOK_BYTES + VBOOK_BYTES + WORK_BYTES + QT_BYTES)

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

// Copies the code rows of tokens [t0, min(t0 + ST, stop)) (one contiguous run of bytes) into a stage.
template <int R, int UNIT>
__device__ __forceinline__ void copy_rows(unsigned char* dst, const unsigned char* src, int t0, int stop) {
  const int bytes = (min(ST, stop - t0) * R + UNIT - 1) / UNIT * UNIT;  // whole units stay inside the capacity
  const unsigned char* from = src + (long)t0 * R;
  if (UNIT == 1) {
    for (int i = threadIdx.x; i < bytes; i += NT) dst[i] = from[i];
  } else {
    constexpr int N = (ST * R + UNIT - 1) / UNIT;
#pragma unroll
    for (int k = 0; k < (N + NT - 1) / NT; ++k) {
      const int i = (threadIdx.x + k * NT) * UNIT;
      if (i < bytes) cp_async(dst + i, from + i, UNIT);
    }
  }
}

// A codebook of E entries of N float16 numbers to shared memory, in REPL copies (`centroid`): 16 bytes a
// load where the sizes allow (the host aligns the books).
template <int E, int N, int REPL>
__device__ __forceinline__ void copy_book(__half* dst, const __half* src) {
  if constexpr (REPL == 1 && E * N % 8 == 0) {
    for (int i = threadIdx.x; i < E * N / 8; i += NT) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if constexpr (REPL > 1 && N % 8 == 0) {
    for (int i = threadIdx.x; i < E * REPL * N / 8; i += NT) {  // 16-byte piece i of the copies
      const int e = i / (REPL * N / 8), piece = i % (N / 8);
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src + e * N)[piece];
    }
  } else {
    for (int i = threadIdx.x; i < E * REPL * N; i += NT) dst[i] = src[(i / (REPL * N)) * N + i % N];
  }
}

// COUNT codes of BITS bits starting at bit `bit` of a stage (32-bit aligned), to out[].
// ALIGNED: the caller knows `bit` is a multiple of 32 (whole words, no funnel shift).
template <int BITS, int COUNT, bool ALIGNED>
__device__ __forceinline__ void codes_at(const unsigned char* stage, int bit, unsigned* out) {
  constexpr int W = (BITS * COUNT + 31) / 32;
  const unsigned* w = reinterpret_cast<const unsigned*>(stage) + (bit >> 5);
  unsigned c[W + 1];
  if (ALIGNED) {
    if (W % 2 == 0) {  // 8-byte loads (the words are 8-byte aligned: see the callers)
#pragma unroll
      for (int i = 0; i < W; i += 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(w + i);
        c[i] = x.x, c[i + 1] = x.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) c[i] = w[i];
    }
  } else {
    const int sh = bit & 31;
    unsigned raw[W + 1];
#pragma unroll
    for (int i = 0; i <= W; ++i) raw[i] = w[i];
#pragma unroll
    for (int i = 0; i < W; ++i) c[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
  }
  c[W] = 0u;
#pragma unroll
  for (int k = 0; k < COUNT; ++k) {
    constexpr int M = (1 << BITS) - 1;
    const int at = k * BITS, wi = at / 32, off = at % 32;
    const unsigned v = off + BITS <= 32 ? c[wi] >> off : __funnelshift_r(c[wi], c[wi + 1], off);
    out[k] = v & M;
  }
}

// The N / 2 half2 words of centroid `code` of a codebook in shared memory. A book held in REPL = 128 / (2N)
// copies (`copy_book`) stores entry e's copies side by side, copy i in banks 2N/4 i ..: lane L reads copy
// L % REPL, so the lanes that share one shared-memory wavefront (16 at 8 bytes, 8 at 16) never meet in a bank.
template <int N, int REPL>
__device__ __forceinline__ void centroid(const __half* book, unsigned code, unsigned* out) {
  const unsigned* p = reinterpret_cast<const unsigned*>(book + (code * REPL + (REPL > 1 ? threadIdx.x % REPL : 0)) * N);
  if (N == 2) {
    out[0] = p[0];
  } else if (N == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    out[0] = x.x, out[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint4 x = reinterpret_cast<const uint4*>(p)[i];
      out[4 * i] = x.x, out[4 * i + 1] = x.y, out[4 * i + 2] = x.z, out[4 * i + 3] = x.w;
    }
  }
}

// Online softmax over a warp's tiles of scores (log2 units, -inf for absent tokens): probabilities to p
// (the scores' layout), running max m and this lane's share l of the sum per head column 2t + e; the
// output accumulators are rescaled when the running max moves (quant_decode.cu `softmax_tiles`).
__device__ __forceinline__ void softmax_tiles(const float (*sc)[4], float* m, float* l, float (*p)[4], float (*acc)[4]) {
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) mx[i & 1] = fmaxf(mx[i & 1], sc[j][i]);
  for (int e = 0; e < 2; ++e)
    for (int o = 4; o < 32; o *= 2) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffff, mx[e], o));
  float alpha[2];
  for (int e = 0; e < 2; ++e) {
    const float m_new = fmaxf(m[e], mx[e]);
    alpha[e] = m_new == NEG_INF ? 1.f : exp2f(m[e] - m_new);  // m = -inf before: 0 (nothing to rescale)
    m[e] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      p[j][e] = m_new == NEG_INF ? 0.f : exp2f(sc[j][e] - m_new);
      p[j][2 + e] = m_new == NEG_INF ? 0.f : exp2f(sc[j][2 + e] - m_new);
      sum += p[j][e] + p[j][2 + e];
    }
    l[e] = l[e] * alpha[e] + sum;
  }
  if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f))
    for (int u = 0; u < KS; ++u)
      for (int i = 0; i < 4; ++i) acc[u][i] *= alpha[i & 1];
}

// The float16 rows (sinks, then the residual window): rows chunk RT .. chunk RT + RT - 1 of the
// n = sinks + r of this (batch, kv head). Scores: warp per row, lanes over channels; values: thread per
// (head, channel), coalesced rows.
__device__ __forceinline__ void extra_body(const QT* __restrict__ q, const __half* __restrict__ ksink,
                                           const __half* __restrict__ vsink, int sinks, int caps,
                                           const __half* __restrict__ kres, const __half* __restrict__ vres, int r,
                                           int capr, float scale_log2, float* __restrict__ part_acc,
                                           float* __restrict__ part_ml, int chunk, float* smem) {
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, num_parts = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, e0 = chunk * RT, n = sinks + r;
  const long bh = (long)b * gridDim.y + kvh;
  float (*qs)[D] = reinterpret_cast<float (*)[D]>(smem);
  float (*s)[RT] = reinterpret_cast<float (*)[RT]>(smem + GQ * D);
  for (int i = threadIdx.x; i < GQ * D; i += NT) qs[i / D][i % D] = to_float(q[(bh * GQ + i / D) * D + i % D]) * scale_log2;
  __syncthreads();
  for (int tt = warp; tt < RT; tt += WARPS) {
    const int e = e0 + tt;
    const __half* kp = e < sinks ? ksink + (bh * caps + e) * D : kres + (bh * capr + e - sinks) * D;
    float kv[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) kv[i] = e < n ? __half2float(kp[lane + 32 * i]) : 0.f;
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) v += qs[h][lane + 32 * i] * kv[i];
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0) s[h][tt] = e < n ? v : NEG_INF;
    }
  }
  __syncthreads();
  for (int h = warp; h < GQ; h += WARPS) {  // RT <= 32: a lane per row
    const float x = lane < RT ? s[h][lane] : NEG_INF;
    float mx = x;
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    const float p = mx == NEG_INF ? 0.f : exp2f(x - mx);
    float sum = p;
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    __syncwarp();
    if (lane < RT) s[h][lane] = p;
    if (lane == 0) {
      const long row = (bh * GQ + h) * num_parts + part;
      part_ml[row * 2] = mx;
      part_ml[row * 2 + 1] = sum;
    }
  }
  __syncthreads();
  for (int x = threadIdx.x; x < GQ * D; x += NT) {
    const int h = x / D, c = x % D;
    float acc = 0.f;
    for (int tt = 0; tt < RT && e0 + tt < n; ++tt) {
      const int e = e0 + tt;
      const __half* vp = e < sinks ? vsink + (bh * caps + e) * D : vres + (bh * capr + e - sinks) * D;
      acc += s[h][tt] * __half2float(vp[c]);
    }
    part_acc[((bh * GQ + h) * num_parts + part) * D + c] = acc;
  }
}

// The value centroids of one tile (stage row `row`) this lane feeds to the values' mma: tokens 2t, 2t+1,
// 2t+8, 2t+9, lane group g's D/8 channels (CV sub-vectors), as half2 words.
__device__ __forceinline__ void value_centroids(const unsigned char* stage, const __half* vb, int row,
                                                unsigned (*va)[D / 16]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int k4 = 0; k4 < 4; ++k4) {
    unsigned code[CV];
    const int tok = row + 2 * t + (k4 & 1) + 8 * (k4 >> 1);
    codes_at<MV, CV, VALIGNED>(stage, tok * RV * 8 + g * CV * MV, code);
#pragma unroll
    for (int k = 0; k < CV; ++k) centroid<NV, VREPL>(vb, code[k], &va[k4][k * NV / 2]);
  }
}

extern "C" __global__ void __launch_bounds__(NT, BLOCKS_PER_SM) vq_partial(
    const QT* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const __half* __restrict__ kbook, const __half* __restrict__ vbook, int kbook_groups, int vbook_groups,
    const __half* __restrict__ smooth,
    const __half* __restrict__ ksink, const __half* __restrict__ vsink, int sinks, int caps,
    const __half* __restrict__ kres, const __half* __restrict__ vres, int r, int capr, int T, int capt,
    int split_len, int num_splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml,
    const int* __restrict__ lengths, const int* __restrict__ residuals) {
  extern __shared__ __align__(16) unsigned char smem[];
  {  // the host sized the launch's shared memory from the same formula; a mismatch must not go unseen
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < SHARED_BYTES) __trap();
  }
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, num_parts = gridDim.x;
  // A captured step reads each sequence's counts on the device and spreads its own T over all the
  // splits, in whole stages (quant_decode.cu's `packed_partial` does the same).
  if (lengths != nullptr) {  // both or neither (the host checks); clamped to the buffers, whatever a caller wrote
    T = min(lengths[b], capt);
    const int units = (T + ST - 1) / ST;
    split_len = max(1, (units + num_splits - 1) / num_splits) * ST;
    r = min(residuals[b], capr);
  }
  sinks = min(sinks, T);  // the first flushed tokens are the sinks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long bh = (long)b * hkv + kvh;
  __half* kb = reinterpret_cast<__half*>(smem);
  __half* vb = reinterpret_cast<__half*>(smem + KBOOK_BYTES);
  unsigned char* work = smem + KBOOK_BYTES + VBOOK_BYTES;
  if (part >= num_splits) {
    extra_body(q, ksink, vsink, sinks, caps, kres, vres, r, capr, scale_log2, part_acc, part_ml, part - num_splits,
               reinterpret_cast<float*>(work));
    return;
  }
  const int start = part * split_len, stop = min(start + split_len, T);
  const int stages = max(0, (stop - start + ST - 1) / ST);
  kcodes += bh * capt * RK;
  vcodes += bh * capt * RV;
  auto kstage = [&](int s) { return work + (s % NSTAGE) * (KSTAGE_BYTES + VSTAGE_BYTES); };
  auto vstage = [&](int s) { return work + (s % NSTAGE) * (KSTAGE_BYTES + VSTAGE_BYTES) + KSTAGE_BYTES; };
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < stages) {
      copy_rows<RK, KUNIT>(kstage(s), kcodes, start + s * ST, stop);
      copy_rows<RV, VUNIT>(vstage(s), vcodes, start + s * ST, stop);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
  if (stages > 0) {  // the books, while the first stages are in flight
    copy_book<(1 << MK), NK, KREPL>(kb, kbook + (kbook_groups > 1 ? (long)kvh * (1 << MK) * NK : 0));
    copy_book<(1 << MV), NV, VREPL>(vb, vbook + (vbook_groups > 1 ? (long)kvh * (1 << MV) * NV : 0));
  }
  // q~ = (q lambda) H of the block's heads, float32, to shared memory: warp w takes heads w, w + WARPS, ...
  float (*qt)[D] = reinterpret_cast<float (*)[D]>(work + WORK_BYTES);
  for (int h = warp; h < GQ; h += WARPS) {
    float x[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int c = lane + 32 * e;
      x[e] = to_float(q[(bh * GQ + h) * D + c]) * (smooth != nullptr ? __half2float(smooth[kvh * D + c]) : 1.f);
    }
    if (HADAMARD) warp_hadamard(x);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) qt[h][lane + 32 * e] = x[e];
  }
  __syncthreads();
  // q~'s B fragments, in registers: head g (column g), k-slice ks: codec channels t D/4 + 4 ks + {0, 1} and
  // + {2, 3} (the keys' permutation), as fp16 hi; the remainders lo in columns 4..7 (LO_COLUMNS: lanes of
  // g = 4 + h carry head h's) or in fragments of their own (LO_MMA).
  uint2 qb[KS];
#if LO_MMA
  uint2 ql[KS];
#endif
  {
    const int h = LO_COLUMNS && g >= 4 ? g - 4 : g;
    const bool lo_lane = LO_COLUMNS && g >= 4;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (h < GQ) f = *reinterpret_cast<const float4*>(&qt[h][t * (D / 4) + 4 * ks]);
      const float x[4] = {f.x, f.y, f.z, f.w};
      float hi[4], lo[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        hi[i] = __half2float(__float2half_rn(x[i]));
        lo[i] = x[i] - hi[i];
      }
      if (lo_lane) qb[ks] = make_uint2(pack_half2(lo[0], lo[1]), pack_half2(lo[2], lo[3]));
      else qb[ks] = make_uint2(pack_half2(hi[0], hi[1]), pack_half2(hi[2], hi[3]));
#if LO_MMA
      ql[ks] = make_uint2(pack_half2(lo[0], lo[1]), pack_half2(lo[2], lo[3]));
#endif
    }
  }
  float acc[KS][4];  // O^T: rows g D/8 + 2u (+1), columns heads 2t, 2t+1
  for (int u = 0; u < KS; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  for (int s = 0; s < stages; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 2));
    __syncthreads();  // stage s (and the books) landed for every thread; stage s - 1 is no longer read
    const int next = s + NSTAGE - 1;
    if (next < stages) {
      copy_rows<RK, KUNIT>(kstage(next), kcodes, start + next * ST, stop);
      copy_rows<RV, VUNIT>(vstage(next), vcodes, start + next * ST, stop);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    const int row0 = 16 * TILES * warp;                   // the warp's first token in the stage
    const int tok0 = start + s * ST + row0;
    if (tok0 >= stop) continue;
    const unsigned char* ks_ = kstage(s);
    const unsigned char* vs_ = vstage(s);
    float sc[TILES][4], pr[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      unsigned ka[2][D / 8];  // tokens g, g + 8: this lane's D/4 channels as half2 words
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        unsigned code[CK];
        codes_at<MK, CK, KALIGNED>(ks_, (row0 + 16 * j + g + 8 * rr) * RK * 8 + t * CK * MK, code);
#pragma unroll
        for (int k = 0; k < CK; ++k) centroid<NK, KREPL>(kb, code[k], &ka[rr][k * NK / 2]);
      }
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};  // two chains
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint4 a = make_uint4(ka[0][2 * ks], ka[1][2 * ks], ka[0][2 * ks + 1], ka[1][2 * ks + 1]);
        mma16816(ks % 2 ? c1 : c0, a, qb[ks].x, qb[ks].y);
#if LO_MMA
        mma16816(ks % 2 ? c0 : c1, a, ql[ks].x, ql[ks].y);
#endif
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float x = c0[i] + c1[i];
#if LO_COLUMNS  // head h's remainder terms sit in column h + 4, two lanes over
        x += __shfl_xor_sync(0xffffffff, x, 2);
#endif
        const int tok = tok0 + 16 * j + g + 8 * (i / 2);
        sc[j][i] = tok < stop && tok >= sinks ? x * scale_log2 : NEG_INF;
      }
    }
    // The values' centroids: gathered before the softmax (PREFETCH_V), so that their latency overlaps its
    // shuffles, or after it, tile by tile (fewer registers live).
#if PREFETCH_V
    unsigned va[TILES][4][D / 16];  // tile j, tokens 2t, 2t+1, 2t+8, 2t+9: lane group g's D/8 channels as half2 words
#pragma unroll
    for (int j = 0; j < TILES; ++j) value_centroids(vs_, vb, row0 + 16 * j, va[j]);
    softmax_tiles(sc, m, l, pr, acc);
#else
    softmax_tiles(sc, m, l, pr, acc);
#endif
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const unsigned pb0 = transpose8x8(pack_half2(pr[j][0], pr[j][1]));
      const unsigned pb1 = transpose8x8(pack_half2(pr[j][2], pr[j][3]));
#if PREFETCH_V
      unsigned (*vt)[D / 16] = va[j];
#else
      unsigned vt[4][D / 16];
      value_centroids(vs_, vb, row0 + 16 * j, vt);
#endif
#pragma unroll
      for (int u = 0; u < KS; ++u) {
        const uint4 a = make_uint4(__byte_perm(vt[0][u], vt[1][u], 0x5410), __byte_perm(vt[0][u], vt[1][u], 0x7632),
                                   __byte_perm(vt[2][u], vt[3][u], 0x5410), __byte_perm(vt[2][u], vt[3][u], 0x7632));
        mma16816(acc[u], a, pb0, pb1);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  for (int e = 0; e < 2; ++e)
    for (int o = 4; o < 32; o *= 2) l[e] += __shfl_xor_sync(0xffffffff, l[e], o);
  // ---- combine the warps (in the ring's memory, now idle) and write one partial, in codec order ----
  __syncthreads();
  __shared__ float wm[WARPS][8], wl[WARPS][8];
  float (*wacc)[GQ][D] = reinterpret_cast<float (*)[GQ][D]>(work);
  if (g == 0)
    for (int e = 0; e < 2; ++e) {
      wm[warp][2 * t + e] = m[e];
      wl[warp][2 * t + e] = l[e];
    }
  for (int u = 0; u < KS; ++u)
    for (int i = 0; i < 4; ++i) {
      const int head = 2 * t + (i & 1), ch = g * (D / 8) + 2 * u + i / 2;
      if (head < GQ) wacc[warp][head][ch] = acc[u][i];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < GQ * D; i += NT) {
    const int h = i / D, c = i % D;
    float M = NEG_INF;
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
    float num = 0.f, den = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      if (wm[w][h] == NEG_INF) continue;
      const float f = exp2f(wm[w][h] - M);
      num += f * wacc[w][h][c];
      den += f * wl[w][h];
    }
    const long row = (bh * GQ + h) * num_parts + part;
    part_acc[row * D + c] = num;
    if (c == 0) {
      part_ml[row * 2] = M;
      part_ml[row * 2 + 1] = den;
    }
  }
}
