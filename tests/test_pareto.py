"""`kvcalib report`: the Pareto frontier, the Markdown table and the plot of several eval JSONs."""

import json

import pytest

from kvcalib.errors import SettingsError
from kvcalib.evaluate import EvalResult
from kvcalib.pareto import frontier, read_results, write_report


def _result(method, bits, ppl, dataset="text.txt", shared=0.0):
    return EvalResult(method=method, settings={}, perplexity=ppl, effective_bits=bits, tokens=100,
                      per_layer_attention_rel_error=[0.1], model="m", dataset=dataset, num_samples=2, seq_len=64,
                      seconds=1.0, bits_breakdown={"cache_bits_per_element": bits - shared,
                                                   "shared_bits_per_element": shared})


def _write(tmp_path, results: dict) -> list[str]:
    paths = []
    for name, r in results.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(r.to_json()))
        paths.append(str(path))
    return paths


RESULTS = {
    "fp16": _result("fp16", 16.0, 10.0),
    "kivi-g128": _result("kivi", 2.375, 16.0),
    "kivi-g32": _result("kivi", 3.0, 12.0),
    "tq-2": _result("turboquant", 2.25, 11.5),  # beats kivi-g128 on both axes, and kivi-g32 on both too
    "tq-3": _result("turboquant", 3.75, 10.4),
    "vecinfer": _result("vecinfer", 2.02, 13.0, shared=0.02),
}


def test_the_frontier_holds_exactly_the_undominated_results(tmp_path):
    rows = read_results(_write(tmp_path, RESULTS))
    assert [r.label for r in frontier(rows)] == ["vecinfer", "tq-2", "tq-3", "fp16"]


def test_report_writes_a_table_by_bits_and_a_png(tmp_path):
    out = write_report(_write(tmp_path, RESULTS), tmp_path / "report")
    md = (out / "report.md").read_text()
    body = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| result")]
    assert [line.split(" | ")[0][2:] for line in body] == ["vecinfer", "tq-2", "kivi-g128", "kivi-g32", "tq-3", "fp16"]
    assert "| tq-2 | turboquant | 2.250 | 2.250 | 0.000 | - | - | 11.500 | +15.0% | yes |" in md  # JSONs without the decode counts
    assert "| kivi-g128 | kivi | 2.375 | 2.375 | 0.000 | - | - | 16.000 | +60.0% |  |" in md
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png", "report.md"]  # no temporary left


def test_results_of_different_texts_are_refused_and_nothing_is_written(tmp_path):
    paths = _write(tmp_path, {"a": _result("kivi", 2.0, 12.0), "b": _result("kivi", 3.0, 11.0, dataset="other.txt")})
    with pytest.raises(SettingsError, match="different models, texts or windows"):
        write_report(paths, tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_a_json_that_is_not_an_eval_result_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"method": "kivi", "perplexity": 1.0}))
    with pytest.raises(SettingsError, match="not an eval JSON"):
        read_results([str(path)])


def _task_json(tmp_path, name, method, scores: dict, samples: int = 10, settings=None):
    """What `kvcalib lm-eval --output-path` writes, reduced to what the report reads."""
    results = {}
    for (task, length), value in scores.items():
        results.setdefault(task, {"alias": task, "sample_len": samples})[f"{length},none"] = value
        results[task][f"{length}_stderr,none"] = "N/A"
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"results": results, "kvcalib": {"method": method, "settings": settings or {}}}))
    return str(path)


def test_task_scores_are_read_beside_the_eval_result_of_their_method(tmp_path):
    evals = _write(tmp_path, {"fp16": RESULTS["fp16"], "tq-2": RESULTS["tq-2"]})
    tasks = [_task_json(tmp_path, "fp16-ruler", "fp16", {("niah_single_1", 4096): 1.0, ("ruler_vt", 4096): 0.8}),
             _task_json(tmp_path, "tq-ruler", "turboquant", {("niah_single_1", 4096): 0.6, ("ruler_vt", 4096): 0.4})]
    out = write_report(evals, tmp_path / "report", tasks)
    md = (out / "report.md").read_text()
    # average 50.0; interval 1.96 sqrt((0.6 * 0.4 + 0.4 * 0.6) / 10) / 2 = 0.2147
    assert "| tq-ruler | turboquant | 2.250 | 11.500 | 60.0 | 40.0 | 50.0 ± 21.5 |" in md
    assert "| fp16-ruler | fp16 | 16.000 | 10.000 | 100.0 | 80.0 | 90.0 ± 12.4 |" in md
    assert "| niah_single_1 @ 4096 | ruler_vt @ 4096 |" in md
    assert (out / "tasks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_task_scores_without_an_eval_result_of_their_method_are_refused_and_nothing_is_written(tmp_path):
    evals = _write(tmp_path, {"fp16": RESULTS["fp16"]})
    tasks = [_task_json(tmp_path, "kivi-ruler", "kivi", {("ruler_vt", 4096): 0.5}, settings={"bits": 2})]
    with pytest.raises(SettingsError, match="no eval JSON of method kivi"):
        write_report(evals, tmp_path / "report", tasks)
    assert not (tmp_path / "report").exists()


def test_a_length_lm_eval_made_no_sample_of_is_no_score(tmp_path):
    """lm-eval's RULER writes -1 at each length of its metric list that the run made no sample of (`--max-lengths
    8192` alone still lists 4096): the report leaves that column out, and the average holds the real scores."""
    evals = _write(tmp_path, {"fp16": RESULTS["fp16"]})
    tasks = [_task_json(tmp_path, "fp16-8k", "fp16", {("niah_single_1", 4096): -1, ("niah_single_1", 8192): 1.0,
                                                       ("ruler_vt", 4096): -1, ("ruler_vt", 8192): 0.5})]
    md = (write_report(evals, tmp_path / "report", tasks) / "report.md").read_text()
    # average 75.0; interval 1.96 sqrt((0 + 0.5 * 0.5) / 10) / 2 = 0.155
    assert "| fp16-8k | fp16 | 16.000 | 10.000 | 100.0 | 50.0 | 75.0 ± 15.5 |" in md
    assert "@ 4096" not in md
