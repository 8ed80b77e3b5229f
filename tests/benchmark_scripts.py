"""A benchmark script of benchmarks/ loaded as a module, for the tests of its rules (the folder on sys.path while
it loads: the scripts import one another)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str, monkeypatch):
    """benchmarks/<name>.py as a module named bench_<name>, the folder on sys.path for the test's duration."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
