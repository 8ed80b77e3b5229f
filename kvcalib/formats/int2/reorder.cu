// 2-bit codes of kvcalib.quant's packed layout -> the tensor-core order of kvcalib/formats/int2/layout.py,
// for the blocks a runtime flush appends (the torch reference, `to_tensor_core_order`, is the spec).
//
// Layouts (n = 16-token block, bh = batch * kv heads, D = head_dim):
//   keys   src (BH, NB, D)      int32: word (n, c) holds tokens 16n..16n+15 of channel c, token j at bits 2j
//   values src (BH, 16 NB, D/16) int32: word (t, w) holds channels 16w..16w+15 of token t, channel j at bits 2j
//   dst    (BH, NB, D) int32, tensor-core order: word w = lane * (D/32) + i, lane = 4g + t; its
//          half h, position p (bits 16h + 2p), r = 8i + p, a = r % 4, k = r / 4, holds
//            keys:   token g + 8(a % 2),       channel 16k + 8(a / 2) + 2t + h
//            values: token 2t + h + 8(a / 2),  channel 16k + g + 8(a % 2)
// Parallel split: a thread per destination word; it reads its 16 codes from L1/L2 (the source block
// is 4 D bytes). Bytes moved: 8 D per 16-token block (source and destination words).
// Compile-time parameters: D (64 or 128), VALUES (0: keys, 1: values).

extern "C" __global__ void reorder(const unsigned* __restrict__ src, unsigned* __restrict__ dst, long words) {
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= words) return;
  const long blk = idx / D;  // (bh, n) flattened: the 16-token block
  const int w = idx % D, lane = w / (D / 32), i = w % (D / 32), g = lane / 4, t = lane % 4;
  unsigned out = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const int r = 8 * i + p, a = r % 4, k = r / 4;
#if VALUES
      const int token = 2 * t + h + 8 * (a / 2), channel = 16 * k + g + 8 * (a % 2);
      const unsigned word = src[(blk * 16 + token) * (D / 16) + channel / 16];
      const unsigned code = (word >> (2 * (channel % 16))) & 3u;
#else
      const int token = g + 8 * (a % 2), channel = 16 * k + 8 * (a / 2) + 2 * t + h;
      const unsigned code = (src[blk * D + channel] >> (2 * token)) & 3u;
#endif
      out |= code << (16 * h + 2 * p);
    }
  dst[idx] = out;
}
