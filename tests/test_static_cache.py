"""The static cache's host-side rules, on any machine (its GPU behaviour: tests/test_static_cache_gpu.py)."""

import pytest
import torch

from kvcalib.errors import SettingsError
from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import AttentionShape
from kvcalib.runtime.static_cache import StaticLayer, _masked_write, check_static

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
CUDA = torch.device("cuda")  # `check_static` reads only the device's type: no GPU needed to ask it


def test_masked_write_writes_each_taken_row_at_its_own_offset_and_the_others_only_into_the_slack():
    buf = torch.arange(3 * 2 * 13 * 4).reshape(3, 2, 13, 4)  # 10 positions and a slack of 3
    before = buf.clone()
    new = -torch.arange(3 * 2 * 3 * 4).reshape(3, 2, 3, 4) - 1
    _masked_write(buf, new, start=torch.tensor([0, 5, 7], dtype=torch.int32), take=torch.tensor([True, False, True]))
    want = before.clone()
    want[0, :, 0:3] = new[0]
    want[1, :, 10:13] = new[1]
    want[2, :, 7:10] = new[2]
    assert torch.equal(buf, want)


@pytest.mark.parametrize("name,settings,reason", [
    ("oscar", MethodSettings(group_size=32), "rotated basis or keeps decoding state"),
    ("kvlinc", MethodSettings(group_size=32), "rotated basis or keeps decoding state"),
    ("turboquant", MethodSettings(), "no fused INT2 layout"),
    ("kivi", MethodSettings(bits=3, group_size=32), "no fused INT2 layout"),
    ("kivi", MethodSettings(group_size=32, residual_mode="sliding"), "flushes blockwise"),
    ("kivi", MethodSettings(group_size=32, sink_tokens=4), "no fused INT2 layout"),
])
def test_a_static_cache_refuses_what_it_cannot_hold_with_the_reason(name, settings, reason):
    method = build_method(name, SHAPE, settings)
    with pytest.raises(SettingsError, match=reason):
        check_static(method, SHAPE.head_dim, CUDA, 2)


def test_a_static_cache_takes_kivi_and_refuses_a_cpu():
    method = build_method("kivi", SHAPE, MethodSettings(group_size=32))
    check_static(method, SHAPE.head_dim, CUDA, 2)  # no error
    with pytest.raises(SettingsError, match="runs on CUDA only"):
        check_static(method, SHAPE.head_dim, torch.device("cpu"), 2)


def test_the_append_and_masked_flush_trace_into_one_graph_that_stores_the_eager_bits():
    """What `torch.compile(fullgraph=True)` sees of the static cache's step: no host sync, no branch on
    a count (aot_eager: the traced, functionalised graph run by eager ops; the GPU tests run Inductor)."""
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=16, residual=32))
    layers = [StaticLayer(method, 0, 3, capacity=128, kv_heads=2, head_dim=64, device=torch.device("cpu"))
              for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate([3, 31, 70]):
        k, v = torch.randn(1, 2, t, 64, generator=g).half(), torch.randn(1, 2, t, 64, generator=g).half()
        for layer in layers:
            layer.prefill(i, k, v)
    compiled = torch.compile(layers[1].append, fullgraph=True, backend="aot_eager")
    k, v = (3 * torch.randn(3, 2, 40, 64, generator=g)).half(), torch.randn(3, 2, 40, 64, generator=g).half()
    for s in range(40):  # every slot flushes once
        layers[0].append(k[:, :, s : s + 1], v[:, :, s : s + 1])
        compiled(k[:, :, s : s + 1], v[:, :, s : s + 1])
        for a, b in zip(layers[0].packed.__dict__.values(), layers[1].packed.__dict__.values()):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, s
        assert torch.equal(layers[0].flushed, layers[1].flushed) and torch.equal(layers[0].residual, layers[1].residual)
    assert layers[0].flushed.tolist() == [32, 64, 96]
