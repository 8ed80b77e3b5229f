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
