// Fused decode attention over codebook codes: TurboQuant's scalar and vector codes (a codebook per coordinate or
// one shared by every sub-vector, a norm per token, a rotation), VecInfer's vector codes, KIVI's and OScaR's affine
// codes (zero + scale * level), and any format of the same shape. One new query per head, q (B, Hq, D) QT (fp16 or
// bf16), in the model's basis. One launch reads one group of a layer's KV heads (a plan mixes formats per head).
//
// Reads the layout of kvcalib/formats/codebook/layout.py (its module docstring has the table), per part (keys K,
// values V) of the launch's H KV heads:
//   kcodes, vcodes (B, H, CAPT, KW | VW) int32   each token's codes as one bit stream, code j at bits
//                                                [j XB, (j + 1) XB), least significant bit first
//   knorm, vnorm (B, H, CAPT) fp16 or null        the token's norm: x = norm * y B
//   kscale, kzero (B, H, CAPT / KTG, D) fp16       affine keys (KTG > 0): y = zero + scale * level per channel and
//                                                group of KTG tokens
//   vscale, vzero (B, H, CAPT, D / VCG) fp16       affine values (VCG > 0): per token and group of VCG channels
//   kbook, vbook (G, P, 2^XB, XDIM) fp16          codebooks as this kernel reads them (launch.py `kernel_book`):
//                                                P = D / XDIM (one per position) or 1 (shared by every
//                                                position), G = 1 (shared by the heads) or H
//   ksink, vsink (B, HR, CAPS, D) fp16            the first min(sinks, T) tokens, read instead of their codes
//   kres, vres (B, HR, CAPR, D) fp16              the residual window (HR: the layer's KV heads, of which the launch
//                                                reads head_map's)
//   lengths, residuals (B,) int32 or null         per-sequence T and r read on the device (a captured step)
//   head_map (H,) int32 or null                   the model's KV head of each launch head (a plan's group)
// A token's vector is x = norm * y B, y the centroids of its codes and B the part's basis (the identity where the
// format has none). `rotate` writes q~ = scale log2(e) q B_K^T (float32) once per query head (without a key basis,
// KIVI's keys, each `partial` block takes q~ = scale log2(e) q itself); the packed tokens are scored against q~ and
// their values summed in V's coded basis; `merge` takes that sum back by B_V. The float16 rows meet q itself and are
// summed in the model's basis. Affine keys are scored as q~ . y = q~ . zero +
// (q~ scale) . level: per group of KTG tokens a warp takes (q~ scale) as its query fragments and q~ . zero as a bias,
// the levels gathered as any codes are, or taken from their bits as fp16 subnormals (KLEVELS: level 2^(s - 24), the
// fragments then q~ scale 2^(3 - s) and the scores times 2^21); affine values are level * scale + zero in fp16 (one
// fma a half2). Limit: the fragments' fp16 pairs need |q~ scale| below 65504, or 8188 where KLEVELS (beyond, the
// scores are inf or NaN).
//
// Bytes that must move per (batch, KV head): T (KW + VW) 4 of codes and T 2 of each norm, 4 D (sinks + r) of
// float16 rows, read once; the books per block, from L2 after the first block; the partials, 4 (D + 2) GQ per part,
// written and read once.
//
// Kernels, each launched by kvcalib/formats/codebook/launch.py, which decides the grid:
//   rotate   block (query head, batch), D SLICES threads: q~ = scale log2(e) q B_K^T, launched only where the
//            keys have a basis (KROT); without one each `partial` block takes q times the scale itself
//   partial  block (part, launch head, batch), WARPS warps. Parts 0 .. num_splits - 1 take split_len packed
//            tokens each (with counts on the device, the batch's tokens balanced over them: `balanced_split`), as
//            16-token tiles, warp w taking the split's w-th quarter, on the tensor cores:
//              scores  S (16 rows x 8 tokens, twice) = Q~ (16 x D) . K^T (D x 8)  mma.m16n8k16, f32 accumulate
//              output  O^T (D x 8 heads)            += (norm V)^T (D x 16 tokens) . P^T
//            Q~'s row h is head h's fp16 hi and row 8 + h its remainder lo (kernels_cupy/mma_tiles.cuh); the
//            centroids are gathered from the books in shared memory straight into the fragments, channels
//            permuted so that a lane's share of a token is contiguous: of a key, lane t holds codec channels
//            t D/4 .. (t + 1) D/4 - 1 of tokens g and g + 8; of a value, lane group g holds g D/8 .. (g + 1) D/8 - 1
//            of tokens 2t, 2t+1, 2t+8, 2t+9 (vq_decode.cu documents the same permutation). A key's score is its
//            fragment sum times its norm; a value's centroids are multiplied by its norm in fp16 (as a
//            dequantized fp16 cache holds it), P rounded to fp16. The next tile's code words and norms are loaded
//            while a tile is computed. The other parts take ROWS float16 rows each (sinks, then the residual) on
//            the CUDA cores: LPT = D / CH lanes a row, each lane CH channels, float32 throughout. The block's
//            warps are merged into one partial (sum of exp2(s - m) v, m, sum of exp2(s - m)).
//   merge    block (query head, batch), D SLICES threads: the parts weighed by exp2(m_p - M); the packed parts' sum
//            taken back by B_V, the rows' added, divided by the total weight; written as QT.
//
// Defines: KROT (optional, 1: the keys' basis, q~ from `rotate`; 0: none), SOFTCAP_LOG2 (optional: Gemma 2's cap on
// the scores, times log2(e)), SPREAD (optional, 1: the grid's
// packed splits a row over those one wave holds for it, `balanced_split`), D, GQ (<= 8), QT, CH (channels a lane of
// a float16 row), WARPS, ROWS (float16 rows a rows part), SLICES (slices of D threads a `rotate` and `merge` block,
// D SLICES <= 1024), and per
// part X in {K, V}: XB (bits a code), XDIM (coordinates a code: 1, 2, 4 or 8), XPOS (1: a book per position),
// XNORM (1: norms), XW (words a row), XREPL (optional, 1: copies of each entry of a book shared by every position,
// launch.py `book_layout`), XROWS (optional, 1: a book per position of single levels held in lane rows); KTG (tokens
// of an affine key group, 0: none), VCG (channels of an affine value group, 0: none), KLEVELS (optional, 1: affine
// keys' pairs of levels taken from their bits, not read from a book).
#include "decode_common.cuh"

#define NT (32 * WARPS)
#define KS (D / 16)  // 16-channel k-slices of a key, 16-row blocks of the output
#define NEG_INF __int_as_float(0xff800000)
#ifndef SPREAD
#define SPREAD 1  // the grid's packed splits a row over those one wave holds for it (`balanced_split`)
#endif
#ifndef KROT
#define KROT 1  // 1: keys coded in a basis of their own, q~ from `rotate`; 0: none, each block scales q itself
#endif
#ifndef SOFTCAP_LOG2
#define SOFTCAP_LOG2 0.f  // soft-capping (Gemma 2): the cap c times log2(e); 0: none
#endif
#define RESCALE_SLACK 8.f  // log2 units a score passes the running max by before it moves (`softmax_tiles`)
#define MERGE_ROUND (D * SLICES >= 1024 ? 8 : 16)  // parts a slice of `merge` loads at once (64 registers at 1024)
#include "mma_tiles.cuh"

// A score s (log2 units, scale log2(e) q.k) soft-capped as the model caps it, c tanh(s_nat / c), in log2 units:
// C tanh(s / C) with C = c log2(e). tanh by exp (near 0 an absolute error of about C 2^-23), not the approximate
// tanh instruction (2^-11).
__device__ __forceinline__ float softcapped(float s) {
  if (SOFTCAP_LOG2 == 0.f) return s;
  return SOFTCAP_LOG2 * (1.f - 2.f / (__expf(2.f * s / SOFTCAP_LOG2) + 1.f));
}

// A lane's share of a token's codes, per part: KCH channels of a key, VCH of a value.
#define KCH (D / 4)
#define VCH (D / 8)
#define KSHARE (KCH / KDIM * KB)  // bits of a lane's share of a key row
#define VSHARE (VCH / VDIM * VB)
#define KNW ((KSHARE + 31) / 32)  // words it spans, once aligned
#define VNW ((VSHARE + 31) / 32)
// KLEVELS (launch.py `made_levels`): affine keys' pairs of levels taken from their bits (`levels`), not read from a
// book, which the block then neither holds nor copies.
#ifndef KLEVELS
#define KLEVELS 0
#endif
static_assert(!KLEVELS || (KTG > 0 && KDIM == 2 && !KPOS), "levels taken for affine keys in pairs only");
#define KENTRIES (1 << KB)
#define VENTRIES (1 << VB)
#define KP (KPOS ? D / KDIM : 1)  // positions with a book of their own
#define VP (VPOS ? D / VDIM : 1)
// Halves from one position's book to the next: one word (or one centroid, for wider ones) more than the book where
// positions have books of their own, so that neighbouring positions start in other banks.
#define KSTRIDE (KENTRIES * KDIM + (KPOS ? (KDIM > 2 ? KDIM : 2) : 0))
#define VSTRIDE (VENTRIES * VDIM + (VPOS ? (VDIM > 2 ? VDIM : 2) : 0))
#ifndef KREPL
#define KREPL 1
#endif
#ifndef VREPL
#define VREPL 1
#endif
// A book shared by every position may be held in XREPL = 128 / (2 XDIM) copies (launch.py `book_copies`): entry e's
// copies side by side in the 128 bytes at 128 e, lane L reading copy L % XREPL. A warp's gather then meets no bank
// conflict whatever codes its lanes hold (each quarter, half or whole warp of a 16-, 8- or 4-byte load reads 128
// bytes of distinct banks), where the codes' random entries otherwise share banks: a key's 4-byte gather cost 2.0
// wavefronts and a value's 8-byte one 4.9, against 1 and 2 (Nsight Compute, turboquant-2 + vecinfer-d4b6 at B=8).
#define COPIED_ENTRY_BYTES 128
#ifndef KROWS
#define KROWS 0
#endif
#ifndef VROWS
#define VROWS 0
#endif
// A book per position of single levels (XDIM 1: 2-byte entries) may be held in lane rows (XROWS, launch.py
// `book_layout`): row (j, e), 128 bytes, holds in lane L's 4-byte slot (the entry in its low half) entry e of the
// position L reads with its j-th code (a key's lane (g, t) reads positions t CODES + j, a value's g CODES + j). A
// gather's lanes then read distinct banks whatever their codes, where positions' books side by side conflict
// (benchmarks/codebook_banks.py: TurboQuant-4's 2-byte gathers 3.4 wavefronts where 1 would do).
#define KCODES (KCH / KDIM)  // codes of a lane's share of a key, of a value
#define VCODES (VCH / VDIM)
#define KJSTRIDE (KENTRIES * COPIED_ENTRY_BYTES)  // bytes from code j's rows to code j + 1's
#define VJSTRIDE (VENTRIES * COPIED_ENTRY_BYTES)
// A book per position held once, of at most 8 words a position (single levels of up to 4 bits), is skewed by share.
// A gather's lanes read, with their j-th code, position j of each lane share (a key's D / 4 channels, a value's D /
// 8), and positions CODES apart start CODES STRIDE / 2 words apart, 0 mod 32 for a key's single levels at head_dim
// 128: its four shares read the same 8 banks (TurboQuant-4's 2-byte gathers, 3.4 wavefronts:
// benchmarks/codebook_banks.py). Share s's positions start SKEWW s words later, which puts its book at bank STRIDE / 2
// j + SPAN s mod 32 (SPAN: a position's words): a key's four shares in banks of their own (one wavefront), a value's
// eight two to a bank. launch.py `_skew_words` is the same rule.
__host__ __device__ constexpr int skew_words(bool held_once, int span, int stride, int codes) {
  return held_once && span <= 8 ? ((span - stride * codes) % 32 + 32) % 32 : 0;
}
#define KSKEWW skew_words(KPOS && !KROWS, KENTRIES * KDIM / 2, KSTRIDE / 2, KCODES)
#define VSKEWW skew_words(VPOS && !VROWS, VENTRIES * VDIM / 2, VSTRIDE / 2, VCODES)
#define KBOOK_HALVES                                                                                                 \
  (KLEVELS ? 0 : KROWS ? KCODES * KJSTRIDE / 2 : KREPL > 1 ? KENTRIES * COPIED_ENTRY_BYTES / 2                        \
                                                     : KP * KSTRIDE + 2 * KSKEWW * (D / KCH - 1))
#define VBOOK_HALVES \
  (VROWS ? VCODES * VJSTRIDE / 2 : VREPL > 1 ? VENTRIES * COPIED_ENTRY_BYTES / 2 : VP * VSTRIDE + 2 * VSKEWW * (D / VCH - 1))
static_assert((KREPL == 1 || (!KPOS && KREPL * 2 * KDIM == COPIED_ENTRY_BYTES)) &&
              (VREPL == 1 || (!VPOS && VREPL * 2 * VDIM == COPIED_ENTRY_BYTES)),
              "copies of shared books only, filling an entry's 128 bytes");
static_assert((!KROWS || (KPOS && KREPL == 1 && KDIM == 1)) && (!VROWS || (VPOS && VREPL == 1 && VDIM == 1)),
              "lane rows of books per position of single levels only");
static_assert(!KLEVELS || KREPL == 1, "levels taken from their bits: their book neither held nor copied");

// Float16 rows (CUDA cores).
#define LPT (D / CH)  // lanes a row
#define TPW (32 / LPT)  // rows a warp takes at once

static_assert(KCH % KDIM == 0 && VCH % VDIM == 0, "a lane's share of a token is whole codes");
#define VGROUP (VCG > 0 ? VCG : D)  // channels of an affine value group (a divisor that never is zero)
static_assert(KTG % 16 == 0 && (VCG == 0 || (VGROUP % VCH == 0 && D % VGROUP == 0)) && !(VCG && VNORM),
              "affine key groups of whole tiles, affine value groups of whole lane shares (and no norm beside them)");
static_assert(D % CH == 0 && 32 % LPT == 0, "a row's channels fill whole lanes of a warp");

// This lane's share of a row: NBITS bits from bit `start` of token `tok`'s row (rows of W words from `rows`), as NW
// words from bit 0 (the bits past the share: the row's next ones or zeros). The word's index within the (batch, head)
// rows is taken in 32 bits (tok W + start / 32 < 2^32 for every capacity the launch allows), one multiply-add to
// the address: a 64-bit product took a tile's loads some 80 instructions of its ~440 (cuobjdump, sm_90).
template <int NBITS, int W>
__device__ __forceinline__ void share_words(const unsigned* __restrict__ rows, unsigned tok, unsigned start,
                                            unsigned* f) {
  constexpr int NW = (NBITS + 31) / 32;
  const unsigned* w = rows + (tok * W + (start >> 5));
  const unsigned off = start & 31;
  unsigned raw[NW + 1];
#pragma unroll
  for (int i = 0; i < NW; ++i) raw[i] = __ldcs(w + i);
  raw[NW] = off + NBITS > 32 * NW ? __ldcs(w + NW) : 0u;  // the share runs into one more word only where it must
#pragma unroll
  for (int i = 0; i < NW; ++i) f[i] = off ? __funnelshift_r(raw[i], raw[i + 1], off) : raw[i];
}

// Code J of BITS bits of a share (`share_words`) times 2^SHIFT: the field moved to bit SHIFT and the rest cleared, so
// that it is a byte offset into a book of 2^SHIFT-byte entries. Masked where it lies, then shifted: the shift and
// the book address's add are then one instruction (LEA.HI or LEA, where a shift of the masked field took SHF, LOP3
// and IADD3: 3 of a gather's 4); a field across two words takes a funnel shift and the mask. A field shifted left is
// masked in an asm of its own, which the compiler keeps apart from the shift (else it shifts first, then masks and
// adds: 3 instructions; turboquant-2 + vecinfer-d4b6's tile loop 408 -> 396, sm_90 SASS).
template <int BITS, int SHIFT, int J>
__device__ __forceinline__ unsigned code_scaled(const unsigned* f) {
  static_assert(BITS + SHIFT <= 32, "a code's byte offset fits a word");
  constexpr int at = J * BITS, wi = at / 32, off = at % 32;
  constexpr unsigned MASK = ((1u << BITS) - 1) << SHIFT;
  if constexpr (off + BITS > 32) return __funnelshift_r(f[wi], f[wi + 1], off - SHIFT) & MASK;  // off > 16 > SHIFT
  constexpr unsigned FIELD = (1u << BITS) - 1;
  if constexpr (off >= SHIFT) return (f[wi] & (FIELD << off)) >> (off - SHIFT);
  unsigned m;
  asm("and.b32 %0, %1, %2;" : "=r"(m) : "r"(f[wi]), "n"(FIELD << off));
  return m << (SHIFT - off);
}

// Loads from a shared-memory byte address (the books) plus a constant: `gather` adds a code's byte offset to a lane's
// book address (one LEA.HI with the code's shift), and the position's offset is the instruction's own (OFF), not an
// add the compiler would otherwise hoist into one register a position. Volatile: the compiler keeps them after the
// barrier that follows the books' copy (they read memory it does not see them read).
template <int OFF>
__device__ __forceinline__ unsigned lds16(unsigned a) {
  unsigned short x;
  asm volatile("ld.shared.u16 %0, [%1+%2];" : "=h"(x) : "r"(a), "n"(OFF));
  return x;
}
template <int OFF>
__device__ __forceinline__ unsigned lds32(unsigned a) {
  unsigned x;
  asm volatile("ld.shared.b32 %0, [%1+%2];" : "=r"(x) : "r"(a), "n"(OFF));
  return x;
}
template <int OFF>
__device__ __forceinline__ uint2 lds64(unsigned a) {
  uint2 x;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2+%3];" : "=r"(x.x), "=r"(x.y) : "r"(a), "n"(OFF));
  return x;
}
template <int OFF>
__device__ __forceinline__ uint4 lds128(unsigned a) {
  uint4 x;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4+%5];" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "r"(a), "n"(OFF));
  return x;
}

// f(Index<0>{}) .. f(Index<N - 1>{}): an unrolled loop whose index is a compile-time constant (no standard header:
// NVRTC compiles this).
template <int I>
struct Index {
  static constexpr int value = I;
};
template <int I, int N, typename F>
__device__ __forceinline__ void constexpr_for_from(F&& f) {
  if constexpr (I < N) {
    f(Index<I>{});
    constexpr_for_from<I + 1, N>(f);
  }
}
template <int N, typename F>
__device__ __forceinline__ void constexpr_for(F&& f) { constexpr_for_from<0, N>(f); }

// The centroids of a share of CHANNELS channels (its first code the row's code `first`), as CHANNELS / 2 half2
// words: channels 2i, 2i + 1 in word i. `book`: the book's shared-memory address (of a copied book, this lane's
// copy of entry 0; of lane rows, its slot of code 0's entry 0: `book_address`). A book of DIM 1 takes two half loads
// a word, 2 one, 4 and 8 one load of two or four words.
template <int CHANNELS, int BITS, int DIM, int POS, int STRIDE, int REPL, int LANE_ROWS, int JSTRIDE, int SKEWW>
__device__ __forceinline__ void gather(unsigned book, const unsigned* f, int first, unsigned* out) {
  static_assert(DIM == 1 || DIM == 2 || DIM == 4 || DIM == 8, "a centroid is one load of at most 16 bytes");
  // an entry's bytes (of a copied book, its copies': 128; of lane rows, its row's), log2
  constexpr int SHIFT = REPL > 1 || LANE_ROWS ? 7 : DIM == 1 ? 1 : DIM == 2 ? 2 : DIM == 4 ? 3 : 4;
  constexpr int CODES = CHANNELS / DIM;  // a share's positions: `first` is the share's times CODES
  const unsigned mine = book + (POS && !LANE_ROWS ? 2 * first * STRIDE + 4 * SKEWW * (unsigned(first) / CODES) : 0);
  constexpr_for<CHANNELS / DIM>([&](auto jc) {
    constexpr int j = decltype(jc)::value, OFF = LANE_ROWS ? j * JSTRIDE : POS ? 2 * j * STRIDE : 0;
    const unsigned e = mine + code_scaled<BITS, SHIFT, j>(f);
    if constexpr (DIM == 1) {
      const unsigned x = lds16<OFF>(e);
      if (j % 2 == 0) out[j / 2] = x;
      else out[j / 2] |= x << 16;
    } else if constexpr (DIM == 2) {
      out[j] = lds32<OFF>(e);
    } else if constexpr (DIM == 4) {
      const uint2 x = lds64<OFF>(e);
      out[2 * j] = x.x, out[2 * j + 1] = x.y;
    } else {
      const uint4 x = lds128<OFF>(e);
      out[4 * j] = x.x, out[4 * j + 1] = x.y, out[4 * j + 2] = x.z, out[4 * j + 3] = x.w;
    }
  });
}

// Affine keys' centroids are their levels 0 .. 2^LB - 1 (layout.py `affine_part`), read in pairs (a code of BITS =
// 2 LB bits, its first level least significant: launch.py `kernel_book`): where KLEVELS, a pair's half2 is taken
// from its bits, no book read: one byte permute puts the bytes holding each level into its half (the first level's
// bytes into the low half, the second's into the high, a byte further where the second would pass the 10 bits of a
// half's mantissa), one AND keeps each level's bits. A half then holds level 2^s, s the level's offset in it
// (`level_shift`): as an fp16, the subnormal level 2^(s - 24), exact, which the tensor cores multiply as any fp16.
// `affine_fragments` takes q~ scale times 2^(3 - s) channel by channel and `tile_step` the scores times 2^21, so that
// a product is (q~ scale level) 2^-21: the same products as the levels' own, each times a power of two, but for the
// fp16 fragments' range (|q~ scale| up to 8188, not 65504: the limit above; s = 0 at a share's first channel) and a
// remainder below 2^-14, which rounds at 2^(s - 28) (a score's error at most that times the level, a channel): 2^(3 -
// s) gives up 8 times the range for up to 16 times the precision (s up to 7) that 2^-s would keep. Where the book
// gathered a pair in 3 instructions (a code's mask, its address, the load), this takes 2 (a byte permute, an AND),
// or less where pairs share a permute's bytes (sm_90 SASS: kivi-2-g128 + vecinfer-d4b6's tile loop 328 -> 247
// instructions, less its loads).
template <int BITS>
__host__ __device__ constexpr int level_shift(int c) {
  const int LB = BITS / 2, at = c / 2 * BITS, s0 = at % 8, k = s0 + 2 * LB <= 10 ? 0 : 1;
  return c % 2 ? s0 + LB - 8 * k : s0;
}

template <int CHANNELS, int BITS>
__device__ __forceinline__ void levels(const unsigned* f, unsigned* out) {
  constexpr int LB = BITS / 2, NW = (CHANNELS / 2 * BITS + 31) / 32;  // a level's bits; the share's words
  static_assert(BITS % 2 == 0 && LB <= 4, "levels of at most 4 bits, in pairs");
  constexpr_for<CHANNELS / 2>([&](auto jc) {
    constexpr int j = decltype(jc)::value, at = j * BITS, wi = at / 32, bo = at % 32 / 8;
    // the first level from bytes bo, bo + 1 of the share (at bit s0 there), the second from bytes bo + k, bo + k + 1
    // (bytes 4 .. 7: the next word's, read only where a level lies there), at the offsets `level_shift` tells
    // `affine_fragments`; each level's bits where the selector and MASK take them (8 bo + s0, 8 (bo + k) + s1 in the
    // share's bytes), within a half's mantissa
    constexpr int s0 = level_shift<BITS>(2 * j), s1 = level_shift<BITS>(2 * j + 1), k = (s0 + LB - s1) / 8;
    static_assert(8 * bo + s0 == at % 32 && 8 * (bo + k) + s1 == at % 32 + LB, "levels where they lie");
    static_assert(s0 + LB <= 10 && s1 + LB <= 10, "levels within the mantissa");
    constexpr bool NEXT = (bo == 3 && s0 + LB > 8) || bo + k == 4 || (bo + k == 3 && s1 + LB > 8);
    static_assert(!NEXT || wi + 1 < NW, "a level in the next word of the share");
    constexpr unsigned sel = bo | (bo + 1) << 4 | (bo + k) << 8 | (bo + k + 1) << 12;
    constexpr unsigned LMASK = (1u << LB) - 1, MASK = LMASK << s0 | LMASK << (s1 + 16);
    out[j] = __byte_perm(f[wi], NEXT ? f[wi + 1] : 0u, sel) & MASK;
  });
}

// A book (P, E, DIM) fp16 from global memory into shared memory, positions STRIDE halves apart, each share of CODES
// positions SKEWW words after the last (`skew_words`; words copied: E DIM is even for every book the launch makes).
template <int P, int ROWLEN, int STRIDE, int CODES, int SKEWW>
__device__ __forceinline__ void copy_book(__half* dst, const __half* __restrict__ src) {
  static_assert(ROWLEN % 2 == 0 && STRIDE % 2 == 0, "books are copied in words");
  const unsigned* s = reinterpret_cast<const unsigned*>(src);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
  for (int i = threadIdx.x; i < P * ROWLEN / 2; i += NT) {
    const int p = i / (ROWLEN / 2);
    d[p * (STRIDE / 2) + p / CODES * SKEWW + i % (ROWLEN / 2)] = s[i];
  }
}

// A shared book (E, DIM) fp16 into shared memory as its copies (`KREPL`): word w of entry e's 128 bytes is word
// w % (DIM / 2) of the entry. Consecutive threads store consecutive words (no bank conflict); a warp's 32 words are
// one entry's, its loads one or a few words of L1.
template <int E, int DIM>
__device__ __forceinline__ void copy_book_copies(__half* dst, const __half* __restrict__ src) {
  static_assert(DIM % 2 == 0, "copied entries are whole words");
  constexpr int WORDS = COPIED_ENTRY_BYTES / 4;
  const unsigned* s = reinterpret_cast<const unsigned*>(src);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll 8
  for (int i = threadIdx.x; i < E * WORDS; i += NT) d[i] = __ldg(s + i / WORDS * (DIM / 2) + i % (DIM / 2));
}

// A book per position of single levels (E fp16 a position), into shared memory as lane rows (`XROWS`): word w of
// row (j, e) is entry e of the position lane w % 32 reads with its j-th code, in the word's low half. Consecutive
// threads store consecutive words.
template <int E, int CODES, bool KEY>
__device__ __forceinline__ void copy_book_rows(__half* dst, const __half* __restrict__ src) {
  const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll 4
  for (int w = threadIdx.x; w < CODES * E * 32; w += NT) {
    const int r = w / 32, e = r % E, j = r / E, lane = w % 32;
    d[w] = __ldg(s + ((KEY ? lane % 4 : lane / 4) * CODES + j) * E + e);
  }
}

// A lane's address of a book in shared memory: of a copied book, its copy of entry 0 (lane % REPL), which `gather`
// offsets by the code times 128 bytes; of lane rows, its slot of code 0's entry 0 (`copy_book_rows`).
template <int DIM, int REPL, int LANE_ROWS>
__device__ __forceinline__ unsigned book_address(const __half* book) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(book)), lane = threadIdx.x % 32;
  if constexpr (LANE_ROWS) return at + lane * 4;
  return REPL > 1 ? at + lane % REPL * 2 * DIM : at;
}

// An address the compiler holds as it is: without it, it folds a row's start into each load's 64-bit index from
// the parameter (two adds with carry and two LEAs a load, where one IMAD.WIDE.U32 offsets an address held).
template <typename T>
__device__ __forceinline__ const T* opaque(const T* p) {
  asm("mov.b64 %0, %0;" : "+l"(p));
  return p;
}

// What a lane loads of one 16-token tile: its key shares (tokens g, g + 8), its value shares and the norms of its four
// slots (2t, 2t+1, 2t+8, 2t+9). The norms stay float16 until `tile_step` reads them, a tile after their loads
// (converted where loaded, each conversion had waited for its load: about a fifth of the warps' stalls, Nsight
// Compute).
struct Tile {
  unsigned k[2][KNW];
  unsigned v[4][VNW];
  // slots 2j and 2j + 1 (tokens side by side) in half2 j: a register holds two (a tile's half registers were what
  // OScaR-4's keys beside TurboQuant's values spilled). vn: a value's norm, or its affine scale (vz its zero).
  __half2 kn[2], vn[2], vz[2];
};

__device__ __forceinline__ int slot_token(int i, int t) { return 8 * (i / 2) + 2 * t + i % 2; }

__device__ __forceinline__ void load_tile(Tile& x, unsigned base, unsigned t1, const unsigned* __restrict__ krow,
                                          const unsigned* __restrict__ vrow, const __half* __restrict__ knorm,
                                          const __half* __restrict__ vnorm, const __half* __restrict__ vscale,
                                          const __half* __restrict__ vzero) {
  // Without a branch: a token past the split's end reads its last token (base < t1 wherever a tile is loaded), so
  // every load lies in a flushed token's row and every number read is finite; `tile_step` masks the tokens outside
  // [t0, t1): their scores -inf, their weights 0.
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, last = t1 - 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) share_words<KSHARE, KW>(krow, min(base + g + 8 * r, last), t * KSHARE, x.k[r]);
  const __half one = __ushort_as_half(0x3c00), zero = __ushort_as_half(0);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    unsigned tok[2];
    __half kn[2], vn[2], vz[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      tok[e] = min(base + slot_token(2 * j + e, t), last);
      share_words<VSHARE, VW>(vrow, tok[e], g * VSHARE, x.v[2 * j + e]);
      kn[e] = KNORM ? __ldcs(knorm + tok[e]) : one;
      if constexpr (VCG > 0) {  // lane group g's channels lie in value group g VCH / VCG
        const unsigned at = tok[e] * (D / VGROUP) + g * VCH / VGROUP;
        vn[e] = __ldcs(vscale + at);
        vz[e] = __ldcs(vzero + at);
      } else {
        vn[e] = VNORM ? __ldcs(vnorm + tok[e]) : one;
        vz[e] = zero;
      }
    }
    x.kn[j] = __halves2half2(kn[0], kn[1]);
    x.vn[j] = __halves2half2(vn[0], vn[1]);
    x.vz[j] = __halves2half2(vz[0], vz[1]);
  }
}

// One tile on the tensor cores into the warp's running max m (head g), sum share l and accumulators acc.
__device__ __forceinline__ void tile_step(const Tile& x, int base, int t0, int t1, const uint4* qa, float kbias,
                                          unsigned kb, unsigned vb, float& m, float& l, float (*acc)[4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    unsigned kh[KCH / 2];  // token g + 8 r: channels t D/4 .. as half2 words
    if constexpr (KLEVELS) levels<KCH, KB>(x.k[r], kh);
    else gather<KCH, KB, KDIM, KPOS, KSTRIDE, KREPL, KROWS, KJSTRIDE, KSKEWW>(kb, x.k[r], t * (KCH / KDIM), kh);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) mma16816(c[r], qa[ks], kh[2 * ks], kh[2 * ks + 1]);
  }
  float sc[1][4], p[1][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = base + slot_token(i, t);
    // levels taken as subnormals (`levels`): the products (q~ scale level) 2^-21
    const float s = (c[i / 2][i % 2] + c[i / 2][2 + i % 2]) * (KLEVELS ? 2097152.f : 1.f) + kbias;
    const float norm = KNORM ? (i % 2 ? __high2float(x.kn[i / 2]) : __low2float(x.kn[i / 2])) : 1.f;
    sc[0][i] = tok >= t0 && tok < t1 ? softcapped(KNORM ? s * norm : s) : NEG_INF;
  }
  softmax_tiles<1>(sc, m, l, p, acc);
  unsigned vh[4][VCH / 2];  // slots 2t, 2t+1, 2t+8, 2t+9: channels g D/8 .. as half2 words, times the norm
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    gather<VCH, VB, VDIM, VPOS, VSTRIDE, VREPL, VROWS, VJSTRIDE, VSKEWW>(vb, x.v[i], g * (VCH / VDIM), vh[i]);
    if constexpr (VNORM || VCG > 0) {  // else the centroids are the values (a masked token's weight is 0)
      const __half2 n = i % 2 ? __high2half2(x.vn[i / 2]) : __low2half2(x.vn[i / 2]);
      const __half2 z = i % 2 ? __high2half2(x.vz[i / 2]) : __low2half2(x.vz[i / 2]);
#pragma unroll
      for (int u = 0; u < VCH / 2; ++u) {
        const __half2 c2 = *reinterpret_cast<const __half2*>(&vh[i][u]);
        const __half2 y = VCG > 0 ? __hfma2(c2, n, z) : __hmul2(c2, n);
        vh[i][u] = *reinterpret_cast<const unsigned*>(&y);
      }
    }
  }
  const unsigned pb0 = pack_half2(p[0][0], p[0][1]), pb1 = pack_half2(p[0][2], p[0][3]);
#pragma unroll
  for (int u = 0; u < KS; ++u) {  // block u: rows g, g + 8 = channels g D/8 + 2u, + 1
    const uint4 a = make_uint4(__byte_perm(vh[0][u], vh[1][u], 0x5410), __byte_perm(vh[0][u], vh[1][u], 0x7632),
                               __byte_perm(vh[2][u], vh[3][u], 0x5410), __byte_perm(vh[2][u], vh[3][u], 0x7632));
    mma16816(acc[u], a, pb0, pb1);
  }
}

// Sums a per-head value over the LPT lanes of a row (lanes lane ^ 1 .. lane ^ LPT/2 hold the same row).
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = 1; o < LPT; o *= 2) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}

// The online softmax of one row slot: s (log2 units, -inf for none) per head into the running max m, sum l and
// accumulators acc; returns the weights p of the row (0 for none).
__device__ __forceinline__ void row_softmax(const float* s, float* m, float* l, float (*acc)[CH], float* p) {
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    if (s[h] > m[h] + RESCALE_SLACK) {
      const float alpha = m[h] == NEG_INF ? 0.f : exp2f(m[h] - s[h]);
      m[h] = s[h];
      l[h] *= alpha;
#pragma unroll
      for (int c = 0; c < CH; ++c) acc[h][c] *= alpha;
    }
    p[h] = s[h] == NEG_INF ? 0.f : exp2f(s[h] - m[h]);
    l[h] += p[h];
  }
}

// The block's warps' states (work: WARPS x (GQ D accumulators in codec channel order, GQ maxima, GQ sums), written
// by each warp) merged into this part's partial: part_acc (GQ x D) and part_ml (GQ x 2) at acc_at / ml_at.
__device__ __forceinline__ void write_partial(const float* work, float* part_acc, float* part_ml, long acc_at,
                                              long ml_at, int part_stride) {
  __syncthreads();
  for (int i = threadIdx.x; i < GQ * D; i += NT) {
    const int h = i / D;
    float mx = NEG_INF;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, work[w * GQ * (D + 2) + GQ * D + h]);
    float sum = 0.f, den = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float* st = work + w * GQ * (D + 2);
      const float mw = st[GQ * D + h];
      const float wt = mw == NEG_INF ? 0.f : exp2f(mw - mx);
      sum += wt * st[i];
      den += wt * st[GQ * D + GQ + h];
    }
    part_acc[acc_at + (long)h * part_stride * D + i % D] = sum;
    if (i % D == 0) {
      part_ml[ml_at + 2L * h * part_stride] = mx;
      part_ml[ml_at + 2L * h * part_stride + 1] = den;
    }
  }
}

// An affine key group's A fragments: q~ scale (channel by channel, as `q_fragments` splits q~) from float32 rows
// src[h][D] and the group's scale and zero rows (D fp16 each); and the bias q~ . zero of head g (lane (g, t)).
__device__ __forceinline__ void affine_fragments(const float (*src)[D], const __half* __restrict__ scale,
                                                 const __half* __restrict__ zero, uint4* qa, float& bias) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float b = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const int c0 = t * (D / 4) + 4 * ks;
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < GQ) f = *reinterpret_cast<const float4*>(&src[g][c0]);
    const uint2 sw = __ldg(reinterpret_cast<const uint2*>(scale + c0));
    const uint2 zw = __ldg(reinterpret_cast<const uint2*>(zero + c0));
    const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sw.x));
    const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sw.y));
    const float2 z01 = __half22float2(*reinterpret_cast<const __half2*>(&zw.x));
    const float2 z23 = __half22float2(*reinterpret_cast<const __half2*>(&zw.y));
    // where KLEVELS, q~ scale times 2^(3 - s), built exactly: the levels' subnormals are level 2^(s - 24) (`levels`)
    const auto k = [](int c) { return KLEVELS ? __int_as_float((130 - level_shift<KB>(c)) << 23) : 1.f; };
    b += f.x * z01.x + f.y * z01.y + f.z * z23.x + f.w * z23.y;
    const float x[4] = {f.x * (s01.x * k(4 * ks)), f.y * (s01.y * k(4 * ks + 1)), f.z * (s23.x * k(4 * ks + 2)),
                        f.w * (s23.y * k(4 * ks + 3))};
    qa[ks] = hi_lo_fragment(x);
  }
  b += __shfl_xor_sync(0xffffffff, b, 1);
  b += __shfl_xor_sync(0xffffffff, b, 2);
  bias = b;
}

// q~ = scale log2(e) q B_K^T for query head blockIdx.x of batch row blockIdx.y (float32, (B, Hl GQ, D)), D SLICES
// threads: thread (c, s) takes channels s D / SLICES .. of row c of B_K (`kbasis` (G, D, D), G = 1 or the launch's
// heads; launched only where the keys have one, KROT: without, each `partial` block scales q itself), all its loads in
// flight at once, the slices summed in shared memory (one trip to L2, where D threads walking a whole row each made
// D / 32 dependent trips: this launch and `merge` are on every step's critical path, latency-bound, not bytes-bound).
extern "C" __global__ void __launch_bounds__(D * SLICES) rotate(const QT* __restrict__ q,
                                                                 const float* __restrict__ kbasis, int basis_heads,
                                                                 const int* __restrict__ head_map, int hq_model,
                                                                 float scale_log2, float* __restrict__ qrot) {
  __shared__ float x[D];
  __shared__ float sums[SLICES][D];
  const int hl = blockIdx.x / GQ, b = blockIdx.y, c = threadIdx.x % D, s = threadIdx.x / D;
  // The basis's loads first, in flight while the query's (behind its head's index) are made: one trip to memory.
  constexpr int SPAN = D / SLICES;
  const float4* m = reinterpret_cast<const float4*>(kbasis + (basis_heads > 1 ? (long)hl * D * D : 0) + c * D + s * SPAN);
  float4 r[SPAN / 4];
#pragma unroll
  for (int i = 0; i < SPAN / 4; ++i) r[i] = __ldg(m + i);
  const int hm = head_map ? head_map[hl] : hl;
  const QT* src = q + ((long)b * hq_model + hm * GQ + blockIdx.x % GQ) * D;
  float* dst = qrot + ((long)b * gridDim.x + blockIdx.x) * D + c;
  if (s == 0) x[c] = to_float(src[c]);
  __syncthreads();
  float y = 0.f;
#pragma unroll
  for (int i = 0; i < SPAN / 4; ++i) {
    const float* xs = x + s * SPAN + 4 * i;
    y += xs[0] * r[i].x + xs[1] * r[i].y + xs[2] * r[i].z + xs[3] * r[i].w;
  }
  sums[s][c] = y;
  __syncthreads();
  if (s == 0) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < SLICES; ++j) t += sums[j][c];
    *dst = t * scale_log2;
  }
}

// Tokens a split takes when the counts are read on the device (a captured step, whose grid was sized for the
// capacity): the batch's flushed tokens spread evenly over the splits one wave holds for a KV head, num_splits /
// SPREAD a row, so that rows of different lengths keep every block of the wave busy (a padded batch), and no row
// needing more than the grid's num_splits; whole SPLIT_UNITs (16 WARPS tokens: a tile for each warp's quarter).
__device__ __forceinline__ int balanced_split(const int* __restrict__ lengths, int capt, int num_splits) {
  int total = 0, longest = 0;
  for (int i = 0; i < gridDim.z; ++i) {
    const int n = min(lengths[i], capt);
    total += n, longest = max(longest, n);
  }
  const int slots = max(1, num_splits / SPREAD) * gridDim.z;
  const int per = max((total + slots - 1) / slots, (longest + num_splits - 1) / num_splits);
  constexpr int UNIT = 16 * WARPS;
  return max(1, (per + UNIT - 1) / UNIT) * UNIT;
}

extern "C" __global__ void __launch_bounds__(NT, PARTIAL_BLOCKS) partial(
    const float* __restrict__ qrot, const QT* __restrict__ q, int hq_model, const int* __restrict__ head_map,
    int row_heads, const unsigned* __restrict__ kcodes, const __half* __restrict__ knorm,
    const __half* __restrict__ kscale, const __half* __restrict__ kzero, int capg, const unsigned* __restrict__ vcodes,
    const __half* __restrict__ vnorm, const __half* __restrict__ vscale, const __half* __restrict__ vzero, int capt, const __half* __restrict__ kbook, int kbook_heads,
    const __half* __restrict__ vbook, int vbook_heads, const __half* __restrict__ ksink,
    const __half* __restrict__ vsink, int sinks, int caps, const __half* __restrict__ kres,
    const __half* __restrict__ vres, int residual, int capr, int length, int split_len, int num_splits,
    float scale_log2, const int* __restrict__ lengths, const int* __restrict__ residuals,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  extern __shared__ float smem[];
  const int part = blockIdx.x, hl = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long bh = (long)b * H + hl;  // the group's buffers
  const long bhr = (long)b * row_heads + (head_map ? head_map[hl] : hl);  // the layer's float16 rows
  const int T = lengths ? min(lengths[b], capt) : length;  // flushed tokens
  const int S = min(sinks, T);  // of them read from the float16 sinks
  const int nrows = S + (residuals ? min(residuals[b], capr) : residual);
  const int parts = gridDim.x;
  const long acc_at = (bh * GQ * parts + part) * D, ml_at = (bh * GQ * parts + part) * 2;
  float* mine = smem + warp * GQ * (D + 2);  // this warp's state for `write_partial`: acc, then m, then l
  if (part < num_splits) {  // packed tokens [t0, t1) on the tensor cores, summed in V's basis
    const int g = lane / 4, t = lane % 4;
    if (lengths) split_len = balanced_split(lengths, capt, num_splits);
    const int t0 = max(S, part * split_len), t1 = min(T, (part + 1) * split_len);
    // The (batch, head)'s rows, each held as an address of its own (`opaque`), which a tile's loads offset by their
    // 32-bit token index in one instruction.
    const unsigned* krow = opaque(kcodes + bh * capt * KW);
    const unsigned* vrow = opaque(vcodes + bh * capt * VW);
    const __half* kn = KNORM ? opaque(knorm + bh * capt) : nullptr;
    const __half* vn = VNORM ? opaque(vnorm + bh * capt) : nullptr;
    const __half* vs = VCG ? opaque(vscale + bh * capt * (D / VGROUP)) : nullptr;
    const __half* vz = VCG ? opaque(vzero + bh * capt * (D / VGROUP)) : nullptr;
    // Warp w takes the split's w-th quarter, whole 16-token tiles (split_len is whole SPLIT_UNITs): an affine key
    // group of KTG tokens then costs a warp its fragments once, not once every WARPS tiles. Its tiles start at the
    // tile of t0 (the split's first token not among the float16 sinks); a split of sinks alone runs none (its books
    // were not copied).
    const int span = split_len / WARPS, begin = part * split_len + span * warp;
    const int first = max(begin, t0 & ~15), last = t0 < t1 ? min(t1, begin + span) : first;
    Tile cur, nxt;
    // The prologue's reads are asked for at once, each a trip to memory the block would otherwise wait on in turn:
    // the first tile's codes, q~ (`rotate`'s, or q), the books (at B=8, 32k no change measured: a split's tiles
    // outweigh its prologue).
    if (first < last) load_tile(cur, first, t1, krow, vrow, kn, vn, vs, vz);
    __half* kb = reinterpret_cast<__half*>(smem);
    __half* vb = kb + (KBOOK_HALVES + 7) / 8 * 8;
    uint4 qa[KS];
    // q~ of the block's GQ query heads: `rotate`'s (keys in a basis of their own), else q times the scale, which
    // the block writes after its books in shared memory (launch.py `_block_bytes`), a launch fewer on the step's
    // critical path.
    float* qs = reinterpret_cast<float*>(vb + (VBOOK_HALVES + 7) / 8 * 8);
    const float(*qrows)[D] = reinterpret_cast<const float(*)[D]>(KROT ? qrot + bh * GQ * D : qs);
    if (t0 < t1) {  // (block-uniform) an empty split writes an empty partial and reads nothing
      if (KROT && !KTG) q_fragments(qrows, qa);
      constexpr int QPER = (GQ * D + NT - 1) / NT;  // elements of q a thread scales (KROT 0)
      float qv[QPER];
      if constexpr (!KROT) {
        const QT* qsrc = q + ((long)b * hq_model + (head_map ? head_map[hl] : hl) * GQ) * D;
#pragma unroll
        for (int j = 0; j < QPER; ++j) {
          const int i = threadIdx.x + j * NT;
          qv[j] = i < GQ * D ? to_float(qsrc[i]) : 0.f;
        }
      }
      const __half* ksrc = kbook + (kbook_heads > 1 ? (long)hl * KP * KENTRIES * KDIM : 0);
      const __half* vsrc = vbook + (vbook_heads > 1 ? (long)hl * VP * VENTRIES * VDIM : 0);
      if constexpr (KROWS) copy_book_rows<KENTRIES, KCODES, true>(kb, ksrc);
      else if constexpr (KREPL > 1) copy_book_copies<KENTRIES, KDIM>(kb, ksrc);
      else if constexpr (!KLEVELS) copy_book<KP, KENTRIES * KDIM, KSTRIDE, KCODES, KSKEWW>(kb, ksrc);
      if constexpr (VROWS) copy_book_rows<VENTRIES, VCODES, false>(vb, vsrc);
      else if constexpr (VREPL > 1) copy_book_copies<VENTRIES, VDIM>(vb, vsrc);
      else copy_book<VP, VENTRIES * VDIM, VSTRIDE, VCODES, VSKEWW>(vb, vsrc);
      if constexpr (!KROT) {  // as `rotate` writes it without a basis: the same float32 products
#pragma unroll
        for (int j = 0; j < QPER; ++j) {
          const int i = threadIdx.x + j * NT;
          if (i < GQ * D) qs[i] = qv[j] * scale_log2;
        }
        __syncthreads();
        if (!KTG) q_fragments(qrows, qa);
      }
    }
    float kbias = 0.f;
    int group = -1;  // the affine key group whose fragments qa holds
    __syncthreads();
    float m = NEG_INF, l = 0.f, acc[KS][4];
#pragma unroll
    for (int u = 0; u < KS; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][i] = 0.f;
    const unsigned kbs = book_address<KDIM, KREPL, KROWS>(kb);
    const unsigned vbs = book_address<VDIM, VREPL, VROWS>(vb);
    for (int base = first; base < last; base += 16) {
      if (base + 16 < last) load_tile(nxt, base + 16, t1, krow, vrow, kn, vn, vs, vz);
      if (KTG && base / (KTG ? KTG : 1) != group) {  // a new affine key group: its fragments and bias (warp-uniform)
        group = base / (KTG ? KTG : 1);
        const long at = (bh * capg + group) * D;
        affine_fragments(qrows, kscale + at, kzero + at, qa, kbias);
      }
      tile_step(cur, base, t0, t1, qa, kbias, kbs, vbs, m, l, acc);
      cur = nxt;
    }
    for (int o = 1; o < 4; o *= 2) l += __shfl_xor_sync(0xffffffff, l, o);
    __syncthreads();  // the books' memory becomes the warps' states
#pragma unroll
    for (int u = 0; u < KS; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = 2 * t + (i & 1), ch = g * (D / 8) + 2 * u + (i >> 1);
        if (h < GQ) mine[h * D + ch] = acc[u][i];
      }
    if (t == 0 && g < GQ) mine[GQ * D + g] = m, mine[GQ * D + GQ + g] = l;
  } else {  // float16 rows [r0, r1): the sinks, then the residual window, against q in the model's basis
    const int slot = lane / LPT, chunk = lane % LPT;
    float m[GQ], l[GQ], acc[GQ][CH], qr[GQ][CH];
    const QT* qsrc = q + ((long)b * hq_model + (head_map ? head_map[hl] : hl) * GQ) * D + chunk * CH;
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      m[h] = NEG_INF, l[h] = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c) acc[h][c] = 0.f, qr[h][c] = to_float(qsrc[h * D + c]) * scale_log2;
    }
    const int r0 = (part - num_splits) * ROWS, r1 = min(nrows, r0 + ROWS);
    for (int base = r0 + warp * TPW; base < r1; base += WARPS * TPW) {
      const int r = base + slot;
      const bool here = r < r1;
      float s[GQ], p[GQ], y[CH];
      const long at = r < S ? (bhr * caps + r) * D : (bhr * capr + r - S) * D;
      const __half* kx = (r < S ? ksink : kres) + at + chunk * CH;
      const __half* vx = (r < S ? vsink : vres) + at + chunk * CH;
#pragma unroll
      for (int c = 0; c < CH; ++c) y[c] = here ? __half2float(kx[c]) : 0.f;
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        float x = 0.f;
#pragma unroll
        for (int c = 0; c < CH; ++c) x += qr[h][c] * y[c];
        const float sum = row_sum(x);  // every lane takes part in the shuffles
        s[h] = here ? softcapped(sum) : NEG_INF;
      }
      row_softmax(s, m, l, acc, p);
#pragma unroll
      for (int c = 0; c < CH; ++c) y[c] = here ? __half2float(vx[c]) : 0.f;
#pragma unroll
      for (int h = 0; h < GQ; ++h)
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[h][c] += p[h] * y[c];
    }
    // The warp's row slots merged (lanes lane ^ LPT .. hold the same channels of other rows).
#pragma unroll
    for (int o = LPT; o < 32; o *= 2)
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        const float mo = __shfl_xor_sync(0xffffffff, m[h], o), lo = __shfl_xor_sync(0xffffffff, l[h], o);
        const float mx = fmaxf(m[h], mo);
        const float a = m[h] == NEG_INF ? 0.f : exp2f(m[h] - mx), bb = mo == NEG_INF ? 0.f : exp2f(mo - mx);
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[h][c] = acc[h][c] * a + __shfl_xor_sync(0xffffffff, acc[h][c], o) * bb;
        l[h] = l[h] * a + lo * bb;
        m[h] = mx;
      }
    if (lane < LPT) {
#pragma unroll
      for (int h = 0; h < GQ; ++h)
#pragma unroll
        for (int c = 0; c < CH; ++c) mine[h * D + chunk * CH + c] = acc[h][c];
    }
    if (lane < GQ) {
      float mm = 0.f, ll = 0.f;
#pragma unroll
      for (int h = 0; h < GQ; ++h)
        if (h == lane) mm = m[h], ll = l[h];
      mine[GQ * D + lane] = mm;
      mine[GQ * D + GQ + lane] = ll;
    }
  }
  write_partial(smem, part_acc, part_ml, acc_at, ml_at, parts);
}

// out[b, head, :] for query head blockIdx.x of the launch (model head head_map[hl] GQ + blockIdx.x % GQ), batch
// row blockIdx.y, D SLICES threads: slice s merges parts s, s + SLICES, ... in one pass (MERGE_ROUND parts' loads in
// flight at once, the running max moved a round at a time), the slices' states are merged in shared memory, the
// packed parts' sum taken back by B_V (`vbasis` (G, D, D), null: the identity; slice s takes rows s D / SLICES .. of
// it, every load in flight at once), the rows' parts added, divided by the total weight.
extern "C" __global__ void __launch_bounds__(D * SLICES) merge(const float* __restrict__ part_acc,
                                                                const float* __restrict__ part_ml, int parts,
                                                                int num_splits, const float* __restrict__ vbasis,
                                                                int basis_heads, const int* __restrict__ head_map,
                                                                int hq_model, QT* __restrict__ out) {
  __shared__ float coded[SLICES][D], rows[SLICES][D];
  __shared__ float slice_max[SLICES], slice_den[SLICES];
  const int hl = blockIdx.x / GQ, b = blockIdx.y, c = threadIdx.x % D, s = threadIdx.x / D;
  const long row = (long)b * gridDim.x + blockIdx.x;
  // What the block reads after the parts, asked for before them: B_V into L2 (its lines spread over the threads),
  // the head's index.
  const float* basis = vbasis ? vbasis + (basis_heads > 1 ? (long)hl * D * D : 0) : nullptr;
  if (basis)
    for (int i = threadIdx.x; i < D * D / 32; i += D * SLICES)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(basis + 32 * i));
  const int hm = head_map ? __ldg(head_map + hl) : hl;
  const float* ml = part_ml + row * parts * 2;
  const float* acc = part_acc + row * parts * D + c;
  float mx = NEG_INF, den = 0.f, sum_coded = 0.f, sum_rows = 0.f;
  for (int p0 = s; p0 < parts; p0 += SLICES * MERGE_ROUND) {
    float2 w[MERGE_ROUND];
    float x[MERGE_ROUND];
#pragma unroll
    for (int i = 0; i < MERGE_ROUND; ++i) {
      const int p = p0 + i * SLICES;
      const bool here = p < parts;
      w[i] = here ? __ldcg(reinterpret_cast<const float2*>(ml) + p) : make_float2(NEG_INF, 0.f);
      x[i] = here ? __ldcg(acc + (long)p * D) : 0.f;
    }
    float round_max = mx;
#pragma unroll
    for (int i = 0; i < MERGE_ROUND; ++i) round_max = fmaxf(round_max, w[i].x);
    if (round_max > mx) {  // mx is NEG_INF until a part holds a token
      const float alpha = mx == NEG_INF ? 0.f : exp2f(mx - round_max);
      den *= alpha, sum_coded *= alpha, sum_rows *= alpha;
      mx = round_max;
    }
#pragma unroll
    for (int i = 0; i < MERGE_ROUND; ++i) {
      const float wp = w[i].x == NEG_INF ? 0.f : exp2f(w[i].x - mx);
      den += wp * w[i].y;
      if (p0 + i * SLICES < num_splits) sum_coded += wp * x[i];
      else sum_rows += wp * x[i];
    }
  }
  if (c == 0) slice_max[s] = mx;  // a slice's max and weight are the same in each of its threads
  __syncthreads();
  float top = NEG_INF;
#pragma unroll
  for (int j = 0; j < SLICES; ++j) top = fmaxf(top, slice_max[j]);
  const float alpha = mx == NEG_INF ? 0.f : exp2f(mx - top);
  coded[s][c] = sum_coded * alpha;
  rows[s][c] = sum_rows * alpha;
  if (c == 0) slice_den[s] = den * alpha;
  __syncthreads();
  if (s == 0) {  // the slices' sums, slice 0 holding them
    float tc = 0.f, tr = 0.f;
#pragma unroll
    for (int j = 0; j < SLICES; ++j) tc += coded[j][c], tr += rows[j][c];
    coded[0][c] = tc, rows[0][c] = tr;
  }
  __syncthreads();
  const float rows_total = rows[0][c];
  float y = coded[0][c];
  if (basis) {
    constexpr int SPAN = D / SLICES;
    const float* m = basis + (long)s * SPAN * D + c;
    constexpr int CHUNK = D * SLICES >= 1024 ? 16 : 32;  // loads in flight (at 1024 threads, 64 registers a thread)
    float part = 0.f;
#pragma unroll
    for (int i0 = 0; i0 < SPAN; i0 += CHUNK) {
      float r[CHUNK];
#pragma unroll
      for (int i = 0; i < CHUNK; ++i) r[i] = i0 + i < SPAN ? __ldg(m + (long)(i0 + i) * D) : 0.f;
#pragma unroll
      for (int i = 0; i < CHUNK && i0 + i < SPAN; ++i) part += coded[0][s * SPAN + i0 + i] * r[i];
    }
    __syncthreads();  // every slice has read coded[0] and rows[0]
    rows[s][c] = part;  // slice s's share of y
    __syncthreads();
    if (s != 0) return;
    y = 0.f;
#pragma unroll
    for (int j = 0; j < SLICES; ++j) y += rows[j][c];
  }
  if (s != 0) return;
  float total_den = 0.f;
#pragma unroll
  for (int j = 0; j < SLICES; ++j) total_den += slice_den[j];
  from_float(out + ((long)b * hq_model + hm * GQ + blockIdx.x % GQ) * D + c,
             total_den > 0.f ? (y + rows_total) / total_den : 0.f);
}
