"""benchmarks/calibrate.py's split of a command's time around its own progress bars: what the ranks share (the bars'
work) against what each does whole, read from the command's stderr as it comes."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

from tqdm import tqdm

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
    """The bars of collect, fit-codebook, train-adapters, diagnose, plan and eval count (by their units), alone or with
    their rank; another library's bar does not, nor a unit's word on the next line."""
    own = _calibrate(monkeypatch).OWN_BAR

    def drawn(desc: str, unit: str, position: int = 0) -> bytes:
        """What tqdm writes for such a bar, as the commands make theirs (`collect.py`, `vecinfer_fit.py`, ...)."""
        out = io.StringIO()
        with tqdm(total=16, desc=desc, unit=unit, position=position, file=out, mininterval=0) as bar:
            bar.update(8)
        return out.getvalue().encode()

    for desc, unit in [("collect", "sample"), ("fit-codebook K d4b8 V d4b8, rank 1 of 2", "layer"),
                       ("train-adapters", "step"), ("diagnose, rank 0 of 2", "layer"), ("plan: sensitivity", "forward"),
                       ("eval kivi", "window")]:
        assert own.search(drawn(desc, unit, position=int(desc.endswith("1 of 2")))), (desc, unit)
    assert not own.search(drawn("diagnose plots", "plot"))  # rank 0's writing, after the shared work
    assert not own.search(drawn("Loading weights", "it"))
    assert not own.search(b"collect: 16 samples written\nstep 3")  # a unit's word outside a bar
    for end in (b"\r", b"\n"):  # a bar of other units, then a line naming a unit: one line at a time
        assert not own.search(b"Loading weights: 100%|#| 291/291 [00:00, 900it/s]" + end + b"collect: 16 samples")
