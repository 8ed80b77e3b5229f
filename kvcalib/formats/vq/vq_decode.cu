// Fused VecInfer decode attention over codebook codes: the INT2 kernel's tensor-core pipeline
// (int2_decode.cu) with a codebook gather where that kernel unpacks 2-bit codes.
//
// Reads the layout of kvcalib/formats/vq/layout.py (its module docstring has the table), for one new query per
// head q (B, Hq, D), QT (fp16 or bf16), in the model's basis:
//   kcodes, vcodes (B, HKV, CAPT, RK | RV) uint8   each flushed token's codes, LSB-first bitstream rows
//   kbook (G, 2^MK, NK), vbook (G, 2^MV, NV) fp16   codebooks, G = 1 (shared) or HKV (one per KV head)
//   smooth (HKV, D) fp16 or null                    the keys' smoothing lambda
//   ksink, vsink (B, HKV, CAPS, D) fp16             the first min(sinks, T) tokens, read instead of their codes
//   kres, vres (B, HKV, CAPR, D) fp16               the residual window
//   lengths, residuals (B,) int32 or null            per-sequence T and r read on the device (a captured step)
// and writes out (B, Hq, D) QT, through part_acc, part_ml (the partials) and counters (B x HKV int32, zero
// before a launch and left zero after it).
// Bytes that must move per (batch, kv head): T (RK + RV) of codes and 4 (min(sinks, T) + r) D of float16 rows,
// read once; both books, 2 (2^MK NK + 2^MV NV) per block (from L2 after the first); the partials, 4 (D + 2) GQ
// written and read again per part.
// Limit: q~'s fp16 pair needs |q lambda H| scale below 65504 (a bfloat16 query beyond it gives inf scores), scale
// the softmax's (1 / sqrt(D) for a Llama) in log2 units.
// The codes hold keys in the codec basis k~ = (k / lambda) H (H with HADAMARD, else the identity): the packed
// blocks take q~ = (q lambda) H, computed here in float32 (`warp_hadamard`), so that q~ . k~ = q . k; the
// sinks and the residual are held as they came in, in the model's basis, and meet q itself. Values are
// coded as they are.
//
// Blocks (part, kv head, batch): part p takes split_len flushed tokens (the packed split p, if p < num_splits)
// and rows_per_part rows of the float16 tokens, the sinks then the residual window (rows p rows_per_part ..,
// if any), which its last warp attends as 16-token tiles (`rows_tiles`; the first chunk's copy is issued at the
// block's start): every block takes a share, where blocks of their own queued behind the packed blocks' wave.
// Every part writes one partial: the unnormalised sum of
// exp2(s - m) v, m and the sum of exp2(s - m), s the score in log2 units (m = -inf for an empty part); the
// last part of a (batch, KV head) to finish merges them all into out (`merge_parts`), counted on
// counters[b HKV + kv head], which that part sets back to zero.
//
// Packed tokens. Both codebooks of the block's KV head sit in shared memory (books in REPL > 1 copies are
// bulk-copied once into the ring's last stage and replicated from there); code rows stream through a
// ring of NSTAGE stages of ST tokens (bulk copies on an mbarrier per stage; cp.async where the rows are not
// 16-byte aligned). A warp takes TILES tiles of 16 tokens per stage:
//   scores  S (16 rows x 8 tokens, twice) = Q~ (16 x D) . K^T (D x 8)  on mma.m16n8k16 (f16 in, f32 accumulate),
//   output  O^T (D x 8 heads)            += V^T (D x 16 tokens) . P^T,
// Q~'s row h is head h's fp16 hi and row 8 + h its remainder lo (rows of heads >= GQ zero), so that a lane
// adds the two accumulators of its head and q~ is carried as an fp16 pair for every GQ <= 8. The centroids
// are gathered from shared memory straight into the mma fragments: the channels of a key and of a value
// are permuted so that each lane's share of a token is whole sub-vectors.
// Slots: a tile's 16 tokens in the order the mma sees them, slot s standing for token `slot_token(s)`.
//   Keys (the B operand, one 8-token mma per half tile): lane (g, t) holds, of slots g and g + 8, the
//   fragment rows 2t, 2t+1, 2t+8, 2t+9 of every 16-channel k-slice: D/4 numbers per token. Row k of slice
//   ks stands for codec channel (k % 8) / 2 * D/4 + 4 ks + 2 (k / 8) + k % 2, so lane t's D/4 numbers
//   are the codec channels t D/4 .. (t + 1) D/4 - 1: CK = D / (4 NK) whole sub-vectors, one gather of NK
//   fp16 each, whose half2 words are the fragment's registers as they are. Q~'s A fragments follow the
//   same permutation. The scores come out as lane (g, t): head g, slots 2t, 2t+1, 2t+8, 2t+9, which is
//   P^T's B fragment for the values as it is (no transpose).
//   Values: lane (g, t) holds output rows g and g + 8 of every 16-row block u, of slots 2t, 2t+1, 2t+8,
//   2t+9. Row g of block u stands for codec channel g D/8 + 2u, row g + 8 for g D/8 + 2u + 1: lane group
//   g's channels are g D/8 .. (g + 1) D/8 - 1, CV = D / (8 NV) whole sub-vectors per token; a byte
//   permute pairs two tokens' halves into each register. The partial is written back in codec order.
// A gather is one byte permute (8-bit codes in PAIRED_BOOKS) or an extraction and a multiply-add (the
// entry's offset plus this lane's copy), then one shared load. Each (token, sub-vector) is gathered once per KV head, shared by its GQ query
// heads. The products are exact (fp16 x fp16 into fp32): the scores err only by q~'s rounding, which the
// hi + lo pair carries; P is rounded to fp16 for the values' mma (benchmarks/vq_lut_emulated.py: 0.27x
// to 0.64x of SDPA's row error on diffuse rows, nothing on peaked ones); the float16 rows' P is an fp16 pair.
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
#define RT 16                    // float16 rows per chunk (one tile of the last warp)
#define RESCALE_SLACK 8.f         // log2 units a score passes the running max by before it moves (`softmax_tiles`)
#define BULK_ROWS (KUNIT == 16 && VUNIT == 16)  // rows 16-byte aligned: bulk copies (else cp.async)
#define NEG_INF __int_as_float(0xff800000)
#include "mma_tiles.cuh"
// A lane's code bits start on a word boundary in every row (and on an 8-byte one where it loads word pairs).
#define KALIGNED (RK % 8 == 0 && (CK * MK) % 64 == 0 || (RK % 4 == 0 && (CK * MK) % 32 == 0 && ((CK * MK + 31) / 32) % 2))
#define VALIGNED (RV % 8 == 0 && (CV * MV) % 64 == 0 || (RV % 4 == 0 && (CV * MV) % 32 == 0 && ((CV * MV + 31) / 32) % 2))

// Books of 8-bit codes both held in copies are interleaved (PAIRED_BOOKS): entry e's key copies fill bytes
// 256 e .. 256 e + 127 of the books' memory, its value copies the next 128, so that a gather's offset is one
// byte permute (`codes_at`) where code x 128 plus the lane's copy took a multiply-add; both books' bytes are
// the same as side by side. KROW, VROW: bytes from one entry of a book to the next.
#define PAIRED_BOOKS (MK == 8 && MV == 8 && KREPL > 1 && VREPL > 1)
#define KROW (PAIRED_BOOKS ? 256 : KREPL * 2 * NK)
#define VROW (PAIRED_BOOKS ? 256 : VREPL * 2 * NV)

// Shared memory of one block, carved in this order (kvcalib/formats/vq/launch.py `shared_bytes` mirrors it).
#define KBOOK_BYTES (((1 << MK) * NK * 2 * KREPL + 15) / 16 * 16)
#define VBOOK_BYTES (((1 << MV) * NV * 2 * VREPL + 15) / 16 * 16)
#define KSTAGE_BYTES ((ST * RK + 15) / 16 * 16 + 16)  // + 16: the code reader loads a word past a row
#define VSTAGE_BYTES ((ST * RV + 15) / 16 * 16 + 16)
#define RING_BYTES (NSTAGE * (KSTAGE_BYTES + VSTAGE_BYTES))
#define COMBINE_BYTES (4 * WARPS * 8 * D)  // the warps' accumulators, as their lanes hold them (KS x 4 x 32 floats)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define WORK_BYTES MAX2(RING_BYTES, COMBINE_BYTES)  // the ring, then the combine, then the merge's weights
#define MIN2(a, b) ((a) < (b) ? (a) : (b))
#define QT_BYTES (4 * GQ * D)  // q~ of the block's heads, float32, while the fragments are taken
#define QS_BYTES (4 * GQ * D)  // q of the block's heads times the scale, float32, for the float16 rows
#define ROWS_BYTES (4 * RT * D)  // a chunk of float16 key rows, then its value rows
#define SHARED_BYTES (KBOOK_BYTES + VBOOK_BYTES + WORK_BYTES + QT_BYTES + QS_BYTES + ROWS_BYTES)
#define KBOOK_SRC ((1 << MK) * NK * 2)  // bytes of one KV head's books in global memory
#define VBOOK_SRC ((1 << MV) * NV * 2)
// Replicated books staged in the ring's last stage by bulk copies (see the prologue): when they fit and are
// whole 16-byte units.
#define STAGED_BOOKS (BULK_ROWS && NSTAGE >= 2 && (KREPL > 1 || VREPL > 1) && KBOOK_SRC % 16 == 0 && VBOOK_SRC % 16 == 0                       && (KREPL > 1 ? KBOOK_SRC : 0) + (VREPL > 1 ? VBOOK_SRC : 0) <= KSTAGE_BYTES + VSTAGE_BYTES)

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

// The tensor memory accelerator's bulk copies (BULK_ROWS): one thread copies a stage's rows (one contiguous
// run of bytes each for keys and values) and the block waits on the stage's mbarrier; cp.async by every
// thread cost ~45 address instructions per warp and stage and 3.5x the ideal shared-memory wavefronts.
// (smem_addr, bulk_copy, mbar_init, mbar_expect, mbar_wait: decode_common.cuh)
//
// The same for code rows, which a decode step reads once: marked evict-first in L2 (`streaming_policy`), so
// that they do not push out what is read again (measured: B = 8 128k d4b8 259.5 -> 249.7 us, B = 1 42.3 -> 41.5).
__device__ __forceinline__ unsigned long long streaming_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void bulk_copy_once(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                               unsigned long long policy) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
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
// shared-memory wavefront per lane); entries ROW bytes apart (256 for PAIRED_BOOKS: the other book's copies
// fill the rest). The host aligns the books to 16 bytes; N is 2, 4 or a multiple of 8.
template <int E, int N, int REPL, int ROW>
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
      if (threadIdx.x + k * NT < PIECES) {
        const int i = threadIdx.x + k * NT;
        reinterpret_cast<uint4*>(dst)[i / 8 * (ROW / 16) + i % 8] = x[k];
      }
  }
}

// COUNT codes of BITS bits starting at bit `bit` of a stage (32-bit aligned), to out[] as byte offsets in a
// book of entries ROW bytes apart: code ROW + copy (this lane's copy's offset, `book_copy`). 8-bit codes in
// PAIRED_BOOKS (ROW 256) take one byte permute: the code to bits 8..15, the copy's offset (< 256) to bits 0..7.
// ALIGNED: the caller knows `bit` is a multiple of 32 (whole words, no funnel shift).
template <int BITS, int COUNT, bool ALIGNED, int ROW>
__device__ __forceinline__ void codes_at(const unsigned char* stage, int bit, unsigned copy, unsigned* out) {
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
    if (BITS == 8 && ROW == 256) {  // code 256 + copy: one PRMT (copy < 256: its byte 1 is zero)
      out[k] = __byte_perm(c[wi], copy, 0x5504 | (off / 8) << 4);
    } else if (BITS == 8) {  // a byte: one PRMT, then the multiply-add
      out[k] = __byte_perm(c[wi], 0u, 0x4440 + off / 8) * ROW + copy;
    } else {
      const unsigned v = off + BITS <= 32 ? c[wi] >> off : __funnelshift_r(c[wi], c[wi + 1], off);
      out[k] = (v & M) * ROW + copy;
    }
  }
}

// A book held in REPL = 128 / (2N) copies (`copy_book`) stores entry e's copies side by side, copy i in
// banks 2N/4 i ..: lane L reads copy L % REPL, so the lanes that share one shared-memory wavefront (16 at
// 8 bytes, 8 at 16) never meet in a bank. `book_copy` is this lane's copy's offset in an entry: (L % REPL) 2N.
template <int N, int REPL>
__device__ __forceinline__ unsigned book_copy() {
  return REPL > 1 ? threadIdx.x % REPL * 2 * N : 0;
}

// The N / 2 half2 words of a centroid, `at` bytes into a book (`codes_at`): the loads, from the book's
// address (the same in every lane) plus `at`.
template <int N>
__device__ __forceinline__ void centroid(const unsigned char* book, unsigned at, unsigned* out) {
  const unsigned* p = reinterpret_cast<const unsigned*>(book + at);
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

// The COUNT centroids whose codes start at bit `bit` of a stage (`codes_at`), from this lane's copy of a book of N
// float16 numbers an entry (REPL copies, entries ROW bytes apart), to out: N / 2 half2 words each.
template <int BITS, int COUNT, bool ALIGNED, int ROW, int N, int REPL>
__device__ __forceinline__ void gather(const unsigned char* stage, int bit, const unsigned char* book, unsigned* out) {
  unsigned at[COUNT];
  codes_at<BITS, COUNT, ALIGNED, ROW>(stage, bit, book_copy<N, REPL>(), at);
#pragma unroll
  for (int k = 0; k < COUNT; ++k) centroid<N>(book, at[k], out + k * N / 2);
}

// Bulk-copies (thread 0) float16 rows e0 .. e0 + nr - 1 (0 < nr <= RT) of the sinks-then-residual sequence of
// this (batch, KV head), keys to rows[0 ..], values to rows[RT D ..], on the mbarrier `bar`: up to two
// contiguous runs each (the sinks' part, the residual's), whole rows of 2 D bytes. PREFETCH: only warm L2
// with them (a later chunk of the block's).
template <bool PREFETCH>
__device__ __forceinline__ void issue_rows(__half* rows, const __half* __restrict__ ksink,
                                           const __half* __restrict__ vsink, int sinks, int caps,
                                           const __half* __restrict__ kres, const __half* __restrict__ vres, int capr,
                                           long bh, int e0, int nr, unsigned long long* bar) {
  const int ns = max(0, min(e0 + nr, sinks) - e0);  // rows from the sinks, then nr - ns from the residual
  const long f = bh * capr + max(e0, sinks) - sinks;
  const __half* src[4] = {ksink + (bh * caps + e0) * D, vsink + (bh * caps + e0) * D, kres + f * D, vres + f * D};
  __half* dst[4] = {rows, rows + RT * D, rows + ns * D, rows + RT * D + ns * D};
  const int n[4] = {ns, ns, nr - ns, nr - ns};
  if (!PREFETCH) mbar_expect(bar, 2u * nr * D * 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (n[i] == 0) continue;
    if (PREFETCH)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src[i]), "r"(n[i] * D * 2) : "memory");
    else
      bulk_copy(dst[i], src[i], n[i] * D * 2, bar);
  }
}

// Rows c_first .. c_end - 1 (whole chunks of RT) of the block's float16 rows r0 .. r0 + nrows - 1 as 16-token
// tiles of one warp, on the same tensor-core path and into the same running max, sum and accumulators (m, l,
// acc): the rows, in the model's basis, meet q itself times the scale (qs), in the keys' and values' channel
// permutations. Chunk k lands in `rows` on phase k % 2 of `bar` (the first copy was issued at the block's
// start; lane 0 issues each next one once the chunk before is read); value rows past a chunk's count are
// zeroed first (P = 0 times a stale NaN would be NaN).
__device__ __forceinline__ void rows_tiles(int r0, int nrows, int c_first, int c_end, const __half* __restrict__ ksink,
                                           const __half* __restrict__ vsink, int sinks, int caps,
                                           const __half* __restrict__ kres, const __half* __restrict__ vres,
                                           int capr, long bh, __half* rows, const float (*qs)[D], float& m,
                                           float& l, float (*acc)[4], unsigned long long* bar) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const __half* kx = rows;
  __half* vx = rows + RT * D;
  uint4 qa[KS];
  q_fragments(qs, qa);
  for (int c0 = c_first, phase = (c_first / RT) & 1; c0 < c_end; c0 += RT, phase ^= 1) {
    const int nr = min(RT, nrows - c0);
    mbar_wait(bar, phase);
    for (int i = nr * D / 8 + lane; i < RT * D / 8; i += 32) reinterpret_cast<uint4*>(vx)[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncwarp();
    unsigned ka[2][D / 8];  // tokens g, g + 8: channels t D/4 .. (t + 1) D/4 - 1 as half2 words
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const uint4 w = reinterpret_cast<const uint4*>(kx + (g + 8 * rr) * D + t * (D / 4))[i];
        ka[rr][4 * i] = w.x, ka[rr][4 * i + 1] = w.y, ka[rr][4 * i + 2] = w.z, ka[rr][4 * i + 3] = w.w;
      }
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) mma16816(c[rr], qa[ks], ka[rr][2 * ks], ka[rr][2 * ks + 1]);
    float sc[1][4], pr[1][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      sc[0][i] = 8 * (i / 2) + 2 * t + i % 2 < nr ? c[i / 2][i % 2] + c[i / 2][2 + i % 2] : NEG_INF;
    softmax_tiles<1>(sc, m, l, pr, acc);
    // P as an fp16 pair, hi + lo, so that these rows' probabilities are not rounded to fp16 (the packed tokens'
    // are): they can carry most of the weight (the newest tokens, a short context), and rounded they took
    // a row past twice SDPA's error (tests/test_static_cache_gpu.py).
    float lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) lo[i] = pr[0][i] - __half2float(__float2half_rn(pr[0][i]));
    const unsigned pb0 = pack_half2(pr[0][0], pr[0][1]), pb1 = pack_half2(pr[0][2], pr[0][3]);
    const unsigned pl0 = pack_half2(lo[0], lo[1]), pl1 = pack_half2(lo[2], lo[3]);
    unsigned vt[4][D / 16];  // tokens 2t, 2t+1, 2t+8, 2t+9: channels g D/8 .. (g + 1) D/8 - 1 as half2 words
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4)
#pragma unroll
      for (int i = 0; i < D / 64; ++i) {
        const uint4 w = reinterpret_cast<const uint4*>(vx + (2 * t + (k4 & 1) + 8 * (k4 >> 1)) * D + g * (D / 8))[i];
        vt[k4][4 * i] = w.x, vt[k4][4 * i + 1] = w.y, vt[k4][4 * i + 2] = w.z, vt[k4][4 * i + 3] = w.w;
      }
#pragma unroll
    for (int u = 0; u < KS; ++u) {
      const uint4 a = make_uint4(__byte_perm(vt[0][u], vt[1][u], 0x5410), __byte_perm(vt[0][u], vt[1][u], 0x7632),
                                 __byte_perm(vt[2][u], vt[3][u], 0x5410), __byte_perm(vt[2][u], vt[3][u], 0x7632));
      mma16816(acc[u], a, pb0, pb1);
      mma16816(acc[u], a, pl0, pl1);
    }
    if (c0 + RT < nrows) {
      __syncwarp();  // this chunk's rows are read
      if (lane == 0)
        issue_rows<false>(rows, ksink, vsink, sinks, caps, kres, vres, capr, bh, r0 + c0 + RT,
                          min(RT, nrows - c0 - RT), bar);
    }
  }
}

// The last part of a (batch, KV head) to finish: its GQ heads' partials, every part's, into out. The weight
// of part p is exp2(m_p - M), M the head's max over parts (parts with m = -inf weigh nothing). Partials are
// read through L2 (__ldcg: other blocks wrote them): thread (slice, head, 4 channels) sums the parts of its
// slice, float4 at a time, and the slices meet in shared memory. Up to MERGE_FAST parts, each thread loads all
// its head's (m, l) pairs with its accumulators and weighs them itself (one trip to L2, no barrier: 1.9 ->
// 0.9 us at B = 1 128k d4b8); more are taken in rounds of MERGE_ROUND parts, every load of a round in flight,
// the weights computed once per head in shared memory and the running max rescaled as in the softmax. `w` is
// scratch of WORK_BYTES.
#define MERGE_SLICES (NT / (GQ * D / 4) > 0 ? NT / (GQ * D / 4) : 1)  // threads per (head, 4 channels)
#define MERGE_AHEAD 8  // accumulators per thread loaded before the weights are known
#define MERGE_FAST 16  // up to this many parts, each thread reads all its head's (m, l) pairs (B = 1, 8 KV heads: 16)
#define MERGE_FAST_EACH ((MERGE_FAST + MERGE_SLICES - 1) / MERGE_SLICES)  // of them in one slice, rounded up: slice s
                                                                         // takes parts s, s + S, ... (5 slices: 4, 3, 3, 3, 3)
#define MERGE_ROUND (MIN2(256, (WORK_BYTES / 4 - 4 * NT) / (2 * GQ)) / 4 * 4)  // the slices' float4 stay aligned
__device__ __forceinline__ void merge_parts(long bh, int num_parts, const float* part_acc, const float* part_ml,
                                            QT* __restrict__ out, float* w) {
  static_assert(MERGE_ROUND >= 8, "the ring's memory holds a round of the merge's weights");
  static_assert(NT >= GQ * D / 4, "a thread for each 4 channels of each head (formats/vq/launch.py, _min_warps)");
  __shared__ float head_m[8], head_den[8], head_alpha[8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float (*mw)[MERGE_ROUND] = reinterpret_cast<float (*)[MERGE_ROUND]>(w);  // the round's m, then its weights
  float (*ml_l)[MERGE_ROUND] = mw + GQ;                                    // the round's sums
  float4* slices = reinterpret_cast<float4*>(w + 2 * GQ * MERGE_ROUND);    // the slices' sums, NT float4
  if (threadIdx.x < GQ) head_m[threadIdx.x] = NEG_INF, head_den[threadIdx.x] = 0.f;
  constexpr int PAIRS = GQ * D / 4;
  const int pair = threadIdx.x % PAIRS, slice = threadIdx.x / PAIRS, h = pair / (D / 4), c4 = pair % (D / 4);
  const bool active = threadIdx.x < PAIRS * MERGE_SLICES;
  float4 num = make_float4(0.f, 0.f, 0.f, 0.f);  // this slice's sum, rescaled as the max moves
  float den = 0.f;
  if (num_parts <= MERGE_FAST) {  // every thread weighs its head's parts itself: one trip to L2, no barrier
    const float4* acc = reinterpret_cast<const float4*>(part_acc + (bh * GQ + h) * num_parts * D) + c4;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + (bh * GQ + h) * num_parts;
    float2 x[MERGE_FAST];
    float4 a[MERGE_FAST_EACH];
#pragma unroll
    for (int p = 0; p < MERGE_FAST; ++p) x[p] = p < num_parts ? __ldcg(ml + p) : make_float2(NEG_INF, 0.f);
#pragma unroll
    for (int k = 0; k < MERGE_FAST_EACH; ++k) {
      const int p = slice + k * MERGE_SLICES;
      a[k] = active && p < num_parts ? __ldcg(acc + (long)p * (D / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float M = NEG_INF;
#pragma unroll
    for (int p = 0; p < MERGE_FAST; ++p) M = fmaxf(M, x[p].x);
#pragma unroll
    for (int p = 0; p < MERGE_FAST; ++p) {
      const float wp = x[p].x == NEG_INF ? 0.f : exp2f(x[p].x - M);
      den += wp * x[p].y;
      if (p % MERGE_SLICES == slice) {
        const float4 y = a[p / MERGE_SLICES];
        num.x += wp * y.x, num.y += wp * y.y, num.z += wp * y.z, num.w += wp * y.w;
      }
    }
  }
  for (int base = 0; num_parts > MERGE_FAST && base < num_parts; base += MERGE_ROUND) {
    const int n = min(MERGE_ROUND, num_parts - base);
    // The round's first MERGE_AHEAD accumulators of this thread's slice, loaded with the (m, l) pairs: one
    // trip to L2 for both.
    const float4* acc = reinterpret_cast<const float4*>(part_acc + ((bh * GQ + h) * num_parts + base) * D) + c4;
    float4 ahead[MERGE_AHEAD];
#pragma unroll
    for (int k = 0; k < MERGE_AHEAD; ++k) {
      const int p = slice + k * MERGE_SLICES;
      ahead[k] = active && p < n ? __ldcg(acc + (long)p * (D / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < GQ * n; i += NT) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part_ml) + (bh * GQ + i / n) * num_parts + base + i % n);
      mw[i / n][i % n] = x.x;
      ml_l[i / n][i % n] = x.y;
    }
    __syncthreads();
    for (int hh = warp; hh < GQ; hh += WARPS) {
      float M = head_m[hh];
      for (int p = lane; p < n; p += 32) M = fmaxf(M, mw[hh][p]);
      for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
      float den = 0.f;
      for (int p = lane; p < n; p += 32) {
        const float wp = mw[hh][p] == NEG_INF ? 0.f : exp2f(mw[hh][p] - M);
        mw[hh][p] = wp;
        den += wp * ml_l[hh][p];
      }
      for (int o = 16; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffff, den, o);
      if (lane == 0) {
        const float a = head_m[hh] == NEG_INF ? 0.f : exp2f(head_m[hh] - M);
        head_alpha[hh] = a;
        head_den[hh] = head_den[hh] * a + den;
        head_m[hh] = M;
      }
    }
    __syncthreads();
    if (active) {
      const float a = head_alpha[h];
      num = make_float4(num.x * a, num.y * a, num.z * a, num.w * a);
#pragma unroll
      for (int k = 0; k < MERGE_AHEAD; ++k) {
        const int p = slice + k * MERGE_SLICES;
        const float wp = p < n ? mw[h][p] : 0.f;
        num.x += wp * ahead[k].x, num.y += wp * ahead[k].y, num.z += wp * ahead[k].z, num.w += wp * ahead[k].w;
      }
#pragma unroll 8
      for (int p = slice + MERGE_AHEAD * MERGE_SLICES; p < n; p += MERGE_SLICES) {
        const float4 x = __ldcg(acc + (long)p * (D / 4));
        const float wp = mw[h][p];
        num.x += wp * x.x, num.y += wp * x.y, num.z += wp * x.z, num.w += wp * x.w;
      }
    }
    __syncthreads();  // the round's weights are read
  }
  if (active) slices[threadIdx.x] = num;
  __syncthreads();
  if (active && slice == 0) {
    for (int k = 1; k < MERGE_SLICES; ++k) {
      const float4 x = slices[k * PAIRS + pair];
      num.x += x.x, num.y += x.y, num.z += x.z, num.w += x.w;
    }
    const float inv = 1.f / (num_parts <= MERGE_FAST ? den : head_den[h]);
    QT* o = out + (bh * GQ + h) * D + 4 * c4;
    from_float(o, num.x * inv), from_float(o + 1, num.y * inv), from_float(o + 2, num.z * inv),
        from_float(o + 3, num.w * inv);
  }
}

// The token of a packed tile that mma slot s stands for (column s of the scores, row s of P^T): slots 8h + j are
// tokens 8h + (0, 5, 2, 7, 1, 4, 3, 6)[j]. A warp's code loads read, for the keys, the rows of slots g + 8h
// (lane (g, t)), for the values those of slots 2t + i + 8h; in this order the rows that one pass of a load
// meets fall in different banks for both: benchmarks/vq_code_banks.py's model (which reproduced ncu's counts)
// gives 8 wavefronts a tile for d4b8 where slots as tokens took 12 (the value loads two each) and
// t + 4i + 8h 12 (the key loads two each); the best of all 8! orders for every configuration it models.
__device__ __forceinline__ int slot_token(int s) { return (s & 8) + (0x63417250 >> 4 * (s & 7) & 7); }

// The value centroids of one tile (stage row `row`) this lane feeds to the values' mma: slots 2t, 2t+1,
// 2t+8, 2t+9, lane group g's D/8 channels (CV sub-vectors), as half2 words.
__device__ __forceinline__ void value_centroids(const unsigned char* stage, const unsigned char* vb, int row,
                                                unsigned (*va)[D / 16]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int k4 = 0; k4 < 4; ++k4) {
    const int tok = row + slot_token(2 * t + (k4 & 1) + 8 * (k4 >> 1));
    gather<MV, CV, VALIGNED, VROW, NV, VREPL>(stage, tok * RV * 8 + g * CV * MV, vb, va[k4]);
  }
}

// A warp's scores over its tiles of one stage: the keys' centroids gathered for tokens g and g + 8 of each tile
// and multiplied by q~ on the tensor cores; a token before `sinks` (served as a float16 row) or at or past
// `stop` scores -inf. sc[j][i]: tile j, head g, token 8 (i / 2) + 2t + i % 2 of the tile.
__device__ __forceinline__ void key_scores(const unsigned char* ks_, const unsigned char* kb_, const uint4* qa, int row0,
                                           int tok0, int stop, int sinks, float (*sc)[4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    unsigned ka[2][D / 8];  // tokens g, g + 8: this lane's D/4 channels as half2 words
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = row0 + 16 * j + slot_token(g + 8 * rr);
      gather<MK, CK, KALIGNED, KROW, NK, KREPL>(ks_, row * RK * 8 + t * CK * MK, kb_, ka[rr]);
    }
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // tokens g + 8 rr as the mma's column g
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        mma16816(c[rr], qa[ks], ka[rr][2 * ks], ka[rr][2 * ks + 1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // head g (rows g and g + 8: hi and lo), token 8 (i / 2) + 2t + i % 2
      const int tok = tok0 + 16 * j + slot_token(8 * (i / 2) + 2 * t + i % 2);
      sc[j][i] = tok < stop && tok >= sinks ? c[i / 2][i % 2] + c[i / 2][2 + i % 2] : NEG_INF;
    }
  }
}

// acc += the values of a warp's tiles of one stage weighted by their probabilities pr (rounded to half2 pairs,
// P^T's B fragment); the values' centroids gathered tile by tile, after the softmax (fewer registers live).
__device__ __forceinline__ void value_products(const unsigned char* vs_, const unsigned char* vb_, int row0,
                                               const float (*pr)[4], float (*acc)[4]) {
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const unsigned pb0 = pack_half2(pr[j][0], pr[j][1]), pb1 = pack_half2(pr[j][2], pr[j][3]);
    unsigned vt[4][D / 16];
    value_centroids(vs_, vb_, row0 + 16 * j, vt);
#pragma unroll
    for (int u = 0; u < KS; ++u) {
      const uint4 a = make_uint4(__byte_perm(vt[0][u], vt[1][u], 0x5410), __byte_perm(vt[0][u], vt[1][u], 0x7632),
                                 __byte_perm(vt[2][u], vt[3][u], 0x5410), __byte_perm(vt[2][u], vt[3][u], 0x7632));
      mma16816(acc[u], a, pb0, pb1);
    }
  }
}

// The block's partial once the ring is no longer read (l: head g's sum over the 4 lanes that hold head g): each warp's
// accumulators combined with the others' in the ring's memory (`work`), one partial written.
__device__ __forceinline__ void write_block_partial(const float (*acc)[4], float m, float l, float (*wm)[8], float (*wl)[8],
                                                    unsigned char* work, float* __restrict__ part_acc,
                                                    float* __restrict__ part_ml, long bh, int part, int num_parts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // Each warp's accumulators as its lanes hold them, wacc[warp][4u + i][lane], and summed over the warps in
  // that order: bank-conflict-free (in (head, channel) order the lanes' stores met in 4 banks: 6.7-way
  // conflicts, ~2300 wavefronts a block, B = 1 128k d4b8).
  float (*wacc)[KS * 4][32] = reinterpret_cast<float (*)[KS * 4][32]>(work);
  if (t == 0) {
    wm[warp][g] = m;
    wl[warp][g] = l;
  }
  for (int u = 0; u < KS; ++u)
    for (int i = 0; i < 4; ++i)
      if (2 * t + (i & 1) < GQ) wacc[warp][4 * u + i][lane] = acc[u][i];
  __syncthreads();
  // Thread x sums the elements x + k NT, k < 8 D / NT (element e: acc[u][i] of lane e % 32, 4u + i = e / 32),
  // all of one head h (WARPS is even): each warp's weight exp2(m_w - M) once, then the sums (every load in
  // flight at once; weighing each element anew took 1.0 us, B = 1 128k d4b8).
  static_assert(WARPS % 2 == 0 && 8 * D % NT == 0 && 8 * D >= NT, "a thread's elements are of one head");
  const int h = 2 * t + (warp & 1);
  if (h < GQ) {
    float M = NEG_INF, f[WARPS], den = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      f[w] = wm[w][h] == NEG_INF ? 0.f : exp2f(wm[w][h] - M);
      den += f[w] * wl[w][h];
    }
    const long row = (bh * GQ + h) * num_parts + part;
#pragma unroll
    for (int k = 0; k < 8 * D / NT; ++k) {
      const int ui = warp + k * WARPS, c = g * (D / 8) + 2 * (ui / 4) + (ui % 4) / 2;
      float num = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) num += f[w] * wacc[w][ui][lane];
      part_acc[row * D + c] = num;
      if (c == 0) {
        part_ml[row * 2] = M;
        part_ml[row * 2 + 1] = den;
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT, BLOCKS_PER_SM) vq_partial(
    const QT* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const __half* __restrict__ kbook, const __half* __restrict__ vbook, int kbook_groups, int vbook_groups,
    const __half* __restrict__ smooth,
    const __half* __restrict__ ksink, const __half* __restrict__ vsink, int sinks, int caps,
    const __half* __restrict__ kres, const __half* __restrict__ vres, int r, int capr, int T, int capt,
    int split_len, int num_splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml,
    const int* __restrict__ lengths, const int* __restrict__ residuals, int rows_per_part,
    int* __restrict__ counters, QT* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  {  // the host sized the launch's shared memory from the same formula; a mismatch must not go unseen
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < SHARED_BYTES) __trap();
  }
  const int part = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, num_parts = gridDim.x;
  // A captured step reads each sequence's counts on the device and spreads its own T over all the
  // splits, in whole stages (int2_decode.cu's `packed_partial` does the same).
  if (lengths != nullptr) {  // both or neither (the host checks); clamped to the buffers, whatever a caller wrote
    T = min(lengths[b], capt);
    const int units = (T + ST - 1) / ST;
    if (num_splits > 0) split_len = max(1, (units + num_splits - 1) / num_splits) * ST;
    r = min(residuals[b], capr);
  }
  sinks = min(sinks, T);  // the first flushed tokens are the sinks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long bh = (long)b * hkv + kvh;
  __half* kb = reinterpret_cast<__half*>(smem);
  __half* vb = reinterpret_cast<__half*>(smem + (PAIRED_BOOKS ? 128 : KBOOK_BYTES));  // PAIRED_BOOKS: in kb's rows
  const unsigned char* kb_ = reinterpret_cast<const unsigned char*>(kb);
  const unsigned char* vb_ = reinterpret_cast<const unsigned char*>(vb);
  unsigned char* work = smem + KBOOK_BYTES + VBOOK_BYTES;
  float (*qs)[D] = reinterpret_cast<float (*)[D]>(work + WORK_BYTES + QT_BYTES);
  __half* rows = reinterpret_cast<__half*>(work + WORK_BYTES + QT_BYTES + QS_BYTES);
  const int r0 = part * rows_per_part, nrows = max(0, min(rows_per_part, sinks + r - r0));  // this part's float16 rows
  __shared__ int rows_held;  // nrows, read back after the main loop (no register held through it)
  if (threadIdx.x == 0) rows_held = nrows;
  // Parts past num_splits have no packed tokens (start >= T).
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
  float x[QH][D / 32], qm[QH][D / 32];  // q lambda; q
#pragma unroll
  for (int i = 0; i < QH; ++i)
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int h = warp + i * WARPS, c = lane + 32 * e;
      qm[i][e] = h < GQ ? to_float(q[(bh * GQ + h) * D + c]) : 0.f;
      x[i][e] = qm[i][e] * (smooth != nullptr && h < GQ ? __half2float(smooth[kvh * D + c]) : 1.f);
    }
  // Stage s's code rows land on bars[s % NSTAGE] (bulk copies), the float16 rows on bars[NSTAGE], the books
  // to be replicated on bars[NSTAGE + 1] (STAGED_BOOKS).
  __shared__ __align__(8) unsigned long long bars[NSTAGE + 2];
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSTAGE + 2; ++i) mbar_init(&bars[i]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int c0 = 0; c0 < nrows; c0 += RT) {  // the first chunk copied, the others into L2 (`rows_tiles`)
      if (c0 == 0) issue_rows<false>(rows, ksink, vsink, sinks, caps, kres, vres, capr, bh, r0, min(RT, nrows), &bars[NSTAGE]);
      else issue_rows<true>(rows, ksink, vsink, sinks, caps, kres, vres, capr, bh, r0 + c0, min(RT, nrows - c0), nullptr);
    }
  }
#if BULK_ROWS
  // A stage's rows: whole 16-byte units (they stay inside the capacity: the host checked its stride).
  const unsigned long long policy = streaming_policy();
  auto issue = [&](int s, unsigned extra) {
    const int t0 = start + s * ST, n = min(ST, stop - t0);
    const unsigned kbytes = (n * RK + 15) / 16 * 16, vbytes = (n * RV + 15) / 16 * 16;
    mbar_expect(&bars[s % NSTAGE], kbytes + vbytes + extra);
    bulk_copy_once(kstage(s), kcodes + (long)t0 * RK, kbytes, &bars[s % NSTAGE], policy);
    bulk_copy_once(vstage(s), vcodes + (long)t0 * RV, vbytes, &bars[s % NSTAGE], policy);
  };
  // Books to be replicated are first bulk-copied whole into the ring's last stage (not filled before the main
  // loop), then copied out from there: read by every block at once, from registers loaded by every thread,
  // they had taken ~2.5 us of a 47 us launch (B=1 128k d4b8, globaltimer probes).
  unsigned char* staged = work + (NSTAGE - 1) * (KSTAGE_BYTES + VSTAGE_BYTES);
  if (threadIdx.x == 0 && stages > 0) {  // single books ride on stage 0's barrier
    constexpr unsigned KB1 = KREPL == 1 ? KBOOK_SRC : 0, VB1 = VREPL == 1 ? VBOOK_SRC : 0;
    if (STAGED_BOOKS) {
      constexpr unsigned KBR = KREPL > 1 ? KBOOK_SRC : 0, VBR = VREPL > 1 ? VBOOK_SRC : 0;
      mbar_expect(&bars[NSTAGE + 1], KBR + VBR);
      if (KBR) bulk_copy(staged, kbook_h, KBR, &bars[NSTAGE + 1]);
      if (VBR) bulk_copy(staged + KBR, vbook_h, VBR, &bars[NSTAGE + 1]);
    }
    issue(0, KB1 + VB1);
    if (KB1) bulk_copy(kb, kbook_h, KB1, &bars[0]);
    if (VB1) bulk_copy(vb, vbook_h, VB1, &bars[0]);
    for (int s = 1; s < NSTAGE - 1 && s < stages; ++s) issue(s, 0);
  }
  __syncthreads();  // the barriers are initialised before anyone waits on one
  if (!STAGED_BOOKS && stages > 0) {  // replicated books, from registers
    if (KREPL > 1) copy_book<(1 << MK), NK, KREPL, KROW>(kb, kbook_h);
    if (VREPL > 1) copy_book<(1 << MV), NV, VREPL, VROW>(vb, vbook_h);
  }
#else
  if (stages > 0) {  // the books (single copies: in the first stage's group of cp.async)
    copy_book<(1 << MK), NK, KREPL, KROW>(kb, kbook_h);
    copy_book<(1 << MV), NV, VREPL, VROW>(vb, vbook_h);
  }
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < stages) {
      copy_rows<RK, KUNIT>(kstage(s), kcodes, start + s * ST, stop);
      copy_rows<RV, VUNIT>(vstage(s), vcodes, start + s * ST, stop);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
#endif
  // q~ = (q lambda) H times the softmax scale in log2 units, float32, to shared memory; q times the scale
  // for the float16 rows.
  float (*qt)[D] = reinterpret_cast<float (*)[D]>(work + WORK_BYTES);
#pragma unroll
  for (int i = 0; i < QH; ++i) {
    const int h = warp + i * WARPS;
    if (h >= GQ) break;
    if (HADAMARD) warp_hadamard(x[i]);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      qt[h][lane + 32 * e] = x[i][e] * scale_log2;
      qs[h][lane + 32 * e] = qm[i][e] * scale_log2;
    }
  }
#if BULK_ROWS
  if (STAGED_BOOKS && stages > 0) {
    mbar_wait(&bars[NSTAGE + 1], 0);
    if (KREPL > 1) copy_book<(1 << MK), NK, KREPL, KROW>(kb, reinterpret_cast<const __half*>(staged));
    if (VREPL > 1) copy_book<(1 << MV), NV, VREPL, VROW>(vb, reinterpret_cast<const __half*>(staged + (KREPL > 1 ? KBOOK_SRC : 0)));
  }
#endif
  __syncthreads();
  float acc[KS][4];  // O^T: rows g D/8 + 2u (+1), columns heads 2t, 2t+1
  for (int u = 0; u < KS; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
  float m = NEG_INF, l = 0.f;  // head g's running max and this lane's share of its sum
  // The float16 rows' first chunk, by the last warp, while the others wait for the first stage (the rest
  // after the packed tokens: their copies follow one another). At the loop's end it was the last thing the
  // block waited on (0.2 to 0.8 us more, B = 1 and 8, 4k to 128k).
  if (warp == WARPS - 1 && nrows > 0)
    rows_tiles(r0, nrows, 0, min(RT, nrows), ksink, vsink, sinks, caps, kres, vres, capr, bh, rows, qs, m, l, acc,
               &bars[NSTAGE]);
  uint4 qa[KS];  // q~'s A fragments, in registers
  q_fragments(qt, qa);

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
    key_scores(ks_, kb_, qa, row0, tok0, stop, sinks, sc);
    softmax_tiles<TILES>(sc, m, l, pr, acc);
    value_products(vs_, vb_, row0, pr, acc);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  // ---- the float16 rows left (the last warp), the warps' combine (in the ring's memory, now idle), one partial ----
  if (warp == WARPS - 1 && rows_held > RT)
    rows_tiles(part * rows_per_part, rows_held, RT, rows_held, ksink, vsink, sinks, caps, kres, vres, capr, bh, rows, qs,
               m, l, acc, &bars[NSTAGE]);
  for (int o = 1; o < 4; o *= 2) l += __shfl_xor_sync(0xffffffff, l, o);
  __syncthreads();  // the ring is no longer read
  __shared__ float wm[WARPS][8], wl[WARPS][8];  // each warp's running max and sum per head
  write_block_partial(acc, m, l, wm, wl, work, part_acc, part_ml, bh, part, num_parts);
  // ---- the last part of this (batch, KV head) to get here merges ----
  // The block's partial, written by all its threads, is released by thread 0's count after the barrier (an
  // acquire-release increment at GPU scope: the pattern of cooperative groups' grid sync), and the part that
  // counts last acquires everyone's; the barrier after it passes that on to its threads. Where every thread
  // fenced before the count and again before the merge: 0.86 -> 0.67 us, and the merge's first loads 1.1 ->
  // 0.7 us (B = 1 128k d4b8, globaltimer probes).
  __syncthreads();
  __shared__ unsigned is_last;
  if (threadIdx.x == 0) {  // the counter wraps to zero on the last arrival: ready for the next launch
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n"
                 : "=r"(before) : "l"(reinterpret_cast<unsigned*>(counters) + bh), "r"(num_parts - 1) : "memory");
    is_last = before == unsigned(num_parts - 1);
  }
  __syncthreads();
  if (!is_last) return;
  merge_parts(bh, num_parts, part_acc, part_ml, out, reinterpret_cast<float*>(work));
}
