"""benchmarks/results.py `record`: a table recorded again replaces its section in place and archives the
old one beside the file it was recorded in (a scratch file's history must never land in the repository's
benchmarks/history: a run on another machine records into its own file first)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _results():
    spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_recording_twice_archives_beside_the_file_and_replaces_in_place(tmp_path):
    results = _results()
    repo_history = _tree(BENCHMARKS / "history")
    target = tmp_path / "out.md"
    target.write_text("# Results\n\n### Other (2026-01-01)\n\nkept\n")
    results.record("Speed", "| a |\n|---|\n| 1 |", ["bench.py", "--x"], target)
    results.record("Speed", "| a |\n|---|\n| 2 |", ["bench.py", "--x"], target)
    text = target.read_text()
    assert text.count("### Speed (") == 1 and "| 2 |" in text and "| 1 |" not in text
    assert "### Other (2026-01-01)\n\nkept" in text and "`python bench.py --x`" in text
    archived = list((tmp_path / "history").glob("*.md"))
    assert len(archived) == 1 and "| 1 |" in archived[0].read_text()
    assert _tree(BENCHMARKS / "history") == repo_history  # the repository's history untouched
