// Fused decode attention over the packed INT2 cache of kvcalib.quant (KIVI, OScaR, KVLinC).
//
// Computes, for one new query per (batch, query head), softmax(q K^T * scale) V over
//   - T flushed tokens stored packed: keys per-channel (2-bit codes, fp16 scale/zero per G tokens
//     and channel), optional fp16 per-token key norms (OScaR: key = norm * dequant), values per-token
//     (2-bit codes, fp16 scale/zero per GV channels and token), the codes (and value scales/zeros)
//     of each 16-token block in the tensor-core order of kvcalib/formats/int2/layout.py;
//   - r < R residual tokens in fp16 (`residual_body`: extra blocks of the same launch, RT tokens each).
// Dequantization happens in registers (tensor-core path below); nothing full-size is written back.
//
// Memory layout (capacity-strided, so the runtime appends in place; see kvcalib/formats/int2/layout.py):
//   q        (B, HKV*GQ, D)            QT (half or bf16), in the model's basis
//   kcodes   (B, HKV, CAPW, D)  int32  row n: the D words of tokens 16n..16n+15, tensor-core order
//   kscale,kzero (B, HKV, CAPG, D) fp16   group g covers tokens G*g..G*g+G-1
//   knorm    (B, HKV, CAPT)     fp16   only when HAS_NORM
//   vcodes   (B, HKV, CAPT, D/16) int32 tokens 16n..16n+15: D words, tensor-core order
//   vscale,vzero (B, HKV, CAPT, D/GV) fp16  per 16-token block stored as (D/GV, 16)
//   kres,vres (B, HKV, CAPR, D) fp16   residual window, in the model's basis
// Rotated methods (OScaR's keys and values, KVLinC's values) store the flushed blocks in the
// normalized Hadamard basis (kvcalib/hadamard.py): with ROT_K the packed blocks rotate q into the keys'
// basis (q.k = qH.kH), with ROT_V they rotate their partial output back (H = H^-1) before writing it.
// The residual window is held as it came in, so its blocks need neither, every partial and the merged
// output are in the model's basis, and the runtime rotates nothing per step (`warp_hadamard`).
// lengths, residuals (B,) int32 or null: per-sequence T and r read on the device (a static cache)
// Parallel split (flash-decoding): block (split, kv head, batch) handles SPLIT_LEN flushed tokens for
// all GQ query heads sharing that KV head, so each packed byte is read once per block. Partial
// results (unnormalised accumulator, running max in log2 units, running sum) go to `part_*`; the
// last ceil(r / RT) partials hold the residual window; `merge` combines them and adds KVLinC's
// correction terms (num, den in exp units, optional) before normalising.
// Bytes that must move per (batch, kv head): T*D/4 (key codes) + T*D/4 (value codes) +
// 4*T*D/G (key scale+zero) + 4*T*D/GV (value scale+zero) + 2*T (norms) + 4*r*D (residual).
//
// Compile-time parameters (#define, set by kvcalib/formats/int2/launch.py): D, G, GV (>= 16), GQ (<= 8),
// BLOCKS_PER_SM (resident blocks of packed_partial per SM: its register budget, and the wave size),
// HAS_NORM, ROT_K, ROT_V, QT, CP_ASYNC_LOADER (1: the cp.async stage loader on sm_90 too), SPLIT_UNIT (tokens a split
// is a whole number of, `kvcalib.formats.int2.launch.split_unit`). Queries are rounded to fp16 for the tensor
// cores whatever QT is (a rotated one, ROT_K, to a pair of fp16 numbers, hi + lo).

#include "decode_common.cuh"

#ifndef ROT_K
#define ROT_K 0
#endif
#ifndef ROT_V
#define ROT_V 0
#endif
// A rotated query is a pair of fp16 numbers, hi + lo (packed_partial): with GQ <= 4 the remainders ride in
// the mma's idle columns 4..7 (head h's at column h + 4, summed into column h after the products: no
// extra instruction but one shuffle), with more heads they take an mma of their own per k-slice.
#define LO_COLUMNS (ROT_K && GQ <= 4)
#define LO_MMA (ROT_K && GQ > 4)

#define NT 128       // threads per block
#define PER_WORD 16  // 2-bit codes per 32-bit word
#define VW (D / PER_WORD)
#define VG (D / GV)
#define REP (NT / D)  // threads per channel in the value phase
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h INFINITY

// Online-softmax step over one tile of scores s[h][t] (log2 units, -inf for absent tokens):
// warp w owns heads w, w+4, ...; turns scores into probabilities in place, stores the rescale
// factor of the old accumulator in alpha[h].
template <int W>
__device__ __forceinline__ void softmax_tile(float (*s)[W], float* m, float* l, float* alpha) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int h = warp; h < GQ; h += NT / 32) {
    float mx = NEG_INF;
    for (int t = lane; t < W; t += 32) mx = fmaxf(mx, s[h][t]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    const float m_new = fmaxf(m[h], mx);
    float sum = 0.f;
    for (int t = lane; t < W; t += 32) {
      const float p = m_new == NEG_INF ? 0.f : exp2f(s[h][t] - m_new);
      s[h][t] = p;
      sum += p;
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) {
      const float a = m[h] == NEG_INF ? 0.f : exp2f(m[h] - m_new);
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

// ---- Tensor-core path for the flushed tokens -------------------------------------------------
// A warp takes TILES tiles of 16 tokens per step, with tokens on the M dimension of mma.m16n8k16 (f16 in, f32
// accumulate) and the GQ query heads of the KV head on N (8 columns, heads GQ..7 zero):
//   scores  S^T (16 tokens x 8 heads) = ((codes_K - 1) o s) (16 x D) . Q^T,
//   output  O^T (D x 8 heads)        += (codes_V - 1.5)^T (D x 16 tokens) . P~^T,
// P^T moved from the scores' C fragments to B fragments by movmatrix (an 8x8 transpose). The
// dequantization is factored out of the operands, which are the codes (`unpack8`):
//   keys   (per channel c: scale s_c, zero z_c of the token's group):
//          q.k_n = sum_c q_c s_c (x_cn - 1) + sum_c q_c (z_c + s_c)  ->  A = (x - 1) o s, B = q,
//   values (per token n: scale s_n, zero z_n of the channel's group):
//          sum_n p_n v_nc = sum_n (x_nc - 1.5) (p_n s_n) + sum_n p_n (z_n + 1.5 s_n)  ->  B = p~ = p o s.
// The codes arrive in the tensor-core order of kvcalib/formats/int2/layout.py: a lane's D/32 words
// hold exactly its A fragments, and one AND-OR per register makes half2(off + x), an fp16 exponent
// making the code bits the units digit (`unpack8`; the offset depends on the register). The zero point
// terms are exact sums on the tensor cores: per key group the score constants k0 = Q.z + Q.s (one mma,
// z and s in its rows g and g + 8: `zero_and_scale_rows`), per value group and step (z + 1.5 s).P (one mma).
// The block's 4 warps share a ring of ST-token stages in shared memory; each warp keeps its
// own online softmax and its own key scale fragments; the block combines its warps and writes one partial.

#define WARPS (NT / 32)
#define KS (D / 16)   // 16-channel k-slices of a key, 16-channel row blocks of the output
#define WPL (D / 32)  // words per lane per 16-token block

// (a & b) | c in one LOP3: with both constants in registers (the ISA takes one immediate) the
// compiler would otherwise split it into an AND and an OR.
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// The 8 A registers of one word: three shifts bring each 2-bit code to bits 4-5 or 6-7 of a half, and an
// fp16 exponent ORed over them makes it the units digit: register p = half2(off_p + code at bits 2p, off_p +
// code at bits 16 + 2p), off_p = 64 for even p, 16 for odd p; then, exactly in fp16:
//   values (SCHEME 3): off_p + 1.5 subtracted (65.5 and 17.5 are fp16 numbers), so the A operand is the
//     centred code x - 1.5 in {-1.5, -0.5, 0.5, 1.5}; the zero point term then uses z + 1.5 s, the middle
//     of the group's range (`centred_zeros`);
//   keys (SCHEME 4): off_p + 1 subtracted, and the code x - 1 in {-1, 0, 1, 2} multiplied by the channel's
//     scale s (exact: a power of two times s, or 0); B is q itself, and the zero point term sums z q and
//     s q apart (`zero_and_scale_rows`). The scores are exact products summed in fp32: no fp16 rounding of
//     q o s.
// Values: an output is sum_n p_n v_n over a whole split, and with diffuse attention it is small:
// random values average out to ~|v| / sqrt(n). Split as sum x p~ + sum z p (x >= 0, z the group
// minimum), both sums would grow like sum p and cancel almost completely, so the tensor cores'
// accumulation error (addends aligned to the largest exponent and truncated, every mma) would be
// amplified by ~sqrt(n); centring both sums makes them random walks like the output, as in SDPA.
// Keys: with q~ = fp16(q o s), the rounding of q~ would multiply the codes, and rows with peaked attention
// broke the 2 x SDPA + 1e-4 rule; multiplying the codes by s removes it.
// H100, B = 8, L = 131072, G = 128, diffuse, worst row against float64 (SDPA fp16: 4.6e-4): 4.2e-4 with
// these two (the other schemes measured, up to 3.2e-1: NOTES-decode.md, "Precision"; their code is in git
// history before the commit that removed them, with the A/B switches of benchmarks/decode_precision.py).
__device__ __forceinline__ unsigned hsub2u(unsigned a, unsigned b) {
  const __half2 v = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<const unsigned*>(&v);
}
// e: the exponents 64, 16 as half2 (masks are immediates).
template <int SCHEME>
__device__ __forceinline__ void unpack8(unsigned w, unsigned* o, const unsigned* e) {
  static_assert(SCHEME == 3 || SCHEME == 4, "values take scheme 3, keys scheme 4");
  const unsigned wl = w << 4, w4 = w >> 4, w8 = w >> 8;
  o[0] = and_or(wl, 0x00300030u, e[0]);  // bits 0-1   -> 4-5: 64 + x
  o[1] = and_or(wl, 0x00C000C0u, e[1]);  // bits 2-3   -> 6-7: 16 + x
  o[2] = and_or(w, 0x00300030u, e[0]);   // bits 4-5
  o[3] = and_or(w, 0x00C000C0u, e[1]);   // bits 6-7
  o[4] = and_or(w4, 0x00300030u, e[0]);  // bits 8-9   -> 4-5
  o[5] = and_or(w4, 0x00C000C0u, e[1]);  // bits 10-11 -> 6-7
  o[6] = and_or(w8, 0x00300030u, e[0]);  // bits 12-13 -> 4-5
  o[7] = and_or(w8, 0x00C000C0u, e[1]);  // bits 14-15 -> 6-7
  if (SCHEME == 3)  // 65.5, 17.5 as half2
    for (int p = 0; p < 8; ++p) o[p] = hsub2u(o[p], p % 2 ? 0x4C604C60u : 0x54185418u);
  if (SCHEME == 4)  // 65, 17 as half2: x - 1 in {-1, 0, 1, 2}, which any fp16 scale multiplies exactly
    for (int p = 0; p < 8; ++p) o[p] = hsub2u(o[p], p % 2 ? 0x4C404C40u : 0x54105410u);
}

__device__ __forceinline__ __half2 half2_at(const __half* p) { return *reinterpret_cast<const __half2*>(p); }
// Value scheme 3's zero points z + 1.5 s (the middle of each token group's range) for the tokens
// whose half2 pairs sit at z, s and z + 8, s + 8, broadcast over rows (rows g and g + 8 alike).
__device__ __forceinline__ uint4 centred_zeros(const __half* z, const __half* s) {
  const __half2 c = __float2half2_rn(1.5f);
  const __half2 a = __hfma2(c, half2_at(s), half2_at(z)), b = __hfma2(c, half2_at(s + 8), half2_at(z + 8));
  const unsigned ua = *reinterpret_cast<const unsigned*>(&a), ub = *reinterpret_cast<const unsigned*>(&b);
  return make_uint4(ua, ua, ub, ub);
}
// The keys' exact zero point term: an A operand whose rows g hold the half2
// pairs at z, z + 8 and rows g + 8 those at s, s + 8. The mma's C rows g then sum z q and rows g + 8
// sum s q, every product exact in fp32, and `key_group` adds the two rows: sum_c (z_c + s_c) q_c
// without the fp16 rounding of z + s, at the same mma count (the rows were copies of each other).
// That rounding is the same for every token of a group: with a sink in the group it moved the
// sink's score by up to ~5e-4 and broke the 2 x SDPA + 1e-4 rule in a peaked row (B = 4, 128k,
// G = 32, GQA 8: 5.44e-4 against a bound of 5.37e-4; benchmarks/decode_precision_rows.py models it
// to 5.21e-4 from this rounding alone). Values keep fp16(z + 1.5 s): the same trick there sums
// z p and s p apart, two long uncentred sums that cancel (tried with both: the worst diffuse row at
// B = 8, 128k, G = 128 went 4.2e-4 -> 1.1e-3), and that rounding costs the rows nothing measurable.
__device__ __forceinline__ uint4 zero_and_scale_rows(const __half* z, const __half* s) {
  return make_uint4(*reinterpret_cast<const unsigned*>(z), *reinterpret_cast<const unsigned*>(s),
                    *reinterpret_cast<const unsigned*>(z + 8), *reinterpret_cast<const unsigned*>(s + 8));
}
__device__ __forceinline__ unsigned hmul2u(unsigned a, __half2 b) {
  const __half2 v = __hmul2(*reinterpret_cast<__half2*>(&a), b);
  return *reinterpret_cast<const unsigned*>(&v);
}

// One pipeline stage: the packed data of ST tokens, copied global -> shared (`issue_stage`).
// 16-token tiles per warp and stage: a warp's tiles lie in one key group, and more tiles spread the
// step's fixed work (ring wait and barrier, stage issue, softmax reductions, key group) over more
// tokens: four when G >= 128 with one value group per token (256-token stages, a ring of two in
// 48 KB; 128k B=1 50.5 -> 41.6 us, B=8 77% -> 93% of copy), two when G >= 32 (with four, a warp's
// tiles would span two key groups, or the ring would not fit), one when G = 16.
// A rotated query with its remainders in an mma of their own (LO_MMA) keeps two tiles there: their
// fragments (2 KB) and a ring of two 4-tile stages do not fit 48 KB together, and the extra mma would
// spill registers at four.
#define TILES (G >= 128 && GV >= D && !LO_MMA ? 4 : G >= 32 ? 2 : 1)
#define ST (16 * WARPS * TILES)
#define SHARED_Q (G >= ST)  // a stage lies in one key group: its q~ is computed once per block
#define KGS ((ST + G - 1) / G)  // key groups a stage touches (G is a power of two >= 16)
struct __align__(16) Stage {
  int kw[ST / 16][D];  // key words, row r = tokens 16r..16r+15 (tensor-core order)
  int vw[ST / 16][D];  // value words, same
  __half ks[KGS][D], kz[KGS][D];
  __half vs[ST / 16][VG][16], vz[ST / 16][VG][16];  // value scales / zeros, tensor-core order
  __half kn[ST];
};
// Static shared memory stays under 48 KB: the ring, q's fragments, the key scales' fragments, shares of k0, one
// mbarrier per stage, the warps' maxima and sums.
constexpr bool ring_fits(int n) {
  return n * sizeof(Stage) + 8 * KS * 32 * (1 + (SHARED_Q ? 1 : WARPS) + (LO_MMA ? 1 : 0)) + 16 * 32 * (SHARED_Q ? WARPS : 1) + 8 * n +
             2 * WARPS * 8 * 4 <= 48 * 1024;
}
constexpr int NSTAGE = ring_fits(4) ? 4 : ring_fits(3) ? 3 : 2;
static_assert(ring_fits(NSTAGE), "the ring of stages does not fit 48 KB of static shared memory");

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 2)); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Two stage loaders, one interface: `issue_stage` starts copying tokens [t0, t0 + ST) of one
// (batch, kv head) into a ring stage (nothing at or past `stop` is read), `wait_stage` blocks until
// they have landed. The pointers are already at that (batch, kv head); offsets stay 32-bit.
#if __CUDA_ARCH__ >= 900 && !CP_ASYNC_LOADER
#define BULK_LOADER 1
// sm_90: the bulk-copy engine (TMA) moves each contiguous piece of a stage (key words, value words,
// key scales, key zeros, value scales, value zeros, norms) with one instruction, and signals an
// mbarrier per stage. Lane 0 of warp w issues part w; warp 0 also announces the stage's bytes.
// The other 124 threads spend no instruction on addresses.
// (smem_addr, bulk_copy, mbar_init, mbar_expect: decode_common.cuh)
__device__ __forceinline__ void init_stages(unsigned long long* bar) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < NSTAGE; ++s) mbar_init(&bar[s]);
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
}
__device__ __forceinline__ void issue_stage(Stage& st, unsigned long long* bar, int t0, int stop, const int* kcodes,
                                            const __half* kscale, const __half* kzero, const __half* knorm,
                                            const int* vcodes, const __half* vscale, const __half* vzero) {
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32) return;
  const unsigned rows = min(ST / 16, (stop - t0 + 15) / 16);         // 16-token rows of codes
  const unsigned groups = min(KGS, (stop + G - 1) / G - t0 / G);     // key groups
  const unsigned code_bytes = rows * D * 4, group_bytes = groups * D * 2, vscale_bytes = rows * 16 * VG * 2;
  if (warp == 0) {
    const unsigned total = 2 * (code_bytes + group_bytes + vscale_bytes) + (HAS_NORM ? rows * 32 : 0);
    mbar_expect(bar, total);
    bulk_copy(st.kw, kcodes + (t0 / 16) * D, code_bytes, bar);
  } else if (warp == 1) {
    bulk_copy(st.vw, vcodes + (t0 / 16) * D, code_bytes, bar);
  } else if (warp == 2) {
    bulk_copy(st.ks, kscale + (t0 / G) * D, group_bytes, bar);
    bulk_copy(st.kz, kzero + (t0 / G) * D, group_bytes, bar);
  } else {
    bulk_copy(st.vs, vscale + t0 * VG, vscale_bytes, bar);
    bulk_copy(st.vz, vzero + t0 * VG, vscale_bytes, bar);
#if HAS_NORM
    bulk_copy(st.kn, knorm + t0, rows * 32, bar);
#endif
  }
}
// Use u of a stage completes phase u of its mbarrier. The wait loop is this kernel's own: decode_common.cuh's
// `mbar_wait` (a while loop, vq_decode.cu's) compiles to different SASS here (benchmarks/sass_same.py).
__device__ __forceinline__ void wait_stage(unsigned long long* bar, int use) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(use & 1) : "memory");
  } while (!done);
}
__device__ __forceinline__ void commit_stage() {}
__device__ __forceinline__ void finish_stages() {}
#else
#define BULK_LOADER 0
// Before sm_90: every thread copies 16-byte chunks with cp.async, one commit group per stage; the
// trip counts are compile-time constants (a runtime-bounded loop costs more instructions than the copies).
__device__ __forceinline__ void init_stages(unsigned long long*) {}
__device__ __forceinline__ void issue_stage(Stage& st, unsigned long long*, int t0, int stop, const int* kcodes,
                                            const __half* kscale, const __half* kzero, const __half* knorm,
                                            const int* vcodes, const __half* vscale, const __half* vzero) {
  constexpr int NW = (ST / 16) * (D / 4);  // 16-byte chunks of key words (and of value words)
#pragma unroll
  for (int k = 0; k < (NW + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT, row = i / (D / 4), ch = 4 * (i % (D / 4));
    if (i < NW && t0 + 16 * row < stop) {
      cp_async16(&st.kw[row][ch], kcodes + (t0 / 16 + row) * D + ch);
      cp_async16(&st.vw[row][ch], vcodes + (t0 / 16 + row) * D + ch);
    }
  }
  constexpr int NS = KGS * (D / 8);  // 16-byte chunks of key scales (and of zeros)
#pragma unroll
  for (int k = 0; k < (NS + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT, r = i / (D / 8), ch = 8 * (i % (D / 8)), grp = t0 / G + r;
    if (i < NS && grp * G < stop) {
      cp_async16(&st.ks[r][ch], kscale + grp * D + ch);
      cp_async16(&st.kz[r][ch], kzero + grp * D + ch);
    }
  }
  constexpr int NV8 = ST * VG / 8;  // 16-byte chunks of value scales (and of zeros)
#pragma unroll
  for (int k = 0; k < (NV8 + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT;
    if (i < NV8 && t0 + 8 * i / VG < stop) {
      cp_async16(&st.vs[0][0][0] + 8 * i, vscale + t0 * VG + 8 * i);
      cp_async16(&st.vz[0][0][0] + 8 * i, vzero + t0 * VG + 8 * i);
    }
  }
#if HAS_NORM
  if (threadIdx.x < ST / 8 && t0 + 8 * threadIdx.x < stop)
    cp_async16(&st.kn[8 * threadIdx.x], knorm + t0 + 8 * threadIdx.x);
#endif
}
// One commit group per stage number, issued or not (see the main loop): groups complete in order,
// so waiting for stage s's group is waiting until at most NSTAGE - 2 newer ones are pending.
__device__ __forceinline__ void commit_stage() { cp_async_commit(); }
__device__ __forceinline__ void wait_stage(unsigned long long*, int) { cp_async_wait(); }
__device__ __forceinline__ void finish_stages() { cp_async_wait_all(); }
#endif

// At a new key group: this lane's key scale pairs (to `frag`: channels 16ks + 2t + {0,1} and + 8, which
// `score_tiles` multiplies the codes by) and the group's score constants in the C-fragment layout of the
// scores (tokens g, g + 8; heads 2t, 2t + 1): k0 = sum_c q_c (z_c + s_c), on the tensor cores exactly as
// the scores are. Over the N k-slices from `first` (all KS, or a warp's share of them).
// With LO_MMA, qlo holds the rotated query's fp16 remainders (q = qraw + qlo to ~2^-22): their terms are
// summed too, on the tensor cores, so the rotation costs the scores no fp16 rounding of q (with
// LO_COLUMNS they sit in qraw's columns 4..7 and every product takes them along).
template <int N>
__device__ __forceinline__ void key_group(const uint2* qraw, const uint2* qlo, const __half* s, const __half* z,
                                          uint2* frag, float* k0, int first) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  float k1[4] = {0.f, 0.f, 0.f, 0.f};  // a second chain: the remainders' terms (LO_MMA), zero otherwise
  k0[0] = k0[1] = k0[2] = k0[3] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int ks = first + i, c = 16 * ks + 2 * t;
    const uint2 q = qraw[ks * 32 + lane];
    // q is kept as it is and the codes are multiplied by s: the fragments hold the scale pairs
    frag[ks * 32 + lane] = make_uint2(*reinterpret_cast<const unsigned*>(s + c), *reinterpret_cast<const unsigned*>(s + c + 8));
    // every token row: sum_c (z_c + s_c) q_c (rows g: sum z q, g + 8: sum s q)
    const uint4 a = zero_and_scale_rows(z + c, s + c);
    mma16816(k0, a, q.x, q.y);
#if LO_MMA
    const uint2 ql = qlo[ks * 32 + lane];
    mma16816(k1, a, ql.x, ql.y);
#endif
  }
  for (int i = 0; i < 4; ++i) k0[i] += k1[i];
  for (int e = 0; e < 2; ++e) k0[e] = k0[2 + e] = k0[e] + k0[2 + e];  // every token row: sum_c z_c q_c + sum_c s_c q_c
}

// The scores sc (log2 units) of a warp's TILES tiles at stage rows row0, row0 + 1, ...: sc[j][0..1]
// token g of tile j, heads 2t, 2t + 1; sc[j][2..3] token g + 8. Two mma chains per tile.
__device__ __forceinline__ void score_tiles(const Stage& st, int row0, const uint2* qf, const uint2* qraw,
                                            const uint2* qlo, const float* k0, const unsigned* kexp, float scale_log2, float (*sc)[4]) {
  const int lane = threadIdx.x % 32;
  float sc2[TILES][4];
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) {
      sc[j][i] = k0[i];
      sc2[j][i] = 0.f;
    }
#pragma unroll
  for (int i = 0; i < WPL; ++i) {  // word i: k-slices 2i (registers 0-3) and 2i + 1 (4-7)
    // B: q itself; the codes are scaled by the pairs in qf
    const uint2 qa = qraw[(2 * i) * 32 + lane], qb = qraw[(2 * i + 1) * 32 + lane];
    const uint2 sa = qf[(2 * i) * 32 + lane], sb = qf[(2 * i + 1) * 32 + lane];
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      unsigned o[8];
      unpack8<4>((unsigned)st.kw[row0 + j][lane * WPL + i], o, kexp);
      // registers 0, 1 | 2, 3 | 4, 5 | 6, 7: channel pairs of sa.x | sa.y | sb.x | sb.y
      const unsigned sp[4] = {sa.x, sa.y, sb.x, sb.y};
      for (int p = 0; p < 8; ++p) o[p] = hmul2u(o[p], *reinterpret_cast<const __half2*>(&sp[p / 2]));
      mma16816(sc[j], make_uint4(o[0], o[1], o[2], o[3]), qa.x, qa.y);
      mma16816(sc2[j], make_uint4(o[4], o[5], o[6], o[7]), qb.x, qb.y);
#if LO_MMA  // the rotated query's remainders on the same (exact) operands
      const uint2 la = qlo[(2 * i) * 32 + lane], lb = qlo[(2 * i + 1) * 32 + lane];
      mma16816(sc[j], make_uint4(o[0], o[1], o[2], o[3]), la.x, la.y);
      mma16816(sc2[j], make_uint4(o[4], o[5], o[6], o[7]), lb.x, lb.y);
#endif
    }
  }
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) {
      float x = sc[j][i] + sc2[j][i];
#if LO_COLUMNS  // head h's remainder terms sit in column h + 4, two lanes over (columns 4..7 repeat 0..3 after)
      x += __shfl_xor_sync(0xffffffff, x, 2);
#endif
      x *= scale_log2;
#if HAS_NORM
      x *= __half2float(st.kn[16 * (row0 + j) + lane / 4 + 8 * (i / 2)]);
#endif
      sc[j][i] = x;
    }
}

// Accumulates the values of a warp's tiles weighted by p (the fp32 probabilities in the scores'
// layout, rounded here to half2 pairs): O^T += codes_V^T . P~^T with P~ = P o (value scales),
// the zero points in vzp. P^T reaches the B fragments (tokens 2t, 2t+1 | 2t+8, 2t+9 of head g) by movmatrix.
__device__ __forceinline__ void value_tiles(const Stage& st, int row0, const float (*p)[4], const unsigned* kexp,
                                            float (*acc)[4], float (*vzp)[4]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const unsigned pb0 = transpose8x8(pack_half2(p[j][0], p[j][1])), pb1 = transpose8x8(pack_half2(p[j][2], p[j][3]));
    uint2 pt[VG];
    for (int gv = 0; gv < VG; ++gv) {
      const __half* vs = st.vs[row0 + j][gv];
      pt[gv] = make_uint2(hmul2u(pb0, half2_at(vs + 2 * t)), hmul2u(pb1, half2_at(vs + 8 + 2 * t)));
      mma16816(vzp[gv], centred_zeros(&st.vz[row0 + j][gv][2 * t], vs + 2 * t), pb0, pb1);
    }
#pragma unroll
    for (int i = 0; i < WPL; ++i) {  // word i: output rows 32i .. 32i + 15 (registers 0-3), 32i + 16 .. (4-7)
      unsigned o[8];
      unpack8<3>((unsigned)st.vw[row0 + j][lane * WPL + i], o, kexp);
      const uint2 b0 = pt[16 * (2 * i) / GV], b1 = pt[16 * (2 * i + 1) / GV];
      mma16816(acc[2 * i], make_uint4(o[0], o[1], o[2], o[3]), b0.x, b0.y);
      mma16816(acc[2 * i + 1], make_uint4(o[4], o[5], o[6], o[7]), b1.x, b1.y);
    }
  }
}

// Online softmax over a warp's tiles of scores: probabilities to p (fp32, the scores' layout, as
// value_tiles reads them), running max m (log2 units) and this lane's share l of the sum, per head
// column 2t + e; the accumulators are rescaled when the running max moves.
__device__ __forceinline__ void softmax_tiles(const float (*sc)[4], float* m, float* l, float (*p)[4],
                                              float (*acc)[4], float (*vzp)[4]) {
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < TILES; ++j)
    for (int i = 0; i < 4; ++i) mx[i & 1] = fmaxf(mx[i & 1], sc[j][i]);
  for (int e = 0; e < 2; ++e)
    for (int o = 4; o < 32; o *= 2) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffff, mx[e], o));
  float alpha[2];
  for (int e = 0; e < 2; ++e) {
    const float m_new = fmaxf(m[e], mx[e]);
    alpha[e] = exp2f(m[e] - m_new);  // m = -inf gives 0
    m[e] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      p[j][e] = exp2f(sc[j][e] - m_new);
      p[j][2 + e] = exp2f(sc[j][2 + e] - m_new);
      sum += p[j][e] + p[j][2 + e];
    }
    l[e] = l[e] * alpha[e] + sum;
  }
  if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the running max moved somewhere
    for (int u = 0; u < KS; ++u)
      for (int i = 0; i < 4; ++i) acc[u][i] *= alpha[i & 1];
    for (int gv = 0; gv < VG; ++gv)
      for (int i = 0; i < 4; ++i) vzp[gv][i] *= alpha[i & 1];
  }
}

// The fp16 residual window (r < R tokens): block (num_splits + chunk, kv head, batch) of
// `packed_partial` takes RT tokens and writes partial number num_splits + chunk; it runs beside the
// packed blocks in the same launch. Shared arrays are carved from `smem` (the ring, idle here).
// Scores: warp per token, lanes over channels (coalesced rows), shuffle-reduced; values: thread per
// channel, coalesced rows of V.
#define RT 16
__device__ __forceinline__ void residual_body(const QT* __restrict__ q, const __half* __restrict__ kres,
                                              const __half* __restrict__ vres, int r, int capr, float scale_log2,
                                              float* __restrict__ part_acc, float* __restrict__ part_ml, int num_parts,
                                              int chunk, float* smem) {
  const int kvh = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, t0 = chunk * RT;
  const long bh = (long)b * gridDim.y + kvh;
  float (*qs)[D] = reinterpret_cast<float (*)[D]>(smem);
  float (*s)[RT] = reinterpret_cast<float (*)[RT]>(smem + GQ * D);
  float* m = smem + GQ * D + GQ * RT;
  float* l = m + GQ;
  float* alpha = l + GQ;
  float* red = alpha + GQ;  // REP * GQ * D
  // Every load is issued before the first is used: a block's latency is a couple of round trips,
  // not one per token (these blocks finish the launch at short lengths).
  constexpr int TPW = RT / (NT / 32);  // tokens per warp
  float kv[TPW][D / 32];
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int tt = warp + i * (NT / 32);
#pragma unroll
    for (int e = 0; e < D / 32; ++e)
      kv[i][e] = t0 + tt < r ? __half2float(kres[(bh * capr + t0 + tt) * D + lane + 32 * e]) : 0.f;
  }
  const int c = tid % D, rep = tid / D;
  float vv[RT / REP];  // this thread's channel of tokens rep, rep + REP, ...
#pragma unroll
  for (int i = 0; i < RT / REP; ++i) {
    const int tt = rep + i * REP;
    vv[i] = t0 + tt < r ? __half2float(vres[(bh * capr + t0 + tt) * D + c]) : 0.f;
  }
  for (int i = tid; i < GQ * D; i += NT) qs[i / D][i % D] = to_float(q[(bh * GQ + i / D) * D + i % D]) * scale_log2;
  if (tid < GQ) { m[tid] = NEG_INF; l[tid] = 0.f; }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int tt = warp + i * (NT / 32);
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
#pragma unroll
      for (int e = 0; e < D / 32; ++e) v += qs[h][lane + 32 * e] * kv[i][e];
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0) s[h][tt] = t0 + tt < r ? v : NEG_INF;
    }
  }
  __syncthreads();
  softmax_tile<RT>(s, m, l, alpha);
  __syncthreads();
  float acc[GQ];
  for (int h = 0; h < GQ; ++h) acc[h] = 0.f;
#pragma unroll
  for (int i = 0; i < RT / REP; ++i)  // absent tokens have p = 0 and v = 0
    for (int h = 0; h < GQ; ++h) acc[h] += s[h][rep + i * REP] * vv[i];
  write_partial(&acc, red, m, l, part_acc, part_ml, b, kvh, blockIdx.x, num_parts);
}

// q's fragments for the tensor cores, into shared memory (the first wait_stage's barrier publishes them):
// entry i holds head h = (i % 32) / 4 at channels c, c + 1, c + 8, c + 9 (c = 16 (i / 32) + 2 (i % 4)).
__device__ __forceinline__ void query_fragments(const QT* __restrict__ q, long bh, uint2* qraw, uint2* qlo) {
#if ROT_K
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // rotated into the keys' basis: warp w takes heads w, w + 4 whole, one float per lane and 32 channels;
  // q = hi + lo, two fp16 numbers (score_tiles sums both: an fp16 q alone would err by its rounding, ~2^-12
  // per channel, which took rows of peaked attention past twice SDPA's error)
  __half* qhalf = reinterpret_cast<__half*>(qraw);
  __half* qlhalf = reinterpret_cast<__half*>(LO_COLUMNS ? qraw : qlo);
  const int lo_head = LO_COLUMNS ? 4 : 0;  // column of head 0's remainders
  for (int i = threadIdx.x; i < KS * 32; i += NT) {
    const int h = (i % 32) / 4;
    if (h >= GQ && !(LO_COLUMNS && h >= 4 && h < 4 + GQ)) qraw[i] = make_uint2(0u, 0u);
    if (LO_MMA && h >= GQ) qlo[i] = make_uint2(0u, 0u);
  }
  for (int h = warp; h < GQ; h += WARPS) {
    float x[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) x[e] = to_float(q[(bh * GQ + h) * D + lane + 32 * e]);
    warp_hadamard(x);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int c = lane + 32 * e, w = c % 16;
      const int at = 4 * ((c / 16) * 32 + 4 * h + (w % 8) / 2) + 2 * (w / 8) + w % 2;  // head h, channel c
      const __half hi = __float2half_rn(x[e]);
      qhalf[at] = hi;
      if (LO_COLUMNS || LO_MMA)
        qlhalf[at + 16 * lo_head] = __float2half_rn(x[e] - __half2float(hi));  // 16 halves per head of an entry row
    }
  }
#else
  for (int i = threadIdx.x; i < KS * 32; i += NT) {
    const int ks = i / 32, h = (i % 32) / 4, c = 16 * ks + 2 * (i % 4);
    float r[4] = {0.f, 0.f, 0.f, 0.f};
    if (h < GQ)
      for (int e = 0; e < 4; ++e) r[e] = to_float(q[(bh * GQ + h) * D + c + 8 * (e / 2) + e % 2]);
    qraw[i] = make_uint2(pack_half2(r[0], r[1]), pack_half2(r[2], r[3]));
  }
#endif
}

// The block's partial once its stages are done: each warp's accumulators settled with the zero points and its
// l summed over the lanes of a head column, the warps combined in the ring's memory (idle now), one partial
// written; where values are stored rotated (ROT_V), rotated back into the model's basis first.
__device__ __forceinline__ void write_block_partial(float (*acc)[4], const float (*vzp)[4], const float* m, float* l,
                                                    float (*wm)[8], float (*wl)[8], Stage* ring,
                                                    float* __restrict__ part_acc, float* __restrict__ part_ml, int b,
                                                    int hkv, int kvh, int split, int num_parts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // ---- offsets and zero points settled; l summed over the lanes of a head column ----
  for (int u = 0; u < KS; ++u)
    for (int i = 0; i < 4; ++i) acc[u][i] += vzp[16 * u / GV][i];
  for (int e = 0; e < 2; ++e)
    for (int o = 4; o < 32; o *= 2) l[e] += __shfl_xor_sync(0xffffffff, l[e], o);
  // ---- combine the four warps of the block (in the ring's memory, now idle), write one partial ----
  __syncthreads();
  float (*wacc)[GQ][D] = reinterpret_cast<float (*)[GQ][D]>(&ring[0]);
  static_assert(sizeof(float) * WARPS * GQ * D <= sizeof(Stage) * NSTAGE, "ring too small for the warp combine");
  if (g == 0)
    for (int e = 0; e < 2; ++e) {
      wm[warp][2 * t + e] = m[e];
      wl[warp][2 * t + e] = l[e];
    }
  for (int u = 0; u < KS; ++u)
    for (int i = 0; i < 4; ++i) {
      const int head = 2 * t + (i & 1), ch = 16 * u + g + 8 * (i / 2);
      if (head < GQ) wacc[warp][head][ch] = acc[u][i];
    }
  __syncthreads();
#if ROT_V
  // the combined rows, still in the values' basis, wait past the warps' accumulators for the rotation
  float (*comb)[D] = reinterpret_cast<float (*)[D]>(&wacc[WARPS][0][0]);
  static_assert(sizeof(float) * (WARPS + 1) * GQ * D <= sizeof(Stage) * NSTAGE, "ring too small for the rotation");
#endif
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
    const long row = ((long)b * hkv * GQ + (long)kvh * GQ + h) * num_parts + split;
#if ROT_V
    comb[h][c] = num;
#else
    part_acc[row * D + c] = num;
#endif
    if (c == 0) {
      part_ml[row * 2] = M;
      part_ml[row * 2 + 1] = den;
    }
  }
#if ROT_V
  __syncthreads();
  for (int h = warp; h < GQ; h += WARPS) {  // back into the model's basis, where the residual's partials are
    float x[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) x[e] = comb[h][lane + 32 * e];
    warp_hadamard(x);
    const long row = ((long)b * hkv * GQ + (long)kvh * GQ + h) * num_parts + split;
#pragma unroll
    for (int e = 0; e < D / 32; ++e) part_acc[row * D + lane + 32 * e] = x[e];
  }
#endif
}

extern "C" __global__ void __launch_bounds__(NT, BLOCKS_PER_SM) packed_partial(
    const QT* __restrict__ q, const int* __restrict__ kcodes, const __half* __restrict__ kscale,
    const __half* __restrict__ kzero, const __half* __restrict__ knorm, const int* __restrict__ vcodes,
    const __half* __restrict__ vscale, const __half* __restrict__ vzero, int T, int capw, int capg, int capt,
    int split_len, int num_splits, const __half* __restrict__ kres, const __half* __restrict__ vres, int r,
    int capr, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml,
    const int* __restrict__ lengths, const int* __restrict__ residuals) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, num_parts = gridDim.x;
  // A static cache (kvcalib/runtime/static_cache.py) keeps each sequence's flushed and residual counts in
  // device memory, so that one captured launch serves every step: they replace T and r for row b, and
  // splits past a row's T write empty partials (m = -inf), which `merge` skips. The launch is sized for
  // the capacity, so each row spreads its own T over all num_splits blocks, in whole SPLIT_UNITs (128
  // tokens and whole key groups): a 4k sequence in a 128k cache takes the wave that a 128k one does.
  if (lengths != nullptr) {
    T = lengths[b];
    const int units = (T + SPLIT_UNIT - 1) / SPLIT_UNIT;
    split_len = max(1, (units + num_splits - 1) / num_splits) * SPLIT_UNIT;
  }
  if (residuals != nullptr) r = residuals[b];
  const int warp = threadIdx.x / 32;
  const long bh = (long)b * hkv + kvh;
  __shared__ Stage ring[NSTAGE];
  static_assert(sizeof(float) * (GQ * D + GQ * RT + 3 * GQ + REP * GQ * D) <= sizeof(Stage) * NSTAGE,
                "ring too small for the residual window's scratch");
  if (split >= num_splits) {  // the residual window's blocks
    residual_body(q, kres, vres, r, capr, scale_log2, part_acc, part_ml, num_parts, split - num_splits,
                  reinterpret_cast<float*>(ring));
    return;
  }
  __shared__ uint2 qraw[KS * 32];         // each lane's B fragments of q (fp16; heads GQ..7 zero)
  __shared__ uint2 qlo[LO_MMA ? KS * 32 : 1];  // LO_MMA: the same of the rotated q's fp16 remainders
  // the key scales' fragments: one set per warp, or one per block when a stage lies in one key group (SHARED_Q)
  __shared__ uint2 qfrag[SHARED_Q ? 1 : WARPS][KS * 32];
#if SHARED_Q
  __shared__ float4 k0part[WARPS][32];  // each warp's share of k0
  const int lane = threadIdx.x % 32;
#endif

  float acc[KS][4];  // O^T: rows channels 16u + g (+8), columns heads 2t, 2t+1
  for (int u = 0; u < KS; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
  float vzp[VG][4];  // per value group: sum_n (z_n + 1.5 s_n) p_n, same layout
  for (int gv = 0; gv < VG; ++gv)
    for (int i = 0; i < 4; ++i) vzp[gv][i] = 0.f;
  const unsigned kexp[2] = {0x54005400u, 0x4C004C00u};  // unpack8's exponents
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // heads 2t, 2t+1; l is this lane's share
  float k0[4];
  int group = -1;

  const int start = split * split_len;
  const int stop = min(start + split_len, T);
  const int stages = (stop - start + ST - 1) / ST;
  kcodes += bh * capw * D;
  vcodes += bh * capt * VW;
  kscale += bh * capg * D;
  kzero += bh * capg * D;
  vscale += bh * capt * VG;
  vzero += bh * capt * VG;
  knorm += HAS_NORM ? bh * capt : 0;
  __shared__ unsigned long long bar[NSTAGE];  // the bulk loader's mbarrier per stage
  init_stages(bar);
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < stages) issue_stage(ring[s], &bar[s], start + s * ST, stop, kcodes, kscale, kzero, knorm, vcodes, vscale, vzero);
    commit_stage();
  }
  query_fragments(q, bh, qraw, qlo);  // while the first stages are in flight
  for (int s = 0; s < stages; ++s) {
    wait_stage(&bar[s % NSTAGE], s / NSTAGE);
    __syncthreads();  // stage s has landed for every thread, and stage s-1 is no longer read
    const int next = s + NSTAGE - 1;
    if (next < stages)
      issue_stage(ring[next % NSTAGE], &bar[next % NSTAGE], start + next * ST, stop, kcodes, kscale, kzero, knorm,
                  vcodes, vscale, vzero);
    commit_stage();
    const Stage& st = ring[s % NSTAGE];
    const int tok0 = start + s * ST + 16 * TILES * warp;  // tile j: tokens tok0 + 16j .. + 15, stage row TILES*warp + j
#if SHARED_Q
    if ((start + s * ST) / G != group) {  // the whole block enters a new key group: each warp takes KS/WARPS slices
      group = (start + s * ST) / G;
      float part[4];
      key_group<KS / WARPS>(qraw, qlo, st.ks[0], st.kz[0], qfrag[0], part, warp * (KS / WARPS));
      k0part[warp][lane] = make_float4(part[0], part[1], part[2], part[3]);
      __syncthreads();  // every slice of q~ and every share of k0 in place
      k0[0] = k0[1] = k0[2] = k0[3] = 0.f;
      for (int w = 0; w < WARPS; ++w) {
        const float4 p = k0part[w][lane];
        k0[0] += p.x, k0[1] += p.y, k0[2] += p.z, k0[3] += p.w;
      }
    }
    const uint2* qf = qfrag[0];
    if (tok0 >= stop) continue;  // T holds whole key groups of >= 16 TILES tokens: a warp's tiles are all full or all absent
#else
    if (tok0 >= stop) continue;
    if (tok0 / G != group) {  // a warp's tiles share one key group
      group = tok0 / G;
      const int kg = group - (start + s * ST) / G;  // the group's row in the stage
      key_group<KS>(qraw, qlo, st.ks[kg], st.kz[kg], qfrag[warp], k0, 0);
    }
    const uint2* qf = qfrag[warp];
#endif
    const int row0 = TILES * warp;
    float sc[TILES][4];
    float pr[TILES][4];
    score_tiles(st, row0, qf, qraw, qlo, k0, kexp, scale_log2, sc);
    softmax_tiles(sc, m, l, pr, acc, vzp);
    value_tiles(st, row0, pr, kexp, acc, vzp);
  }
  finish_stages();
  __shared__ float wm[WARPS][8], wl[WARPS][8];  // each warp's running max and sum per head
  write_block_partial(acc, vzp, m, l, wm, wl, ring, part_acc, part_ml, b, hkv, kvh, split, num_parts);
}

// Combine the partials of one (batch, query head): out = (sum_s 2^(m_s-M) acc_s + 2^-M num)
//                                                        / (sum_s 2^(m_s-M) l_s + 2^-M den),
// where num (D) and den (1) are KVLinC's correction terms in exp units (null when absent).
// A warp per (batch, query head, 32 channels), lane = channel, no block-wide barrier. The first
// 32 MP partials' (m, l) (lane p holds partials p, p + 32, ...) and the first MA accumulators of
// the lane's channel are all loaded before any is used: up to MA partials cost about one round
// trip to L2. Rounds of 32 MP partials: their weights go through the warp's shared row `w`.
#define MERGE_WARPS 4  // kvcalib/formats/int2/launch.py launches 32 * MERGE_WARPS threads per block
#define MP 4   // partials' (m, l) per lane and round (32 * MP partials)
#define MA 64  // accumulators per lane loaded up front

extern "C" __global__ void __launch_bounds__(32 * MERGE_WARPS) merge(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const float* __restrict__ corr_num,
    const float* __restrict__ corr_den, int num_parts, int rows, QT* __restrict__ out) {
  __shared__ float weights[MERGE_WARPS][32 * MP];
  const int lane = threadIdx.x % 32;
  float* w = weights[threadIdx.x / 32];
  const long item = (long)blockIdx.x * MERGE_WARPS + threadIdx.x / 32;
  const long row = item / (D / 32);
  const int c = (item % (D / 32)) * 32 + lane;
  if (row >= rows) return;  // whole warps
  const float* ml = part_ml + row * num_parts * 2;
  const float* acc = part_acc + row * num_parts * D + c;
  float mp[MP], lp[MP], a[MA], cnum = 0.f, cden = 0.f;
#pragma unroll
  for (int i = 0; i < MP; ++i) {
    const int p = lane + 32 * i;
    mp[i] = p < num_parts ? ml[2 * p] : NEG_INF;
    lp[i] = p < num_parts ? ml[2 * p + 1] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < MA; ++i) a[i] = i < num_parts ? acc[(long)i * D] : 0.f;
  if (corr_num != nullptr) {
    cnum = corr_num[row * D + c];
    cden = corr_den[row];
  }
  float M = NEG_INF;
#pragma unroll
  for (int i = 0; i < MP; ++i) M = fmaxf(M, mp[i]);
  for (int p = lane + 32 * MP; p < num_parts; p += 32) M = fmaxf(M, ml[2 * p]);
  for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
  float num = 0.f, den = 0.f;
  for (int base = 0; base < num_parts; base += 32 * MP) {
    __syncwarp();  // the previous round's weights are read
#pragma unroll
    for (int i = 0; i < MP; ++i) {
      const int p = base + lane + 32 * i;
      const float m = base == 0 ? mp[i] : p < num_parts ? ml[2 * p] : NEG_INF;
      const float l = base == 0 ? lp[i] : p < num_parts ? ml[2 * p + 1] : 0.f;
      const float wp = m == NEG_INF ? 0.f : exp2f(m - M);
      w[lane + 32 * i] = wp;
      den += wp * l;
    }
    __syncwarp();
    const int n = min(32 * MP, num_parts - base);
    if (base == 0) {
#pragma unroll
      for (int i = 0; i < MA; ++i)
        if (i < n) num += w[i] * a[i];
#pragma unroll 8
      for (int i = MA; i < n; ++i) num += w[i] * acc[(long)i * D];
    } else {
#pragma unroll 8
      for (int i = 0; i < n; ++i) num += w[i] * acc[(long)(base + i) * D];
    }
  }
  for (int o = 16; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffff, den, o);
  if (corr_num != nullptr) {
    const float wc = exp2f(-M);
    num += wc * cnum;
    den += wc * cden;
  }
  from_float(&out[row * D + c], num / den);
}
