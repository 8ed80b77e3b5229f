"""The normalized Walsh–Hadamard rotation, H Hᵀ = I, used by VecInfer, KVLinC and OScaR.

For a power-of-two size n, H_n is Sylvester's construction scaled by 1/sqrt(n): symmetric and
orthogonal, so rotating queries and keys by the same H leaves q·k unchanged, and H⁻¹ = H.
For other sizes the rotation is block-diagonal with the largest power-of-two block that divides
n (n = 96 -> three 32x32 blocks); an odd n has no such block and is refused.
"""

from __future__ import annotations

import functools

import torch

from .errors import SettingsError


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
        held = store[key] = make(n).to(dtype=dtype, device=key[2])
    return held


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The n x n (block-)Hadamard matrix, normalized and symmetric."""
    return held_matrix(_COPIES, n, dtype, device, _matrix)


# Up to this many vectors, a CUDA rotation runs as a batched product, one vector per batch entry: cuBLAS
# takes 52 us for a (8, 128) x (128, 128) float32 product on an H100 (one block), the batched form 2 us
# (a decode step rotates 8 keys and 8 values per layer; benchmarks/RESULTS.md, static cache profiles).
SMALL_ROWS = 64


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dimension. H is symmetric and orthogonal, so rotate(rotate(x)) == x."""
    d = x.shape[-1]
    h = hadamard(d, x.dtype if x.is_floating_point() else torch.float32, x.device)
    rows = x.numel() // d if d else 0
    if x.is_cuda and 0 < rows <= SMALL_ROWS:
        return torch.bmm(x.reshape(rows, 1, d).to(h.dtype), h.expand(rows, d, d)).view(x.shape)
    return x @ h
