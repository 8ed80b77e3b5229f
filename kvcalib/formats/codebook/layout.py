"""The codebook layout a fused decode kernel reads (kernels_cupy/codebook_decode.cu), and its float64 reference.

Used by TurboQuant (`Method.codebook_spec`, `codebook_parts`): scalar codes with one codebook for every
coordinate (oblivious) or one per coordinate (calibrated), and vector codes of D coordinates with one codebook
that every sub-vector shares; a norm per token; one rotation.

A part (keys or values) of a layer stores, per token and KV head, a vector x of d numbers as

    x = norm · y B,   y = the centroids of its codes, B the part's basis (d x d; the identity where None)

`CodedPart` says how: `bits` a code, `dim` coordinates a code (1: scalar), `book` (G, P, 2^bits, dim) float32 with
P = d / dim (a codebook per position: position i codes coordinates i dim .. (i + 1) dim - 1) or P = 1 (one shared
by every position), G = 1 or one per KV head; `norm` whether a norm is stored; `basis` (G, d, d) or None.
TurboQuant: B = Π (`methods.turboquant.rotation`), norms on, keys and values alike.

`CodebookLayer` holds one layer's cache in capacity-sized buffers:

| what     | dtype   | shape               | meaning                                                                  |
|----------|---------|---------------------|--------------------------------------------------------------------------|
| `kcodes` | int32   | `(B, H, CAPT, KW)`  | each flushed token's key codes, one bit stream (`quant.pack_stream`)    |
| `knorm`  | float16 | `(B, H, CAPT)`      | its norm (None where the key part stores none)                           |
| `vcodes` | int32   | `(B, H, CAPT, VW)`  | the same for values                                                      |
| `vnorm`  | float16 | `(B, H, CAPT)`      |                                                                          |
| `ksink`  | float16 | `(B, H, S, d)`      | the first S tokens' keys as they came in (read instead of their codes)  |
| `vsink`  | float16 | `(B, H, S, d)`      | their values                                                             |
| `kres`   | float16 | `(B, H, CAPR, d)`   | the residual window's keys, as they came in                              |
| `vres`   | float16 | `(B, H, CAPR, d)`   | its values                                                               |

KW = ceil((d / dim) bits / 32). `length` flushed tokens (their first `sinks` read from the float16 sinks; their
codes are stored all the same, as the method counts them), `residual` tokens in the window. Where the layer is one
of a plan's groups of KV heads, `head_map` (H,) int32 gives the model's KV head of each of its heads.

What the kernel computes, per query head h of KV head j, in float32:
- the score of a flushed token t: q_h · x_t = norm_t (q_h Bᵀ) · y_t (the query taken into the basis once), or
  q_h · ksink[t] for t < sinks; of a residual token: q_h · kres[t];
- softmax over all of them; the output Σ p_t norm_t y_t of the coded values, taken back by B once, plus
  Σ p_t vsink[t] and Σ p_t vres[t].
`reference_decode` computes the same in float64 over the dequantized cache (the two sums differ only by
round-off): the kernel's tests hold it to this (tests/test_codebook_kernel_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quant import unpack_stream
from ..rows import grow, take_rows


@dataclass(frozen=True)
class CodedPart:
    """How keys or values are coded (module docstring)."""

    bits: int
    dim: int  # coordinates a code
    book: torch.Tensor  # (G, P, 2^bits, dim) float32
    norm: bool
    basis: torch.Tensor | None = None  # (G, d, d) float32; None: the identity

    @property
    def per_position(self) -> bool:
        return self.book.shape[1] > 1

    def words(self, head_dim: int) -> int:
        """int32 words of one token's codes."""
        return -(-(head_dim // self.dim) * self.bits // 32)

    def to(self, device) -> "CodedPart":
        basis = None if self.basis is None else self.basis.to(device)
        return CodedPart(self.bits, self.dim, self.book.to(device), self.norm, basis)


@dataclass(frozen=True)
class CodebookSpec:
    """A layer's flushed blocks as the codebook kernel reads them (`Method.codebook_spec`)."""

    key: CodedPart
    value: CodedPart

    def to(self, device) -> "CodebookSpec":
        return CodebookSpec(self.key.to(device), self.value.to(device))


@dataclass
class CodebookLayer:
    kcodes: torch.Tensor  # (B, H, CAPT, KW) int32
    knorm: torch.Tensor | None  # (B, H, CAPT) float16
    vcodes: torch.Tensor
    vnorm: torch.Tensor | None
    ksink: torch.Tensor  # (B, H, S, d) float16, model's basis
    vsink: torch.Tensor
    kres: torch.Tensor  # (B, H, CAPR, d) float16, model's basis
    vres: torch.Tensor
    length: int  # flushed tokens
    residual: int  # tokens in the residual window
    sinks: int  # leading flushed tokens read from ksink / vsink
    spec: CodebookSpec
    head_map: torch.Tensor | None = None  # (H,) int32: the model's KV head of each of this layer's heads
    kv_heads: int = 0  # the model's KV heads where `head_map` picks some of them (0: this layer's own)

    @property
    def head_dim(self) -> int:
        return self.kres.shape[-1]


def decode_part(codes: torch.Tensor, norm: torch.Tensor | None, part: CodedPart, head_dim: int,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Vectors (B, H, T, d) in the model's basis from codes (B, H, T, W) and norms (B, H, T): norm · y B."""
    b, h, t = codes.shape[:3]
    count = head_dim // part.dim
    c = unpack_stream(codes, part.bits, count)  # (B, H, T, count)
    book = part.book.to(device=codes.device, dtype=dtype)
    book = book.expand(h, *book.shape[1:]) if book.shape[0] == 1 else book  # (H, P, E, dim)
    pos = torch.arange(count, device=codes.device) if part.per_position else torch.zeros(count, dtype=torch.long,
                                                                                          device=codes.device)
    heads = torch.arange(h, device=codes.device).view(1, h, 1, 1)
    y = book[heads, pos.view(1, 1, 1, count), c].reshape(b, h, t, head_dim)  # (B, H, T, count, dim) -> d
    if part.basis is not None:
        basis = part.basis.to(device=codes.device, dtype=dtype)
        basis = basis.expand(h, *basis.shape[1:]) if basis.shape[0] == 1 else basis
        y = torch.einsum("bhti,hic->bhtc", y, basis)
    return y * norm.to(dtype)[..., None] if part.norm else y


def append_block(layer: CodebookLayer | None, spec: CodebookSpec, kcodes: torch.Tensor, knorm: torch.Tensor | None,
                 vcodes: torch.Tensor, vnorm: torch.Tensor | None, sink_k: torch.Tensor, sink_v: torch.Tensor,
                 residual_k: torch.Tensor, residual_v: torch.Tensor) -> CodebookLayer:
    """`layer` with more flushed tokens: code rows (B, H, T, W) int32 and norms (B, H, T) float16 (None where the
    part has none), and the float16 sink tokens among them ((B, H, 0, d) when none); buffers grow by doubling
    and the residual window is replaced. Sinks and residual in the model's basis."""
    if layer is None:
        empty = lambda x: None if x is None else x.new_zeros(*x.shape[:2], 0, *x.shape[3:])  # noqa: E731
        layer = CodebookLayer(empty(kcodes), empty(knorm), empty(vcodes), empty(vnorm), empty(residual_k).half(),
                              empty(residual_v).half(), residual_k, residual_v, 0, 0, 0, spec)
    layer.kcodes = grow(layer.kcodes, kcodes, layer.length)
    layer.vcodes = grow(layer.vcodes, vcodes, layer.length)
    if knorm is not None:
        layer.knorm = grow(layer.knorm, knorm, layer.length)
    if vnorm is not None:
        layer.vnorm = grow(layer.vnorm, vnorm, layer.length)
    take_rows(layer, kcodes.shape[2], sink_k, sink_v, residual_k, residual_v)
    return layer


def flushed_kv(layer: CodebookLayer, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The flushed tokens dequantized (B, H, length, d) in the model's basis, the sinks as held: the cache a
    reference path reads when a step cannot use the kernel."""
    n, d, spec = layer.length, layer.head_dim, layer.spec
    knorm = None if layer.knorm is None else layer.knorm[:, :, :n]
    vnorm = None if layer.vnorm is None else layer.vnorm[:, :, :n]
    k = decode_part(layer.kcodes[:, :, :n], knorm, spec.key, d, dtype)
    v = decode_part(layer.vcodes[:, :, :n], vnorm, spec.value, d, dtype)
    s = layer.sinks
    k[:, :, :s], v[:, :, :s] = layer.ksink[:, :, :s].to(dtype), layer.vsink[:, :, :s].to(dtype)
    return k, v


def reference_decode(q: torch.Tensor, layer: CodebookLayer, scaling: float) -> torch.Tensor:
    """Attention of one query per head, q (B, Hq, d) in the model's basis, over `layer` (all of q's heads belong to
    its KV heads): (B, Hq, d) float64."""
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    k, v = flushed_kv(layer, torch.float64)
    k = torch.cat([k, layer.kres[:, :, : layer.residual].double()], 2)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].double()], 2)
    qm = q.double().reshape(b, hkv, hq // hkv, d)
    scores = torch.einsum("bjgd,bjtd->bjgt", qm, k) * scaling
    p = torch.softmax(scores, -1)
    return torch.einsum("bjgt,bjtd->bjgd", p, v).reshape(b, hq, d)
