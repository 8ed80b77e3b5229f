"""The VecInfer cache layout a fused decode kernel reads (issue 18), and its float64 torch reference.

The kernel (`kernels_cupy/vq_decode.cu`, launched by `kvcalib.runtime.vq_kernel`) reads this layout;
this module fixes what it reads and computes, from the definition, what it must return, so that the
kernel is tested against it (tests/test_vq_kernel_gpu.py) the way the INT2 kernel is tested against
`kvcalib.int2_layout.reference_decode`.

`VQLayer` holds one layer's VecInfer cache (`kvcalib.methods.vecinfer`) in capacity-sized buffers:

| what     | dtype   | shape                  | meaning                                                        |
|----------|---------|------------------------|----------------------------------------------------------------|
| `kcodes` | uint8   | `(B, Hkv, CAPT, Rk)`   | each flushed token's key codes, `kvcalib.vq`'s bitstream rows  |
| `vcodes` | uint8   | `(B, Hkv, CAPT, Rv)`   | the same for values                                            |
| `kbook`  | float16 | `(G, 2^Mk, Nk)`        | key codebook, G = 1 (per layer) or Hkv (per KV head)           |
| `vbook`  | float16 | `(G, 2^Mv, Nv)`        | value codebook                                                 |
| `ksink`  | float16 | `(B, Hkv, S, d)`       | the first S tokens' keys in float16, in the codec basis        |
| `vsink`  | float16 | `(B, Hkv, S, d)`       | their values in float16                                        |
| `kres`   | float16 | `(B, Hkv, CAPR, d)`    | the residual window's keys, in the codec basis                 |
| `vres`   | float16 | `(B, Hkv, CAPR, d)`    | its values                                                     |

`length` flushed tokens (their first `sinks` read from `ksink`/`vsink` instead of their codes, which are
stored all the same, as the method counts them), `residual` tokens in the window.

The codec basis: VecInfer codes k̃ = (k / λ) H (`keys_to_codec`), and a query meets the keys there as
q̃ = (q λ) H (`queries_to_codec`), so q̃ · k̃ = q · k. The layout holds every key in that basis (the
residual's and the sinks' once, when they are stored, rounded to float16 after the transform, as the
static cache holds OScaR's residual), and the caller hands the kernel q̃: the query's transform is one
small product per step, the keys' none. Values are coded as they are: the output needs no transform back.

What the kernel computes, per query head h of KV head j, with c = d / Nk key sub-vectors:
- the table LUT[i, e] = q̃_h[i Nk : (i + 1) Nk] · kbook[g, e] (g = 0, or j per head), once;
- the score of a flushed token t: scale Σ_i LUT[i, code_i(t)], or q̃_h · ksink[t] for t < sinks;
  of a residual token: q̃_h · kres[t];
- softmax over all of them; the output sums, per value sub-vector i, p_t vbook[g, code_i(t)] (or
  p_t vsink[t]) and p_t vres[t].
`reference_decode` is that computation in float64; `VecInfer.decode` over the dequantized cache gives
the same up to float64 round-off (tests/test_vq_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import vq
from .int2_layout import grow


@dataclass
class VQLayer:
    kcodes: torch.Tensor  # (B, Hkv, CAPT, Rk) uint8
    vcodes: torch.Tensor  # (B, Hkv, CAPT, Rv) uint8
    kbook: torch.Tensor  # (G, 2^Mk, Nk) float16
    vbook: torch.Tensor  # (G, 2^Mv, Nv) float16
    ksink: torch.Tensor  # (B, Hkv, S, d) float16, codec basis
    vsink: torch.Tensor
    kres: torch.Tensor  # (B, Hkv, CAPR, d) float16, codec basis
    vres: torch.Tensor
    length: int  # flushed tokens
    residual: int  # tokens in the residual window
    sinks: int  # leading flushed tokens read from ksink / vsink
    k_bits: int
    v_bits: int

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
                 residual_k: torch.Tensor, residual_v: torch.Tensor) -> VQLayer:
    """`layer` with more flushed tokens: packed code rows (B, Hkv, T, R) of `kvcalib.vq`, and the float16
    sink tokens among them (keys in the codec basis; (B, Hkv, 0, d) when none); buffers grow by doubling
    and the residual window (keys in the codec basis) is replaced."""
    if layer is None:
        empty = lambda x: x.new_zeros(*x.shape[:2], 0, x.shape[3])  # noqa: E731
        layer = VQLayer(empty(kcodes), empty(vcodes), kbook, vbook, empty(residual_k), empty(residual_v),
                        residual_k, residual_v, 0, 0, 0, k_bits, v_bits)
    layer.kcodes = grow(layer.kcodes, kcodes, layer.length)
    layer.vcodes = grow(layer.vcodes, vcodes, layer.length)
    if sink_k.shape[2]:
        layer.ksink = torch.cat([layer.ksink[:, :, : layer.sinks], sink_k.half()], 2)
        layer.vsink = torch.cat([layer.vsink[:, :, : layer.sinks], sink_v.half()], 2)
        layer.sinks += sink_k.shape[2]
    layer.length += kcodes.shape[2]
    layer.kres, layer.vres, layer.residual = residual_k.half(), residual_v.half(), residual_k.shape[2]
    return layer


def reference_decode(q_codec: torch.Tensor, layer: VQLayer, scaling: float) -> torch.Tensor:
    """Attention of one query per head, q̃ (B, Hq, d) in the codec basis, over `layer`: (B, Hq, d) float64,
    by the kernel's computation (module docstring) in float64."""
    b, hq, d = q_codec.shape
    hkv, t, s = layer.kres.shape[1], layer.length, layer.sinks
    gqa = hq // hkv
    q = q_codec.double().reshape(b, hkv, gqa, d)
    kbook, vbook = layer.kbook.double(), layer.vbook.double()
    nk = kbook.shape[-1]
    # The books of each KV head: one shared (G = 1) or its own.
    kb = kbook.expand(hkv, *kbook.shape[1:]) if kbook.shape[0] == 1 else kbook
    vb = vbook.expand(hkv, *vbook.shape[1:]) if vbook.shape[0] == 1 else vbook
    lut = torch.einsum("bjgcn,jen->bjgce", q.reshape(b, hkv, gqa, d // nk, nk), kb)  # (B, Hkv, GQA, c, 2^Mk)
    kc = layer.codes("k")  # (B, Hkv, T, c)
    index = kc.permute(0, 1, 3, 2)[:, :, None].expand(b, hkv, gqa, d // nk, t)
    flushed = lut.gather(-1, index).sum(3)  # (B, Hkv, GQA, T)
    if s:
        flushed[..., :s] = torch.einsum("bjgd,bjtd->bjgt", q, layer.ksink[:, :, :s].double())
    residual = torch.einsum("bjgd,bjtd->bjgt", q, layer.kres[:, :, : layer.residual].double())
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
