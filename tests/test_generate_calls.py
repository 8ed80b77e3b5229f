"""benchmarks/generate_calls.py's padded batch: its rows' residual windows fill at different steps, as a user's
batch's rows do, so that the step that compresses them is measured as often as users meet it."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_the_batch_rows_fill_their_windows_at_eight_different_steps(monkeypatch):
    module = load_script("generate_calls", monkeypatch)
    lengths = module.batch8_lengths(32768)
    assert len(lengths) == 8 and max(lengths) == 32768 and min(lengths) > 0
    assert len({n % 128 for n in lengths}) == 8  # the windows of 128 tokens: 8 phases (multiples of 4096: one)
