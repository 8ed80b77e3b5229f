"""The sampling benchmark's draw without host reads (`generate_calls.sync_free_multinomial`) samples what torch's
`multinomial` samples: one index per row, with the row's probabilities."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "bench_generate_calls", Path(__file__).resolve().parents[1] / "benchmarks" / "generate_calls.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)  # imports torch and the standard library only at its top
sync_free_multinomial = _module.sync_free_multinomial


def test_the_draw_follows_each_rows_probabilities():
    torch.manual_seed(0)
    probs = torch.softmax(2 * torch.randn(3, 50), -1)
    n = 20000
    draws = torch.cat([sync_free_multinomial(probs, 1) for _ in range(n)], dim=1)
    assert draws.shape == (3, n) and draws.dtype == torch.long
    freq = torch.stack([torch.bincount(row, minlength=50).double() / n for row in draws])
    # each frequency is a binomial mean, within 5 of its standard errors: a correct draw misses that with odds of
    # about 6e-7 a cell, 1e-4 over the 150 (seeded, so a pass is a pass every run); no probability is 0 or 1 here
    stderr = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * stderr).all()


def test_the_draw_is_torchs_own_one_sample_draw_on_the_cpu():
    # torch's one-sample multinomial draws argmax(p / E) itself, E exponential: under one seed on the CPU (the
    # locked torch) the same random numbers give the same indices
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(20):
        torch.manual_seed(seed)
        want = torch.multinomial(probs, 1)
        torch.manual_seed(seed)
        assert torch.equal(sync_free_multinomial(probs, 1), want)


def test_the_draw_refuses_more_than_one_sample():
    with pytest.raises(AssertionError):
        sync_free_multinomial(torch.full((1, 4), 0.25), 2)
