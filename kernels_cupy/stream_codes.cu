// Codes in kvcalib.quant's packed layout (`pack_bits`: PER_WORD = 32 / BITS codes a word along the packed axis, least
// significant first) rewritten as one bit stream a token along its channels (`quant.pack_stream`'s layout: channel c's
// code at bits [c BITS, (c + 1) BITS), running across words): how the codebook layout holds KIVI's and OScaR's affine
// codes (`kvcalib.quant.codes_as_stream` is the spec; the GPU tests compare the two bit for bit). One launch where
// unpacking and packing again took about ten.
//
//   codes (N, ceil(T / PER_WORD), C) int32 (AXIS_TOKENS 1: keys, packed along tokens)
//      or (N, T, ceil(C / PER_WORD)) int32 (AXIS_TOKENS 0: values, packed along channels)
//   out   (N, T, W) int32, W = ceil(C BITS / 32), the last word zero-padded
// A thread an output word: it reads the codes of the channels whose bits the word holds. Bytes: the codes read about
// once (a key word's codes by PER_WORD threads of consecutive tokens), the stream written once.
// Defines: BITS (1..8), AXIS_TOKENS.

#define PER_WORD (32 / BITS)
#define MASK ((1u << BITS) - 1u)

extern "C" __global__ void stream_codes(const unsigned* __restrict__ codes, unsigned* __restrict__ out, int N, int T,
                                        int C) {
  const int W = (C * BITS + 31) / 32;
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long)N * T * W) return;
  const long w = idx % W, t = idx / W % T, n = idx / W / T;
  const int lo = (int)w * 32, j0 = lo / BITS, j1 = min(C - 1, (lo + 31) / BITS);
  unsigned word = 0;
  for (int j = j0; j <= j1; ++j) {
#if AXIS_TOKENS
    const unsigned c = codes[(n * ((T + PER_WORD - 1) / PER_WORD) + t / PER_WORD) * C + j] >> (t % PER_WORD * BITS) & MASK;
#else
    const unsigned c = codes[(n * T + t) * ((C + PER_WORD - 1) / PER_WORD) + j / PER_WORD] >> (j % PER_WORD * BITS) & MASK;
#endif
    const int off = j * BITS - lo;  // the code's first bit in this word (negative: in the word before)
    word |= off >= 0 ? c << off : c >> -off;
  }
  out[idx] = word;
}
