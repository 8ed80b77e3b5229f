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
// ring of NSTAGE stages of ST tokens (bulk copies on an mbarrier per stage; cp.async where the rows are not
// 16-byte aligned). A warp takes TILES tiles of 16 tokens per stage:
//   scores  S (16 rows x 8 tokens, twice) = Q~ (16 x D) . K^T (D x 8)  on mma.m16n8k16 (f16 in, f32 accumulate),
//   output  O^T (D x 8 heads)            += V^T (D x 16 tokens) . P^T,
// Q~'s row h is head h's fp16 hi and row 8 + h its remainder lo (rows of heads >= GQ zero), so that a lane
// adds the two accumulators of its head and q~ is carried as an fp16 pair for every GQ <= 8. The centroids
// are gathered from shared memory straight into the mma fragments: the channels of a key and of a value
// are permuted so that each lane's share of a token is whole sub-vectors.
//   Keys (the B operand, one 8-token mma per half tile): lane (g, t) holds, of tokens g and g + 8, the
//   fragment rows 2t, 2t+1, 2t+8, 2t+9 of every 16-channel k-slice: D/4 numbers per token. Row k of slice
//   ks stands for codec channel (k % 8) / 2 * D/4 + 4 ks + 2 (k / 8) + k % 2, so lane t's D/4 numbers
//   are the codec channels t D/4 .. (t + 1) D/4 - 1: CK = D / (4 NK) whole sub-vectors, one gather of NK
//   fp16 each, whose half2 words are the fragment's registers as they are. Q~'s A fragments follow the
//   same permutation. The scores come out as lane (g, t): head g, tokens 2t, 2t+1, 2t+8, 2t+9, which is
//   P^T's B fragment for the values as it is (no transpose).
//   Values: lane (g, t) holds output rows g and g + 8 of every 16-row block u, of tokens 2t, 2t+1, 2t+8,
//   2t+9. Row g of block u stands for codec channel g D/8 + 2u, row g + 8 for g D/8 + 2u + 1: lane group
//   g's channels are g D/8 .. (g + 1) D/8 - 1, CV = D / (8 NV) whole sub-vectors per token; a byte
//   permute pairs two tokens' halves into each register. The partial is written back in codec order.
// A gather is one byte permute (8-bit codes) or shift and mask, one shift-add onto this lane's copy of the
// book, one shared load. Each (token, sub-vector) is gathered once per KV head, shared by its GQ query
// heads. The products are exact (fp16 x fp16 into fp32): the scores err only by q~'s rounding, which the
// hi + lo pair carries; P is rounded to fp16 for the values' mma (benchmarks/vq_lut_emulated.py: 0.27x
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
#ifndef RESCALE_SLACK  // 0: the exact running max (A/B)
#define RESCALE_SLACK 8.f
#endif
#define BULK_ROWS (KUNIT == 16 && VUNIT == 16)  // rows 16-byte aligned: bulk copies (else cp.async)
#ifndef PREFETCH_V  // 1: measured no faster (benchmarks/vq_decode_plans.py), kept for A/B
#define PREFETCH_V 0
#endif
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
#define EXTRA_BYTES (4 * (GQ * D + GQ * RT) + 4 * RT * D)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define WORK_BYTES MAX2(RING_BYTES, MAX2(COMBINE_BYTES, EXTRA_BYTES))
#define QT_BYTES (4 * GQ * D)  // q~ of the block's heads, float32, while the fragments are taken
#define SHARED_BYTES (KBOOK_BYTES + VBOOK_BYTES + WORK_BYTES + QT_BYTES)

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

// The tensor memory accelerator's bulk copies (BULK_ROWS): one thread copies a stage's rows (one contiguous
// run of bytes each for keys and values) and the block waits on the stage's mbarrier; cp.async by every
// thread cost ~45 address instructions per warp and stage and 3.5x the ideal shared-memory wavefronts.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
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
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
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

// A codebook of E entries of N float16 numbers to shared memory, in REPL copies (`centroid`). One copy: a
// flat cp.async of 16-byte pieces (the caller commits it with the first stage of code rows). More: entry
// e's REPL copies fill the 128 bytes at 128 e, written as 16-byte pieces in order (conflict-free stores)
// from registers loaded first, all loads in flight at once (an 8-byte cp.async per copy cost one
// shared-memory wavefront per lane). The host aligns the books to 16 bytes; N is 2, 4 or a multiple of 8.
template <int E, int N, int REPL>
__device__ __forceinline__ void copy_book(__half* dst, const __half* src) {
  if constexpr (REPL == 1) {
    static_assert(E * N * 2 % 16 == 0, "a single book is copied in 16-byte pieces");
    for (int i = threadIdx.x; i < E * N * 2 / 16; i += NT) cp_async(dst + 8 * i, src + 8 * i, 16);
  } else {
    static_assert(REPL * 2 * N == 128, "copies of an entry fill 128 bytes");
    constexpr int PIECES = E * 8, PER = (PIECES + NT - 1) / NT;
    uint4 x[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * NT, e = i / 8, c = i % 8;
      if (i < PIECES) {
        if constexpr (N == 2) {
          const unsigned w = reinterpret_cast<const unsigned*>(src)[e];
          x[k] = make_uint4(w, w, w, w);
        } else if constexpr (N == 4) {
          const uint2 w = reinterpret_cast<const uint2*>(src)[e];
          x[k] = make_uint4(w.x, w.y, w.x, w.y);
        } else {
          x[k] = reinterpret_cast<const uint4*>(src + e * N)[c % (N / 8)];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (threadIdx.x + k * NT < PIECES) reinterpret_cast<uint4*>(dst)[threadIdx.x + k * NT] = x[k];
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
    if (BITS == 8) {  // a byte: one PRMT
      out[k] = __byte_perm(c[wi], 0u, 0x4440 + off / 8);
    } else {
      const unsigned v = off + BITS <= 32 ? c[wi] >> off : __funnelshift_r(c[wi], c[wi + 1], off);
      out[k] = v & M;
    }
  }
}

// A book held in REPL = 128 / (2N) copies (`copy_book`) stores entry e's copies side by side, copy i in
// banks 2N/4 i ..: lane L reads copy L % REPL, so the lanes that share one shared-memory wavefront (16 at
// 8 bytes, 8 at 16) never meet in a bank. `lane_book` is this lane's copy: the book plus (L % REPL) 2N bytes.
template <int N, int REPL>
__device__ __forceinline__ const unsigned char* lane_book(const __half* book) {
  return reinterpret_cast<const unsigned char*>(book) + (REPL > 1 ? threadIdx.x % REPL * 2 * N : 0);
}

// The N / 2 half2 words of centroid `code` of this lane's copy of a book: one shift-add of the code, then
// the loads.
template <int N, int REPL>
__device__ __forceinline__ void centroid(const unsigned char* book, unsigned code, unsigned* out) {
  const unsigned* p = reinterpret_cast<const unsigned*>(book + code * (REPL * 2 * N));
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

// Online softmax over a warp's tiles of scores (log2 units, -inf for absent tokens): lane (g, t) holds head
// g's scores of tokens 2t, 2t+1, 2t+8, 2t+9 of each tile. Probabilities to p (the same layout), the running
// max m and this lane's share l of head g's sum; the output accumulators (columns: heads 2t, 2t+1) are
// rescaled when a running max moves, each by its own head's factor (two shuffles, rarely taken).
__device__ __forceinline__ void softmax_tiles(const float (*sc)[4], float& m, float& l, float (*p)[4], float (*acc)[4]) {
  float mx = NEG_INF;
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) mx = fmaxf(mx, sc[j][i]);
  for (int o = 1; o < 4; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
  // The max moves only when a score passes it by more than RESCALE_SLACK (log2 units): probabilities
  // then stay below 2^RESCALE_SLACK, well inside P's fp16, and the accumulators are rescaled rarely.
  const float m_new = mx > m + RESCALE_SLACK ? mx : m;
  const float alpha = m_new == m ? 1.f : exp2f(m - m_new);  // m = -inf before: 0 (nothing to rescale)
  m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) {
      p[j][i] = m_new == NEG_INF ? 0.f : exp2f(sc[j][i] - m_new);
      sum += p[j][i];
    }
  l = l * alpha + sum;
  if (__any_sync(0xffffffff, alpha != 1.f)) {
    const int t = threadIdx.x % 4;
    const float a0 = __shfl_sync(0xffffffff, alpha, 8 * t), a1 = __shfl_sync(0xffffffff, alpha, 8 * t + 4);
    for (int u = 0; u < KS; ++u)
      for (int i = 0; i < 4; ++i) acc[u][i] *= i & 1 ? a1 : a0;
  }
}

// The float16 rows (sinks, then the residual window): rows chunk RT .. chunk RT + RT - 1 of the
// n = sinks + r of this (batch, kv head). The block first copies the chunk's key and value rows to shared
// memory, every load in flight at once (they were read in a chain, a load's latency per row), then scores (warp per row, lanes over channels) and values (thread per (head, channel)).
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
  uint4* rows = reinterpret_cast<uint4*>(smem + GQ * D + GQ * RT);  // keys then values, RT x D fp16 each
  constexpr int PIECES = 2 * RT * D / 8;                              // 16-byte pieces of both
  uint4 x[(PIECES + NT - 1) / NT];
#pragma unroll
  for (int k = 0; k < (PIECES + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT, tt = i % (RT * D / 8) / (D / 8), e = e0 + tt;
    x[k] = make_uint4(0u, 0u, 0u, 0u);
    if (i < PIECES && e < n) {
      const bool val = i >= RT * D / 8;
      const __half* row = e < sinks ? (val ? vsink : ksink) + (bh * caps + e) * D
                                    : (val ? vres : kres) + (bh * capr + e - sinks) * D;
      x[k] = reinterpret_cast<const uint4*>(row)[i % (D / 8)];
    }
  }
#pragma unroll
  for (int k = 0; k < (PIECES + NT - 1) / NT; ++k)
    if (threadIdx.x + k * NT < PIECES) rows[threadIdx.x + k * NT] = x[k];
  const __half* kx = reinterpret_cast<const __half*>(rows);
  const __half* vx = kx + RT * D;
  for (int i = threadIdx.x; i < GQ * D; i += NT) qs[i / D][i % D] = to_float(q[(bh * GQ + i / D) * D + i % D]) * scale_log2;
  __syncthreads();
  for (int tt = warp; tt < RT; tt += WARPS) {
    float kv[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) kv[i] = __half2float(kx[tt * D + lane + 32 * i]);
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) v += qs[h][lane + 32 * i] * kv[i];
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0) s[h][tt] = e0 + tt < n ? v : NEG_INF;
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
  for (int i = threadIdx.x; i < GQ * D; i += NT) {  // rows past n hold zeros and p = 0
    const int h = i / D, c = i % D;
    float acc = 0.f;
#pragma unroll
    for (int tt = 0; tt < RT; ++tt) acc += s[h][tt] * __half2float(vx[tt * D + c]);
    part_acc[((bh * GQ + h) * num_parts + part) * D + c] = acc;
  }
}

// The value centroids of one tile (stage row `row`) this lane feeds to the values' mma: tokens 2t, 2t+1,
// 2t+8, 2t+9, lane group g's D/8 channels (CV sub-vectors), as half2 words.
__device__ __forceinline__ void value_centroids(const unsigned char* stage, const unsigned char* vb, int row,
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
  const unsigned char* kbl = lane_book<NK, KREPL>(kb);  // this lane's copies of the books
  const unsigned char* vbl = lane_book<NV, VREPL>(vb);
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
  const __half* kbook_h = kbook + (kbook_groups > 1 ? (long)kvh * (1 << MK) * NK : 0);  // this KV head's books
  const __half* vbook_h = vbook + (vbook_groups > 1 ? (long)kvh * (1 << MV) * NV : 0);
  auto kstage = [&](int s) { return work + (s % NSTAGE) * (KSTAGE_BYTES + VSTAGE_BYTES); };
  auto vstage = [&](int s) { return work + (s % NSTAGE) * (KSTAGE_BYTES + VSTAGE_BYTES) + KSTAGE_BYTES; };
  // q (times the keys' lambda) of the block's heads to registers first, so that its loads' latency
  // overlaps the copies: warp w takes heads w, w + WARPS, ...
  constexpr int QH = (GQ + WARPS - 1) / WARPS;
  float x[QH][D / 32];
#pragma unroll
  for (int i = 0; i < QH; ++i)
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int h = warp + i * WARPS, c = lane + 32 * e;
      x[i][e] = h < GQ ? to_float(q[(bh * GQ + h) * D + c]) * (smooth != nullptr ? __half2float(smooth[kvh * D + c]) : 1.f)
                       : 0.f;
    }
#if BULK_ROWS
  __shared__ __align__(8) unsigned long long bars[NSTAGE];  // stage s's rows land on bars[s % NSTAGE]
  // A stage's rows: whole 16-byte units (they stay inside the capacity: the host checked its stride).
  auto issue = [&](int s, unsigned extra) {
    const int t0 = start + s * ST, n = min(ST, stop - t0);
    const unsigned kbytes = (n * RK + 15) / 16 * 16, vbytes = (n * RV + 15) / 16 * 16;
    mbar_expect(&bars[s % NSTAGE], kbytes + vbytes + extra);
    bulk_copy(kstage(s), kcodes + (long)t0 * RK, kbytes, &bars[s % NSTAGE]);
    bulk_copy(vstage(s), vcodes + (long)t0 * RV, vbytes, &bars[s % NSTAGE]);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSTAGE; ++i) mbar_init(&bars[i]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    if (stages > 0) {  // single books ride on stage 0's barrier
      constexpr unsigned KB1 = KREPL == 1 ? (1 << MK) * NK * 2 : 0, VB1 = VREPL == 1 ? (1 << MV) * NV * 2 : 0;
      issue(0, KB1 + VB1);
      if (KB1) bulk_copy(kb, kbook_h, KB1, &bars[0]);
      if (VB1) bulk_copy(vb, vbook_h, VB1, &bars[0]);
      for (int s = 1; s < NSTAGE - 1 && s < stages; ++s) issue(s, 0);
    }
  }
  if (stages > 0) {  // replicated books, from registers
    if (KREPL > 1) copy_book<(1 << MK), NK, KREPL>(kb, kbook_h);
    if (VREPL > 1) copy_book<(1 << MV), NV, VREPL>(vb, vbook_h);
  }
#else
  if (stages > 0) {  // the books (single copies: in the first stage's group of cp.async)
    copy_book<(1 << MK), NK, KREPL>(kb, kbook_h);
    copy_book<(1 << MV), NV, VREPL>(vb, vbook_h);
  }
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < stages) {
      copy_rows<RK, KUNIT>(kstage(s), kcodes, start + s * ST, stop);
      copy_rows<RV, VUNIT>(vstage(s), vcodes, start + s * ST, stop);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
#endif
  // q~ = (q lambda) H, float32, to shared memory.
  float (*qt)[D] = reinterpret_cast<float (*)[D]>(work + WORK_BYTES);
#pragma unroll
  for (int i = 0; i < QH; ++i) {
    const int h = warp + i * WARPS;
    if (h >= GQ) break;
    if (HADAMARD) warp_hadamard(x[i]);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) qt[h][lane + 32 * e] = x[i][e];
  }
  __syncthreads();
  // q~'s A fragments, in registers: row g is head g's fp16 hi, row g + 8 its remainder lo (zero without
  // LO_PAIR; both zero for g >= GQ); k-slice ks: codec channels t D/4 + 4 ks + {0, 1} and + {2, 3} (the
  // keys' permutation).
  uint4 qa[KS];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < GQ) f = *reinterpret_cast<const float4*>(&qt[g][t * (D / 4) + 4 * ks]);
    const float x[4] = {f.x, f.y, f.z, f.w};
    float hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      hi[i] = __half2float(__float2half_rn(x[i]));
      lo[i] = LO_PAIR ? x[i] - hi[i] : 0.f;
    }
    qa[ks] = make_uint4(pack_half2(hi[0], hi[1]), pack_half2(lo[0], lo[1]), pack_half2(hi[2], hi[3]),
                        pack_half2(lo[2], lo[3]));
  }
  float acc[KS][4];  // O^T: rows g D/8 + 2u (+1), columns heads 2t, 2t+1
  for (int u = 0; u < KS; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
  float m = NEG_INF, l = 0.f;  // head g's running max and this lane's share of its sum

  for (int s = 0; s < stages; ++s) {
    const int next = s + NSTAGE - 1;
#if BULK_ROWS
    mbar_wait(&bars[s % NSTAGE], (s / NSTAGE) & 1);
    __syncthreads();  // stage s (and the books) landed for every thread; stage s - 1 is no longer read
    if (threadIdx.x == 0 && next < stages) issue(next, 0);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 2));
    __syncthreads();  // stage s (and the books) landed for every thread; stage s - 1 is no longer read
    if (next < stages) {
      copy_rows<RK, KUNIT>(kstage(next), kcodes, start + next * ST, stop);
      copy_rows<RV, VUNIT>(vstage(next), vcodes, start + next * ST, stop);
    }
    asm volatile("cp.async.commit_group;\n" ::);
#endif
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
        for (int k = 0; k < CK; ++k) centroid<NK, KREPL>(kbl, code[k], &ka[rr][k * NK / 2]);
      }
      float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // tokens g + 8 rr as the mma's column g
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) mma16816(c[rr], qa[ks], ka[rr][2 * ks], ka[rr][2 * ks + 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // head g (rows g and g + 8: hi and lo), token 8 (i / 2) + 2t + i % 2
        const int tok = tok0 + 16 * j + 8 * (i / 2) + 2 * t + i % 2;
        const float x = c[i / 2][i % 2] + c[i / 2][2 + i % 2];
        sc[j][i] = tok < stop && tok >= sinks ? x * scale_log2 : NEG_INF;
      }
    }
    // The values' centroids: gathered before the softmax (PREFETCH_V), so that their latency overlaps its
    // shuffles, or after it, tile by tile (fewer registers live).
#if PREFETCH_V
    unsigned va[TILES][4][D / 16];  // tile j, tokens 2t, 2t+1, 2t+8, 2t+9: lane group g's D/8 channels as half2 words
#pragma unroll
    for (int j = 0; j < TILES; ++j) value_centroids(vs_, vbl, row0 + 16 * j, va[j]);
#endif
    softmax_tiles(sc, m, l, pr, acc);
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const unsigned pb0 = pack_half2(pr[j][0], pr[j][1]), pb1 = pack_half2(pr[j][2], pr[j][3]);  // P^T's B fragment
#if PREFETCH_V
      unsigned (*vt)[D / 16] = va[j];
#else
      unsigned vt[4][D / 16];
      value_centroids(vs_, vbl, row0 + 16 * j, vt);
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
  for (int o = 1; o < 4; o *= 2) l += __shfl_xor_sync(0xffffffff, l, o);
  // ---- combine the warps (in the ring's memory, now idle) and write one partial, in codec order ----
  __syncthreads();
  __shared__ float wm[WARPS][8], wl[WARPS][8];
  float (*wacc)[GQ][D] = reinterpret_cast<float (*)[GQ][D]>(work);
  if (t == 0) {
    wm[warp][g] = m;
    wl[warp][g] = l;
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
