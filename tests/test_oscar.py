import copy

import pytest
import torch

from kvcalib.attention import intercept, mixed_attention
from kvcalib.cli import main
from kvcalib.errors import SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.hadamard import rotate
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.methods.oscar import SCALINGS, OscarConfig, decode_keys, encode_keys, fold_value_rotation, save_oscar_artifact
from kvcalib.models import AttentionShape, LoadedModel

from conftest import tiny_model

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("d", [16, 64, 96])
@pytest.mark.parametrize("scaling", ["none", "l2"])
def test_rotated_queries_against_rotated_scaled_keys_give_the_same_scores(d, scaling):
    q, k = torch.randn(2, 3, 7, d, dtype=torch.float64), torch.randn(2, 3, 11, d, dtype=torch.float64)
    enc, s = encode_keys(k, rotation=True, scaling=scaling)
    stored = enc if s is None else enc * s.float()  # what the kernel multiplies back after dequantization
    scores = rotate(q).float() @ stored.transpose(-1, -2)
    assert _rel(scores, q @ k.transpose(-1, -2)) < 1e-5


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("rotation", [True, False])
def test_norm_scaling_round_trips(scaling, rotation):
    k = torch.randn(2, 3, 40, 64) * torch.rand(2, 3, 40, 1) * 10
    enc, s = encode_keys(k, rotation, scaling)
    assert _rel(decode_keys(enc, s, rotation), k) < 1e-5
    if scaling == "l2":
        # The stored coefficient is float16, so unit norm holds to float16 rounding.
        torch.testing.assert_close(enc.norm(dim=-1), torch.ones(2, 3, 40), rtol=2e-3, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 has a v_proj bias
def test_folding_the_value_rotation_leaves_the_model_outputs_unchanged(arch):
    model = tiny_model(arch, seed=3).double()
    ids = torch.randint(0, 512, (2, 24))
    values = {}

    def record(tag):
        def attend(layer, q, k, v, opts):
            values[tag, layer] = v
            return mixed_attention(q, k, v, opts)
        return attend

    folded = copy.deepcopy(model)
    fold_value_rotation(folded)
    with torch.no_grad():
        before, after = model(ids).logits, folded(ids).logits  # eager float64 attention
        for tag, m in (("plain", model), ("folded", folded)):
            with intercept(m, record(tag)):
                m(ids)
    assert _rel(after, before) < 1e-10
    # The cache now holds v H, which OScaR quantizes per token (layer 0 only: later layers' inputs pass
    # through the intercepted float32 attention).
    assert _rel(values["folded", 0], rotate(values["plain", 0])) < 1e-10
    assert _rel(folded.model.layers[0].self_attn.v_proj.weight, model.model.layers[0].self_attn.v_proj.weight) > 0.1


@pytest.mark.parametrize("scaling,norm_bits", [("l2", 16 / 16), ("max", 16 / 16), ("none", 0.0)])
def test_stored_bits_count_one_float16_coefficient_per_key_token(scaling, norm_bits):
    method = build_method("oscar", SHAPE, MethodSettings(bits=2, group_size=8, residual=16, scaling=scaling))
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    held = hold(method, 0, k, v)
    # keys: 2 + 32/8 bits + 16 bits per token over 16 channels; values: 2 + 32/8
    assert held.stored_bits / (k.numel() + v.numel()) == pytest.approx(2 + 32 / 8 + norm_bits / 2)


def test_scaling_fixes_the_error_of_planted_low_norm_tokens():
    torch.manual_seed(0)
    k = torch.randn(4, 2, 128, 64) + torch.linspace(-3, 3, 64)  # channel offsets, as real keys have
    sinks = [0, 37, 90]
    k[..., sinks, :] *= 0.05
    errs = {}
    for name, settings in {"kivi": MethodSettings(), "oscar": MethodSettings(scaling="l2")}.items():
        method = build_method(name, AttentionShape(1, 2, 2, 64), settings)
        kq, _ = method.decompress(0, method.compress(0, k, k))
        errs[name] = ((kq - k).norm(dim=-1) / k.norm(dim=-1))[..., sinks].mean().item()
    assert errs["oscar"] < 0.5 * errs["kivi"]


def test_held_prefix_does_not_change_as_the_sequence_grows():
    method = build_method("oscar", SHAPE, MethodSettings(bits=2, group_size=4, residual=8))
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    long = hold(method, 0, k, v)
    for n in (8, 17, 31):
        short = hold(method, 0, k[..., :n, :], v[..., :n, :])
        assert torch.equal(long.k[..., : short.flushed, :], short.k[..., : short.flushed, :])
        assert torch.equal(long.v[..., : short.flushed, :], short.v[..., : short.flushed, :])


def test_artifact_reproduces_its_settings_and_refuses_another_model(tiny_lm, text_file, tmp_path):
    path = save_oscar_artifact(str(tmp_path / "oscar"), model=tiny_lm, group_size=8, residual=16, scaling="max")
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=40, method="oscar", artifacts=path)
    assert result.settings["scaling"] == "max" and result.settings["group_size"] == 8
    direct = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=40, method="oscar", group_size=8,
                      residual=16, scaling="max")
    assert result.perplexity == direct.perplexity
    other = LoadedModel(model=tiny_model("llama", num_hidden_layers=3), tokenizer=tiny_lm.tokenizer, spec="other")
    with pytest.raises(SettingsError, match="another model"):
        evaluate(other, dataset=str(text_file), num_samples=1, seq_len=40, method="oscar", artifacts=path)


@pytest.mark.parametrize("kwargs", [dict(scaling="l3"), dict(group_size=32, residual=48), dict(bits=0)])
def test_invalid_oscar_settings_are_refused(kwargs):
    with pytest.raises(SettingsError):
        OscarConfig(**kwargs)


@pytest.mark.parametrize("args", [
    ["eval", "--method", "oscar", "--scaling", "l3"],
    ["diagnose", "--activations", "/nonexistent/acts", "--out", "runs/x"],
    ["diagnose", "--activations", "/nonexistent/acts", "--bits", "2,x", "--out", "runs/x"],
])
def test_bad_oscar_and_diagnose_input_gives_one_line_and_exit_2(args, capsys, tiny_model_dir):
    if args[0] == "eval":
        args = args + ["--model", str(tiny_model_dir), "--num-samples", "1", "--seq-len", "32"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("kvcalib: error: ")


def test_the_oscar_recipe_runs_the_ablations_as_settings_of_one_method():
    from kvcalib.recipes import load_recipe

    steps = {s.label: s.arguments for s in load_recipe("recipes/oscar.toml")}
    assert steps["Hadamard only"]["method"] == steps["scaling only (l2)"]["method"] == "oscar"
    assert steps["Hadamard only"]["scaling"] == "none" and steps["scaling only (l2)"]["rotation"] is False
    assert {a.get("scaling") for a in steps.values() if a["method"] == "oscar"} == set(SCALINGS)
