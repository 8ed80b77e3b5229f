// Fused decode attention over the packed INT2 cache of kvcalib.quant (KIVI, OScaR).
//
// Computes, for one new query per (batch, query head), softmax(q K^T * scale) V over
//   - T flushed tokens stored packed: keys per-channel (2-bit codes packed 16 tokens per int32 word
//     along tokens, fp16 scale/zero per G tokens and channel), optional fp16 per-token key norms
//     (OScaR: key = norm * dequant), values per-token (2-bit codes packed 16 channels per word along
//     channels, fp16 scale/zero per GV channels and token);
//   - r < R residual tokens in fp16 (kernel `residual_partial`, RT tokens per block).
// Dequantization happens in registers (tensor-core path below); nothing full-size is written back.
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
// results (unnormalised accumulator, running max in log2 units, running sum) go to `part_*`; the
// last ceil(r / RT) partials hold the residual window; `merge` combines them and adds KVLinC's correction
// terms (num, den in exp units, optional) before normalising.
// Bytes that must move per (batch, kv head): T*D/4 (key codes) + T*D/4 (value codes) +
// 4*T*D/G (key scale+zero) + 4*T*D/GV (value scale+zero) + 2*T (norms) + 4*r*D (residual).
//
// Compile-time parameters (#define, set by kvcalib/runtime/decode.py): D, G, GV (>= 16), GQ (<= 16),
// HAS_NORM, QT. Queries are rounded to fp16 for the tensor cores whatever QT is.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define NT 128       // threads per block
#define PER_WORD 16  // 2-bit codes per 32-bit word
#define VW (D / PER_WORD)
#define VG (D / GV)
#define REP (NT / D)  // threads per channel in the value phase
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h INFINITY

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
// A warp takes 16 tokens per step. Scores S (16 head rows x 16 tokens) = Q (16 x D) . K^T with
// mma.m16n8k16 (f16 in, f32 accumulate): keys are dequantized from the packed words into the B
// fragments in registers. The block's 4 warps share a 4-stage cp.async ring of 64-token stages in
// shared memory, which keeps enough bytes in flight to stream at memory speed. Within a 16-channel k-slice, lane (g = lane/4, t = lane%4)
// supplies logical k = {2t, 2t+1, 2t+8, 2t+9} from physical channels {4t..4t+3} (one 16-byte load
// of 4 consecutive words); Q's A fragments use the same permutation, so q.k is unchanged.
// Token order is natural: n-tile j column n is token 8j + n, so one word gives tokens g and g+8.
// Then O (16 x D) += P (16 x 16 tokens, f16) . V with the C fragments of S reused as P's A
// fragments; values are dequantized into B fragments the same way (channel 8u + g of n-tile u).
// Heads GQ..15 are zero padding. Each warp keeps its own online softmax; the block combines its
// four warps at the end and writes one partial.

#define WARPS (NT / 32)
#define KS (D / 16)  // 16-channel k-slices of a key
#define NV (D / 8)   // 8-channel n-tiles of the output

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Codes at bit `shift` and `shift + 16` of w, as half2(1024 + code_lo, 1024 + code_hi).
__device__ __forceinline__ unsigned code_pair(unsigned w, int shift) {
  return ((w >> shift) & 0x00030003u) | 0x64006400u;
}

__device__ __forceinline__ unsigned dequant(unsigned x, __half2 scale, __half2 zero) {
  const __half2 c = __hsub2(*reinterpret_cast<__half2*>(&x), __float2half2_rn(1024.f));
  const __half2 v = __hfma2(c, scale, zero);
  return *reinterpret_cast<const unsigned*>(&v);
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

__device__ __forceinline__ __half2 half2_at(const __half* p) { return *reinterpret_cast<const __half2*>(p); }

// One pipeline stage: the packed data of ST tokens, copied global -> shared with cp.async.
#define ST (16 * WARPS)
#define NSTAGE 4
#define KGS ((ST + G - 1) / G)  // key groups a stage touches (G is a power of two >= 16)
struct __align__(16) Stage {
  int kw[ST / 16][D];  // key words: row r = tokens 16r..16r+15
  int vw[ST][VW];      // value words
  __half ks[KGS][D], kz[KGS][D];
  __half vs[ST][VG], vz[ST][VG];
  __half kn[ST];
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 2)); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Copy tokens [t0, t0 + ST) of this (batch, kv head) into `st`; nothing at or past `stop` is read.
__device__ __forceinline__ void load_stage(Stage& st, int t0, int stop, long bh, const int* kcodes,
                                           const __half* kscale, const __half* kzero, const __half* knorm,
                                           const int* vcodes, const __half* vscale, const __half* vzero,
                                           int capw, int capg, int capt) {
  for (int i = threadIdx.x; i < (ST / 16) * (D / 4); i += NT) {
    const int row = i / (D / 4), ch = 4 * (i % (D / 4));
    if (t0 + 16 * row < stop) cp_async16(&st.kw[row][ch], kcodes + (bh * capw + t0 / 16 + row) * D + ch);
  }
  for (int i = threadIdx.x; i < ST * (VW / 4); i += NT) {
    const int tok = i / (VW / 4), ch = 4 * (i % (VW / 4));
    if (t0 + tok < stop) cp_async16(&st.vw[tok][ch], vcodes + (bh * capt + t0 + tok) * VW + ch);
  }
  for (int i = threadIdx.x; i < KGS * (D / 8); i += NT) {
    const int r = i / (D / 8), ch = 8 * (i % (D / 8)), grp = t0 / G + r;
    if (grp * G < stop) {
      cp_async16(&st.ks[r][ch], kscale + (bh * capg + grp) * D + ch);
      cp_async16(&st.kz[r][ch], kzero + (bh * capg + grp) * D + ch);
    }
  }
  for (int i = threadIdx.x; i < ST * VG / 8; i += NT) {
    if (t0 + 8 * i / VG < stop) {
      cp_async16(&st.vs[0][0] + 8 * i, vscale + (bh * capt + t0) * VG + 8 * i);
      cp_async16(&st.vz[0][0] + 8 * i, vzero + (bh * capt + t0) * VG + 8 * i);
    }
  }
#if HAS_NORM
  for (int i = threadIdx.x; i < ST / 8; i += NT)
    if (t0 + 8 * i < stop) cp_async16(&st.kn[8 * i], knorm + bh * capt + t0 + 8 * i);
#endif
}

extern "C" __global__ void __launch_bounds__(NT, 4) packed_partial(
    const QT* __restrict__ q, const int* __restrict__ kcodes, const __half* __restrict__ kscale,
    const __half* __restrict__ kzero, const __half* __restrict__ knorm, const int* __restrict__ vcodes,
    const __half* __restrict__ vscale, const __half* __restrict__ vzero, int T, int capw, int capg, int capt,
    int split_len, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml, int num_parts) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long bh = (long)b * hkv + kvh;
  __shared__ Stage ring[NSTAGE];

  // Q A-fragments of every lane, in shared memory (registers go to the accumulators): rows g and
  // g+8 (heads), permuted channels 16s + 4t + {0,1 | 2,3}. Read after the loop's first barrier.
  __shared__ uint4 qfrag[KS][32];
  for (int i = threadIdx.x; i < KS * 32; i += NT) {
    const int s = i / 32, fg = (i % 32) / 4, c = 16 * s + 4 * (i % 4);
    float r0[4] = {0.f, 0.f, 0.f, 0.f}, r1[4] = {0.f, 0.f, 0.f, 0.f};
    if (fg < GQ)
      for (int j = 0; j < 4; ++j) r0[j] = to_float(q[(bh * GQ + fg) * D + c + j]);
    if (fg + 8 < GQ)
      for (int j = 0; j < 4; ++j) r1[j] = to_float(q[(bh * GQ + fg + 8) * D + c + j]);
    qfrag[s][i % 32] = make_uint4(pack_half2(r0[0], r0[1]), pack_half2(r1[0], r1[1]), pack_half2(r0[2], r0[3]),
                                  pack_half2(r1[2], r1[3]));
  }
  float acc[NV][4];
  for (int u = 0; u < NV; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // rows g, g+8; l is this lane's share

  const int start = split * split_len;
  const int stop = min(start + split_len, T);
  const int stages = (stop - start + ST - 1) / ST;
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < stages)
      load_stage(ring[s], start + s * ST, stop, bh, kcodes, kscale, kzero, knorm, vcodes, vscale, vzero, capw, capg, capt);
    cp_async_commit();
  }
  for (int s = 0; s < stages; ++s) {
    cp_async_wait();
    __syncthreads();  // stage s has landed for every thread, and stage s-1 is no longer read
    const int next = s + NSTAGE - 1;
    if (next < stages)
      load_stage(ring[next % NSTAGE], start + next * ST, stop, bh, kcodes, kscale, kzero, knorm, vcodes, vscale,
                 vzero, capw, capg, capt);
    cp_async_commit();
    const Stage& st = ring[s % NSTAGE];
    if (start + s * ST + 16 * warp >= stop) continue;
    const int kg = 16 * warp / G;  // this warp's key group row in the stage
    // ---- scores: two n-tiles of 8 tokens ----
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int ks = 0; ks < KS; ++ks) {
      const int c = 16 * ks + 4 * t;
      const uint4 q4 = qfrag[ks][lane];
      const unsigned qa[4] = {q4.x, q4.y, q4.z, q4.w};
      const int4 w = *reinterpret_cast<const int4*>(&st.kw[warp][c]);
      const uint2 sv = *reinterpret_cast<const uint2*>(&st.ks[kg][c]);
      const uint2 zv = *reinterpret_cast<const uint2*>(&st.kz[kg][c]);
      const __half2 s01 = *reinterpret_cast<const __half2*>(&sv.x), s23 = *reinterpret_cast<const __half2*>(&sv.y);
      const __half2 z01 = *reinterpret_cast<const __half2*>(&zv.x), z23 = *reinterpret_cast<const __half2*>(&zv.y);
      const unsigned x0 = code_pair(w.x, 2 * g), x1 = code_pair(w.y, 2 * g);
      const unsigned x2 = code_pair(w.z, 2 * g), x3 = code_pair(w.w, 2 * g);
      // n-tile 0: token g (low halves); n-tile 1: token g + 8 (high halves).
      mma16816(sc[0], qa, dequant(__byte_perm(x0, x1, 0x5410), s01, z01), dequant(__byte_perm(x2, x3, 0x5410), s23, z23));
      mma16816(sc[1], qa, dequant(__byte_perm(x0, x1, 0x7632), s01, z01), dequant(__byte_perm(x2, x3, 0x7632), s23, z23));
    }
    // sc[j][0..1]: row g, tokens 8j + 2t + {0,1}; sc[j][2..3]: row g + 8.
    float norm[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
#if HAS_NORM
    for (int j = 0; j < 2; ++j) {
      const __half2 n2 = half2_at(&st.kn[16 * warp + 8 * j + 2 * t]);
      norm[j][0] = __low2float(n2);
      norm[j][1] = __high2float(n2);
    }
#endif
    float mx[2] = {NEG_INF, NEG_INF};
    for (int j = 0; j < 2; ++j)
      for (int i = 0; i < 4; ++i) {
        sc[j][i] *= scale_log2 * norm[j][i & 1];
        mx[i / 2] = fmaxf(mx[i / 2], sc[j][i]);
      }
    unsigned pa[4];
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      const float alpha = exp2f(m[r] - m_new);  // m[r] = -inf gives 0
      m[r] = m_new;
      l[r] *= alpha;
      for (int u = 0; u < NV; ++u) {
        acc[u][2 * r] *= alpha;
        acc[u][2 * r + 1] *= alpha;
      }
      float p[2][2];
      for (int j = 0; j < 2; ++j) {
        p[j][0] = exp2f(sc[j][2 * r] - m_new);
        p[j][1] = exp2f(sc[j][2 * r + 1] - m_new);
        l[r] += p[j][0] + p[j][1];
      }
      pa[r] = pack_half2(p[0][0], p[0][1]);      // A reg 0 / 1: k = 2t, 2t+1 (n-tile 0)
      pa[2 + r] = pack_half2(p[1][0], p[1][1]);  // A reg 2 / 3: k = 2t+8, 2t+9 (n-tile 1)
    }
    // ---- values: tokens 2t, 2t+1 (B reg 0) and 2t+8, 2t+9 (B reg 1) ----
    const int v0 = 16 * warp;
    for (int gv = 0; gv < VG; ++gv) {
      __half2 vsc[2], vze[2];  // one value group: (token 2t, 2t+1) and (2t+8, 2t+9)
      for (int k = 0; k < 2; ++k) {
        const int tok = v0 + 2 * t + 8 * k;
        vsc[k] = __halves2half2(st.vs[tok][gv], st.vs[tok + 1][gv]);
        vze[k] = __halves2half2(st.vz[tok][gv], st.vz[tok + 1][gv]);
      }
      for (int wi = gv * (GV / 16); wi < (gv + 1) * (GV / 16); ++wi) {
        unsigned x[4];
        for (int k = 0; k < 4; ++k) x[k] = code_pair((unsigned)st.vw[v0 + 2 * t + (k & 1) + 8 * (k / 2)][wi], 2 * g);
        // n-tile 2wi: channel 16wi + g (low halves); n-tile 2wi + 1: channel 16wi + 8 + g (high halves).
        mma16816(acc[2 * wi], pa, dequant(__byte_perm(x[0], x[1], 0x5410), vsc[0], vze[0]),
                 dequant(__byte_perm(x[2], x[3], 0x5410), vsc[1], vze[1]));
        mma16816(acc[2 * wi + 1], pa, dequant(__byte_perm(x[0], x[1], 0x7632), vsc[0], vze[0]),
                 dequant(__byte_perm(x[2], x[3], 0x7632), vsc[1], vze[1]));
      }
    }
  }
  cp_async_wait_all();
  // ---- combine the four warps of the block, write one partial ----
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
  }
  __shared__ float wm[WARPS][16], wl[WARPS][16];
  __shared__ float wacc[WARPS][GQ][D];
  if (t == 0) {
    wm[warp][g] = m[0]; wl[warp][g] = l[0];
    wm[warp][g + 8] = m[1]; wl[warp][g + 8] = l[1];
  }
  for (int u = 0; u < NV; ++u)
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 8 * u + 2 * t + (i & 1);
      if (row < GQ) wacc[warp][row][col] = acc[u][i];
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
    const long row = ((long)b * hkv * GQ + (long)kvh * GQ + h) * num_parts + split;
    part_acc[row * D + c] = num;
    if (c == 0) {
      part_ml[row * 2] = M;
      part_ml[row * 2 + 1] = den;
    }
  }
}

// The fp16 residual window (r < R tokens): block (chunk, kv head, batch) takes RT tokens and writes
// partial number num_parts - gridDim.x + chunk. Scores: warp per token, lanes over channels
// (coalesced rows), shuffle-reduced; values: thread per channel, coalesced rows of V.
#define RT 16
extern "C" __global__ void __launch_bounds__(NT) residual_partial(
    const QT* __restrict__ q, const __half* __restrict__ kres, const __half* __restrict__ vres, int r, int capr,
    float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_ml, int num_parts) {
  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, hkv = gridDim.y, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, t0 = chunk * RT;
  const long bh = (long)b * hkv + kvh;
  __shared__ float qs[GQ][D];
  __shared__ float s[GQ][RT];
  __shared__ float m[GQ], l[GQ], alpha[GQ];
  __shared__ float red[REP * GQ * D];
  for (int i = tid; i < GQ * D; i += NT) qs[i / D][i % D] = to_float(q[(bh * GQ + i / D) * D + i % D]) * scale_log2;
  if (tid < GQ) { m[tid] = NEG_INF; l[tid] = 0.f; }
  __syncthreads();
  for (int tt = warp; tt < RT; tt += NT / 32) {
    float kv[D / 32];
    for (int i = 0; i < D / 32; ++i) kv[i] = t0 + tt < r ? __half2float(kres[(bh * capr + t0 + tt) * D + lane + 32 * i]) : 0.f;
    for (int h = 0; h < GQ; ++h) {
      float v = 0.f;
      for (int i = 0; i < D / 32; ++i) v += qs[h][lane + 32 * i] * kv[i];
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0) s[h][tt] = t0 + tt < r ? v : NEG_INF;
    }
  }
  __syncthreads();
  softmax_tile<RT>(s, m, l, alpha);
  __syncthreads();
  const int c = tid % D, rep = tid / D;
  float acc[GQ];
  for (int h = 0; h < GQ; ++h) acc[h] = 0.f;
  for (int tt = rep; tt < RT && t0 + tt < r; tt += REP) {
    const float v = __half2float(vres[(bh * capr + t0 + tt) * D + c]);
    for (int h = 0; h < GQ; ++h) acc[h] += s[h][tt] * v;
  }
  write_partial(&acc, red, m, l, part_acc, part_ml, b, kvh, num_parts - gridDim.x + chunk, num_parts);
}

// Combine the partials of one (batch, query head): out = (sum_s 2^(m_s-M) acc_s + 2^-M num)
//                                                        / (sum_s 2^(m_s-M) l_s + 2^-M den),
// where num (D) and den (1) are KVLinC's correction terms in exp units (null when absent).
// Block per (batch, query head), D threads; the weights 2^(m_s-M) are computed once, in parallel.
#define MAX_PARTS 1024

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffff, v, o);
    v = is_max ? fmaxf(v, other) : v + other;
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < D / 32; ++w) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

extern "C" __global__ void merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                 const float* __restrict__ corr_num, const float* __restrict__ corr_den,
                                 int num_parts, QT* __restrict__ out) {
  const long row = blockIdx.x;
  const int c = threadIdx.x;
  __shared__ float weight[MAX_PARTS];
  __shared__ float scratch[D / 32];
  float M = NEG_INF;
  for (int p = c; p < num_parts; p += D) M = fmaxf(M, part_ml[(row * num_parts + p) * 2]);
  M = block_reduce(M, true, scratch);
  float den = 0.f;
  for (int p = c; p < num_parts; p += D) {
    const float mp = part_ml[(row * num_parts + p) * 2];
    const float w = mp == NEG_INF ? 0.f : exp2f(mp - M);
    weight[p] = w;
    den += w * part_ml[(row * num_parts + p) * 2 + 1];
  }
  den = block_reduce(den, false, scratch);  // its barriers also publish weight[]
  float num = 0.f;
#pragma unroll 8
  for (int p = 0; p < num_parts; ++p) num += weight[p] * part_acc[(row * num_parts + p) * D + c];
  if (corr_num != nullptr) {
    const float w = exp2f(-M);
    num += w * corr_num[row * D + c];
    den += w * corr_den[row];
  }
  from_float(&out[row * D + c], num / den);
}
