"""Bad input: one line on stderr, exit code 2, no traceback, nothing written."""

import pytest

from kvcalib.cli import main


def _run(capsys, args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr()


@pytest.fixture
def bad_cases(tmp_path, tiny_model_dir, text_file):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    partial = tmp_path / "partial.json"
    partial.write_text('{"method": "kivi", "perplexity": 12.0, "effective_bits": 2.0}')
    model = ["--model", str(tiny_model_dir)]
    small = ["--num-samples", "1", "--seq-len", "32"]
    return {
        "missing model path": ["eval", "--model", str(tmp_path / "no-model"), "--method", "fp16"],
        "missing dataset": ["eval", *model, "--dataset", str(tmp_path / "none.txt"), "--method", "fp16", *small],
        "empty dataset": ["eval", *model, "--dataset", str(empty), "--method", "fp16", *small],
        "unsupported dataset": ["eval", *model, "--dataset", str(blocker), "--method", "fp16", *small],
        "seq-len beyond context": ["eval", *model, "--dataset", str(text_file), "--method", "fp16",
                                   "--num-samples", "1", "--seq-len", "100000"],
        "too few tokens": ["eval", *model, "--dataset", str(text_file), "--method", "fp16",
                           "--num-samples", "5000", "--seq-len", "512"],
        "unknown method": ["eval", *model, "--method", "zip", *small],
        "unknown option": ["eval", "--methd", "fp16"],
        "bad kivi settings": ["eval", *model, "--dataset", str(text_file), "--method", "kivi", "--group-size", "48", *small],
        "unwritable --out": ["collect", *model, "--dataset", str(text_file), *small, "--out", str(blocker / "acts")],
        "unwritable --json": ["eval", *model, "--dataset", str(text_file), "--method", "fp16", *small,
                              "--json", str(blocker / "r.json")],
        "collect with bad dataset": ["collect", *model, "--dataset", str(empty), *small, "--out", str(tmp_path / "acts")],
        "report of a file that is no eval JSON": ["report", str(blocker), "--out", str(tmp_path / "report")],
        "report of nothing": ["report", "--out", str(tmp_path / "report")],
        "report of an eval JSON missing fields": ["report", str(partial), "--out", str(tmp_path / "report")],
        "fit-turboquant without a collection": ["fit-turboquant", "--activations", str(tmp_path / "no-acts"),
                                                "--out", str(tmp_path / "art")],
        "--json where nothing can be created": ["eval", *model, "--dataset", str(text_file), "--method", "fp16", *small,
                                                "--json", "/proc/nope/r.json"],
        "collect --out where nothing can be created": ["collect", *model, "--dataset", str(text_file), *small,
                                                       "--out", "/proc/nope"],
        "plan without a collection": ["plan", "--activations", str(tmp_path / "no-acts"), "--budget", "2.25",
                                      *model, "--out", str(tmp_path / "plan")],
        "plan with an unknown scheme": ["plan", "--activations", str(tmp_path / "no-acts"), "--budget", "2.25",
                                        "--candidates", "turboquant-2,kivi-two", "--out", str(tmp_path / "plan")],
        "plan with a negative budget": ["plan", "--activations", str(tmp_path / "no-acts"), "--budget", "-1",
                                        "--out", str(tmp_path / "plan")],
    }


CASES = ["missing model path", "missing dataset", "empty dataset", "unsupported dataset", "seq-len beyond context",
         "too few tokens", "unknown method", "unknown option", "bad kivi settings", "unwritable --out",
         "unwritable --json", "collect with bad dataset", "report of a file that is no eval JSON", "report of nothing",
         "report of an eval JSON missing fields", "fit-turboquant without a collection", "plan without a collection",
         "--json where nothing can be created", "collect --out where nothing can be created",
         "plan with an unknown scheme", "plan with a negative budget"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_line_exit_2_and_no_output(case, bad_cases, capsys, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out = _run(capsys, bad_cases[case])
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcalib: error: "), out.err
    assert "Traceback" not in out.err + out.out
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_eval_prints_a_table_and_writes_json(tiny_model_dir, text_file, tmp_path, capsys):
    code = 0
    try:
        main(["eval", "--model", str(tiny_model_dir), "--dataset", str(text_file), "--method", "kivi",
              "--group-size", "8", "--residual", "16", "--num-samples", "1", "--seq-len", "48",
              "--json", str(tmp_path / "r.json")])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    assert code in (0, None)
    assert "| kivi |" in out and "perplexity" in out
    assert (tmp_path / "r.json").exists()
