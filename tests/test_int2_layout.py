"""The INT2 layout the fused kernel reads (kvcalib.formats.int2.layout, CPU): tensor-core order of the codes and its
reference."""

import dataclasses

import pytest
import torch

from kvcalib.quant import dequantize, quantize
from kvcalib.formats.int2.layout import (append_block, from_tensor_core_order, pack, reference_decode,
                                         to_tensor_core_order)
from tolerances import U64, gamma


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("which", ["k", "v"])
def test_tensor_core_order_is_a_permutation_of_the_codes_of_each_block(d, which):
    codes = torch.randint(0, 4, (2, 3, 48, d))
    words = to_tensor_core_order(codes, which)
    assert words.shape == (2, 3, 3, d) and words.dtype == torch.int32
    assert torch.equal(from_tensor_core_order(words, which), codes)
    # One code set in a block lands in exactly one 2-bit field of that block's words.
    one = torch.zeros(1, 1, 16, d, dtype=torch.int64)
    one[0, 0, 5, 7] = 3
    fields = to_tensor_core_order(one, which).to(torch.int64) & 0xFFFFFFFF
    assert (fields != 0).sum() == 1 and bin(int(fields.max())).count("1") == 2


def test_key_words_give_each_lane_its_mma_a_fragments():
    # Lane (g, t) = (2, 1), word 0, position 1 (r = 1: register a1 = row g + 8, k = 2t), low half:
    # token g + 8, channel 2t.
    codes = torch.zeros(1, 1, 16, 128, dtype=torch.int64)
    codes[0, 0, 2 + 8, 2] = 1
    words = to_tensor_core_order(codes, "k")[0, 0, 0]
    lane = 4 * 2 + 1
    assert int(words[lane * 4]) == 1 << 2 and int(words.abs().sum()) == 1 << 2


@pytest.mark.parametrize("d", [64, 128])
def test_packed_layer_reads_back_what_kvcalib_quant_stores(d):
    k, v = torch.randn(2, 2, 64, d), torch.randn(2, 2, 64, d)
    layer = pack(k, v, torch.randn(2, 2, 5, d), torch.randn(2, 2, 5, d), 32, 16)
    kd, vd = layer.flushed_kv()
    assert torch.equal(kd, dequantize(quantize(k, 2, 32, "tokens")))
    assert torch.equal(vd, dequantize(quantize(v, 2, 16, "channels")))


def test_appending_blocks_equals_packing_them_at_once():
    d = 64
    k, v = torch.randn(1, 2, 48, d), torch.randn(1, 2, 48, d)
    layer = None
    empty = torch.zeros(1, 2, 0, d).half()
    for start in range(0, 48, 16):
        block = slice(start, start + 16)
        layer = append_block(layer, quantize(k[:, :, block], 2, 16, "tokens"), quantize(v[:, :, block], 2, 16, "channels"),
                             None, empty, empty)
    kd, vd = layer.flushed_kv()
    assert layer.length == 48
    assert torch.equal(kd, dequantize(quantize(k, 2, 16, "tokens")))
    assert torch.equal(vd, dequantize(quantize(v, 2, 16, "channels")))


def _decode_error_over_bound(got: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             scaling: float) -> float:
    """max over outputs of |got − softmax attention over keys, values| / bound; both float64 evaluations
    of the same float32 inputs, q (B, Hq, d), keys and values (B, Hq, T, d).

    Each evaluation: a score sums d terms (γ_d scaling |q|·|k|), is scaled, shifted by the max and
    exponentiated (u64 |s| each, and 2 u64 for exp), so every weight p_t is within a relative η of
    exact; relative errors η in the weights move o = Σ p v / Σ p by <= 2η Σ w|v| (w = p / Σ p); the
    sums over T keys add γ_T each, the division u64. Two evaluations: twice (2η + 2γ_T + u64) Σ w|v|.
    """
    d, t = q.shape[-1], keys.shape[-2]
    scores = torch.einsum("bhd,bhtd->bht", q.double(), keys) * scaling
    weights = torch.softmax(scores, -1)
    want = torch.einsum("bht,bhtd->bhd", weights, values)
    eta = (gamma(d, U64) * scaling * torch.einsum("bhd,bhtd->bht", q.double().abs(), keys.abs()).amax(-1, keepdim=True)
           + U64 * (3 * scores.abs().amax(-1, keepdim=True) + 2))
    bound = 2 * (2 * eta + 2 * gamma(t, U64) + U64) * torch.einsum("bht,bhtd->bhd", weights, values.abs())
    return ((got - want).abs() / bound).max().item()


def _held(layer, kr, vr) -> tuple[torch.Tensor, torch.Tensor]:
    kd, vd = layer.flushed_kv()
    return (torch.cat([kd, kr.float()], 2).double().repeat_interleave(2, 1),
            torch.cat([vd, vr.float()], 2).double().repeat_interleave(2, 1))


def _small_layer(d: int = 64):
    """A packed layer of 32 flushed tokens and 3 residual ones, a query, and the held cache in float64."""
    k, v = torch.randn(1, 2, 32, d), torch.randn(1, 2, 32, d)
    kr, vr = torch.randn(1, 2, 3, d).half(), torch.randn(1, 2, 3, d).half()
    layer = pack(k, v, kr, vr, 16, 16)
    return layer, torch.randn(1, 4, d), *_held(layer, kr, vr)


def test_reference_decode_is_softmax_attention_over_the_held_cache():
    layer, q, keys, values = _small_layer()
    d = q.shape[-1]
    assert _decode_error_over_bound(reference_decode(q, layer, d**-0.5), q, keys, values, d**-0.5) <= 1


@pytest.mark.parametrize("which", ["kcodes", "vcodes"])
def test_reference_decode_with_one_code_flipped_breaks_the_bound(which):
    layer, q, keys, values = _small_layer()
    d = q.shape[-1]
    words = getattr(layer, which).clone()
    words[0, 1, 0, 3] ^= 1  # the low bit of one 2-bit code: one key or value element a step off
    planted = dataclasses.replace(layer, **{which: words})
    assert _decode_error_over_bound(reference_decode(q, planted, d**-0.5), q, keys, values, d**-0.5) > 1e3


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("which", ["k", "v"])
def test_reordering_packed_words_equals_reordering_codes(d, which):
    from kvcalib.quant import pack_bits
    from kvcalib.formats.int2.layout import reorder_packed

    codes = torch.randint(0, 4, (2, 3, 48, d))
    words = pack_bits(codes, 2, -2 if which == "k" else -1)
    assert torch.equal(reorder_packed(words, which), to_tensor_core_order(codes, which))
