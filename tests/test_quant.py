import pytest
import torch

from kvcalib.quant import dequantize, pack_bits, per_word, quantize, unpack_bits


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


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("axis,group", [("tokens", 32), ("tokens", 8), ("channels", 16), ("channels", 64)])
def test_quantize_error_is_within_half_a_step(bits, axis, group):
    x = torch.randn(2, 3, 64, 64) * torch.rand(1, 1, 1, 64) * 4
    p = quantize(x, bits, group, axis)
    y = dequantize(p)
    red = -2 if axis == "tokens" else -1
    step = p.scale.float().repeat_interleave(group, dim=red)
    zero = p.zero.float().repeat_interleave(group, dim=red)
    # Half a step, plus float16 rounding of the stored scale and zero (relative 2^-11 each).
    bound = 0.5 * step + 2**-10 * (zero.abs() + step * ((1 << bits) - 1)) + 1e-6
    assert ((x - y).abs() <= bound).all()
    assert y.shape == x.shape


def test_constant_group_is_reconstructed_exactly():
    x = torch.full((1, 1, 32, 8), 0.75)
    assert torch.equal(dequantize(quantize(x, 2, 32, "tokens")), x)


@pytest.mark.parametrize("bits,stored", [(2, 2.0), (3, 3.2), (4, 4.0), (5, 32 / 6)])
def test_stored_bits_count_whole_words_and_fp16_metadata(bits, stored):
    x = torch.randn(1, 1, 480, 64)  # 480 tokens: a multiple of every per_word above
    p = quantize(x, bits, 32, "tokens")
    assert p.stored_bits() / x.numel() == pytest.approx(stored + 32 / 32)


def test_grouping_isolates_an_outlier_channel_for_per_channel_keys():
    x = torch.randn(1, 1, 64, 16)
    x[..., 3] *= 100
    err = (dequantize(quantize(x, 2, 32, "tokens")) - x).abs()
    clean = (dequantize(quantize(x[..., :3], 2, 32, "tokens")) - x[..., :3]).abs()
    assert torch.allclose(err[..., :3], clean)
