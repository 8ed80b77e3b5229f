// Fused decode attention over codebook codes: TurboQuant's scalar and vector codes (a codebook per coordinate or
// one shared by every sub-vector, a norm per token, a rotation) and any format of the same shape. One new query
// per head, q (B, Hq, D) QT (fp16 or bf16), in the model's basis.
//
// Reads the layout of kvcalib/formats/codebook/layout.py (its module docstring has the table), per part (keys K,
// values V) of the launch's H KV heads:
//   kcodes, vcodes (B, H, CAPT, KW | VW) int32   each token's codes as one bit stream, code j at bits
//                                                [j BITS, (j + 1) BITS), least significant bit first
//   knorm, vnorm (B, H, CAPT) fp16 or null        the token's norm: x = norm * y B
//   kbook, vbook (G, P, 2^BITS, DIM) fp32         codebooks: P = D / DIM (one per position) or 1 (shared by
//                                                every position), G = 1 (shared by the heads) or H
//   ksink, vsink (B, H, CAPS, D) fp16             the first min(sinks, T) tokens, read instead of their codes
//   kres, vres (B, H, CAPR, D) fp16               the residual window
//   lengths, residuals (B,) int32 or null         per-sequence T and r read on the device (a captured step)
//   head_map (H,) int32 or null                   the model's KV head of each launch head (a plan's group)
// A token's vector is x = norm * y B, y the centroids of its codes and B the part's basis (kvcalib's layout
// names it; the identity where the format has none). The launch's `rotate` writes q~ = scale log2(e) q B_K^T
// (float32) once per query head, the packed tokens are scored against q~ and their values summed in V's coded
// basis; `merge` takes that sum back by B_V. The float16 rows meet q itself and are summed in the model's basis.
//
// Bytes that must move per (batch, KV head): T (KW + VW) 4 of codes and T 2 of each norm, 4 D (sinks + r) of
// float16 rows, read once; the books (G, P, 2^BITS, DIM) float32 per block, from L2 after the first block; the
// partials, 4 (D + 2) GQ per part, written and read once.
//
// Kernels, each launched by kvcalib/formats/codebook/launch.py, which decides the grid:
//   rotate   block (query head, batch), D threads: q~ = scale log2(e) q B_K^T (a copy times the scale without one)
//   partial  block (part, launch head, batch), WARPS warps: parts 0 .. num_splits - 1 take split_len packed
//            tokens each, the others ROWS float16 rows each (sinks, then the residual). A warp takes TPW tokens
//            at a time, LPT = D / CH lanes a token, each lane CH channels: the lane's codes (one 32-bit field,
//            at most two words of the row), its centroids from shared memory, its partial dot with q~ for each
//            of the GQ heads, summed over the token's lanes by shuffles; the online softmax in log2 units;
//            the values' centroids times p norm into CH x GQ float32 accumulators. The warp's token slots and
//            then the block's warps are merged into one partial (sum of exp2(s - m) v, m, sum of exp2(s - m)).
//   merge    block (query head, batch), D threads: the parts weighed by exp2(m_p - M); the packed parts' sum
//            taken back by B_V, the rows' added, divided by the total weight; written as QT.
// Every product and sum is float32; the books hold fp16 centroids exactly.
//
// Defines: D, GQ (<= 8), QT, CH (channels a lane), WARPS, ROWS (float16 rows a rows part), and per part X in
// {K, V}: XB (bits a code), XDIM (coordinates a code), XPOS (1: a book per position), XNORM (1: norms), XW (words
// a row).
#include "decode_common.cuh"

#define LPT (D / CH)  // lanes a token
#define TPW (32 / LPT)  // tokens a warp takes at once
#define NT (32 * WARPS)
#define KCODES (CH / KDIM)  // codes of a lane's channels
#define VCODES (CH / VDIM)
#define KENTRIES (1 << KB)
#define VENTRIES (1 << VB)
#define KP (KPOS ? D / KDIM : 1)  // positions with a book of their own
#define VP (VPOS ? D / VDIM : 1)
// Floats from one position's book to the next: one more than the book where positions have books of their own, so
// that the lanes of a token (neighbouring positions) read different banks.
#define KSTRIDE (KENTRIES * KDIM + KPOS)
#define VSTRIDE (VENTRIES * VDIM + VPOS)
#define KBOOK_FLOATS (KP * KSTRIDE)
#define VBOOK_FLOATS (VP * VSTRIDE)
#define RESCALE_SLACK 8.f  // log2 units a score passes the running max by before it moves
#define NEG_INF __int_as_float(0xff800000)

static_assert(D % CH == 0 && 32 % LPT == 0, "a token's channels fill whole lanes of a warp");
static_assert(CH % KDIM == 0 && CH % VDIM == 0, "a lane's channels are whole codes");
static_assert(KCODES * KB <= 32 && VCODES * VB <= 32, "a lane's codes of a token fit one 32-bit field");

// The 32-bit field of this lane's codes in a row of W words: NBITS bits from bit `start`, which may run into the
// next word (never past the row: the field ends inside it).
template <int W, int NBITS>
__device__ __forceinline__ unsigned code_field(const unsigned* __restrict__ row, int start) {
  const int w = start >> 5, off = start & 31;
  const unsigned lo = __ldcs(row + w);
  if ((NBITS % 32 == 0 && (start & 31) == 0) || off + NBITS <= 32) return lo >> off;
  return __funnelshift_r(lo, __ldcs(row + w + 1), off);
}

// This lane's CH coordinates of one token from its codes' field: centroid entries of the books in shared memory.
template <int BITS, int DIM, int POS, int STRIDE>
__device__ __forceinline__ void centroids(const float* book, unsigned field, int first_code, float* y) {
#pragma unroll
  for (int k = 0; k < CH / DIM; ++k) {
    const unsigned c = (field >> (k * BITS)) & ((1u << BITS) - 1);
    const float* e = book + (POS ? (first_code + k) * STRIDE : 0) + c * DIM;
#pragma unroll
    for (int i = 0; i < DIM; ++i) y[k * DIM + i] = e[i];
  }
}

// Sums a per-head value over the LPT lanes of a token (lanes lane ^ 1 .. lane ^ LPT/2 hold the same token).
__device__ __forceinline__ float token_sum(float x) {
#pragma unroll
  for (int o = 1; o < LPT; o *= 2) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}

// The online softmax of one token slot: s (log2 units, -inf for none) per head into the running max m, sum l and
// accumulators acc; returns the weights p of the token (0 for none).
__device__ __forceinline__ void softmax_step(const float* s, float* m, float* l, float (*acc)[CH], float* p) {
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    // The max moves only when a score passes it by more than RESCALE_SLACK: the accumulators are rescaled rarely,
    // and every weight stays below 2^RESCALE_SLACK.
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

// Merges the running states (m, l, acc) of the warp's TPW token slots (lanes lane ^ LPT .. hold the same
// channels of other slots), then of the block's warps, into the partial of this part: part_acc (GQ x D) and
// part_ml (GQ x 2) at `part_at` / `ml_at`. `work`: WARPS (GQ (D + 2)) floats of shared memory.
__device__ __forceinline__ void write_partial(float* m, float* l, float (*acc)[CH], float* work, float* part_acc,
                                              float* part_ml, long acc_at, long ml_at, int part_stride) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunk = lane % LPT;
#pragma unroll
  for (int o = LPT; o < 32; o *= 2)
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float mo = __shfl_xor_sync(0xffffffff, m[h], o), lo = __shfl_xor_sync(0xffffffff, l[h], o);
      const float mx = fmaxf(m[h], mo);
      const float a = m[h] == NEG_INF ? 0.f : exp2f(m[h] - mx), b = mo == NEG_INF ? 0.f : exp2f(mo - mx);
#pragma unroll
      for (int c = 0; c < CH; ++c) acc[h][c] = acc[h][c] * a + __shfl_xor_sync(0xffffffff, acc[h][c], o) * b;
      l[h] = l[h] * a + lo * b;
      m[h] = mx;
    }
  float* mine = work + warp * GQ * (D + 2);  // this warp's state: acc (GQ x D), then m (GQ), then l (GQ)
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

// q~ = scale log2(e) q B_K^T for query head blockIdx.x of batch row blockIdx.y (float32, (B, Hl GQ, D)); `qbasis`
// (G, D, D) is B_K^T, G = 1 or the launch's heads; null: q times the scale.
extern "C" __global__ void rotate(const QT* __restrict__ q, const float* __restrict__ qbasis, int basis_heads,
                                  const int* __restrict__ head_map, int hq_model, float scale_log2,
                                  float* __restrict__ qrot) {
  __shared__ float x[D];
  const int hl = blockIdx.x / GQ, b = blockIdx.y, c = threadIdx.x;
  const int hm = head_map ? head_map[hl] : hl;
  const QT* src = q + ((long)b * hq_model + hm * GQ + blockIdx.x % GQ) * D;
  x[c] = to_float(src[c]);
  __syncthreads();
  float y = x[c];
  if (qbasis) {
    const float* m = qbasis + (basis_heads > 1 ? (long)hl * D * D : 0);
    y = 0.f;
#pragma unroll 8
    for (int i = 0; i < D; ++i) y += x[i] * m[i * D + c];
  }
  qrot[((long)b * gridDim.x + blockIdx.x) * D + c] = y * scale_log2;
}

extern "C" __global__ void __launch_bounds__(NT) partial(
    const float* __restrict__ qrot, const QT* __restrict__ q, int hq_model, const int* __restrict__ head_map,
    const unsigned* __restrict__ kcodes, const __half* __restrict__ knorm, const unsigned* __restrict__ vcodes,
    const __half* __restrict__ vnorm, int capt, const float* __restrict__ kbook, int kbook_heads,
    const float* __restrict__ vbook, int vbook_heads, const __half* __restrict__ ksink,
    const __half* __restrict__ vsink, int sinks, int caps, const __half* __restrict__ kres,
    const __half* __restrict__ vres, int residual, int capr, int length, int split_len, int num_splits,
    float scale_log2, const int* __restrict__ lengths, const int* __restrict__ residuals,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  extern __shared__ float smem[];
  const int part = blockIdx.x, hl = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, slot = lane / LPT, chunk = lane % LPT;
  const long bh = (long)b * H + hl;
  const int T = lengths ? min(lengths[b], capt) : length;  // flushed tokens
  const int S = min(sinks, T);  // of them read from the float16 sinks
  const int nrows = S + (residuals ? min(residuals[b], capr) : residual);
  const int parts = gridDim.x;
  const long acc_at = (bh * GQ * parts + part) * D, ml_at = (bh * GQ * parts + part) * 2;
  float m[GQ], l[GQ], acc[GQ][CH], qr[GQ][CH];
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    m[h] = NEG_INF, l[h] = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[h][c] = 0.f;
  }
  const int step = WARPS * TPW;  // tokens the block takes at once
  if (part < num_splits) {  // packed tokens [t0, t1), scored against q~ and summed in V's basis
    float* kb = smem;
    float* vb = smem + KBOOK_FLOATS;
    const float* ksrc = kbook + (kbook_heads > 1 ? (long)hl * KP * KENTRIES * KDIM : 0);
    const float* vsrc = vbook + (vbook_heads > 1 ? (long)hl * VP * VENTRIES * VDIM : 0);
    for (int i = threadIdx.x; i < KP * KENTRIES * KDIM; i += NT) kb[i / (KENTRIES * KDIM) * KSTRIDE + i % (KENTRIES * KDIM)] = ksrc[i];
    for (int i = threadIdx.x; i < VP * VENTRIES * VDIM; i += NT) vb[i / (VENTRIES * VDIM) * VSTRIDE + i % (VENTRIES * VDIM)] = vsrc[i];
    const float* qsrc = qrot + (bh * GQ) * D + chunk * CH;
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int c = 0; c < CH; ++c) qr[h][c] = qsrc[h * D + c];
    __syncthreads();
    const int t0 = max(S, part * split_len), t1 = min(T, (part + 1) * split_len);
    const unsigned* krow = kcodes + bh * capt * KW;
    const unsigned* vrow = vcodes + bh * capt * VW;
    const int kfirst = chunk * KCODES, vfirst = chunk * VCODES;
    for (int base = t0 + warp * TPW; base < t1; base += step) {
      const int t = base + slot;
      const bool here = t < t1;
      float s[GQ], p[GQ], y[CH];
      const unsigned kf = here ? code_field<KW, KCODES * KB>(krow + (long)t * KW, kfirst * KB) : 0u;
      const unsigned vf = here ? code_field<VW, VCODES * VB>(vrow + (long)t * VW, vfirst * VB) : 0u;
      const float kn = KNORM && here ? __half2float(__ldcs(knorm + bh * capt + t)) : 1.f;
      const float vn = VNORM && here ? __half2float(__ldcs(vnorm + bh * capt + t)) : 1.f;
      centroids<KB, KDIM, KPOS, KSTRIDE>(kb, kf, kfirst, y);
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        float x = 0.f;
#pragma unroll
        for (int c = 0; c < CH; ++c) x += qr[h][c] * y[c];
        const float sum = token_sum(x);  // every lane takes part in the shuffles
        s[h] = here ? sum * kn : NEG_INF;
      }
      softmax_step(s, m, l, acc, p);
      centroids<VB, VDIM, VPOS, VSTRIDE>(vb, vf, vfirst, y);
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        const float w = p[h] * vn;
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[h][c] += w * y[c];
      }
    }
  } else {  // float16 rows [r0, r1): the sinks, then the residual window, against q in the model's basis
    const QT* qsrc = q + ((long)b * hq_model + (head_map ? head_map[hl] : hl) * GQ) * D + chunk * CH;
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int c = 0; c < CH; ++c) qr[h][c] = to_float(qsrc[h * D + c]) * scale_log2;
    const int r0 = (part - num_splits) * ROWS, r1 = min(nrows, r0 + ROWS);
    for (int base = r0 + warp * TPW; base < r1; base += step) {
      const int r = base + slot;
      const bool here = r < r1;
      float s[GQ], p[GQ], y[CH];
      const long at = r < S ? (bh * caps + r) * D : (bh * capr + r - S) * D;
      const __half* kx = (r < S ? ksink : kres) + at + chunk * CH;
      const __half* vx = (r < S ? vsink : vres) + at + chunk * CH;
#pragma unroll
      for (int c = 0; c < CH; ++c) y[c] = here ? __half2float(kx[c]) : 0.f;
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        float x = 0.f;
#pragma unroll
        for (int c = 0; c < CH; ++c) x += qr[h][c] * y[c];
        const float sum = token_sum(x);
        s[h] = here ? sum : NEG_INF;
      }
      softmax_step(s, m, l, acc, p);
#pragma unroll
      for (int c = 0; c < CH; ++c) y[c] = here ? __half2float(vx[c]) : 0.f;
#pragma unroll
      for (int h = 0; h < GQ; ++h)
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[h][c] += p[h] * y[c];
    }
  }
  __syncthreads();  // the books' memory becomes the warps' states
  write_partial(m, l, acc, smem, part_acc, part_ml, acc_at, ml_at, parts);
}

// out[b, head, :] for query head blockIdx.x of the launch (model head head_map[hl] GQ + blockIdx.x % GQ), batch
// row blockIdx.y: the parts weighed by exp2(m_p - M), the packed parts' sum taken back by B_V (`vbasis` (G, D, D),
// null: the identity), the rows' parts added, divided by the total weight.
extern "C" __global__ void merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml, int parts,
                                 int num_splits, const float* __restrict__ vbasis, int basis_heads,
                                 const int* __restrict__ head_map, int hq_model, QT* __restrict__ out) {
  __shared__ float coded[D];
  const int hl = blockIdx.x / GQ, b = blockIdx.y, c = threadIdx.x;
  const long row = (long)b * gridDim.x + blockIdx.x;
  const float* ml = part_ml + row * parts * 2;
  const float* acc = part_acc + row * parts * D + c;
  float mx = NEG_INF;
  for (int p = 0; p < parts; ++p) mx = fmaxf(mx, __ldcg(ml + 2 * p));
  float sum_coded = 0.f, sum_rows = 0.f, den = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float mp = __ldcg(ml + 2 * p);
    const float w = mp == NEG_INF ? 0.f : exp2f(mp - mx);
    den += w * __ldcg(ml + 2 * p + 1);
    const float x = w == 0.f ? 0.f : w * __ldcg(acc + (long)p * D);
    if (p < num_splits) sum_coded += x;
    else sum_rows += x;
  }
  float y = sum_coded;
  if (vbasis) {
    coded[c] = sum_coded;
    __syncthreads();
    const float* m = vbasis + (basis_heads > 1 ? (long)hl * D * D : 0);
    y = 0.f;
#pragma unroll 8
    for (int i = 0; i < D; ++i) y += coded[i] * m[i * D + c];
  }
  const int hm = head_map ? head_map[hl] : hl;
  from_float(out + ((long)b * hq_model + hm * GQ + blockIdx.x % GQ) * D + c, den > 0.f ? (y + sum_rows) / den : 0.f);
}
