"""The packed layouts the fused decode kernels read, one folder each, named by format:

- `int2/`: 2-bit codes with per-group scales and zero points, in the tensor-core order of
  `int2/int2_decode.cu`; the layout of KIVI, OScaR and KVLinC at 2 bits (`int2/coded.py`).
- `vq/`: codebook indices with per-layer or per-head codebooks, read by `vq/vq_decode.cu`; the layout
  of VecInfer (`vq/coded.py`).
- `codebook/`: code rows read through codebooks (per position, shared, or affine levels), a norm per token and a
  basis, read by `codebook/codebook_decode.cu`; the layout of TurboQuant, of KIVI and OScaR beyond 2 bits or with
  sinks, and of a plan's groups of KV heads (`codebook/coded.py`).

Each folder holds `layout.py` (the tensors, how a method's flushed blocks are appended, and the float64
reference every kernel is tested against), `launch.py` (what the kernel can read, `supports`; its launch plan
and launch), `coded.py` (the class a method's class takes to declare its blocks in this layout) and `format.py`
(what the caches hold of it: `base.Format`). `registry.py` lists the formats in the order the caches try them;
`waves.py` holds how a launch's splits fill the GPU; `rows.py` what the appends share (buffers that grow by doubling,
the float16 sinks and residual window). A method names its layouts by the `coded.py` classes it takes; the runtime
(`kvcalib.runtime`) holds formats and never imports the other way."""
