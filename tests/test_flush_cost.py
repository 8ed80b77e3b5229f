"""benchmarks/flush_cost.py counts the kernels a flushing step launches as the ops that launch one: not views, not
allocations, not ops on empty tensors (a plan's coder packs its unread part over no tokens: no launch)."""

from __future__ import annotations

import torch

from benchmark_scripts import load_script


def test_the_launch_count_takes_kernels_only(monkeypatch):
    module = load_script("flush_cost", monkeypatch)
    a, empty = torch.ones(4, 3), torch.ones(4, 0)
    with module.LaunchCount() as counted:
        b = a.view(3, 4).t()  # views: none
        c = (b + 1).sum()  # two kernels
        empty * 2  # on no element: none
        torch.empty(5)  # an allocation: none
    assert c.item() == 24
    assert dict(counted.ops) == {"add": 1, "sum": 1}


def test_a_one_slot_flush_is_measured_on_one_full_window_and_stays_in_bounds_over_timeds_calls(monkeypatch):
    """`--one`: slot 0's window full, the others one token short (the step `append_one` takes), and the counts put
    back after each call, so the 34 calls `decode.timed` makes (3 warm-ups, the capture, 30 replays) stay within
    every window (without the put-back the other slots pass their windows' end at the second call: an index error
    on the CPU, an out-of-bounds write on a GPU); the masked flush of every slot stays in bounds on its own."""
    module = load_script("flush_cost", monkeypatch)
    from kvcalib.methods import MethodSettings, build_method
    from kvcalib.models import attention_shape

    config, _ = module.model_config("llama-3.1-8b", 4096)
    config.num_hidden_layers = 1
    method = build_method("kivi", attention_shape(config), MethodSettings(2, 128, 128))
    for one in (True, False):
        static, k, v = module.full_layer(method, 0, 3, config, torch.device("cpu"), one)
        r = method.block
        assert static.residual.tolist() == ([r - 1, r - 2, r - 2] if one else [r - 1] * 3)
        flush = module.flush_of(static, one)
        for _ in range(34):
            flush(k, v)
        assert static.flushed.tolist() == ([r] * 3 if one else [2 * r] * 3)
