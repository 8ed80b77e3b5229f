"""The normalized Walsh–Hadamard rotation, H Hᵀ = I, used by VecInfer, KVLinC and OScaR.

For a power-of-two size n, H_n is Sylvester's construction scaled by 1/sqrt(n): symmetric and
orthogonal, so rotating queries and keys by the same H leaves q·k unchanged, and H⁻¹ = H.
For other sizes the rotation is block-diagonal with the largest power-of-two block that divides
n (n = 96 -> three 32x32 blocks); an odd n has no such block and is refused.
"""

from __future__ import annotations

import functools
import math

import torch

from .errors import SettingsError
from .quant import CUPY_FOUND
from .streams import settled


def block_size(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


@functools.lru_cache(maxsize=16)
def _matrix(n: int) -> torch.Tensor:
    b = block_size(n)
    if b < 2:
        raise SettingsError(f"head_dim {n} is odd: no Hadamard rotation exists; use a method that does not rotate "
                            "(kivi, turboquant, oscar --no-rotation, fit-codebook --no-hadamard)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / b**0.5
    return torch.block_diag(*[h] * (n // b))


# One copy per size, dtype and device: a decode step rotates several times per layer, and a host-to-device
# copy each time would wait for the GPU. A plain dict rather than an lru_cache: `torch.compile` reads a
# copy made before tracing as a graph input (it traces through an lru_cache, building the matrix on the
# host and copying it over inside the step); a static cache makes its copy when it is created.
_COPIES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def held_matrix(store: dict, n: int, dtype: torch.dtype, device, make) -> torch.Tensor:
    """`make(n)` (an n x n matrix made on the host) as `dtype` on `device`, made once per (n, dtype, device) and
    kept in `store` (the comment above says why a dict)."""
    key = (n, dtype, torch.device(device) if device is not None else torch.device("cpu"))
    held = store.get(key)
    if held is None:
        held = store[key] = settled(make(n).to(dtype=dtype, device=key[2]))  # `streams.side_by_side`
    return held


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The n x n (block-)Hadamard matrix, normalized and symmetric."""
    return held_matrix(_COPIES, n, dtype, device, _matrix)


# Where the rotation kernel does not serve a CUDA tensor (float64, a gradient, CuPy absent): up to this
# many vectors, a batched product, one vector per batch entry: cuBLAS takes 52 us for a (8, 128) x (128, 128) float32
# product on an H100 (one block), the batched form 2 us (a decode step rotates 8 keys and 8 values per layer;
# benchmarks/RESULTS.md, static cache profiles).
SMALL_ROWS = 64
_KERNEL_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def on_the_rotation_kernel(x: torch.Tensor) -> bool:
    """Whether `rotate` takes x on `kernels_cupy/hadamard_rows.cu`: on CUDA with CuPy, float32, float16 or bfloat16,
    an even last dimension (eager or compiled: an opaque op to torch.compile)."""
    d = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and CUPY_FOUND and x.dtype in _KERNEL_KINDS and d > 0 and d % 2 == 0
            and not (x.requires_grad and torch.is_grad_enabled()))  # the product carries a gradient; the op none


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dimension. H is symmetric and orthogonal, so rotate(rotate(x)) == x. On CUDA, where
    `on_the_rotation_kernel`, the fast transform in one launch, whose rows have the same bits whatever rows come
    with them (a product's kernel, and its order of sums, depends on the count of rows); within a few float32 ulps of
    the product (denormal float32 values flushed to zero). Elsewhere (float64, a gradient, no CuPy) the product, whose
    rows may differ in the last bit with the count of rows."""
    if on_the_rotation_kernel(x):
        return torch.ops.kvcalib.hadamard_rows(x, False)
    d = x.shape[-1]
    h = hadamard(d, x.dtype if x.is_floating_point() else torch.float32, x.device)
    rows = x.numel() // d if d else 0
    if x.is_cuda and 0 < rows <= SMALL_ROWS:
        return torch.bmm(x.reshape(rows, 1, d).to(h.dtype), h.expand(rows, d, d)).view(x.shape)
    return x @ h


@torch.library.custom_op("kvcalib::hadamard_rows", mutates_args=())
def _hadamard_rows(x: torch.Tensor, checked: bool) -> torch.Tensor:
    """`rotate` on the GPU (`kernels_cupy/hadamard_rows.cu`, whose opening comment has the layout): a new tensor of x's
    shape and dtype, row after row. A custom op, so that a compiled step rotates as an eager one does. `checked`: wait
    for the kernel, so that a fault inside it raises here (the tests)."""
    if not on_the_rotation_kernel(x):
        raise ValueError(f"hadamard_rows takes a CUDA tensor of float32, float16 or bfloat16 whose last dimension is "
                         f"even (CuPy installed, no gradient asked); got {tuple(x.shape)} {x.dtype} on {x.device}")
    if x.stride(-1) != 1:  # the kernel reads a row's elements one after another
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not x.numel():
        return out
    x4 = x.flatten(0, x.dim() - 4) if x.dim() > 4 else x.view(*[1] * (4 - x.dim()), *x.shape)
    b, h, t, d = x4.shape
    rows = b * h * t
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    block = block_size(d)
    strides = [cupy.int64(s) for s in x4.stride()[:3]]
    defines = {"D": d, "BLOCK": block, "ELEM_KIND": _KERNEL_KINDS[x.dtype]}
    with torch_stream(x.device):
        launch(kernel("hadamard_rows.cu", defines, "hadamard_rows"),
               (-(-rows // 4),), (128,), (cupy.uint64(x4.data_ptr()), cupy.uint64(out.data_ptr()), cupy.int64(rows),
                                          cupy.int64(h), cupy.int64(t), *strides, cupy.float32(1 / math.sqrt(block))),
               checked)
    return out


@_hadamard_rows.register_fake
def _(x, checked):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
