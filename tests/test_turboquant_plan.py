"""`kvcalib plan`: the multiple-choice knapsack, the Fisher sensitivity, and the plan artifact that
`--method turboquant --artifacts` loads with per-layer key and value bits."""

import itertools
import json

import pytest
import torch

from kvcalib.collect import collect
from kvcalib.errors import SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.methods import Method, MethodSettings, build_method
from kvcalib.methods.turboquant_plan import COST_UNITS, item_cost, make_plan, measure_sensitivity, solve
from kvcalib.models import AttentionShape

SHAPE = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


# ---- the knapsack ----

def _brute_force(sens: torch.Tensor, cost: torch.Tensor, budget: float) -> float:
    items, options = sens.shape
    best = float("inf")
    for picks in itertools.product(range(options), repeat=items):
        total = sum(float(cost[i, j]) for i, j in enumerate(picks))
        if total <= budget * items + 1e-12:
            best = min(best, sum(float(sens[i, j]) for i, j in enumerate(picks)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_knapsack_finds_the_brute_force_optimum_within_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    items, options = 6, 3
    # costs on the knapsack's own grid (multiples of 1/COST_UNITS), so rounding up changes nothing
    cost = torch.randint(COST_UNITS, 5 * COST_UNITS, (items, options), generator=gen).double() / COST_UNITS
    sens = torch.rand(items, options, generator=gen, dtype=torch.float64)
    budget = float(cost.min(1).values.mean() + torch.rand(1, generator=gen) * (cost.max(1).values - cost.min(1).values).mean())
    picks = solve(sens, cost, budget)
    total_cost = sum(float(cost[i, j]) for i, j in enumerate(picks))
    assert total_cost <= budget * items + 1e-12
    assert sum(float(sens[i, j]) for i, j in enumerate(picks)) == pytest.approx(_brute_force(sens, cost, budget), abs=1e-12)


def test_a_budget_below_the_cheapest_choice_is_refused():
    cost = torch.tensor([[1.25, 2.25], [1.25, 2.25]], dtype=torch.float64)
    with pytest.raises(SettingsError, match="below the cheapest plan"):
        solve(torch.zeros_like(cost), cost, 1.2)
    assert solve(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), cost, 1.25) == [0, 0]  # exactly the cheapest: allowed


def test_item_cost_counts_codes_norm_and_codebook_as_eval_does():
    # d = 64, 3 bits: 192 code bits + 16 norm bits per 64 elements; a (1, 64, 8) codebook of float16
    # spread over eval's default 4 x 1024 tokens of 3 KV heads
    assert item_cost(64, 3, 1, 3) == (192 + 16) / 64 + 16 * 64 * 8 / (4096 * 3 * 64)
    assert item_cost(64, 2, 1, 3, tokens=10**12) == pytest.approx(2.25, abs=1e-9)


# ---- sensitivity ----

class _Noisy(Method):
    """Keys or values read back with a fixed perturbation of size `scale` (a stand-in coder)."""

    name, block = "noisy", 16

    def __init__(self, scale_k: float, scale_v: float):
        self.scale_k, self.scale_v = scale_k, scale_v

    def compress(self, layer, k, v):
        return k, v

    def decompress(self, layer, packed):
        k, v = packed
        noise = torch.sin(torch.arange(k.numel(), dtype=k.dtype).reshape(k.shape) * 0.7)  # fixed, input-independent
        return k + self.scale_k * noise, v + self.scale_v * noise

    def stored_bits(self, packed):
        return 0


def test_value_sensitivity_grows_as_the_square_of_the_error_and_vanishes_without_one(tiny_lm, tokenizer):
    windows = tokenizer("\n".join(["def f(x):\n    return x + 1"] * 20), return_tensors="pt")["input_ids"][:, :48]
    # attention is linear in the values: twice the value error, four times ½ Σ (g ⊙ Δo)², to float32 rounding
    sens = measure_sensitivity(tiny_lm, {1: _Noisy(0.0, 1e-2), 2: _Noisy(0.0, 2e-2), 3: _Noisy(0.0, 0.0)}, windows)
    values = sens[:, 1]
    assert (values[:, 0] > 0).all() and (sens[:, 0] == 0).all()  # keys untouched: Δo is exactly zero
    assert torch.allclose(values[:, 1] / values[:, 0], torch.full_like(values[:, 0], 4.0), rtol=1e-3)
    assert (values[:, 2] == 0).all()


# ---- the plan artifact ----

@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_lm, text_file):
    out = tmp_path_factory.mktemp("acts") / "acts"
    return collect(out, model=tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


@pytest.fixture(scope="module")
def plan(acts, tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("plan") / "plan"
    [path] = make_plan(acts, 4.0, out, model=tiny_lm, bits=(1, 2, 3, 4), windows=2, seq_len=32, iters=5, residual=16)
    assert path == out
    return path


def test_the_plan_spends_the_budget_and_eval_counts_what_it_planned(plan, tiny_lm, text_file):
    manifest = json.loads((plan / "manifest.json").read_text())
    s = manifest["settings"]
    assert s["bits"] == "plan" and len(s["k_bits"]) == len(s["v_bits"]) == 2
    method = build_method("turboquant", SHAPE, MethodSettings(residual=16), str(plan), tiny_lm)
    for i, (k, v) in enumerate(method.books):
        assert k.shape[-1] == 1 << s["k_bits"][i] and v.shape[-1] == 1 << s["v_bits"][i]
    # eval at the plan's accounting run: 4 windows of 1024 tokens would be slow here; the codes and
    # norms are counted per vector, so one window of 32 tokens checks them, and the codebooks apart
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=32, method="turboquant",
                      residual=16, artifacts=str(plan))
    elements = 2 * 2 * 2 * 32 * 16
    codes = sum(2 * 32 * (32 * -(-16 * b // 32) + 16) for b in s["k_bits"] + s["v_bits"])
    books = sum(16 * 16 * (1 << b) for b in s["k_bits"] + s["v_bits"])
    assert result.effective_bits == (codes + books) / elements
    # d = 16: 1 and 2 bits cost one word and a norm (3 bits per element), 3 and 4 two words (5): a mix
    assert manifest["extra"]["predicted_bits_per_element"] <= 4.0
    assert sorted(set(s["k_bits"] + s["v_bits"]))[0] <= 2 < sorted(set(s["k_bits"] + s["v_bits"]))[-1]
    sens = manifest["extra"]["sensitivity"]
    assert all(len(row) == 4 for which in ("k", "v") for row in sens[which])


def test_several_budgets_share_one_measurement_and_spend_what_each_allows(acts, tmp_path, tiny_lm):
    paths = make_plan(acts, [3.5, 5.0], tmp_path / "plans", model=tiny_lm, windows=1, seq_len=32, iters=3, residual=16)
    assert paths == [tmp_path / "plans" / "budget-3.5", tmp_path / "plans" / "budget-5"]
    extras = [json.loads((p / "manifest.json").read_text())["extra"] for p in paths]
    assert extras[0]["sensitivity"] == extras[1]["sensitivity"]
    assert extras[0]["predicted_bits_per_element"] <= 3.5 < extras[1]["predicted_bits_per_element"] <= 5.0

    def planned(extra, path):
        s = json.loads((path / "manifest.json").read_text())["settings"]
        pick = {b: j for j, b in enumerate(extra["candidate_bits"])}
        return sum(extra["sensitivity"][w][i][pick[b]] for w in ("k", "v") for i, b in enumerate(s[f"{w}_bits"]))

    assert planned(extras[1], paths[1]) <= planned(extras[0], paths[0])  # more bits never cost accuracy


def test_bits_cannot_be_given_with_a_plan(plan):
    with pytest.raises(SettingsError, match="--bits does not apply to the bit plan"):
        build_method("turboquant", SHAPE, MethodSettings(bits=2), str(plan))


@pytest.mark.parametrize("kwargs,match", [({"budget": 2.0}, "below the cheapest plan"), ({"bits": (5,)}, "--bits"),
                                          ({"budget": float("nan")}, "--budget"), ({"windows": 0}, "--windows")])
def test_bad_plan_settings_are_refused_before_anything_is_written(acts, tmp_path, tiny_lm, kwargs, match):
    args = {"budget": 2.25, **kwargs}
    budget = args.pop("budget")
    with pytest.raises(SettingsError, match=match):
        make_plan(acts, budget, tmp_path / "plan", model=tiny_lm, **args)
    assert not (tmp_path / "plan").exists()


def test_replaying_the_layers_before_the_item_changes_no_sensitivity(tiny_lm, monkeypatch):
    """The per-item forwards skip the decoder layers before the item (their reference outputs replayed):
    bit for bit what whole forwards give."""
    import kvcalib.methods.turboquant_plan as plan_module
    from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig
    from kvcalib.models import attention_shape

    shape = attention_shape(tiny_lm.config)
    coders = {b: TurboQuant(TurboQuantConfig(bits=b, residual=16), shape) for b in (1, 2, 3)}
    windows = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    replayed = measure_sensitivity(tiny_lm, coders, windows)
    monkeypatch.setattr(plan_module, "_decoder_layers", lambda model: [])
    assert torch.equal(replayed, measure_sensitivity(tiny_lm, coders, windows))
    assert (replayed[:, :, 0] > replayed[:, :, 2]).all()  # 1 bit hurts more than 3 in every item
