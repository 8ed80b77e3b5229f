"""profile_step.py's reading of a step's kernels into each layer's attention window (the phases are differences of
the profiler's timestamps, so the expected values are exact)."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_a_layers_window_splits_at_its_partials_and_idle_gaps(monkeypatch):
    mod = load_script("profile_step", monkeypatch)
    spans = [("gemv_q", 0.0, 10.0),  # the layer's query before its attention
             ("rotate", 12.0, 16.0), ("partial", 17.0, 60.0), ("rotate", 13.0, 15.0), ("partial", 16.5, 70.0),
             ("merge", 61.0, 64.0), ("merge", 71.0, 75.0),
             ("gemv_o", 76.5, 80.0),
             ("packed_partial", 81.0, 90.0), ("merge", 91.0, 92.0),  # a window the profile's end cuts: not read
             ]
    (w,) = mod.attention_windows(spans[::-1])  # the order the profiler gives them in does not matter
    assert w == {"idle before": 2.0, "before the partials": 4.5, "partials": 53.5, "after the partials": 5.0,
                 "window": 63.0, "idle after": 1.5}


def test_windows_without_a_partial_are_not_layers(monkeypatch):
    mod = load_script("profile_step", monkeypatch)
    spans = [("gemv", 0.0, 1.0), ("merge", 2.0, 3.0), ("gemv", 4.0, 5.0)]
    assert mod.attention_windows(spans) == []
