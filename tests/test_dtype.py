"""The dtype a model loads in: by default the checkpoint's own on a GPU (its config's, a GGUF's float type, bfloat16 for
a quantized Gemma GGUF) and float32 on the CPU; `--dtype` on every command that loads a model, passed down to the load;
a bad name refused in one line. On any machine: the choice is a function of the checkpoint and of whether the device
is a GPU, and the loads are captured before any weight moves."""

import json

import pytest
import torch
from click.testing import CliRunner

from kvcalib import models
from kvcalib.cli import cli
from kvcalib.errors import SettingsError
from kvcalib.models import GGUFHeader, checkpoint_dtype, default_dtype, load_model, parse_dtype


def _with_dtype(src, dst, name: str):
    """A copy of a saved model directory whose config names `name` as its dtype."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = name
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("name,want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                       ("float32", torch.float32)])
def test_a_directorys_config_names_its_dtype_and_a_gpu_loads_in_it(tiny_model_dir, tmp_path, name, want):
    path = str(_with_dtype(tiny_model_dir, tmp_path / name, name))
    assert checkpoint_dtype(path) == want
    assert default_dtype(path, gpu=True) == want
    assert default_dtype(path, gpu=False) == torch.float32  # the CPU computes in float32 whatever the checkpoint


# GGMLQuantizationType: 0 F32, 1 F16, 30 BF16; 2 Q4_0, 3 Q4_1 (quantized)
@pytest.mark.parametrize("arch,types,want", [
    ("llama", {0: 10, 1: 1000}, torch.float16),
    ("gemma3", {0: 10, 30: 1000}, torch.bfloat16),
    ("llama", {0: 1000}, torch.float32),
    ("gemma3", {0: 10, 3: 1000}, torch.bfloat16),  # quantized: a family whose activations pass float16's range
    ("gemma2", {0: 10, 2: 1000}, torch.bfloat16),
    ("llama", {0: 10, 3: 1000}, torch.float16),
    ("qwen3", {0: 10, 2: 900, 1: 100}, torch.float16),
])
def test_a_gguf_names_its_dtype_by_its_float_tensors_or_by_its_family(monkeypatch, arch, types, want):
    monkeypatch.setattr(models, "gguf_header", lambda path: GGUFHeader(arch, 0, 0, types))
    assert checkpoint_dtype("smollm2-135m") == want


def test_the_embedded_models_quantized_gguf_loads_in_float16_on_a_gpu():
    header = models.gguf_header(models.Path(models._resolve("smollm2-135m")[0]) / models._EMBEDDED["smollm2-135m"][1])
    assert header.architecture == "llama" and 3 in header.types  # Q4_1 weights
    assert default_dtype("smollm2-135m", gpu=True) == torch.float16


def test_a_hub_id_names_no_dtype_and_a_gpu_takes_float16():
    assert checkpoint_dtype("someone/some-model") is None
    assert default_dtype("someone/some-model", gpu=True) == torch.float16


def test_a_dtype_given_by_name_loads_so_and_a_bad_name_is_refused(tiny_model_dir):
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert parse_dtype("auto") is None and parse_dtype(torch.float16) == torch.float16
    with pytest.raises(SettingsError, match="--dtype must be one of auto, float16, bfloat16, float32"):
        parse_dtype("float64")


COMMANDS = {  # every command that loads a model, with the arguments it needs to get as far as the load
    "collect": ["collect", "--out", "{tmp}/acts", "--num-samples", "1", "--seq-len", "16"],
    "eval": ["eval", "--method", "fp16", "--num-samples", "1", "--seq-len", "16"],
    "generate": ["generate", "--prompt", "hello", "--method", "fp16"],
    "oscar-artifact": ["oscar-artifact", "--out", "{tmp}/oscar"],
    "run": ["run", "recipes/oscar/oscar.toml"],
    "lm-eval": ["lm-eval", "--tasks", "niah_single_1", "--method", "fp16"],
    "plan": ["plan", "--activations", "{acts}", "--budget", "3", "--model", "{model}", "--out", "{tmp}/plan"],
}


@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_model_dir):
    """A collection of the tiny model's (a plan reads one before it loads the model)."""
    from kvcalib.collect import collect

    return collect(tmp_path_factory.mktemp("dtype") / "acts", model=str(tiny_model_dir), num_samples=1, seq_len=16,
                   device="cpu")


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_every_command_that_loads_a_model_passes_its_dtype_down(command, dtype, tmp_path, monkeypatch, acts,
                                                                 tiny_model_dir):
    seen = []

    class Stop(Exception):
        pass

    def capture(spec, device, dtype, *args, **kwargs):
        seen.append(dtype)
        raise Stop

    monkeypatch.setattr(models, "_load_cached", capture)
    args = [a.format(tmp=tmp_path, acts=acts, model=tiny_model_dir) for a in COMMANDS[command]]
    args += ["--dtype", dtype, "--device", "cpu"]
    result = CliRunner().invoke(cli, args)
    assert isinstance(result.exception, Stop), result.output
    assert seen == [torch.bfloat16 if dtype == "bfloat16" else torch.float32]  # auto on the CPU: float32


def test_a_bad_dtype_is_refused_in_one_line_with_exit_code_2():
    result = CliRunner().invoke(cli, ["eval", "--method", "fp16", "--dtype", "float64"])
    assert result.exit_code == 2 and "float64" in result.output and "Traceback" not in result.output
