"""The INT2 cache layout the fused decode kernel reads (`int2_decode.cu`, in this folder), and its torch reference.

Used by kivi, oscar and kvlinc (`Int2Coded.int2_spec` in `coded.py`, `Kivi`'s, which the other two inherit; at 2 bits).

`PackedLayer` holds the INT2 cache of `kvcalib.quant` (keys axis="tokens", values axis="channels":
the same scales, zero points and buffer shapes), with optional per-token key norms (OScaR) and the
float16 residual window, in capacity-sized buffers so that a runtime can append in place; `length`
and `residual` say how much is filled. Only the order of the 2-bit codes inside each block of 16
tokens differs: the "tensor-core order" below, written once per flushed block by `append_block`.

Tensor-core order (keys and values alike: a block of 16 tokens x D channels is D int32 words)
-------------------------------------------------------------------------------------------
Word `w = lane * (D / 32) + i` (lane = 4 g + t of a warp, i < D/32) holds 16 codes, 8 per 16-bit
half: half `h`, position `p` at bits `16 h + 2 p`. With r = 8 i + p, a = r % 4, n = r // 4:
- keys:   token `g + 8 (a % 2)`,        channel `16 n + 8 (a // 2) + 2 t + h`;
- values: token `2 t + h + 8 (a // 2)`, channel `16 n + g + 8 (a % 2)`.
Each lane thus reads D/32 consecutive words holding exactly the elements of its mma.m16n8k16 A
fragments (keys 16 tokens x 16 channels, values 16 channels x 16 tokens; register a of k-slice or
row block n), and one AND-OR per pair of elements turns them into half2(offset + code) (see
`int2_decode.cu`). Key words of block n are row n of `kcodes` (B, Hkv, CAPT/16, D); value words
fill `vcodes` (B, Hkv, CAPT, D/16) row-major, so block n holds tokens 16n..16n+15. Value
scales and zeros (B, Hkv, CAPT, D/GV) hold each block of 16 tokens as (D/GV, 16): group-major, so a
lane reads the scales of its two tokens as one half2.

A method that stores blocks in the Hadamard basis (OScaR, KVLinC) says so in `PackedLayer.rotated_keys`
and `rotated_values`; the query, the float16 residual window, the correction terms and the output stay
in the model's basis (the kernel rotates the query for the flushed blocks and their partial output back).

`reference_decode` dequantizes and attends in float64: the reference the kernel
(`kvcalib.formats.int2.launch.fused_decode`) is tested against; both take KVLinC's correction terms
(numerator (B, Hq, D) and denominator (B, Hq), in exp units, in the model's basis) when given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...hadamard import rotate
from ...quant import Quantized, dequantize_codes, low_words, quantize, unpack_bits
from ..rows import grow

KERNEL = str(Path(__file__).with_name("reorder.cu"))  # the layout's reorder kernel, beside it

TILE = 128  # the kernel's split alignment in tokens, and the smallest buffer `pack` allocates


@dataclass(frozen=True)
class Int2Spec:
    """What a method's flushed blocks are, as the kernel sees them (`Int2Coded.int2_spec`)."""

    bits: int
    group_size: int  # key group, tokens
    value_group_size: int  # value group, channels
    block: int  # tokens per flush
    sink: int = 0  # leading tokens kept in float16 beside their codes


@functools.lru_cache(maxsize=4)
def _order(d: int, device: str) -> tuple[torch.Tensor, ...]:
    """(key token, key channel, value token, value channel, bit shift) per (word, half, position)."""
    lane = torch.arange(32).view(32, 1, 1, 1)
    g, t = lane // 4, lane % 4
    i = torch.arange(d // 32).view(1, -1, 1, 1)
    h = torch.arange(2).view(1, 1, 2, 1)
    p = torch.arange(8).view(1, 1, 1, 8)
    r = 8 * i + p
    full = lambda x: x.expand(32, d // 32, 2, 8).reshape(d, 16).to(device)  # noqa: E731
    a, blk = r % 4, r // 4
    return (full(g + 8 * (a % 2)), full(16 * blk + 8 * (a // 2) + 2 * t + h),
            full(2 * t + h + 8 * (a // 2)), full(16 * blk + g + 8 * (a % 2)), full(16 * h + 2 * p))


def to_tensor_core_order(codes: torch.Tensor, which: str) -> torch.Tensor:
    """2-bit codes (..., T, D), T a multiple of 16, to the words (..., T/16, D) int32 of the order above."""
    *lead, t, d = codes.shape
    ktok, kch, vtok, vch, shift = _order(d, str(codes.device))
    tok, ch = (ktok, kch) if which == "k" else (vtok, vch)
    blocks = codes.reshape(*lead, t // 16, 16, d).to(torch.int64)
    words = (blocks[..., tok, ch] << shift).sum(-1)
    return low_words(words)


def from_tensor_core_order(words: torch.Tensor, which: str) -> torch.Tensor:
    """Inverse of `to_tensor_core_order`: words (..., T/16, D) to codes (..., T, D) int64."""
    *lead, n, d = words.shape
    ktok, kch, vtok, vch, shift = _order(d, str(words.device))
    tok, ch = (ktok, kch) if which == "k" else (vtok, vch)
    bits = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shift) & 3  # (..., n, D, 16)
    codes = torch.empty(*lead, n, 16, d, dtype=torch.int64, device=words.device)
    codes[..., tok, ch] = bits
    return codes.reshape(*lead, n * 16, d)


def _block_transpose(x: torch.Tensor) -> torch.Tensor:
    """Per-token rows (..., T, n) stored per block of 16 tokens as (n, 16): same shape, new order."""
    *lead, t, n = x.shape
    return x.reshape(*lead, t // 16, 16, n).transpose(-1, -2).reshape(*lead, t, n)


def _block_untranspose(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `_block_transpose`."""
    *lead, t, n = x.shape
    return x.reshape(*lead, t // 16, n, 16).transpose(-1, -2).reshape(*lead, t, n)


def reorder_packed(words: torch.Tensor, which: str) -> torch.Tensor:
    """2-bit words of kvcalib.quant (keys (..., T/16, D) packed along tokens, values (..., T, D/16)
    along channels) to the tensor-core order, as (..., T/16, D): `reorder.cu` (in this folder) on CUDA,
    `to_tensor_core_order` elsewhere and under `torch.compile` (the two are tested equal bit for bit)."""
    if which == "k":
        *lead, nb, d = words.shape
    else:
        *lead, t, w = words.shape
        nb, d = t // 16, 16 * w
    if not words.is_cuda or torch.compiler.is_compiling():
        codes = unpack_bits(words, 2, -2, 16 * nb) if which == "k" else unpack_bits(words, 2, -1, d)
        return to_tensor_core_order(codes, which)
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    src = words.contiguous()
    out = torch.empty(*lead, nb, d, dtype=torch.int32, device=words.device)
    total = out.numel()
    if total:
        with torch_stream(words.device):
            # Thread per destination word, 256 per block.
            launch(kernel(KERNEL, {"D": d, "VALUES": int(which == "v")}, "reorder"), (-(-total // 256),), (256,),
                   (cupy.uint64(src.data_ptr()), cupy.uint64(out.data_ptr()), cupy.int64(total)))
    return out


def kernel_parts(kq: Quantized, vq: Quantized) -> tuple[torch.Tensor, ...]:
    """Key codes, value codes, value scales and zeros of kvcalib.quant in tensor-core order."""
    kw = reorder_packed(kq.codes, "k")
    vw = reorder_packed(vq.codes, "v")
    vw = vw.reshape(*vw.shape[:-2], vw.shape[-2] * 16, vw.shape[-1] // 16)
    return kw, vw, _block_transpose(vq.scale), _block_transpose(vq.zero)


@dataclass
class PackedLayer:
    kcodes: torch.Tensor  # (B, Hkv, CAPT/16, D) int32, tensor-core order
    kscale: torch.Tensor  # (B, Hkv, CAPT/G, D) fp16
    kzero: torch.Tensor
    vcodes: torch.Tensor  # (B, Hkv, CAPT, D/16) int32, tensor-core order
    vscale: torch.Tensor  # (B, Hkv, CAPT, D/GV) fp16
    vzero: torch.Tensor
    kres: torch.Tensor  # (B, Hkv, CAPR, D) fp16
    vres: torch.Tensor
    length: int  # flushed tokens
    residual: int  # tokens in the residual window
    group_size: int
    value_group_size: int
    knorm: torch.Tensor | None = None  # (B, Hkv, CAPT) fp16, OScaR
    # The flushed keys (values) are stored in the normalized Hadamard basis (OScaR's keys and values,
    # KVLinC's values); the query, the residual window and the output are in the model's basis.
    rotated_keys: bool = False
    rotated_values: bool = False

    @property
    def head_dim(self) -> int:
        return self.kcodes.shape[-1]

    def flushed_kv(self, model_basis: bool = False, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized flushed keys and values in `dtype`, norms applied: in the basis they are stored in,
        or with `model_basis` rotated back where they are stored rotated (in `dtype`)."""
        k, v = (x.to(dtype) for x in self._flushed_stored())
        if model_basis:
            k = rotate(k) if self.rotated_keys else k
            v = rotate(v) if self.rotated_values else v
        return k, v

    def _flushed_stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        t, g, d = self.length, self.group_size, self.head_dim
        kc = from_tensor_core_order(self.kcodes[:, :, : t // 16], "k")
        vc = from_tensor_core_order(self.vcodes[:, :, :t].reshape(*self.vcodes.shape[:2], t // 16, d), "v")
        k = dequantize_codes(kc, self.kscale[:, :, : t // g], self.kzero[:, :, : t // g], g, "tokens")
        v = dequantize_codes(vc, _block_untranspose(self.vscale[:, :, :t]), _block_untranspose(self.vzero[:, :, :t]),
                             self.value_group_size, "channels")
        if self.knorm is not None:
            k = k * self.knorm[:, :, :t, None].float()
        return k, v


def append_block(layer: PackedLayer | None, kq: Quantized, vq: Quantized, knorm: torch.Tensor | None,
                 residual_k: torch.Tensor, residual_v: torch.Tensor, rotated_keys: bool = False,
                 rotated_values: bool = False) -> PackedLayer:
    """`layer` with more flushed tokens (2-bit `Quantized` keys and values of kvcalib.quant, optional
    per-token key norms), growing its buffers by doubling; the residual window is replaced. The
    `rotated_*` flags describe a new layer's blocks (`PackedLayer`)."""
    t = kq.length
    kcodes, vcodes, vscale, vzero = kernel_parts(kq, vq)
    if layer is None:
        empty = lambda x: x.new_zeros(*x.shape[:2], 0, *x.shape[3:])  # noqa: E731
        layer = PackedLayer(empty(kcodes), empty(kq.scale), empty(kq.zero), empty(vcodes), empty(vscale),
                            empty(vzero), residual_k, residual_v, 0, 0, kq.group_size, vq.group_size,
                            None if knorm is None else empty(knorm.half()), rotated_keys, rotated_values)
    new_len = layer.length + t
    g = layer.group_size
    layer.kcodes = grow(layer.kcodes, kcodes, layer.length // 16)
    layer.kscale = grow(layer.kscale, kq.scale, layer.length // g)
    layer.kzero = grow(layer.kzero, kq.zero, layer.length // g)
    layer.vcodes = grow(layer.vcodes, vcodes, layer.length)
    layer.vscale = grow(layer.vscale, vscale, layer.length)
    layer.vzero = grow(layer.vzero, vzero, layer.length)
    if knorm is not None:
        layer.knorm = grow(layer.knorm, knorm.half(), layer.length)
    layer.length = new_len
    layer.kres, layer.vres, layer.residual = residual_k, residual_v, residual_k.shape[2]
    return layer


def pack(k: torch.Tensor, v: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, group_size: int,
         value_group_size: int, knorm: torch.Tensor | None = None, capacity: int | None = None,
         residual_capacity: int = 128, rotated_keys: bool = False, rotated_values: bool = False) -> PackedLayer:
    """Quantize flushed k, v (B, Hkv, T, D) to INT2 in buffers of `capacity` tokens (default T); k and v are
    taken as stored (in the Hadamard basis where `rotated_*` says so), the residual in the model's basis."""
    b, h, t, d = k.shape
    cap = capacity or max(t, TILE)
    kq = quantize(k, 2, group_size, "tokens")
    vq = quantize(v, 2, value_group_size, "channels")
    kcodes, vcodes, vscale, vzero = kernel_parts(kq, vq)

    def buffer(src: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        shape = list(src.shape)
        shape[dim] = size
        out = torch.zeros(shape, dtype=src.dtype, device=src.device)
        out.narrow(dim, 0, src.shape[dim]).copy_(src)
        return out

    return PackedLayer(
        kcodes=buffer(kcodes, 2, cap // 16), kscale=buffer(kq.scale, 2, cap // group_size),
        kzero=buffer(kq.zero, 2, cap // group_size), vcodes=buffer(vcodes, 2, cap),
        vscale=buffer(vscale, 2, cap), vzero=buffer(vzero, 2, cap),
        kres=buffer(k_res.half(), 2, residual_capacity), vres=buffer(v_res.half(), 2, residual_capacity),
        length=t, residual=k_res.shape[2], group_size=group_size, value_group_size=value_group_size,
        knorm=None if knorm is None else buffer(knorm.half(), 2, cap), rotated_keys=rotated_keys,
        rotated_values=rotated_values,
    )


def reference_decode(q: torch.Tensor, layer: PackedLayer, scaling: float,
                     correction: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) float64, straight from the definition, in the model's basis (rotated
    blocks rotated back in float64)."""
    k, v = layer.flushed_kv(model_basis=True, dtype=torch.float64)
    k = torch.cat([k, layer.kres[:, :, : layer.residual].double()], dim=2)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].double()], dim=2)
    b, hq, d = q.shape
    g = hq // k.shape[1]
    qd = q.double().reshape(b, -1, g, d)
    s = torch.einsum("bkgd,bktd->bkgt", qd, k) * scaling
    mx = s.amax(-1, keepdim=True)
    p = torch.exp(s - mx)
    num = torch.einsum("bkgt,bktd->bkgd", p, v).reshape(b, hq, d)
    den = p.sum(-1).reshape(b, hq)
    if correction is not None:
        scale = torch.exp(-mx).reshape(b, hq)
        num = num + scale[..., None] * correction[0].double()
        den = den + scale * correction[1].double()
    return num / den[..., None]
