// The tensor-core tile pieces that the decode kernels over gathered centroids share (vq_decode.cu,
// codebook_decode.cu): the query's A fragments (fp16 hi + lo pair) and the online softmax over a warp's tiles
// of scores, in the lane layout those kernels document (lane (g, t): head g, slots 2t, 2t+1, 2t+8, 2t+9).
// Included textually after the including kernel defines D, GQ, KS (D / 16), NEG_INF and RESCALE_SLACK.

// Online softmax over a warp's tiles of scores (log2 units, -inf for absent tokens): lane (g, t) holds head
// g's scores of slots 2t, 2t+1, 2t+8, 2t+9 of each tile. Probabilities to p (the same layout), the running
// max m and this lane's share l of head g's sum; the output accumulators (columns: heads 2t, 2t+1) are
// rescaled when a running max moves, each by its own head's factor (two shuffles, rarely taken).
template <int NTILES>
__device__ __forceinline__ void softmax_tiles(const float (*sc)[4], float& m, float& l, float (*p)[4], float (*acc)[4]) {
  float mx = NEG_INF;
#pragma unroll
  for (int j = 0; j < NTILES; ++j)
    for (int i = 0; i < 4; ++i) mx = fmaxf(mx, sc[j][i]);
  for (int o = 1; o < 4; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
  // The max moves only when a score passes it by more than RESCALE_SLACK (log2 units): probabilities
  // then stay below 2^RESCALE_SLACK, well inside P's fp16, and the accumulators are rescaled rarely.
  const float m_new = mx > m + RESCALE_SLACK ? mx : m;
  const float alpha = m_new == m ? 1.f : exp2f(m - m_new);  // m = -inf before: 0 (nothing to rescale)
  m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NTILES; ++j)
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

// Four float32 numbers as an A fragment's hi and lo rows: fp16 hi, and the remainder lo (x - hi) in fp16.
__device__ __forceinline__ uint4 hi_lo_fragment(const float* x) {
  float hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    hi[i] = __half2float(__float2half_rn(x[i]));
    lo[i] = x[i] - hi[i];
  }
  return make_uint4(pack_half2(hi[0], hi[1]), pack_half2(lo[0], lo[1]), pack_half2(hi[2], hi[3]),
                    pack_half2(lo[2], lo[3]));
}

// A query's A fragments for the scores' mma, from float32 rows src[h][D] (h < GQ): row g is head g's fp16 hi,
// row g + 8 its remainder lo (both zero for g >= GQ); k-slice ks: channels
// t D/4 + 4 ks + {0, 1} and + {2, 3} (the keys' permutation).
__device__ __forceinline__ void q_fragments(const float (*src)[D], uint4* qa) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < GQ) f = *reinterpret_cast<const float4*>(&src[g][t * (D / 4) + 4 * ks]);
    const float x[4] = {f.x, f.y, f.z, f.w};
    qa[ks] = hi_lo_fragment(x);
  }
}

