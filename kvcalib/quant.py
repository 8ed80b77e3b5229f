"""Asymmetric uniform quantization (1-8 bits) and bit-packing: the packed cache format.

This module is the single definition of the packed layout. The torch reference, the evaluation and
the CuPy kernels (`kernels_cupy/`) all read exactly this.

Packed layout
=============

| what        | dtype   | shape                                   | meaning                                  |
|-------------|---------|-----------------------------------------|------------------------------------------|
| `codes`     | int32   | `(..., words, C)` packed along tokens    | axis="tokens" (per-channel keys)          |
|             |         | `(..., T, words)` packed along channels  | axis="channels" (per-token values)        |
| `scale`     | float16 | `(..., T/G, C)` or `(..., T, C/G)`       | one per group: (max - min) / (2^b - 1)    |
| `zero`      | float16 | same as `scale`                          | one per group: the group minimum          |

- A value is `x ≈ zero + scale * q`, `q` an unsigned integer in `[0, 2^b - 1]`.
- Groups are `G` consecutive elements along the quantized axis: `G` tokens of one channel
  (axis="tokens") or `G` channels of one token (axis="channels"). The axis length must be a
  multiple of `G`.
- Packing: each 32-bit word holds `per_word = 32 // b` codes of consecutive elements along the
  packed axis; element `j` lives in word `j // per_word` at bits `[b * (j % per_word), b * (j %
  per_word) + b)`, least significant first. For b in {3, 5, 6, 7} the top `32 - b * per_word`
  bits stay zero; that waste is counted in the stored bits. The last word is zero-padded.
- Keys pack along tokens (one word covers 16 tokens of one channel at 2 bits, so a warp reading
  consecutive channels reads consecutive words); values pack along channels.
- `scale` and `zero` are rounded to float16 before use, so the dequantized value is bit-for-bit what
  a kernel computing `zero + scale * q` in float32 from the stored halves gets.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from .streams import settled

FLOAT16_MAX = 65504.0  # float16's largest finite number
# Whether CuPy, which the CUDA kernels launch through, is installed: looked up once, at import (torch.compile may not
# trace the lookup, and a flush asks at every launch).
CUPY_FOUND = importlib.util.find_spec("cupy") is not None

Axis = Literal["tokens", "channels"]
WORD_BITS = 32


_HELD: dict[tuple, torch.Tensor] = {}  # (n, step, device) -> arange(n) * step: a few small int64 ranges a device


def held(table, key, make):
    """table[key], made by `make()` the first time where a tensor may be kept: made afresh, and not kept, under
    torch.compile (traced as any op) and while a CUDA graph captures (made there, it would live in the graph's memory,
    freed with it). A static cache's flush runs eagerly inside the captured step, where each tensor made anew is a
    launch; its warm-up, before the capture, makes them once."""
    if torch.compiler.is_compiling():
        return make()
    got = table.get(key)
    if got is None:
        got = make()
        if not capturing():
            table[key] = settled(got)  # whole before a side stream's sibling reads it (`streams.side_by_side`)
    return got


def steps(n: int, step: int, device: torch.device) -> torch.Tensor:
    """arange(n) * step (int64) on `device`: the packers' shifts and the slots' index ranges, `held` once a (n, step,
    device) (about 30 launches a plan's flushed layer made them anew: benchmarks/flush_cost.py)."""
    return held(_HELD, (n, step, torch.device(device)),
                lambda: torch.arange(n, device=device, dtype=torch.int64) * step)


def memory_as_words() -> bool:
    """Whether int32 words may be read straight from a tensor's memory (`low_words`, `bytes_as_words`): on a
    little-endian device (x86, Arm, CUDA), outside torch.compile, whose fake tensors refuse a dtype view that changes
    the element size (torch 2.11 does, on CUDA) and which fuses the arithmetic form anyway."""
    return sys.byteorder == "little" and not torch.compiler.is_compiling()


def low_words(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 words x (each < 2^32) as int32, the high bit the sign (torch has no uint32
    arithmetic on every device): x's memory read a 32-bit word at a time, low word first as on every little-endian
    device (x86, Arm, CUDA), then one copy, where comparing, subtracting 2^32, choosing and casting took four
    launches (a flush runs them eagerly inside the captured step). Elsewhere (`memory_as_words`) the arithmetic form."""
    if not memory_as_words():
        return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
    return x.contiguous().view(torch.int32)[..., 0::2].clone()  # a tensor of its own, never a view of x


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never, where CUDA has not started)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def per_word(bits: int) -> int:
    return WORD_BITS // bits


def pack_bits(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned codes (< 2^bits) along `dim` into int32 words, least significant first."""
    dim = dim % codes.dim()
    n = codes.shape[dim]
    k = per_word(bits)
    words = -(-n // k)
    codes = codes.movedim(dim, -1).to(torch.int64)
    codes = torch.nn.functional.pad(codes, (0, words * k - n))
    codes = codes.reshape(*codes.shape[:-1], words, k)
    packed = (codes << steps(k, bits, codes.device)).sum(-1)
    # Reinterpret the low 32 bits as signed int32 (torch has no uint32 arithmetic on every device).
    packed = low_words(packed)
    return packed.movedim(-1, dim)


def unpack_bits(words: torch.Tensor, bits: int, dim: int, length: int) -> torch.Tensor:
    """Inverse of `pack_bits`: int32 words along `dim` to `length` codes (int64)."""
    dim = dim % words.dim()
    k = per_word(bits)
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    codes = (w.unsqueeze(-1) >> steps(k, bits, w.device)) & ((1 << bits) - 1)
    codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * k)[..., :length]
    return codes.movedim(-1, dim)


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2^bits) along the last axis as one bit stream: code j at bits
    [bits j, bits (j + 1)) of the stream, which fills int32 words least significant bit first and
    runs across word boundaries (3-bit codes: 32 in three words). For bits dividing 32 this is
    `pack_bits`' layout exactly; otherwise it wastes no bits (the last word zero-padded). The stream's bytes
    (`stream_bytes`) read as words (`bytes_as_words`)."""
    return bytes_as_words(stream_bytes(codes, bits))


def stream_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., n) < 2^bits as one bit stream in bytes (..., ceil(n bits / 8)) uint8: code j at stream bits
    [bits j, bits (j + 1)), stream bit b bit b % 8 of byte b // 8 (`kvcalib.vq`'s rows; `pack_stream`'s words read
    them four at a time), the last byte zero-padded. A period of lcm(bits, 8) bits (at most 56: 8 codes of 7 bits) is
    one int64 sum of its shifted codes, then cut into its bytes: the codes are read once, where a stream of one int64
    a bit moved bits x 8 bytes a code through four ops (a flush runs them eagerly inside the captured step, 40% of a
    plan's flushed bytes at B = 8). Widths whose period is longer (9, 11, 13, 15 bits) go bit by bit."""
    n = codes.shape[-1]
    span = math.lcm(bits, 8)
    c = codes.to(torch.int64)
    if span > 56:
        stream = ((c.unsqueeze(-1) >> steps(bits, 1, codes.device)) & 1).flatten(-2)
        stream = torch.nn.functional.pad(stream, (0, -stream.shape[-1] % 8)).unflatten(-1, (-1, 8))
        return (stream << steps(8, 1, codes.device)).sum(-1).to(torch.uint8)
    per = span // bits  # codes a period
    if n % per:
        c = torch.nn.functional.pad(c, (0, -n % per))
    period = (c.unflatten(-1, (-1, per)) << steps(per, bits, codes.device)).sum(-1)
    out = ((period.unsqueeze(-1) >> steps(span // 8, 8, codes.device)) & 0xFF).to(torch.uint8).flatten(-2)
    size = -(-n * bits // 8)
    return out if out.shape[-1] == size else out[..., :size].contiguous()


def bytes_as_words(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows (..., bytes) uint8 as int32 words (..., ceil(bytes / 4)), four bytes a word, the first the least
    significant (as every little-endian device reads them: x86, Arm, CUDA), zero-padded to whole words, in a tensor
    of their own: the rows copied once and their memory read as int32, where assembling each word from shifted bytes
    took some ten launches (a flush runs them eagerly inside the captured step). Elsewhere (`memory_as_words`) the
    arithmetic form."""
    if not rows.shape[-1]:  # no bytes: no words (an int32 view of no bytes is refused)
        return torch.empty(*rows.shape[:-1], 0, dtype=torch.int32, device=rows.device)
    if not memory_as_words():
        b = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 4)).to(torch.int64)
        return low_words(b[..., 0::4] | b[..., 1::4] << 8 | b[..., 2::4] << 16 | b[..., 3::4] << 24)
    if rows.shape[-1] % 4:
        return torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 4)).view(torch.int32)  # pad makes a new tensor
    return rows.clone(memory_format=torch.contiguous_format).view(torch.int32)


def unpack_stream(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of `pack_stream`: int32 words along the last axis to `length` codes (int64)."""
    shifts = steps(WORD_BITS, 1, words.device)
    stream = ((words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF) >> shifts & 1).flatten(-2)[..., : length * bits]
    return (stream.reshape(*stream.shape[:-1], length, bits) << steps(bits, 1, words.device)).sum(-1)


@dataclass
class Quantized:
    """A tensor quantized and packed as the module docstring describes."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: Axis
    length: int  # elements along the packed axis before padding

    def stored_bits(self) -> int:
        return 32 * self.codes.numel() + 16 * (self.scale.numel() + self.zero.numel())


def _dim(axis: Axis) -> int:
    return -2 if axis == "tokens" else -1


def _grouped(x: torch.Tensor, group_size: int, axis: Axis) -> torch.Tensor:
    """View x (..., T, C) as (..., groups, G, C) for tokens or (..., T, groups, G) for channels."""
    dim = _dim(axis)
    n = x.shape[dim]
    if n % group_size:
        raise ValueError(f"length {n} along {axis} is not a multiple of group size {group_size}")
    if axis == "tokens":
        return x.reshape(*x.shape[:-2], n // group_size, group_size, x.shape[-1])
    return x.reshape(*x.shape[:-1], n // group_size, group_size)


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: Axis) -> Quantized:
    """Asymmetric round-to-nearest quantization of x (..., T, C) in groups along `axis`.

    On CUDA with cupy installed, `kernels_cupy/quantize.cu` computes it (bit for bit the same: the GPU
    tests compare the two); elsewhere these torch ops, and under `torch.compile` too, which fuses them
    into the code around them.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if not torch.compiler.is_compiling() and x.is_cuda and CUPY_FOUND:
        return _quantize_cuda(x, bits, group_size, axis)
    return _quantize_torch(x, bits, group_size, axis)


def _codes(g: torch.Tensor, bits: int, lo: torch.Tensor, hi: torch.Tensor):
    """Codes of the grouped g for each group's range [lo, hi], with the float16 scale and zero stored."""
    levels = (1 << bits) - 1
    # at most float16's largest number: a 1-bit group spanning more than it (keys past +-32752) would store an inf
    # scale, and its codes of 0 would decode as 0 * inf = NaN; held there, they decode finite, their range cut short
    scale = ((hi - lo) / levels).clamp(max=FLOAT16_MAX).half()
    zero = lo.half()
    s = scale.float()
    # A constant group has scale 0: every code is 0 and zero alone reconstructs it.
    q = torch.where(s > 0, torch.round((g - zero.float()) / torch.where(s > 0, s, 1.0)), 0.0)
    return q.clamp_(0, levels), scale, zero


def _quantize_torch(x: torch.Tensor, bits: int, group_size: int, axis: Axis) -> Quantized:
    g = _grouped(x.float(), group_size, axis)
    red = -2 if axis == "tokens" else -1
    q, scale, zero = _codes(g, bits, g.amin(red, keepdim=True), g.amax(red, keepdim=True))
    return Quantized(
        codes=pack_bits(q.reshape(x.shape), bits, _dim(axis)),
        scale=scale.squeeze(red),
        zero=zero.squeeze(red),
        bits=bits,
        group_size=group_size,
        axis=axis,
        length=x.shape[_dim(axis)],
    )


def round_trip(x: torch.Tensor, bits: int, group_size: int, axis: Axis, keep: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize(quantize(x))` without packing (float32): what the cache reads back of x (..., T, C).

    With `keep` (..., T) and axis "tokens", each group's range is taken over its kept tokens only (a
    group with none kept uses all) and the others are clamped into it: `kvcalib diagnose` measures
    what outlier tokens cost their group this way.
    """
    g = _grouped(x.float(), group_size, axis)
    red = -2 if axis == "tokens" else -1
    lo, hi = g.amin(red, keepdim=True), g.amax(red, keepdim=True)
    if keep is not None:
        if axis != "tokens":
            raise ValueError("keep selects tokens: it needs axis='tokens'")
        mask = _grouped(keep.unsqueeze(-1), group_size, axis)
        kept = mask.any(red, keepdim=True)
        lo = torch.where(kept, torch.where(mask, g, math.inf).amin(red, keepdim=True), lo)
        hi = torch.where(kept, torch.where(mask, g, -math.inf).amax(red, keepdim=True), hi)
    q, scale, zero = _codes(g, bits, lo, hi)
    return (zero.float() + scale.float() * q).reshape(x.shape)


def _quantize_cuda(x: torch.Tensor, bits: int, group_size: int, axis: Axis) -> Quantized:
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    _grouped(x, group_size, axis)  # the same refusal as the torch path
    *lead, t, c = x.shape
    n = math.prod(lead)
    k = per_word(bits)
    xf = x.float().contiguous()
    if axis == "tokens":
        codes_shape, group_shape = (*lead, -(-t // k), c), (*lead, t // group_size, c)
    else:
        codes_shape, group_shape = (*lead, t, -(-c // k)), (*lead, t, c // group_size)
    codes = torch.empty(codes_shape, dtype=torch.int32, device=x.device)
    scale = torch.empty(group_shape, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    defines = {"BITS": bits, "G": group_size, "AXIS_TOKENS": int(axis == "tokens")}
    ptr = lambda a: cupy.uint64(a.data_ptr())  # noqa: E731
    sizes = (cupy.int32(n), cupy.int32(t), cupy.int32(c))
    with torch_stream(x.device):
        for name, count, args in (("group_stats", scale.numel(), (ptr(xf), ptr(scale), ptr(zero))),
                                  ("pack_codes", codes.numel(), (ptr(xf), ptr(scale), ptr(zero), ptr(codes)))):
            if count:  # thread per group, then thread per word
                launch(kernel("quantize.cu", defines, name), (-(-count // 256),), (256,), (*args, *sizes))
    return Quantized(codes=codes, scale=scale, zero=zero, bits=bits, group_size=group_size, axis=axis,
                     length=x.shape[_dim(axis)])


def codes_as_stream(q: Quantized) -> torch.Tensor:
    """Each token's codes of `q` (..., T, C) as one bit stream along its channels, `pack_stream`'s int32 words
    (..., T, ceil(C bits / 32)): how the codebook layout holds affine codes (keys are packed along tokens here). On
    CUDA with CuPy one launch (`kernels_cupy/stream_codes.cu`, bit for bit these ops: the GPU tests compare), where
    unpacking and packing again took about ten; under torch.compile these ops, which it fuses."""
    if q.codes.is_cuda and not torch.compiler.is_compiling() and CUPY_FOUND:
        return _codes_as_stream_cuda(q)
    return pack_stream(unpack_bits(q.codes, q.bits, _dim(q.axis), q.length), q.bits)


def _codes_as_stream_cuda(q: Quantized, checked: bool = False) -> torch.Tensor:
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    *lead, a, b = q.codes.shape
    t, c = (q.length, b) if q.axis == "tokens" else (a, q.length)
    n = math.prod(lead)
    out = torch.empty(*lead, t, -(-c * q.bits // WORD_BITS), dtype=torch.int32, device=q.codes.device)
    codes = q.codes.contiguous()
    with torch_stream(codes.device):
        if out.numel():  # a thread an output word
            launch(kernel("stream_codes.cu", {"BITS": q.bits, "AXIS_TOKENS": int(q.axis == "tokens")}, "stream_codes"),
                   (-(-out.numel() // 256),), (256,), (cupy.uint64(codes.data_ptr()), cupy.uint64(out.data_ptr()),
                                                     cupy.int32(n), cupy.int32(t), cupy.int32(c)), checked)
    return out


def dequantize(p: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = unpack_bits(p.codes, p.bits, _dim(p.axis), p.length)
    return dequantize_codes(codes, p.scale, p.zero, p.group_size, p.axis, dtype)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, axis: Axis,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`zero + scale * q` for unpacked codes (..., T, C), with scale and zero laid out as in `Quantized`."""
    red = -2 if axis == "tokens" else -1
    g = _grouped(codes.float(), group_size, axis)
    x = zero.float().unsqueeze(red) + scale.float().unsqueeze(red) * g
    return x.reshape(codes.shape).to(dtype)
