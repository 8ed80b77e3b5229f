"""benchmarks/calibrate.py's split of a command's time around its own progress bars: what the ranks share (the bars'
work) against what each does whole, read from the command's stderr as it comes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _calibrate(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports results.py beside it
    spec = importlib.util.spec_from_file_location("bench_calibrate", BENCHMARKS / "calibrate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_phases_are_before_the_first_bar_between_the_bars_and_after_the_last(monkeypatch):
    phases = _calibrate(monkeypatch).phases
    assert phases([2.0, 3.5, 7.0], 10.0) == (2.0, 5.0, 3.0)
    assert phases([4.0], 4.5) == (4.0, 0.0, 0.5)
    assert phases([], 6.0) == (6.0, 0.0, 0.0)  # no bar seen: nothing is counted as the shared work
    assert sum(phases([1.0, 2.0], 9.0)) == 9.0


def test_only_kvcalibs_own_bars_mark_the_work(monkeypatch):
    """The bars of collect, fit-codebook, train-adapters, diagnose and eval count (by their units), alone or with
    their rank; another library's bar does not, nor a unit's word on the next line."""
    own = _calibrate(monkeypatch).OWN_BAR
    for line in [b"collect:  50%|#####     | 16/32 [00:05<00:05,  3.1sample/s]",
                 b"diagnose, rank 1 of 2:  12%|#2  | 2/16 [00:01<00:07, 2.0layer/s]",
                 b"train:   0%|          | 0/400 [00:00<?, ?step/s]",
                 b"eval: 100%|##########| 4/4 [00:02<00:00, 1.9window/s]",
                 b"fit-codebook K d4b8 V d4b8, rank 0 of 2:  50%|#####  | 8/16 [00:09<00:09, 1.1s/layer]"]:
        assert own.search(line), line
    assert not own.search(b"Loading weights: 100%|##########| 291/291 [00:00<00:00, 900.1it/s]")
    assert not own.search(b"collect: 16 samples written\nstep 3")  # a unit's word outside a bar
    for end in (b"\r", b"\n"):  # a bar of other units, then a line naming a unit: one line at a time
        assert not own.search(b"Loading weights: 100%|#| 291/291 [00:00, 900it/s]" + end + b"collect: 16 samples")
