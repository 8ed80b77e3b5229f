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


def _decode_a_bfloat16_model_past_float16s_range(steps: int = 6):
    """A tiny bfloat16 Llama whose first layer's keys and values pass float16's range, decoded greedily through
    `KvcalibCache` (KIVI-2, blocks of 16: the prompt's first 32 tokens flushed): (the largest |key| the layer
    computed, the logits, eval's cache of that layer's keys)."""
    import copy

    from conftest import tiny_model
    from kvcalib.methods import MethodSettings, build_method, hold
    from kvcalib.models import LoadedModel, attention_shape
    from kvcalib.runtime.cache import KvcalibCache

    model = tiny_model("llama", seed=7).to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    seen = []
    with torch.no_grad():
        attn.k_proj.weight.mul_(1e5)  # keys and values of about 1e5: bfloat16 holds them, float16 does not
        attn.v_proj.weight.mul_(1e5)
    attn.k_proj.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    method = build_method("kivi", attention_shape(model.config), MethodSettings(bits=2, group_size=8, residual=16))
    cache = KvcalibCache(LoadedModel(model=model, tokenizer=None, spec="tiny"), copy.copy(method))
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    k = seen[0].view(1, 40, -1, 16).transpose(1, 2)  # the prompt's keys before rotary: the magnitude that matters
    held = hold(method, 0, k.float(), k.float())
    return float(torch.cat(seen, 1).abs().max()), torch.stack(out.logits, 1), held


def test_keys_and_values_past_float16s_range_are_held_at_its_largest_number_and_decode_finite(monkeypatch):
    """A bfloat16 (or float32) model's keys and values may pass 65504, where float16, which the caches hold (the
    residual window, the sinks, the rows the kernels read), has only inf, and one inf makes its row's scores or
    outputs NaN. The caches and eval's `hold` cast through `as_float16`, which holds such numbers at float16's edge
    (+-65280 from this bfloat16 model, +-65504 from float32): the decode stays finite, and eval's cache of the layer
    is too. Planted: a plain cast in the cache and in `hold`,
    and the same decode's logits go NaN (so this test can fail)."""
    import kvcalib.attention as attention
    import kvcalib.runtime.cache as runtime_cache

    largest, logits, held = _decode_a_bfloat16_model_past_float16s_range()
    assert largest > 65504  # the case is real: the layer computed keys float16 cannot hold
    assert torch.isfinite(logits).all() and torch.isfinite(held.k).all()
    assert float(held.k16.abs().max()) == 65504.0  # float32 keys held at float16's edge

    plain = lambda x: x.half()  # noqa: E731
    monkeypatch.setattr(runtime_cache, "as_float16", plain)  # the residual window
    monkeypatch.setattr(attention, "as_float16", plain)  # `held_in_float16`: the prompt's attention, `hold`
    _, planted, planted_held = _decode_a_bfloat16_model_past_float16s_range()
    assert not torch.isfinite(planted).all() and not torch.isfinite(planted_held.k).all()


def test_as_float16_holds_what_float16_cannot_at_its_edge_and_casts_the_rest_as_is():
    """`as_float16` against a plain cast: numbers float16 holds are the cast's, bit for bit; past its range, +-65504
    (float32) or +-65280 (bfloat16's largest number below 65504: 65504 itself rounds to 65536 there, whose cast is
    inf); NaN stays NaN; float16 is returned as it is."""
    from kvcalib.attention import as_float16

    x = torch.tensor([0.0, -1.5, 1e-6, 3e4, 65504.0, 65519.0, 7e4, -1e9, float("inf"), float("nan")])
    got = as_float16(x)
    want = torch.tensor([0.0, -1.5, 1e-6, 3e4, 65504.0, 65504.0, 65504.0, -65504.0, 65504.0, float("nan")]).half()
    assert torch.equal(got[:-1], want[:-1]) and got[-1].isnan() and got.dtype == torch.float16
    assert torch.equal(got[:6], x[:6].half())  # in range: the plain cast's
    b = torch.tensor([65280.0, 65536.0, -3e5, 2.0], dtype=torch.bfloat16)
    assert as_float16(b).tolist() == [65280.0, 65280.0, -65280.0, 2.0] and torch.isinf(b.half()[1])
    h = torch.tensor([1.0, 65504.0]).half()
    assert as_float16(h) is h
