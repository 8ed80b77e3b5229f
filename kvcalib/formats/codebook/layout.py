"""The codebook layout a fused decode kernel reads (`codebook_decode.cu`, in this folder), and its float64 reference.

One layout for every format whose vectors are read back from codes through small tables: TurboQuant's scalar codes
(one codebook for every coordinate, or one per coordinate) and vector codes of D coordinates, VecInfer's vector codes,
and the affine codes of KIVI and OScaR (`zero + scale · code`, whose "book" is the levels 0 .. 2^b - 1); a norm per
token where the format stores one, and a basis. A plan (`methods/plan.py`) mixes them per KV head: its layer holds
one group of heads per pair of (key format, value format), each read by its own launch.

A part (keys or values) of a layer stores, per token and KV head, a vector x of d numbers as

    x = norm · y B,   y = the centroids of its codes, B the part's basis (d x d; the identity where None)

`CodedPart` says how: `bits` a code, `dim` coordinates a code (1: scalar), `book` (G, P, 2^bits, dim) float32 with
P = d / dim (a codebook per position: position i codes coordinates i dim .. (i + 1) dim - 1) or P = 1 (one shared
by every position), G = 1 or one per KV head; `norm` whether a norm is stored; `basis` (G, d, d) or None. An affine
part's book is the levels 0 .. 2^b - 1, and y_i = zero_i + scale_i · level: per channel over groups of
`token_group` tokens (KIVI's and OScaR's keys) or per token over groups of `channel_group` channels (their values).
- TurboQuant: B = Π (`methods.turboquant.rotation`), norms on, keys and values alike.
- VecInfer: values as coded (no norm, no basis); keys k = (y H) λ, so B = H diag(λ), one per KV head.
- KIVI: affine, no norm, no basis. OScaR: affine; keys with their per-token scale as the norm; B = H for both.

`CodebookLayer` holds one layer's cache in capacity-sized buffers: per group of heads (`CodedRows`)

| what     | dtype   | shape                   | meaning                                                              |
|----------|---------|-------------------------|----------------------------------------------------------------------|
| `kcodes` | int32   | `(B, Hg, CAPT, KW)`     | each flushed token's key codes, one bit stream (`quant.pack_stream`) |
| `knorm`  | float16 | `(B, Hg, CAPT)`         | its norm (None where the key part stores none)                       |
| `kscale` | float16 | `(B, Hg, CAPT / G, d)`  | an affine key part's scale per channel and group of G tokens         |
| `kzero`  | float16 | `(B, Hg, CAPT / G, d)`  | and its zero                                                         |
| `vcodes`, `vnorm` |  | as the keys'        | the same for values                                                  |
| `vscale` | float16 | `(B, Hg, CAPT, d / Gc)` | an affine value part's scale per token and group of Gc channels      |
| `vzero`  | float16 | `(B, Hg, CAPT, d / Gc)` | and its zero                                                         |

and, shared by the groups, indexed by the layer's KV head

| what     | dtype   | shape               | meaning                                                                  |
|----------|---------|---------------------|--------------------------------------------------------------------------|
| `ksink`  | float16 | `(B, H, S, d)`      | the first S tokens' keys as they came in (read instead of their codes)  |
| `vsink`  | float16 | `(B, H, S, d)`      | their values                                                             |
| `kres`   | float16 | `(B, H, CAPR, d)`   | the residual window's keys, as they came in                              |
| `vres`   | float16 | `(B, H, CAPR, d)`   | its values                                                               |

KW = ceil((d / dim) bits / 32). `length` flushed tokens (their first `sinks` read from the float16 sinks; their
codes are stored all the same, as the method counts them), `residual` tokens in the window. A group's `head_map`
(Hg,) int32 gives the layer's KV head of each of its heads (None: all of them, in order).

What the kernel computes, per query head h of KV head j, in float32:
- the score of a flushed token t: q_h · x_t = norm_t (q_h Bᵀ) · y_t (the query taken into the basis once), or
  q_h · ksink[t] for t < sinks; of a residual token: q_h · kres[t];
- softmax over all of them; the output Σ p_t norm_t y_t of the coded values, taken back by B once, plus
  Σ p_t vsink[t] and Σ p_t vres[t].
`reference_decode` computes the same in float64 over the dequantized cache (the two sums differ only by
round-off): the kernel's tests hold it to this (tests/test_codebook_kernel_gpu.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...quant import unpack_stream
from ..rows import grow, take_rows


@dataclass(frozen=True)
class CodedPart:
    """How keys or values are coded (module docstring)."""

    bits: int
    dim: int  # coordinates a code
    book: torch.Tensor  # (G, P, 2^bits, dim) float32; an affine part's: the levels (1, 1, 2^bits, 1)
    norm: bool
    basis: torch.Tensor | None = None  # (G, d, d) float32; None: the identity
    token_group: int = 0  # affine per channel over groups of this many tokens (0: not)
    channel_group: int = 0  # affine per token over groups of this many channels (0: not)

    @property
    def per_position(self) -> bool:
        return self.book.shape[1] > 1

    @property
    def affine(self) -> bool:
        return bool(self.token_group or self.channel_group)

    def words(self, head_dim: int) -> int:
        """int32 words of one token's codes."""
        return -(-(head_dim // self.dim) * self.bits // 32)

    def to(self, device) -> "CodedPart":
        basis = None if self.basis is None else self.basis.to(device)
        return dataclasses.replace(self, book=self.book.to(device), basis=basis)

    def heads(self, index: list[int]) -> "CodedPart":
        """This part for some of its KV heads (positions `index` of them): books and bases held per head sliced."""
        pick = lambda t: t if t is None or t.shape[0] == 1 else t[index].contiguous()  # noqa: E731
        return dataclasses.replace(self, book=pick(self.book), basis=pick(self.basis))


def affine_part(bits: int, *, token_group: int = 0, channel_group: int = 0, norm: bool = False,
                basis: torch.Tensor | None = None) -> CodedPart:
    """An affine part (`zero + scale · code`, KIVI's and OScaR's): its book the levels 0 .. 2^bits - 1."""
    levels = torch.arange(1 << bits, dtype=torch.float32).view(1, 1, -1, 1)
    return CodedPart(bits, 1, levels, norm, basis, token_group, channel_group)


@dataclass(frozen=True)
class CodebookSpec:
    """A layer's flushed blocks as the codebook kernel reads them (`CodebookCoded.codebook_spec`, `coded.py`)."""

    key: CodedPart
    value: CodedPart

    def to(self, device) -> "CodebookSpec":
        return CodebookSpec(self.key.to(device), self.value.to(device))


@dataclass(frozen=True)
class HeadGroup:
    """KV heads of a layer read by one launch (`heads`: the layer's heads in the group's order; None: all of them)
    and how their blocks are coded (`CodebookCoded.codebook_groups`)."""

    heads: tuple[int, ...] | None
    spec: CodebookSpec

    def to(self, device) -> "HeadGroup":
        return HeadGroup(self.heads, self.spec.to(device))


BUFFERS = ("kcodes", "knorm", "kscale", "kzero", "vcodes", "vnorm", "vscale", "vzero")


@dataclass
class CodedBlock:
    """One group's flushed tokens as a method's flush codes them (`CodebookCoded.codebook_parts`): code rows (B, Hg, T, W)
    int32, norms (B, Hg, T) float16, an affine part's scales and zeros (module docstring); None where the part has
    none."""

    kcodes: torch.Tensor
    knorm: torch.Tensor | None
    vcodes: torch.Tensor
    vnorm: torch.Tensor | None
    kscale: torch.Tensor | None = None
    kzero: torch.Tensor | None = None
    vscale: torch.Tensor | None = None
    vzero: torch.Tensor | None = None

    def present(self) -> list[str]:
        """The names of the buffers it has, in `BUFFERS`' order."""
        return [n for n in BUFFERS if getattr(self, n) is not None]


@dataclass
class CodedRows(CodedBlock):
    """One group's buffers (a `CodedBlock`'s, capacity-sized) and what reads them."""

    spec: CodebookSpec | None = None
    head_map: torch.Tensor | None = None  # (Hg,) int32 on the buffers' device: the layer's KV head of each

    def unit(self, name: str) -> int:
        """Tokens one row of buffer `name` stands for along dim 2: an affine key part's G for its scales, else 1."""
        return self.spec.key.token_group if name in ("kscale", "kzero") and self.spec.key.token_group else 1


@dataclass
class CodebookLayer:
    groups: list[CodedRows]
    ksink: torch.Tensor  # (B, H, S, d) float16, model's basis
    vsink: torch.Tensor
    kres: torch.Tensor  # (B, H, CAPR, d) float16, model's basis
    vres: torch.Tensor
    length: int  # flushed tokens
    residual: int  # tokens in the residual window
    sinks: int  # leading flushed tokens read from ksink / vsink

    @property
    def head_dim(self) -> int:
        return self.kres.shape[-1]

    @property
    def specs(self) -> list[CodebookSpec]:
        return [g.spec for g in self.groups]


def head_map(heads: tuple[int, ...] | None, device) -> torch.Tensor | None:
    return None if heads is None else torch.tensor(heads, dtype=torch.int32, device=device)


def _expand(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.expand(h, *t.shape[1:]) if t.shape[0] == 1 else t


def decode_part(codes: torch.Tensor, norm: torch.Tensor | None, part: CodedPart, head_dim: int,
                dtype: torch.dtype = torch.float64, scale: torch.Tensor | None = None,
                zero: torch.Tensor | None = None) -> torch.Tensor:
    """Vectors (B, H, T, d) in the model's basis from codes (B, H, T, W), norms (B, H, T) and, for an affine part,
    its scales and zeros: norm · y B."""
    b, h, t = codes.shape[:3]
    count = head_dim // part.dim
    c = unpack_stream(codes, part.bits, count)  # (B, H, T, count)
    if part.affine:
        s, z = scale.to(dtype), zero.to(dtype)
        if part.token_group:  # (B, H, T / G, d): each row for G tokens
            s, z = s.repeat_interleave(part.token_group, 2)[:, :, :t], z.repeat_interleave(part.token_group, 2)[:, :, :t]
        else:  # (B, H, T, d / Gc): each for Gc channels
            s, z = s.repeat_interleave(part.channel_group, -1), z.repeat_interleave(part.channel_group, -1)
        y = z + s * c.to(dtype)
    else:
        book = _expand(part.book.to(device=codes.device, dtype=dtype), h)  # (H, P, E, dim)
        pos = (torch.arange(count, device=codes.device) if part.per_position
               else torch.zeros(count, dtype=torch.long, device=codes.device))
        heads = torch.arange(h, device=codes.device).view(1, h, 1, 1)
        y = book[heads, pos.view(1, 1, 1, count), c].reshape(b, h, t, head_dim)  # (B, H, T, count, dim) -> d
    if part.basis is not None:
        y = torch.einsum("bhti,hic->bhtc", y, _expand(part.basis.to(device=codes.device, dtype=dtype), h))
    return y * norm.to(dtype)[..., None] if part.norm else y


def rows_like(group: HeadGroup, block: CodedBlock, batch: int, tokens: int, device) -> CodedRows:
    """A group's buffers for `batch` sequences of `tokens` flushed tokens, zeros, shaped and typed as `block`'s (the
    buffers it has), on `device`."""
    rows = CodedRows(None, None, None, None, spec=group.spec.to(device), head_map=head_map(group.heads, device))
    for n in block.present():
        x = getattr(block, n)
        setattr(rows, n, torch.zeros(batch, x.shape[1], tokens // rows.unit(n), *x.shape[3:], dtype=x.dtype,
                                     device=device))
    return rows


def new_layer(groups: list[HeadGroup], blocks: list[CodedBlock], kv_heads: int, head_dim: int) -> CodebookLayer:
    """An empty layer (no tokens) with buffers shaped as these blocks', on their device."""
    device, batch = blocks[0].kcodes.device, blocks[0].kcodes.shape[0]
    rows = [rows_like(group, block, batch, 0, device) for group, block in zip(groups, blocks)]
    none = torch.zeros(batch, kv_heads, 0, head_dim, dtype=torch.float16, device=device)
    return CodebookLayer(rows, none, none.clone(), none.clone(), none.clone(), 0, 0, 0)


def append_block(layer: CodebookLayer | None, groups: list[HeadGroup], blocks: list[CodedBlock],
                 sink_k: torch.Tensor, sink_v: torch.Tensor, residual_k: torch.Tensor,
                 residual_v: torch.Tensor) -> CodebookLayer:
    """`layer` with more flushed tokens: each group's block (`CodedBlock`), and the float16 sink tokens among them
    ((B, H, 0, d) when none); buffers grow by doubling and the residual window is replaced. Sinks and residual in
    the model's basis, every head of the layer."""
    if layer is None:
        layer = new_layer(groups, blocks, residual_k.shape[1], residual_k.shape[-1])
    t = blocks[0].kcodes.shape[2]
    for rows, block in zip(layer.groups, blocks):
        for n in block.present():
            unit = rows.unit(n)
            setattr(rows, n, grow(getattr(rows, n), getattr(block, n), layer.length // unit))
    take_rows(layer, t, sink_k, sink_v, residual_k, residual_v)
    return layer


def group_kv(rows: CodedRows, n: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's first n flushed tokens dequantized, (B, Hg, n, d) in the model's basis (sinks as coded)."""
    spec = rows.spec
    cut = lambda x, unit=1: None if x is None else x[:, :, : -(-n // unit)]  # noqa: E731
    kg = spec.key.token_group or 1
    k = decode_part(rows.kcodes[:, :, :n], cut(rows.knorm), spec.key, head_dim, dtype, cut(rows.kscale, kg),
                    cut(rows.kzero, kg))
    v = decode_part(rows.vcodes[:, :, :n], cut(rows.vnorm), spec.value, head_dim, dtype, cut(rows.vscale),
                    cut(rows.vzero))
    return k, v


def flushed_kv(layer: CodebookLayer, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The flushed tokens dequantized (B, H, length, d) in the model's basis, the sinks as held: the cache a
    reference path reads when a step cannot use the kernel."""
    n, d = layer.length, layer.head_dim
    b, h = layer.kres.shape[:2]
    k = torch.empty(b, h, n, d, dtype=dtype, device=layer.kres.device)
    v = torch.empty_like(k)
    for rows in layer.groups:
        kg, vg = group_kv(rows, n, d, dtype)
        heads = slice(None) if rows.head_map is None else rows.head_map.long()
        k[:, heads], v[:, heads] = kg, vg
    s = layer.sinks
    k[:, :, :s], v[:, :, :s] = layer.ksink[:, :, :s].to(dtype), layer.vsink[:, :, :s].to(dtype)
    return k, v


def reference_decode(q: torch.Tensor, layer: CodebookLayer, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of one query per head, q (B, Hq, d) in the model's basis, over `layer`: (B, Hq, d) float64; the
    scores capped as softcap tanh(s / softcap) where given (Gemma 2)."""
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    k, v = flushed_kv(layer, torch.float64)
    k = torch.cat([k, layer.kres[:, :, : layer.residual].double()], 2)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].double()], 2)
    qm = q.double().reshape(b, hkv, hq // hkv, d)
    scores = torch.einsum("bjgd,bjtd->bjgt", qm, k) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    p = torch.softmax(scores, -1)
    return torch.einsum("bjgt,bjtd->bjgd", p, v).reshape(b, hq, d)
