"""The CLI's success path; its bad inputs are the catalog of tests/test_bad_inputs.py."""

from kvcalib.cli import main


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
