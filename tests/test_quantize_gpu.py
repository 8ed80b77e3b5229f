"""kernels_cupy/quantize.cu against the torch definition in kvcalib.quant, bit for bit."""

import pytest
import torch

from kvcalib.quant import _quantize_torch, dequantize, quantize

cupy = pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)


def _same(x, bits, group, axis):
    got, want = quantize(x, bits, group, axis), _quantize_torch(x, bits, group, axis)
    for name in ("codes", "scale", "zero"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name} differs in {(a != b).sum().item()} places"
    assert (got.length, got.group_size, got.axis) == (want.length, want.group_size, want.axis)
    return got


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["tokens", "channels"])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_kernel_equals_torch_on_fresh_random_inputs(bits, axis, group):
    torch.manual_seed(bits * 1000 + group)
    shape = (3, 2, 256, 128) if axis == "tokens" else (3, 2, 40, 128)
    # channels of very different ranges, as keys have; some float16 inputs (what the cache holds)
    x = torch.randn(shape, device="cuda") * (0.1 + 8 * torch.rand(1, 1, 1, shape[-1], device="cuda"))
    _same(x, bits, group, axis)
    _same(x.half().float(), bits, group, axis)


@pytest.mark.parametrize("axis", ["tokens", "channels"])
def test_ties_round_half_to_even_and_constant_groups_give_code_zero(axis):
    # groups with max - min = 3 have scale 1, so x - min = 0.5, 1.5, 2.5 are ties (to 0, 2, 2)
    base = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5] * 2, device="cuda")
    const = torch.full((16,), 4.25, device="cuda")
    x = torch.stack([base, const, -base])  # (3, 16)
    x = x[:, :, None].expand(3, 16, 8) if axis == "tokens" else x[:, None, :].expand(3, 8, 16)
    p = _same(x.contiguous(), 2, 16, axis)
    assert torch.equal(dequantize(p)[1], x[1])  # a constant group comes back exactly


@pytest.mark.parametrize("bits,length", [(3, 36), (5, 20), (7, 50)])  # a partial last word; words span groups of 2
def test_partial_last_words_and_words_spanning_groups(bits, length):
    torch.manual_seed(bits)
    _same(torch.randn(2, length, 16, device="cuda"), bits, 2, "tokens")
    _same(torch.randn(2, 16, length, device="cuda"), bits, 2, "channels")


def test_empty_and_refused_inputs():
    _same(torch.randn(0, 32, 16, device="cuda"), 2, 16, "tokens")
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize(torch.randn(1, 40, 16, device="cuda"), 2, 16, "tokens")


def test_a_range_first_made_while_a_graph_captures_is_not_held(monkeypatch):
    """`quant.steps` holds a range made outside a capture (the warm-up of a captured step) and not one made while a
    CUDA graph captures: that tensor lives in the graph's memory, freed with it, and a later caller would read freed
    memory. Made again after the capture, it is held."""
    from kvcalib import quant

    monkeypatch.setattr(quant, "_HELD", {})
    device = torch.device("cuda", torch.cuda.current_device())
    warm = quant.steps(5, 2, device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            assert quant.steps(5, 2, device) is warm  # held: read from the graph too
            inside = quant.steps(7, 3, device)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert set(quant._HELD) == {(5, 2, device)}
    assert torch.equal(inside, torch.arange(7, device=device) * 3)
    assert quant.steps(7, 3, device) is not inside and (7, 3, device) in quant._HELD
    del graph


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["tokens", "channels"])
@pytest.mark.parametrize("shape", [(2, 3, 128, 64), (1, 37, 40), (2, 5, 24)])
def test_codes_restreamed_on_the_gpu_are_the_torch_restream_bit_for_bit(bits, axis, shape):
    """`quant.codes_as_stream` (kernels_cupy/stream_codes.cu): each token's codes as one stream along its channels,
    the same words as unpacking and packing again in torch ops, for every width, both packed axes, lengths that fill
    no whole word (37 tokens, 40 or 24 channels), into an output poisoned first (every word written), checked."""
    from test_codebook_encode_gpu import _poison

    from kvcalib.quant import _codes_as_stream_cuda, pack_stream, unpack_bits

    torch.manual_seed(bits * 10 + len(shape))
    group = 8 if axis == "tokens" and shape[-2] % 8 == 0 else (shape[-2] if axis == "tokens" else 8)
    q = quantize(torch.randn(shape, device="cuda"), bits, group, axis)
    _poison()
    got = _codes_as_stream_cuda(q, checked=True)
    want = pack_stream(unpack_bits(q.codes, bits, -2 if axis == "tokens" else -1, q.length), bits)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), f"{(got != want).sum().item()} words differ"
