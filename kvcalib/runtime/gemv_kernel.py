"""The decode step's weight products at one or two rows (kernels_cupy/gemv.cu): `nn.Linear` on a token or two.

At B = 1 a decode step reads every weight once for one row of activations, and the step's time is mostly
that read. cuBLAS splits the smaller products (k, v, o, down) over K and adds the pieces in a second kernel;
this kernel gives each output row one warp, which reads it 512 contiguous bytes at a time. Over the 8B
shape's 15 GB of weights on an H100 (benchmarks/gemv.py; its table in benchmarks/history/2026-11-27.md), the
read floor 4.86 ms: one row, cuBLAS 6.06 ms and this kernel 5.42; two rows, 6.09 and 5.72; four, even (6.12 and
6.11); eight, cuBLAS the faster (5.99 against 7.2 at best). So the kernel takes up to `MAX_ROWS` rows.

`linear(x, weight, bias)` is `F.linear` by the kernel where it applies (`applies`), by `F.linear` otherwise.
The static cache's decode step switches `nn.Linear.forward` to `FAST_FORWARD`, which calls it, while the step
runs (`kvcalib.runtime.captured._Regions`), so its captured graph and torch.compile's traces take the kernel,
through the custom op `torch.ops.kvcalib.gemv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 2  # rows of x the kernel takes: from four rows on cuBLAS is as fast or faster (module docstring)
RPW, WARPS, CHUNK = 1, 8, 0  # rows a warp, warps a block, 16-byte words a lane keeps in flight (0: balanced_chunk)
EAGER_FORWARD = torch.nn.Linear.forward  # as torch defines it, whatever is switched in later


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel computes `F.linear(x, weight, bias)`: float16 or bfloat16 throughout, on one GPU, a
    dense 2-D weight of at least one row of a multiple of 8 values (16-byte words), at most `MAX_ROWS` rows of
    x, and no gradient to keep (the kernel has no backward). A weight of a tensor subclass (a DTensor, a
    quantized weight) is not asked about here: the step switches the kernel in only for models without one
    (`captured._Regions`)."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype):
        return False
    if weight.dim() != 2 or weight.device != x.device or not weight.is_contiguous() or weight.shape[0] == 0:
        return False
    k = weight.shape[1]
    if x.shape[-1] != k or k % 8 or x.numel() // max(k, 1) > MAX_ROWS or x.numel() == 0:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],) or bias.device != x.device):
        return False
    grads = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return not (torch.is_grad_enabled() and grads)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the kernel where it `applies`."""
    if applies(x, weight, bias):
        return torch.ops.kvcalib.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return linear(input, self.weight, self.bias)


FAST_FORWARD = _linear_forward  # what the step switches in for `nn.Linear.forward`


def launch_gemv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                n: int | None = None, config: tuple[int, int, int] = (RPW, WARPS, CHUNK), checked: bool = False) -> None:
    """out (M, N) = rows (M, K) weightᵀ (+ bias) by the kernel, on torch's current stream: rows and weight dense and
    16-byte aligned; `n` of weight's rows (all by default: fewer leaves the others unwritten, a test's planted
    fault); `config`: rows a warp, warps a block, 16-byte words a lane keeps in flight (0: `balanced_chunk`'s)
    (benchmarks/gemv.py)."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    rpw, warps, chunk = config
    chunk = chunk or balanced_chunk(weight.shape[1])
    n = weight.shape[0] if n is None else n
    defines = {"KDIM": weight.shape[1], "MROWS": rows.shape[0], "RPW": rpw, "WARPS": warps, "CHUNK": chunk,
               "BF16": int(rows.dtype == torch.bfloat16)}
    ptr = lambda t: cupy.uint64(t.data_ptr() if t is not None else 0)  # noqa: E731
    with torch_stream(rows.device):  # a warp per rpw rows of W, `warps` warps a block: every row of W read once
        launch(kernel("gemv.cu", defines, "gemv"), (-(-n // (rpw * warps)),), (32 * warps,),
               (ptr(weight), ptr(rows), ptr(bias), ptr(out), cupy.int32(n)), checked)


def balanced_chunk(k: int, most: int = 10) -> int:
    """16-byte words a lane keeps in flight for rows of `k` values: the fewest passes of at most `most`, all of one
    size but a shorter last: a row of 2560 (Gemma 3's hidden size, 10 words a lane) in one pass of 10, not a pass
    of 8 and one of 2 (Gemma-3-4B's products 13% faster; the Llama 8B shape's within 1%: benchmarks/gemv.py)."""
    per_lane = -(-k // 8 // 32)
    passes = -(-per_lane // most)
    return -(-per_lane // passes)


@torch.library.custom_op("kvcalib::gemv", mutates_args=())
def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, checked: bool = False) -> torch.Tensor:
    """`launch_gemv` as a custom op; x (..., K) -> (..., N). Inputs that do not start 16-byte aligned (a view into
    a row) go to `F.linear`: known only here, not when torch.compile traces the call."""
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    if rows.data_ptr() % 16 or weight.data_ptr() % 16:
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    launch_gemv(rows, weight, bias.contiguous() if bias is not None else None, out, checked=checked)
    return out


@_gemv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, checked: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
