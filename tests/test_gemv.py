"""The one-row weight products (kvcalib.runtime.gemv_kernel) without a GPU: which calls the kernel takes,
that everything else is `F.linear` exactly, and that the decode step switches `nn.Linear.forward` to it only
while it runs. CUDA tensors here are fake (shapes, dtypes and devices, no data); the kernel's numbers are
tested on the GPU (tests/test_gemv_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kvcalib.runtime import captured, gemv_kernel
from kvcalib.runtime.gemv_kernel import MAX_ROWS, applies, linear


def _cuda(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def test_the_kernel_takes_one_row_products_of_dense_half_precision_weights_only():
    with FakeTensorMode():
        w = _cuda(1024, 4096)
        assert applies(_cuda(1, 1, 4096), w) and applies(_cuda(4096), w)
        assert applies(_cuda(1, 4096, dtype=torch.bfloat16), _cuda(1024, 4096, dtype=torch.bfloat16))
        assert applies(_cuda(1, 4096), w, _cuda(1024))
        refused = {
            "more rows than MAX_ROWS": (_cuda(MAX_ROWS + 1, 4096), w, None),
            "float32": (_cuda(1, 4096, dtype=torch.float32), _cuda(1024, 4096, dtype=torch.float32), None),
            "dtypes differ": (_cuda(1, 4096, dtype=torch.bfloat16), w, None),
            "rows of no whole 16-byte words": (_cuda(1, 4092), _cuda(1024, 4092), None),
            "a transposed weight": (_cuda(1, 4096), _cuda(4096, 1024).t(), None),
            "a bias of another length": (_cuda(1, 4096), w, _cuda(1000)),
            "a bias of another dtype": (_cuda(1, 4096), w, _cuda(1024, dtype=torch.float32)),
            "an empty input": (_cuda(0, 4096), w, None),
            "a weight of no rows": (_cuda(1, 4096), _cuda(0, 4096), None),
            "a weight on another GPU": (_cuda(1, 4096), torch.empty(1024, 4096, device="cuda:1", dtype=torch.float16),
                                        None),
        }
        for why, (x, weight, bias) in refused.items():
            assert not applies(x, weight, bias), why
        x = _cuda(1, 4096).requires_grad_()
        trained = _cuda(1024).requires_grad_()
        assert not applies(x, w) and not applies(_cuda(1, 4096), w, trained)  # the kernel has no backward
        with torch.no_grad():
            assert applies(x, w) and applies(_cuda(1, 4096), w, trained)
    assert not applies(torch.zeros(1, 64, dtype=torch.float16), torch.zeros(8, 64, dtype=torch.float16))


def test_linear_calls_the_kernel_where_it_applies_and_f_linear_elsewhere(monkeypatch):
    calls = []

    def spy(x, weight, bias):
        calls.append(tuple(x.shape))
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(torch.ops.kvcalib, "gemv", spy)
    with FakeTensorMode():
        w = _cuda(96, 64)
        assert linear(_cuda(1, 1, 64), w).shape == (1, 1, 96)
        assert linear(_cuda(MAX_ROWS, 1, 64), w).shape == (MAX_ROWS, 1, 96)
        assert linear(_cuda(MAX_ROWS + 1, 1, 64), w).shape == (MAX_ROWS + 1, 1, 96)  # one row too many: F.linear
    assert calls == [(1, 1, 64), (MAX_ROWS, 1, 64)]
    x, w, b = torch.randn(3, 1, 64), torch.randn(96, 64), torch.randn(96)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b)) and len(calls) == 2


def test_the_ops_shape_on_fake_tensors_is_the_products():
    with FakeTensorMode():
        assert torch.ops.kvcalib.gemv(_cuda(1, 1, 64), _cuda(96, 64), None).shape == (1, 1, 96)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def test_the_step_switches_linear_forward_only_while_it_runs_and_only_on_a_gpu(monkeypatch):
    """`_Regions` switches `nn.Linear.forward` to the kernel's in every compile mode when the model lies on a GPU
    with plain weights (here that is faked; on the CPU the switched forward falls back to `F.linear`, so the model's logits
    do not move by a bit), and puts torch's back after, also when the step raises. Planted: without the put-back,
    the assertions after each exit fail."""
    model = _model().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(ids).logits
    eager = torch.nn.Linear.forward
    assert not any(name == "forward" for _, name, *_ in captured._Regions(model, compiled=False).swaps)
    monkeypatch.setattr(captured, "_linears_for_the_kernel", lambda model: True)
    for compiled in (False, True):
        regions = captured._Regions(model, compiled=compiled)
        with regions:
            assert torch.nn.Linear.forward is gemv_kernel.FAST_FORWARD
            if not compiled:
                with torch.no_grad():
                    assert torch.equal(model(ids).logits, expected)
        assert torch.nn.Linear.forward is eager
        with pytest.raises(RuntimeError, match="inside"):
            with regions:
                raise RuntimeError("inside")
        assert torch.nn.Linear.forward is eager
    # built while a set is open, a set still puts torch's own forward back, not the switched one
    with captured._Regions(model, compiled=False):
        late = captured._Regions(model, compiled=False)
    assert late.swaps[-1][2] is eager
    with late:
        pass
    assert torch.nn.Linear.forward is eager
    # what is there when the step is entered is put back, though it came after the regions were built
    # (planted: putting back what was there at building undoes this patch)
    mine = lambda self, input: eager(self, input)  # noqa: E731
    monkeypatch.setattr(torch.nn.Linear, "forward", mine)
    with regions:
        with late:  # nested: switches nothing more
            assert torch.nn.Linear.forward is gemv_kernel.FAST_FORWARD
        assert torch.nn.Linear.forward is gemv_kernel.FAST_FORWARD
    assert torch.nn.Linear.forward is mine


def test_the_kernel_is_switched_in_only_for_a_model_on_a_gpu_whose_linear_weights_are_plain_tensors():
    """A weight of a tensor subclass (a DTensor, a quantized weight reporting float16) has no dense rows to read:
    such a model keeps cuBLAS for every product. Planted: with the subclass check dropped, the last assertion
    fails."""
    model = _model()
    assert not captured._linears_for_the_kernel(model)  # on the CPU
    model.to("meta")  # no GPU here: stand in for one by the check's only device question

    class Subclass(torch.Tensor):
        pass

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert captured._linears_for_the_kernel(model)
        layer = model.model.layers[0].mlp.down_proj
        layer.weight = torch.nn.Parameter(layer.weight.as_subclass(Subclass), requires_grad=False)
        assert not captured._linears_for_the_kernel(model)


def test_words_in_flight_come_in_equal_passes_of_at_most_ten():
    """`balanced_chunk`: a lane's share of a row (K / 8 words over 32 lanes) in the fewest passes of at most 10 words,
    all of one size but the last: Gemma 3's rows of 2560 values (10 words a lane) in one pass, not 8 and then 2, which
    measured 14% slower over Gemma-3-4B's products (benchmarks/gemv.py); Llama's 4096 as before (8, two passes)."""
    from kvcalib.runtime.gemv_kernel import balanced_chunk

    for k, want in [(2560, 10), (10240, 10), (4096, 8), (14336, 10), (5376, 7), (2048, 8), (200, 1), (8, 1)]:
        assert balanced_chunk(k) == want, k
    for k in range(8, 40000, 8):
        per_lane, chunk = -(-k // 256), balanced_chunk(k)
        passes = -(-per_lane // chunk)
        assert chunk <= 10 and passes == -(-per_lane // 10) and per_lane - (passes - 1) * chunk > 0, k
