import copy

import pytest
import torch

from kvcalib.attention import intercept, mixed_attention
from kvcalib.cli import main
from kvcalib.errors import SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.hadamard import hadamard, rotate
from kvcalib.methods import MethodSettings, build_method, hold, oscar
from kvcalib.methods.oscar import SCALINGS, OscarConfig, decode_keys, encode_keys, fold_value_rotation
from kvcalib.methods.oscar_fit import save_oscar_artifact
from kvcalib.models import AttentionShape, LoadedModel

from conftest import float64, tiny_model
from tolerances import U16, U32, U64, gamma, rel_error, worst_row_rel_error

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def _flipped_hadamard(n: int, dtype=torch.float32) -> torch.Tensor:
    """The normalized Hadamard matrix with the sign of its first entry flipped (no longer orthogonal)."""
    h = hadamard(n, dtype).clone()
    h[0, 0] = -h[0, 0]
    return h


def _scores_error_over_bound(q: torch.Tensor, k: torch.Tensor, scaling: str) -> float:
    """max over scores of |scores − q kᵀ| / bound, OScaR's keys against rotated float32 queries.

    Float32 work per score: the rotation k H and the dot product q'·k', sums of d terms, γ_d each
    (Higham); k and q H rounded to float32, H's entries (1/sqrt(32) for d = 96 is not exact), k'/s and
    back * s: five roundings. Each term is bounded elementwise by |q||H| and |k||H|, so
    |error| <= (2γ_d + 6u32) (|q||H|)·(|k||H|); the sixth u32 covers the float64 reference's own
    γ_d(u64) and second-order products.
    """
    d = q.shape[-1]
    enc, s = encode_keys(k, rotation=True, scaling=scaling)
    stored = enc if s is None else enc * s.float()  # what the kernel multiplies back after dequantization
    scores = rotate(q).float() @ stored.transpose(-1, -2)
    h = hadamard(d, torch.float64).abs()
    bound = (2 * gamma(d, U32) + 6 * U32) * ((q.abs() @ h) @ (k.abs() @ h).transpose(-1, -2))
    return ((scores.double() - q @ k.transpose(-1, -2)).abs() / bound).max().item()


@pytest.mark.parametrize("d", [16, 64, 96])
@pytest.mark.parametrize("scaling", ["none", "l2"])
def test_rotated_queries_against_rotated_scaled_keys_give_the_same_scores(d, scaling):
    q, k = torch.randn(2, 3, 7, d, dtype=torch.float64), torch.randn(2, 3, 11, d, dtype=torch.float64)
    assert _scores_error_over_bound(q, k, scaling) <= 1


@pytest.mark.parametrize("d", [16, 96])
def test_keys_rotated_by_a_hadamard_with_one_flipped_sign_break_the_score_bound(d, monkeypatch):
    monkeypatch.setattr(oscar, "rotate", lambda x: x @ _flipped_hadamard(x.shape[-1], x.dtype))  # the keys only
    q, k = torch.randn(2, 3, 7, d, dtype=torch.float64), torch.randn(2, 3, 11, d, dtype=torch.float64)
    assert _scores_error_over_bound(q, k, "l2") > 10


def _keys_of_spread_norms() -> torch.Tensor:
    # Norms spread over three decades, kept in float16's normal range (>= 2^-14), where its rounding
    # is relative.
    return torch.randn(2, 3, 40, 64) * torch.rand(2, 3, 40, 1).clamp_min(2**-10) * 10


def _round_trip_bound(d: int, rotation: bool) -> float:
    """Bound on every key's ‖decode(encode(k)) − k‖ / ‖k‖, all in float32.

    k'/s then * s: two roundings of each element, 2u32 (s cancels, whatever its float16 rounding).
    A rotation (H's entries ±1/8 are exact for d = 64) sums d terms per output, error <= γ_d |k||H|,
    of 2-norm γ_d ‖k‖₁ <= γ_d sqrt(d) ‖k‖; the other (orthogonal) rotation keeps that norm. Two
    rotations: 2 sqrt(d) γ_d. The third u32 covers second-order products.
    """
    return (2 * d**0.5 * gamma(d, U32) if rotation else 0.0) + 3 * U32


def _unit_norm_rtol(d: int) -> float:
    """|‖k / s‖ − 1| for s the float16 l2 norm: the float16 rounding of s (1/(1+δ) moves by <= γ_1(u16)),
    the float32 norm s is rounded from and the test's norm of the result (sums of d squares: γ_d/2
    + u32 each, the sqrt halving the sum's error), the division (u32); one u32 for products of these."""
    return gamma(1, U16) + gamma(d, U32) + 4 * U32


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("rotation", [True, False])
def test_norm_scaling_round_trips(scaling, rotation):
    k = _keys_of_spread_norms()
    enc, s = encode_keys(k, rotation, scaling)
    assert worst_row_rel_error(decode_keys(enc, s, rotation), k) <= _round_trip_bound(64, rotation)
    if scaling == "l2":
        torch.testing.assert_close(enc.norm(dim=-1), torch.ones(2, 3, 40), rtol=_unit_norm_rtol(64), atol=0)


@pytest.mark.parametrize("rotation", [True, False])
def test_a_coefficient_one_float16_ulp_off_breaks_the_round_trip_and_unit_norm_bounds(rotation):
    k = _keys_of_spread_norms()
    enc, s = encode_keys(k, rotation, "l2")
    s_off = (s.view(torch.int16) + 1).view(torch.float16)  # the next float16 up: 2^-11 to 2^-10 relative
    assert worst_row_rel_error(decode_keys(enc, s_off, rotation), k) > 5 * _round_trip_bound(64, rotation)
    with pytest.raises(AssertionError):  # keys divided by it: norms off by up to 3 u16
        torch.testing.assert_close((enc * s.float() / s_off.float()).norm(dim=-1), torch.ones(2, 3, 40),
                                   rtol=_unit_norm_rtol(64), atol=0)


def _fold_errors_over_bounds(arch: str) -> tuple[float, float]:
    """Fold H into a float64 tiny model; (logits error / bound, max over layer-0 values of error / bound)."""
    model = float64(tiny_model(arch, seed=3))
    ids = torch.randint(0, 512, (2, 24))
    values, x = {}, {}

    def record(tag):
        def attend(layer, q, k, v, opts):
            values[tag, layer] = v
            return mixed_attention(q, k, v, opts)
        return attend

    folded = copy.deepcopy(model)
    fold_value_rotation(folded)
    plain32 = copy.deepcopy(model).float()
    v_proj = model.model.layers[0].self_attn.v_proj
    hook = v_proj.register_forward_hook(lambda module, args, out: x.update(input=args[0]))
    # Through kvcalib's attention, in the inputs' precision (eager attention would round the softmax to
    # float32, and a weight one float32 ulp apart between the two runs would swamp float64 round-off).
    with torch.no_grad():
        logits = {}
        for tag, m in (("plain", model), ("folded", folded), ("plain32", plain32)):
            with intercept(m, record(tag)):
                logits[tag] = m(ids).logits
    hook.remove()
    before, after = logits["plain"], logits["folded"]
    assert rel_error(folded.model.layers[0].self_attn.v_proj.weight, v_proj.weight) > 0.1  # H really is folded in
    # Logits: the two float64 models differ only by round-off (of the folded weights and of the
    # reordered sums), which to first order is linear in the unit roundoff. The float32 run measures
    # how much this network makes of it, rel32 = ‖float32 logits − float64 logits‖ / ‖float64 logits‖
    # (~4e-7), so a float64 evaluation is within about rel32 · u64/u32 of exact; the bound allows
    # two evaluations and the folded weights' rounding, and one more to spare.
    logits_bound = 4 * rel_error(logits["plain32"], before) * U64 / U32
    # Layer-0 values, what the cache would hold (v H), from the same input x in both models (later
    # layers' inputs already differ by round-off): x (W_jᵀ H) + b H against (x W_jᵀ + b) H. Each side
    # sums hidden + 1 terms (γ_{h+1}) and d terms through H (γ_d, in the fold or in the rotation), all
    # bounded by (|x||Wᵀ| + |b|)|H|; two sides, float64.
    d, hidden = values["plain", 0].shape[-1], x["input"].shape[-1]
    bias = v_proj.bias.abs() if v_proj.bias is not None else 0.0
    magnitude = (x["input"].abs() @ v_proj.weight.abs().T + bias).unflatten(-1, (-1, d)) @ hadamard(d, torch.float64).abs()
    bound = 2 * (gamma(hidden + 1, U64) + gamma(d, U64)) * magnitude.transpose(1, 2)
    value_error = ((values["folded", 0] - rotate(values["plain", 0])).abs() / bound).max().item()
    return rel_error(after, before) / logits_bound, value_error


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 has a v_proj bias
def test_folding_the_value_rotation_leaves_the_model_outputs_unchanged(arch):
    logits, values = _fold_errors_over_bounds(arch)
    assert logits <= 1 and values <= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folding_a_hadamard_with_one_flipped_sign_breaks_both_fold_bounds(arch, monkeypatch):
    monkeypatch.setattr(oscar, "hadamard", lambda n, dtype, device=None: _flipped_hadamard(n, dtype))
    logits, values = _fold_errors_over_bounds(arch)
    assert logits > 1e6 and values > 1e6


@pytest.mark.parametrize("scaling,norm_bits", [("l2", 16 / 16), ("max", 16 / 16), ("none", 0.0)])
def test_stored_bits_count_one_float16_coefficient_per_key_token(scaling, norm_bits):
    method = build_method("oscar", SHAPE, MethodSettings(bits=2, group_size=8, residual=16, scaling=scaling))
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    held = hold(method, 0, k, v)
    # keys: 2 + 32/8 bits + 16 bits per token over 16 channels; values: 2 + 32/8. Bit counts are
    # integers and these ratios dyadic, so the float division is exact.
    assert held.stored_bits / (k.numel() + v.numel()) == 2 + 32 / 8 + norm_bits / 2


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
    # A claim about quantization error, not round-off: KIVI's per-channel steps are set by the normal
    # tokens, so a token at 1/20 of their norm comes back with relative error above 1 (3.4 here); scaled
    # to unit norm first it errs like any token (0.19). "At least halves it" leaves room for other seeds.
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

    steps = {s.label: s.arguments for s in load_recipe("recipes/oscar/oscar.toml")}
    assert steps["Hadamard only"]["method"] == steps["scaling only (l2)"]["method"] == "oscar"
    assert steps["Hadamard only"]["scaling"] == "none" and steps["scaling only (l2)"]["rotation"] is False
    assert {a.get("scaling") for a in steps.values() if a["method"] == "oscar"} == set(SCALINGS)
