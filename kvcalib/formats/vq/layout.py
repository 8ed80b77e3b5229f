"""The VecInfer cache layout a fused decode kernel reads, and its float64 torch reference.

Used by vecinfer (`VQCoded.vq_books` in `coded.py`, `VecInfer`'s).

The kernel (`vq_decode.cu` in this folder, launched by `kvcalib.formats.vq.launch`) reads this layout;
this module fixes what it reads and computes, from the definition, what it must return, so that the
kernel is tested against it (tests/test_vq_kernel_gpu.py) the way the INT2 kernel is tested against
`kvcalib.formats.int2.layout.reference_decode`.

`VQLayer` holds one layer's VecInfer cache (`kvcalib.methods.vecinfer`) in capacity-sized buffers:

| what     | dtype   | shape                  | meaning                                                        |
|----------|---------|------------------------|----------------------------------------------------------------|
| `kcodes` | uint8   | `(B, Hkv, CAPT, Rk)`   | each flushed token's key codes, `kvcalib.vq`'s bitstream rows  |
| `vcodes` | uint8   | `(B, Hkv, CAPT, Rv)`   | the same for values                                            |
| `kbook`  | float16 | `(G, 2^Mk, Nk)`        | key codebook, G = 1 (per layer) or Hkv (per KV head)           |
| `vbook`  | float16 | `(G, 2^Mv, Nv)`        | value codebook                                                 |
| `smooth` | float16 | `(Hkv, d)` or None     | the keys' smoothing λ                                          |
| `ksink`  | float16 | `(B, Hkv, S, d)`       | the first S tokens' keys in float16, as they came in           |
| `vsink`  | float16 | `(B, Hkv, S, d)`       | their values in float16                                        |
| `kres`   | float16 | `(B, Hkv, CAPR, d)`    | the residual window's keys, as they came in                    |
| `vres`   | float16 | `(B, Hkv, CAPR, d)`    | its values                                                     |

`length` flushed tokens (their first `sinks` read from `ksink`/`vsink` instead of their codes, which are
stored all the same, as the method counts them), `residual` tokens in the window.

Two bases. VecInfer codes k̃ = (k / λ) H (`keys_to_codec` below; H the Hadamard rotation when `hadamard`, else
the identity), and a query meets the coded keys as q̃ = (q λ) H (`queries_to_codec`), so q̃ · k̃ = q · k.
The kernel takes q as the model gives it (float16 or bfloat16) and computes q̃ itself, in float32; the
sinks and the residual are held as they came in, in the model's basis, and meet q itself: the runtime
transforms nothing per step. Values are coded as they are: the output needs no transform back.

What the kernel computes, per query head h of KV head j, with c = d / Nk key sub-vectors:
- the table LUT[i, e] = q̃_h[i Nk : (i + 1) Nk] · kbook[g, e] (g = 0, or j per head), once (the kernel
  takes these products on the tensor cores, per token, from the gathered centroids: the same sums);
- the score of a flushed token t: scale Σ_i LUT[i, code_i(t)], or q_h · ksink[t] for t < sinks;
  of a residual token: q_h · kres[t];
- softmax over all of them; the output sums, per value sub-vector i, p_t vbook[g, code_i(t)] (or
  p_t vsink[t]) and p_t vres[t].
`reference_decode` is that computation in float64; attention over the dequantized cache, keys taken back to
the model's basis, gives the same up to float64 round-off (tests/test_vq_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import vq
from ...hadamard import rotate
from ..rows import grow, take_rows


# The codec's bases (module docstring): VecInfer's method codes keys with these, the layout holds them so.
def keys_to_codec(k: torch.Tensor, smooth: torch.Tensor | None, hadamard: bool) -> torch.Tensor:
    """k̃ = (k / λ) H for keys (B, Hkv, T, d)."""
    k = k.float()
    if smooth is not None:
        k = k / smooth.float()[:, None, :]
    return rotate(k) if hadamard else k


def keys_from_codec(k: torch.Tensor, smooth: torch.Tensor | None, hadamard: bool) -> torch.Tensor:
    """Inverse of `keys_to_codec`: H is symmetric and orthogonal, so H⁻¹ = H."""
    if hadamard:
        k = rotate(k)
    return k * smooth.float()[:, None, :] if smooth is not None else k


def queries_to_codec(q: torch.Tensor, smooth: torch.Tensor | None, hadamard: bool,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q̃ = (q λ) H for queries (B, Hq, T, d) in `dtype`; query head h reads KV head h // (Hq / Hkv)."""
    q = q.to(dtype)
    if smooth is not None:
        q = q * smooth.to(dtype).repeat_interleave(q.shape[1] // smooth.shape[0], dim=0)[:, None, :]
    return rotate(q) if hadamard else q


@dataclass(frozen=True)
class VQBooks:
    """What a method's flushed blocks are, as the VecInfer kernel sees them (`VQCoded.vq_books`): one layer's
    codebooks and the keys' transform."""

    kbook: torch.Tensor  # (G, 2^Mk, Nk) float16
    vbook: torch.Tensor  # (G, 2^Mv, Nv) float16
    k_bits: int
    v_bits: int
    smooth: torch.Tensor | None  # (Hkv, d) float16
    hadamard: bool


@dataclass
class VQLayer:
    kcodes: torch.Tensor  # (B, Hkv, CAPT, Rk) uint8
    vcodes: torch.Tensor  # (B, Hkv, CAPT, Rv) uint8
    kbook: torch.Tensor  # (G, 2^Mk, Nk) float16
    vbook: torch.Tensor  # (G, 2^Mv, Nv) float16
    ksink: torch.Tensor  # (B, Hkv, S, d) float16, model's basis
    vsink: torch.Tensor
    kres: torch.Tensor  # (B, Hkv, CAPR, d) float16, model's basis
    vres: torch.Tensor
    length: int  # flushed tokens
    residual: int  # tokens in the residual window
    sinks: int  # leading flushed tokens read from ksink / vsink
    k_bits: int
    v_bits: int
    smooth: torch.Tensor | None = None  # (Hkv, d) float16: the keys' λ
    hadamard: bool = True

    @property
    def head_dim(self) -> int:
        return self.kres.shape[-1]

    def codes(self, which: str) -> torch.Tensor:
        """The flushed tokens' codes (B, Hkv, length, c) int64 of keys or values."""
        packed, book, bits = (self.kcodes, self.kbook, self.k_bits) if which == "k" else (self.vcodes, self.vbook, self.v_bits)
        count = self.head_dim // book.shape[-1]
        if not self.length:
            return torch.zeros(*packed.shape[:2], 0, count, dtype=torch.int64, device=packed.device)
        return vq.unpack_codes(packed[:, :, : self.length], bits, count)


def append_block(layer: VQLayer | None, kcodes: torch.Tensor, vcodes: torch.Tensor, kbook: torch.Tensor,
                 vbook: torch.Tensor, k_bits: int, v_bits: int, sink_k: torch.Tensor, sink_v: torch.Tensor,
                 residual_k: torch.Tensor, residual_v: torch.Tensor, smooth: torch.Tensor | None = None,
                 hadamard: bool = True) -> VQLayer:
    """`layer` with more flushed tokens: packed code rows (B, Hkv, T, R) of `kvcalib.vq`, and the float16
    sink tokens among them ((B, Hkv, 0, d) when none); buffers grow by doubling and the residual window is
    replaced. Sinks and residual in the model's basis; `smooth` and `hadamard` (the keys' transform) are
    taken when the layer is created."""
    if layer is None:
        empty = lambda x: x.new_zeros(*x.shape[:2], 0, x.shape[3])  # noqa: E731
        layer = VQLayer(empty(kcodes), empty(vcodes), kbook, vbook, empty(residual_k).half(), empty(residual_v).half(),
                        residual_k, residual_v, 0, 0, 0, k_bits, v_bits, smooth, hadamard)
    layer.kcodes = grow(layer.kcodes, kcodes, layer.length)
    layer.vcodes = grow(layer.vcodes, vcodes, layer.length)
    take_rows(layer, kcodes.shape[2], sink_k, sink_v, residual_k, residual_v)
    return layer


def flushed_kv(layer: VQLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The flushed tokens dequantized (B, Hkv, length, d) float32, keys back in the model's basis, the sinks
    as held: the cache a reference path reads when a step cannot use the kernel."""
    k = keys_from_codec(vq.decode(layer.codes("k"), layer.kbook.float()), layer.smooth, layer.hadamard)
    v = vq.decode(layer.codes("v"), layer.vbook.float())
    k[:, :, : layer.sinks], v[:, :, : layer.sinks] = layer.ksink.float(), layer.vsink.float()
    return k, v


def reference_decode(q: torch.Tensor, layer: VQLayer, scaling: float) -> torch.Tensor:
    """Attention of one query per head, q (B, Hq, d) in the model's basis, over `layer`: (B, Hq, d) float64,
    by the kernel's computation (module docstring) in float64."""
    b, hq, d = q.shape
    hkv, t, s = layer.kres.shape[1], layer.length, layer.sinks
    gqa = hq // hkv
    qm = q.double().reshape(b, hkv, gqa, d)
    qc = queries_to_codec(q[:, :, None], layer.smooth, layer.hadamard, torch.float64).reshape(b, hkv, gqa, d)
    kbook, vbook = layer.kbook.double(), layer.vbook.double()
    nk = kbook.shape[-1]
    # The books of each KV head: one shared (G = 1) or its own.
    kb = kbook.expand(hkv, *kbook.shape[1:]) if kbook.shape[0] == 1 else kbook
    vb = vbook.expand(hkv, *vbook.shape[1:]) if vbook.shape[0] == 1 else vbook
    lut = torch.einsum("bjgcn,jen->bjgce", qc.reshape(b, hkv, gqa, d // nk, nk), kb)  # (B, Hkv, GQA, c, 2^Mk)
    kc = layer.codes("k")  # (B, Hkv, T, c)
    index = kc.permute(0, 1, 3, 2)[:, :, None].expand(b, hkv, gqa, d // nk, t)
    flushed = lut.gather(-1, index).sum(3)  # (B, Hkv, GQA, T)
    if s:
        flushed[..., :s] = torch.einsum("bjgd,bjtd->bjgt", qm, layer.ksink[:, :, :s].double())
    residual = torch.einsum("bjgd,bjtd->bjgt", qm, layer.kres[:, :, : layer.residual].double())
    scores = torch.cat([flushed, residual], -1) * scaling
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    vc = layer.codes("v")  # (B, Hkv, T, c_v)
    heads = torch.arange(hkv, device=vc.device).view(1, hkv, 1, 1)
    v_flushed = vb[heads, vc].reshape(b, hkv, t, d)  # each sub-vector's centroid
    if s:
        v_flushed[:, :, :s] = layer.vsink[:, :, :s].double()
    v = torch.cat([v_flushed, layer.vres[:, :, : layer.residual].double()], 2)
    return torch.einsum("bjgt,bjtd->bjgd", p, v).reshape(b, hq, d)
