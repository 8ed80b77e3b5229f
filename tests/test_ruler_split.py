"""benchmarks/ruler_split.py's file names: a row's files carry only characters every machine hands back."""

import json

import pytest

from benchmark_scripts import load_script


def test_a_rows_files_are_named_without_spaces_commas_or_parentheses(monkeypatch):
    split = load_script("ruler_split", monkeypatch)
    assert split.file_name("plan-2.25 (shipped), fused static cache") == "plan-2.25-shipped-fused-static-cache"
    assert split.file_name("fp16") == "fp16"
    assert split.file_name("OScaR-2 G=32") == "OScaR-2-G-32"
    assert split.file_name("(),") == "row"


def test_rows_whose_names_give_one_file_name_are_refused(monkeypatch, tmp_path):
    split = load_script("ruler_split", monkeypatch)
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"name": "plan 2", "method": "plan"}, {"name": "plan-2", "method": "plan"}]))
    with pytest.raises(SystemExit, match=r"two rows' names give one file name \(plan-2\)"):
        split._rows(str(rows))
    rows.write_text(json.dumps([{"name": "plan 2", "method": "plan"}, {"name": "plan 3", "method": "plan"}]))
    assert [r["name"] for r in split._rows(str(rows))] == ["plan 2", "plan 3"]
