"""The CLI's success path; its bad inputs are the catalog of tests/test_bad_inputs.py."""

import pytest

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


def test_device_auto_is_the_default_device_cpu_the_cpu_and_a_missing_gpu_is_refused_naming_what_there_is():
    import torch

    from kvcalib.errors import SettingsError
    from kvcalib.devices import default_device, resolve_device

    assert resolve_device(None) == resolve_device("auto") == default_device()
    assert resolve_device("cpu") == "cpu"
    count = torch.cuda.device_count()
    with pytest.raises(SettingsError, match="no CUDA device" if count == 0 else f"cuda:0 to cuda:{count - 1}"):
        resolve_device(f"cuda:{count}")
    with pytest.raises(SettingsError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("cuda:x")
