"""The packed layouts the fused decode kernels read, one folder each, named by format:

- `int2/`: 2-bit codes with per-group scales and zero points, in the tensor-core order of
  `kernels_cupy/int2_decode.cu`; the layout of KIVI, OScaR and KVLinC (`Method.int2_spec`).
- `vq/`: codebook indices with per-layer or per-head codebooks, read by `kernels_cupy/vq_decode.cu`; the layout
  of VecInfer (`Method.vq_books`).
- `codebook/`: code rows read through codebooks (per position or shared), a norm per token and a basis, read by
  `kernels_cupy/codebook_decode.cu`; the layout of TurboQuant (`Method.codebook_spec`).

`rows.py` holds what their appends share: buffers that grow by doubling, the float16 sinks and residual window.

Each folder holds `layout.py` (the tensors, how a method's flushed blocks are appended, and the float64
reference every kernel is tested against) and `launch.py` (what the kernel can read, `supports`; its launch plan
and launch). A method names its layout by what it declares (`kvcalib.methods.base.KernelLayout`); the runtime
(`kvcalib.runtime.cache`) asks `supports` and launches, and never imports the other way."""
