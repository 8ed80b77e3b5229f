import dataclasses
from fractions import Fraction

import pytest
import torch

from kvcalib.quant import Quantized, dequantize, pack_bits, pack_stream, per_word, quantize, unpack_bits, unpack_stream
from tolerances import U16, U32, gamma

FLOAT16_SUBNORMAL_ROUNDING = 2.0**-25  # below 2^-14 float16 rounds to multiples of 2^-24: absolute error <= 2^-25


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [1, 15, 16, 33, 100])
@pytest.mark.parametrize("dim", [0, -1])
def test_pack_unpack_round_trips_every_bit_width(bits, length, dim):
    shape = (length, 5) if dim == 0 else (5, length)
    codes = torch.randint(0, 1 << bits, shape)
    words = pack_bits(codes, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == -(-length // per_word(bits))
    assert torch.equal(unpack_bits(words, bits, dim, length), codes)


def test_packed_layout_puts_element_j_at_bits_b_times_j_mod_per_word():
    codes = torch.tensor([1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 3, 2])  # 17 codes at 2 bits
    words = pack_bits(codes, 2, 0)
    expected0 = sum(int(c) << (2 * j) for j, c in enumerate(codes[:16].tolist()))
    assert words.shape == (2,)
    assert int(words[0]) & 0xFFFFFFFF == expected0
    assert int(words[1]) == 2  # element 16 in the low bits of the zero-padded second word


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [1, 21, 64, 100])
def test_bit_stream_round_trips_in_the_fewest_words(bits, length):
    codes = torch.randint(0, 1 << bits, (3, 5, length))
    words = pack_stream(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, -(-length * bits // 32))
    assert torch.equal(unpack_stream(words, bits, length), codes)
    if 32 % bits == 0:  # a code never straddles two words: pack_bits' layout exactly
        assert torch.equal(words, pack_bits(codes, bits, -1))


def test_bit_stream_puts_code_j_at_bit_b_times_j_across_words():
    codes = torch.tensor([5, 3, 7, 1, 6, 2, 4, 0, 7, 7, 1])  # 11 codes at 3 bits: 33 bits, code 10 straddles
    words = pack_stream(codes, 3)
    stream = sum(int(c) << (3 * j) for j, c in enumerate(codes.tolist()))
    assert words.shape == (2,)
    assert int(words[0]) & 0xFFFFFFFF == stream & 0xFFFFFFFF
    assert int(words[1]) == stream >> 32  # the top bits of code 10 (7 at bits 30-32): 1


def _error_over_bound(x: torch.Tensor, p: Quantized) -> float:
    """max over elements of |x − dequantize(p)| / bound, in terms of the stored step s and zero z.

    Rounding to the nearest of L = 2^b − 1 steps: s/2. Beyond it only when the stored s and z, rounded
    to float16 from the group's (max − min)/L and min, no longer span the group and the clamp to
    [0, L] bites: by L |s − s_exact| + |z − min| <= γ_1(u16)(L s + |z|) (relative, float16 normal
    range) plus (L + 1) · 2^-25 (subnormal float16). Float32 work: max − min and / L before the
    float16 rounding, x − z and / s for the code, s q and + z reading back: six roundings of at most
    L s + |z|, and one more u32 for second-order products.
    """
    red = -2 if p.axis == "tokens" else -1
    levels = (1 << p.bits) - 1
    step = p.scale.float().repeat_interleave(p.group_size, dim=red)
    zero = p.zero.float().repeat_interleave(p.group_size, dim=red)
    bound = (0.5 * step + (gamma(1, U16) + 7 * U32) * (zero.abs() + step * levels)
             + (levels + 1) * FLOAT16_SUBNORMAL_ROUNDING)
    return ((x - dequantize(p)).abs() / bound).max().item()


def _channel_gains() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64) * torch.rand(1, 1, 1, 64) * 4  # channels of very different ranges


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("axis,group", [("tokens", 32), ("tokens", 8), ("channels", 16), ("channels", 64)])
def test_quantize_error_is_within_half_a_step(bits, axis, group):
    x = _channel_gains()
    p = quantize(x, bits, group, axis)
    assert _error_over_bound(x, p) <= 1
    assert dequantize(p).shape == x.shape


@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize("axis", ["tokens", "channels"])
def test_one_code_off_by_one_breaks_the_half_step_bound(bits, axis):
    x = _channel_gains()
    p = quantize(x, bits, 16, axis)
    dim = -2 if axis == "tokens" else -1
    codes = unpack_bits(p.codes, bits, dim, p.length).contiguous()
    # Of the elements that read back at or above x and whose code can go up (one more step puts them
    # a whole step or more away), the one in the group of the largest step.
    step = p.scale.float().repeat_interleave(16, dim=dim)
    candidates = (dequantize(p) >= x) & (codes < (1 << bits) - 1)
    at = torch.where(candidates, step, -1.0).argmax()
    codes.view(-1)[at] += 1
    planted = dataclasses.replace(p, codes=pack_bits(codes, bits, dim))
    assert _error_over_bound(x, planted) > 1


def test_constant_group_is_reconstructed_exactly():
    x = torch.full((1, 1, 32, 8), 0.75)
    assert torch.equal(dequantize(quantize(x, 2, 32, "tokens")), x)


@pytest.mark.parametrize("bits,stored", [(2, 2), (3, Fraction(32, 10)), (4, 4), (5, Fraction(32, 6))])
def test_stored_bits_count_whole_words_and_fp16_metadata(bits, stored):
    x = torch.randn(1, 1, 480, 64)  # 480 tokens: a multiple of every per_word above
    p = quantize(x, bits, 32, "tokens")
    assert Fraction(p.stored_bits(), x.numel()) == stored + Fraction(32, 32)  # counts: exact


def test_grouping_isolates_an_outlier_channel_for_per_channel_keys():
    x = torch.randn(1, 1, 64, 16)
    x[..., 3] *= 100
    err = (dequantize(quantize(x, 2, 32, "tokens")) - x).abs()
    clean = (dequantize(quantize(x[..., :3], 2, 32, "tokens")) - x[..., :3]).abs()
    # Each channel's min, max, codes and read-back are elementwise float operations on that channel
    # alone, so the other channels' results are identical to the bit.
    assert torch.equal(err[..., :3], clean)


@pytest.mark.parametrize("bits", [1, 2])
def test_a_group_spanning_float16s_whole_range_stores_a_finite_scale_and_decodes_finite(bits):
    """Keys held at float16's edges (`kvcalib.attention.as_float16`) can span 131008 in one group: at 1 bit that is
    the scale itself, past float16 (a plain cast stores inf, and the codes of 0 decode as 0 * inf = NaN). The scale
    is held at 65504: every number decodes finite, the group's ends within one scale of themselves (at 2 bits the
    scale, 43669, fits and the half-step bound holds as always)."""
    x = torch.tensor([[-65504.0, 65504.0, 0.0, 1000.0] * 4]).T.reshape(1, 16, 1)  # 16 tokens of one channel
    assert torch.tensor((65504.0 * 2) / ((1 << bits) - 1)).half().isinf() == (bits == 1)  # the case is real at 1 bit
    q = quantize(x, bits, 16, "tokens")
    assert torch.isfinite(q.scale.float()).all() and float(q.scale.float().max()) <= 65504.0
    y = dequantize(q)
    assert torch.isfinite(y).all()
    assert float((y - x).abs().max()) <= float(q.scale.float().max()) * (1.0 if bits == 1 else 0.5 + 2**-10)


def test_the_packers_shifts_are_made_once_a_device_and_afresh_under_torch_compile(monkeypatch):
    """`steps`: arange(n) * step held per (n, step, device), so that an eager flush inside a captured step launches
    nothing to make its shifts; under torch.compile (a traced flush) it is made as any op, and the packers give the
    same words either way."""
    from kvcalib import quant
    from kvcalib.quant import steps

    a, b = steps(11, 3, torch.device("cpu")), steps(11, 3, torch.device("cpu"))
    assert a is b and torch.equal(a, torch.arange(11) * 3) and a.dtype == torch.int64
    assert steps(11, 2, torch.device("cpu")) is not a  # another step: another tensor
    codes = torch.randint(0, 8, (5, 37))
    eager = pack_stream(codes, 3)
    monkeypatch.setattr(quant, "_HELD", {})
    compiled = torch.compile(lambda c: pack_stream(c, 3), fullgraph=True, dynamic=False)(codes)
    assert quant._HELD == {}  # traced as made: nothing held from inside the compiled code
    assert torch.equal(compiled, eager) and torch.equal(unpack_stream(eager, 3, 37), codes)
    assert torch.equal(unpack_bits(pack_bits(codes % 4, 2, -1), 2, -1, 37), codes % 4)


def test_low_words_are_the_words_as_int32_with_the_high_bit_the_sign():
    """`low_words`: int64 words below 2^32 as int32 by reading their low halves (one copy): the same numbers as
    subtracting 2^32 from those at or past 2^31, for a strided input too."""
    from kvcalib.quant import low_words

    x = torch.randint(0, 2**32, (4, 6, 5), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    x[0, 0, :4] = torch.tensor([0, 2**31 - 1, 2**31, 2**32 - 1])
    for words in (x, x.transpose(0, 2)):
        got = low_words(words)
        assert got.dtype == torch.int32 and got.is_contiguous() and got.shape == words.shape
        assert torch.equal(got.long(), torch.where(words >= 2**31, words - 2**32, words))
    assert low_words(x)[0, 0, :4].tolist() == [0, 2**31 - 1, -(2**31), -1]


def _dtype_views(fn, *args) -> list:
    """The dtype views in the graph torch.compile traces of fn(*args) (captured by a backend that runs it eagerly)."""
    views = []

    def backend(gm, _inputs):
        views.extend(n for n in gm.graph.nodes if n.target in ("view", torch.Tensor.view) and
                     any(isinstance(a, torch.dtype) for a in (*n.args, *n.kwargs.values())))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return views


def test_compiled_low_words_trace_no_dtype_view_and_give_the_eager_bits():
    """Under torch.compile `low_words` takes its arithmetic form: Inductor's fake tensors on CUDA (torch 2.11)
    refuse a dtype view that changes the element size, which failed every compiled KIVI flush there; the compiled
    words equal the eager ones."""
    from kvcalib.quant import low_words

    x = torch.randint(0, 2**32, (3, 8), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    assert _dtype_views(low_words, x) == []
    compiled = torch.compile(low_words, fullgraph=True, dynamic=False)(x)
    assert torch.equal(compiled, low_words(x))


def _stream_bit_by_bit(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The stream's bytes as the definition says: bit i of code j is stream bit bits j + i, stream bit b is bit b % 8
    of byte b // 8 (plain Python integers, one row at a time)."""
    rows = codes.reshape(-1, codes.shape[-1]).tolist()
    size = -(-codes.shape[-1] * bits // 8)
    out = []
    for row in rows:
        value = sum(int(c) << (bits * j) for j, c in enumerate(row))
        out.append([(value >> (8 * i)) & 0xFF for i in range(size)])
    return torch.tensor(out, dtype=torch.uint8).reshape(*codes.shape[:-1], size)


@pytest.mark.parametrize("bits", list(range(1, 17)))
def test_the_stream_bytes_are_the_bit_stream_for_every_width_and_length(bits):
    """`stream_bytes` (a period of lcm(bits, 8) bits summed in one int64, cut into bytes; bit by bit where the period
    passes 56 bits) against the stream built bit by bit in Python integers, for lengths that fill whole periods and
    not, every code at its largest value in one row (its bits all set); `pack_stream`'s words are those bytes read
    four at a time, little-endian, and `unpack_stream` gives the codes back."""
    from kvcalib.quant import pack_stream, stream_bytes, unpack_stream

    g = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 32, 37, 128):
        codes = torch.randint(0, 2**bits, (3, 2, n), generator=g)
        codes[0, 0] = 2**bits - 1
        got = stream_bytes(codes, bits)
        assert got.dtype == torch.uint8 and got.is_contiguous()
        assert torch.equal(got, _stream_bit_by_bit(codes, bits)), n
        words = pack_stream(codes, bits)
        assert words.shape[-1] == -(-n * bits // 32)
        padded = torch.nn.functional.pad(got, (0, -got.shape[-1] % 4)).long()
        built = padded[..., 0::4] | padded[..., 1::4] << 8 | padded[..., 2::4] << 16 | padded[..., 3::4] << 24
        assert torch.equal(words.long() & 0xFFFFFFFF, built)
        assert torch.equal(unpack_stream(words, bits, n), codes)
    assert pack_stream(torch.zeros(2, 3, 0, dtype=torch.int64), bits).shape == (2, 3, 0)  # no codes: no words
