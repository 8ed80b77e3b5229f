"""`kvcalib plan`: the schemes (`methods/plan.py`), the multiple-choice knapsack, the KL-anchored
sensitivity, and the plan artifact that `--method plan --artifacts` loads with a scheme per layer's keys
and values."""

import itertools
import json
import math

import pytest
import torch

from kvcalib.collect import Activations, collect
from kvcalib.errors import ArtifactError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.methods import Method, MethodSettings, build_method
from kvcalib.methods.kivi import Kivi, KiviConfig
from kvcalib.methods.oscar import Oscar, OscarConfig
from kvcalib.methods.plan import Plan, codebook_name, parse_scheme
from kvcalib.methods.plan_fit import COST_UNITS, item_costs, make_plan, measure_sensitivity, solve
from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig, TurboQuantVQ, codebook, rotation, unit_rotated
from kvcalib.methods.turboquant_fit import fit_vector_codebooks
from kvcalib.methods.vecinfer import LayerCodebooks, VecInfer, VecInferConfig
from kvcalib.vq import VQConfig
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


def test_item_costs_count_codes_metadata_and_codebooks_as_eval_does():
    shape = AttentionShape(num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64)
    book = torch.zeros(1, 64, 8)
    coders = {"turboquant-3": TurboQuant(TurboQuantConfig(bits=3, residual=128), shape, [(book, book)], "layer"),
              "kivi-2-g128": Kivi(KiviConfig(bits=2, group_size=128, residual=128), shape),
              "oscar-2-g32": Oscar(OscarConfig(bits=2, group_size=32, residual=128), shape)}
    cost = item_costs(coders, shape, residual=128, groups=1, sink_tokens=1)
    sink = 16 / 1024  # one float16 token in each 1024-token window
    # TurboQuant, d = 64, 3 bits: 192 code bits + 16 norm bits per 64 elements; a (1, 64, 8) codebook of
    # float16 spread over eval's default 4 x 1024 tokens of 3 KV heads
    book_bits = 16 * 64 * 8 / (4096 * 3 * 64)
    assert cost[:, 0].tolist() == [(192 + 16) / 64 + book_bits + sink] * 2
    # KIVI-2 G=128: keys carry a float16 scale and zero per channel and 128 tokens, values per token and
    # min(G, d) = 64 channels
    assert cost[:, 1].tolist() == [2 + 32 / 128 + sink, 2 + 32 / 64 + sink]
    # OScaR-2 G=32: KIVI's, plus one float16 coefficient per key vector
    assert cost[:, 2].tolist() == [2 + 32 / 32 + 16 / 64 + sink, 2 + 32 / 32 + sink]


# ---- the schemes ----

@pytest.mark.parametrize("text,want", [("turboquant-3", "turboquant-3"), (" kivi-2-g128", "kivi-2-g128"),
                                       ("oscar-4-g32", "oscar-4-g32"), ("turboquant-d4b6", "turboquant-d4b6"),
                                       ("vecinfer-d4b8", "vecinfer-d4b8")])
def test_a_scheme_reads_back_as_written(text, want):
    assert str(parse_scheme(text)) == want


@pytest.mark.parametrize("text", ["turboquant-5", "turboquant-2-g32", "kivi-2", "kivi-0-g32", "oscar-2-g0", "vecinfer-2", "",
                                  "turboquant-d4b13", "turboquant-d0b4", "turboquant-d4",
                                  "vecinfer-4", "vecinfer-d4b13"])
def test_an_unknown_or_impossible_scheme_is_refused(text):
    with pytest.raises(SettingsError):
        parse_scheme(text)


def test_each_part_and_head_of_a_plan_is_stored_and_read_back_by_its_own_scheme():
    """Layer 0: keys TurboQuant-3 on head 0 and OScaR-2 on head 1, values KIVI-2 on both; layer 1: OScaR-2
    everywhere. Each head holds what its scheme alone stores of it."""
    shape = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    book = codebook(16, 3).float().expand(1, 16, 8).contiguous()
    tq, kivi, oscar = parse_scheme("turboquant-3"), parse_scheme("kivi-2-g8"), parse_scheme("oscar-2-g8")
    schemes = {"k": [[tq, oscar], [oscar, oscar]], "v": [[kivi, kivi], [oscar, oscar]]}
    plan = Plan(shape, schemes, 16, 8, {codebook_name(0, "k", 3): book}, "layer")
    k, v = (torch.randn(2, 2, 16, 16, generator=gen) for _ in range(2))
    alone = {tq: TurboQuant(TurboQuantConfig(bits=3, residual=16), shape, [(book, book)] * 2, "layer"),
             kivi: Kivi(KiviConfig(bits=2, group_size=8, residual=16), shape),
             oscar: Oscar(OscarConfig(bits=2, group_size=8, residual=16), shape)}
    for layer in range(2):
        packed = plan.compress(layer, k, v)
        kq, vq = plan.decompress(layer, packed)
        bits = [0, 0]
        for w, (part, x) in enumerate((("k", kq), ("v", vq))):
            for h, scheme in enumerate(schemes[part][layer]):
                coder = alone[scheme]
                one = coder.compress(layer, k[:, [h]], v[:, [h]])
                assert torch.equal(x[:, [h]], coder.decompress(layer, one)[w])
                bits[w] += coder.part_bits(one)[w]
        assert plan.part_bits(packed) == tuple(bits)
    assert plan.constant_bits() == 16 * book.numel()


def test_a_vector_codebook_codes_each_sub_vector_by_its_nearest_centroid():
    """TurboQuantVQ against a float64 recomputation: unit vectors rotated by TurboQuant's Π, cut into
    sub-vectors of D, each replaced by its nearest centroid (the brute-force argmin over all of them),
    rotated back and scaled by the float16 norm; head h reads codebook h with granularity head."""
    shape = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(1)
    config = VQConfig(4, 5)
    book = torch.randn(2, 32, 4, generator=gen).half().float() * 0.3
    coder = TurboQuantVQ(config, 16, shape, [(book, book)], "head")
    k, v = (torch.randn(2, 2, 16, 16, generator=gen) * 3 for _ in range(2))
    packed = coder.compress(0, k, v)
    kq, vq_ = coder.decompress(0, packed)
    for x, xq in ((k, kq), (v, vq_)):
        norm = x.double().norm(dim=-1, keepdim=True)
        y = (x.double() / norm) @ rotation(16, torch.float64).T
        sub = y.unflatten(-1, (4, 4))  # (B, H, T, 4, D)
        dist = (sub.unsqueeze(-2) - book.double()[None, :, None, None]).pow(2).sum(-1)  # (B, H, T, 4, 32)
        nearest = book.double()[torch.arange(2)[None, :, None, None], dist.argmin(-1)]
        want = (nearest.flatten(-2) @ rotation(16, torch.float64)) * norm.half().double()
        # float32 codes may pick another centroid only at a near-tie: compare where the float64 choice is clear
        gap = dist.sort(-1).values[..., 1] - dist.min(-1).values
        clear = (gap > 1e-5).all(-1, keepdim=True)
        torch.testing.assert_close(torch.where(clear, xq.double(), want), want, rtol=1e-5, atol=1e-5)
        assert clear.float().mean() > 0.9
    # bits: 4 codes x 5 bits in one int32 word, and a float16 norm, per vector
    assert coder.part_bits(packed) == (2 * 2 * 16 * (32 + 16),) * 2


def test_vector_codebooks_fit_the_collection_better_than_the_oblivious_product_codebook(acts):
    """k-means on the rotated unit vectors' sub-vectors: 2^8 centroids of 4 coordinates reconstruct the
    collection's own sub-vectors better than the 256 points of the oblivious 2-bit codebook taken per
    coordinate (the same number of centroids, not fitted)."""
    acts = Activations(acts)
    books = fit_vector_codebooks(acts, (VQConfig(4, 8),), "layer", iters=10)["d4b8"]
    fp = acts.fingerprint
    grid = torch.cartesian_prod(*[codebook(16, 2).float()] * 4)  # (256, 4)
    for i in range(fp["num_layers"]):
        for part in ("k", "v"):
            book = books[f"layers.{i}.{part}_codebook"]
            assert book.shape == (1, 256, 4) and book.dtype == torch.float16 and torch.isfinite(book).all()
            y = unit_rotated(acts.layer(i)[part].transpose(1, 2).reshape(-1, 16))[0].reshape(-1, 4).double()

            def mse(c):
                return torch.cdist(y, c.double()).min(-1).values.pow(2).mean()

            assert mse(book[0]) < mse(grid)


def test_a_vecinfer_head_of_a_plan_holds_what_vecinfer_alone_stores_of_it():
    """Keys: VecInfer on head 0 (λ of head 0), TurboQuant with a vector codebook on head 1; values: VecInfer
    on both. Each head reads back what its scheme alone stores of it, with the same bits; the plan counts
    its codebooks and λ once."""
    shape = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(2)
    vi, tv = parse_scheme("vecinfer-d4b5"), parse_scheme("turboquant-d4b5")
    books = {codebook_name(0, "k", vi.book): torch.randn(1, 32, 4, generator=gen),
             codebook_name(0, "v", vi.book): torch.randn(1, 32, 4, generator=gen),
             codebook_name(0, "k", tv.book): torch.randn(1, 32, 4, generator=gen) * 0.3,
             "layers.0.k_smooth": torch.rand(2, 16, generator=gen).half() + 0.5}
    plan = Plan(shape, {"k": [[vi, tv]], "v": [[vi, vi]]}, 16, 1, books, "layer")
    k, v = (torch.randn(2, 2, 16, 16, generator=gen) for _ in range(2))
    config = VecInferConfig("d4b5", "d4b5")
    lam = books["layers.0.k_smooth"]
    alone_k = VecInfer(config, [LayerCodebooks(books["layers.0.k_codebook_vecinfer_d4b5"], books["layers.0.k_codebook_vecinfer_d4b5"],
                                               lam[[0]])], shape, 16)
    alone_v = VecInfer(config, [LayerCodebooks(books["layers.0.v_codebook_vecinfer_d4b5"], books["layers.0.v_codebook_vecinfer_d4b5"],
                                               None)], shape, 16)
    alone_t = TurboQuantVQ(VQConfig(4, 5), 16, shape, [(books["layers.0.k_codebook_d4b5"],) * 2], "layer")
    packed = plan.compress(0, k, v)
    kq, vq_ = plan.decompress(0, packed)
    one_k, one_t, one_v = (alone_k.compress(0, k[:, [0]], v[:, [0]]), alone_t.compress(0, k[:, [1]], v[:, [1]]),
                           alone_v.compress(0, k, v))
    assert torch.equal(kq[:, [0]], alone_k.decompress(0, one_k)[0])
    assert torch.equal(kq[:, [1]], alone_t.decompress(0, one_t)[0])
    assert torch.equal(vq_, alone_v.decompress(0, one_v)[1])
    assert plan.part_bits(packed) == (alone_k.part_bits(one_k)[0] + alone_t.part_bits(one_t)[0], alone_v.part_bits(one_v)[1])
    assert plan.part_bits(packed) == (2 * 16 * (24 + 32 + 16), 2 * 16 * 2 * 24)  # 3 bytes a VecInfer vector; a word + norm
    assert plan.constant_bits() == 16 * sum(t.numel() for t in books.values())


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

    def part_bits(self, packed):
        return 0, 0

    def settings(self):
        return {}


def test_value_sensitivity_grows_as_the_square_of_the_error_and_vanishes_without_one(tiny_lm, tokenizer):
    windows = tokenizer("\n".join(["def f(x):\n    return x + 1"] * 20), return_tensors="pt")["input_ids"][:, :48]
    # attention is linear in the values: twice the value error, four times ½ Σ (g ⊙ Δo)², to float32 rounding
    sens = measure_sensitivity(tiny_lm, {"a": _Noisy(0.0, 1e-2), "b": _Noisy(0.0, 2e-2), "c": _Noisy(0.0, 0.0)}, windows,
                               anchor="b")
    values = sens[:, 1]  # (layers, KV heads, coders)
    assert (values[..., 0] > 0).all() and (sens[:, 0] == 0).all()  # keys untouched: Δo is exactly zero
    assert torch.allclose(values[..., 1] / values[..., 0], torch.full_like(values[..., 0], 4.0), rtol=1e-3)
    assert (values[..., 2] == 0).all()


# ---- the plan artifact ----

@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_lm, text_file):
    out = tmp_path_factory.mktemp("acts") / "acts"
    return collect(out, model=tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


MIXED = ("turboquant-1", "turboquant-2", "turboquant-3", "turboquant-4", "turboquant-d4b6", "vecinfer-d4b6", "kivi-2-g8",
         "kivi-4-g8", "oscar-2-g16")


@pytest.fixture(scope="module", params=["layer", "head"])
def plan(request, acts, tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("plan") / "plan"
    [path] = make_plan(acts, 4.0, out, model=tiny_lm, candidates=MIXED, windows=2, seq_len=32, iters=5, residual=16,
                       items=request.param, sink_tokens=0)  # the accounting below counts no float16 sink
    assert path == out
    return path


def test_the_plan_spends_the_budget_and_eval_counts_what_it_planned(plan, tiny_lm, text_file):
    manifest = json.loads((plan / "manifest.json").read_text())
    s, extra = manifest["settings"], manifest["extra"]
    assert len(s["k"]) == len(s["v"]) == 2 and all(len(heads) == 2 for p in ("k", "v") for heads in s[p])
    assert s["flush_step"] == 16  # lcm of key groups 8 and 16
    if s["items"] == "layer":
        assert all(len(set(heads)) == 1 for p in ("k", "v") for heads in s[p])
    method = build_method("plan", SHAPE, MethodSettings(), str(plan), tiny_lm)
    assert [[str(c) for c in heads] for heads in method.schemes["k"]] == s["k"]
    # The knapsack's costs (d = 16, 2 KV heads) in eval's accounting: one window of 32 tokens with R = 16
    # flushes all 32, so the cache is the items' per-element costs less the codebook and sink shares
    # (which the costs spread over 4 x 1024 tokens of the item's heads), and the codebooks are counted
    # once per layer, part and width, apart.
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=32, method="plan", artifacts=str(plan))
    per_head = 32 * 16  # tokens x head_dim of one KV head
    item_heads = 2 if s["items"] == "layer" else 1
    names = extra["candidates"]
    books, cache = set(), 0.0
    for part in ("k", "v"):
        for i, heads in enumerate(s[part]):
            for name in heads:
                scheme = parse_scheme(name)
                book = 16 * math.prod(scheme.book_shape(1, 16)) if scheme.book else 0  # granularity layer
                if book:
                    books.add((i, part, scheme.book, book))
                cost = extra["cost_bits_per_element"][part][names.index(name)]
                smooth = 0.0
                if scheme.family == "vecinfer" and part == "k":  # λ: 16 bits per channel, counted per item
                    books.add((i, "k", "smooth", 16 * 2 * 16))
                    smooth = 16 / 4096
                cache += (cost - book / (4096 * item_heads * 16) - smooth) * per_head
    elements = 2 * 2 * 2 * per_head  # layers x parts x KV heads
    assert result.bits_breakdown["shared_bits_per_element"] * elements == sum(b[-1] for b in books)
    assert result.bits_breakdown["cache_bits_per_element"] * elements == pytest.approx(cache, rel=1e-12)
    assert extra["predicted_bits_per_element"] <= 4.0
    sens = extra["sensitivity_per_kv_head"]
    assert all(len(row) == len(MIXED) for part in ("k", "v") for layer in sens[part] for row in layer)


def _planned(manifest) -> float:
    """The summed sensitivity of a plan's choices."""
    s, extra = manifest["settings"], manifest["extra"]
    sens, names = extra["sensitivity_per_kv_head"], extra["candidates"]
    return sum(sens[p][i][h][names.index(name)] for p in ("k", "v") for i, heads in enumerate(s[p])
               for h, name in enumerate(heads))


@pytest.mark.parametrize("items", ["layer", "head"])
def test_several_budgets_share_one_measurement_and_spend_what_each_allows(acts, tmp_path, tiny_lm, items):
    paths = make_plan(acts, [3.5, 5.0], tmp_path / "plans", model=tiny_lm, candidates=MIXED, windows=1, seq_len=32,
                      iters=3, residual=16, items=items)
    assert paths == [tmp_path / "plans" / "budget-3.5", tmp_path / "plans" / "budget-5"]
    manifests = [json.loads((p / "manifest.json").read_text()) for p in paths]
    extras = [m["extra"] for m in manifests]
    assert extras[0]["sensitivity_per_kv_head"] == extras[1]["sensitivity_per_kv_head"]
    assert extras[0]["predicted_bits_per_element"] <= 3.5 < extras[1]["predicted_bits_per_element"] <= 5.0
    assert _planned(manifests[1]) <= _planned(manifests[0])  # more bits never cost accuracy


def test_choosing_per_kv_head_is_never_worse_than_per_layer_at_the_same_budget(acts, tmp_path, tiny_lm):
    """Per-layer plans are among the per-head plans, and both are measured alike: the per-head optimum
    of the summed sensitivity is at most the per-layer one (each within the knapsack's 1/256-bit grid)."""
    plans = {items: make_plan(acts, 3.5, tmp_path / items, model=tiny_lm, candidates=MIXED, windows=1, seq_len=32,
                              iters=3, residual=16, items=items)[0] for items in ("layer", "head")}
    manifests = {items: json.loads((path / "manifest.json").read_text()) for items, path in plans.items()}
    assert manifests["layer"]["extra"]["sensitivity_per_kv_head"] == manifests["head"]["extra"]["sensitivity_per_kv_head"]
    assert _planned(manifests["head"]) <= _planned(manifests["layer"]) * (1 + 1e-12)


def test_a_plan_may_take_schemes_of_any_family(acts, tmp_path, tiny_lm, caplog):
    """Without TurboQuant candidates nothing is fitted and the plan holds no tensors; eval loads it. A small
    collection (this one: 4 x 64 tokens) gets no warning asking for a larger one: with the default flags a 64 x 512
    collection planned worse than collect's default 16 x 512 (benchmarks/RESULTS.md, "The plan from default flags")."""
    # d = 16: KIVI-2 G=8 costs 2 + 32/8 = 6 bits per key element, 4 per value element
    with caplog.at_level("WARNING", logger="kvcalib.methods.plan_fit"):
        [path] = make_plan(acts, 6.5, tmp_path / "plan", model=tiny_lm,
                           candidates=("kivi-2-g8", "kivi-4-g8", "oscar-2-g8"), anchor="kivi-2-g8", windows=1,
                           seq_len=32, residual=16)
    assert [r.getMessage() for r in caplog.records if r.name == "kvcalib.methods.plan_fit"] == []
    s = json.loads((path / "manifest.json").read_text())["settings"]
    assert {n for p in ("k", "v") for heads in s[p] for n in heads} <= {"kivi-2-g8", "kivi-4-g8", "oscar-2-g8"}
    assert s["flush_step"] == 8
    method = build_method("plan", SHAPE, MethodSettings(), str(path), tiny_lm)
    assert method.constant_bits() == 0 and method.block == 16


VECTORS = ("turboquant-2", "turboquant-d4b6", "vecinfer-d4b6")


def test_the_plans_vector_codebooks_are_fitted_by_the_kmeans_chosen_without_faiss(acts, tmp_path, tiny_lm, text_file,
                                                                                   no_faiss, monkeypatch):
    """`kmeans="torch"` (what `auto` takes on a GPU where faiss has no GPU build): the plan's vector codebooks,
    TurboQuant's and VecInfer's, are kvcalib's own k-means of the same points (each fit called with that
    library, on the model's device), the manifest says which, and eval runs the plan. faiss is absent, so a
    plan that still called it would fail here. With --device-map auto the fits go to the first GPU."""
    import kvcalib.methods.plan_fit as plan_module
    from kvcalib.artifacts import load_artifact
    from kvcalib.methods.vecinfer_fit import fit_plan_codebooks

    def only(vector: str):
        """The plan whose one candidate (and anchor) is `vector`: every item takes it."""
        [path] = make_plan(acts, 8.0, tmp_path / vector, model=tiny_lm, candidates=(vector,), anchor=vector, windows=1,
                           seq_len=32, iters=3, residual=16, kmeans="torch")
        art = load_artifact(path)
        assert {name for part in ("k", "v") for layer in art.settings[part] for name in layer} == {vector}
        return path, art

    tq = fit_vector_codebooks(Activations(acts), (VQConfig(4, 6),), "layer", 3, library="torch", device="cpu")["d4b6"]
    vi, smooth = fit_plan_codebooks(Activations(acts), (VQConfig(4, 6),), "layer", 3, library="torch", device="cpu")
    _, art = only("turboquant-d4b6")
    for i, part in itertools.product(range(SHAPE.num_layers), ("k", "v")):
        assert torch.equal(art.tensors[codebook_name(i, part, "d4b6")], tq[f"layers.{i}.{part}_codebook"])
    path, art = only("vecinfer-d4b6")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["extra"]["kmeans"]["library"].startswith("torch ") and manifest["extra"]["kmeans"]["gpu"] is False
    for i, part in itertools.product(range(SHAPE.num_layers), ("k", "v")):
        assert torch.equal(art.tensors[codebook_name(i, part, "vecinfer_d4b6")], vi["d4b6"][f"layers.{i}.{part}_codebook"])
    for name, lam in smooth.items():
        assert lam.device.type == "cpu" and torch.equal(art.tensors[name], lam)
    result = evaluate(tiny_lm, str(text_file), num_samples=1, seq_len=32, method="plan", artifacts=str(path), residual=16)
    assert math.isfinite(result.perplexity)

    asked = []
    monkeypatch.setattr(plan_module, "kmeans_library", lambda kmeans, device: asked.append(device) or ("torch", False))
    monkeypatch.setattr(plan_module, "load_model", lambda *args, **kwargs: tiny_lm)
    monkeypatch.setattr(plan_module, "resolve_device", lambda device: "cuda:0" if device is None else device)
    monkeypatch.setattr(plan_module, "placement", lambda device, device_map, max_memory, size: {"device": device})
    for kwargs in ({"device": "cpu"}, {"device_map": "auto"}):
        with pytest.raises(SettingsError, match="below the cheapest plan"):  # stops after the choice, before a fit
            make_plan(acts, 0.5, tmp_path / "cheap", model=tiny_lm, candidates=VECTORS, residual=16, **kwargs)
    assert asked == ["cpu", "cuda:0"]


def test_a_plan_whose_kmeans_cannot_run_is_refused_before_anything_is_written(acts, tmp_path, tiny_lm, no_faiss):
    """On the CPU `auto` takes faiss: without it, the vector candidates are named, with the way out. An unknown
    --kmeans is refused whatever the candidates."""
    with pytest.raises(SettingsError, match=r"candidates turboquant-d4b6, vecinfer-d4b6 fit vector codebooks by "
                                            r"k-means: k-means needs faiss.*--kmeans torch"):
        make_plan(acts, 4.0, tmp_path / "plan", model=tiny_lm, candidates=VECTORS, windows=1, seq_len=32,
                  residual=16)
    with pytest.raises(SettingsError, match="--kmeans must be one of"):
        make_plan(acts, 4.0, tmp_path / "plan", model=tiny_lm, candidates=("turboquant-2",), residual=16,
                  kmeans="sometimes")
    assert not (tmp_path / "plan").exists()
    [path] = make_plan(acts, 4.0, tmp_path / "plan", model=tiny_lm, candidates=("turboquant-2", "kivi-2-g8"),
                       windows=1, seq_len=32, iters=3, residual=16)  # no vector candidate: no k-means needed
    assert "kmeans" not in json.loads((path / "manifest.json").read_text())["extra"]


def test_a_residual_other_than_the_plans_is_refused(plan):
    with pytest.raises(SettingsError, match="contradicts the artifact"):
        build_method("plan", SHAPE, MethodSettings(residual=32), str(plan))


@pytest.mark.parametrize("damage,match", [
    (lambda s, t: s.update(k=s["k"][:1]), "one scheme per layer"),
    (lambda s, t: s.update(k=[heads[:1] for heads in s["k"]]), "one scheme per layer"),
    (lambda s, t: s.update(v=[["kivi-2"] * 2] * 2), "unknown scheme"),
    (lambda s, t: s.update(flush_step=0), "invalid plan settings"),
    (lambda s, t: t.update({"layers.9.k_codebook": torch.zeros(1)}), "does not use"),
    (lambda s, t: (s.update(k=[["turboquant-d4b6"] * 2] * 2),
                   t.update({f"layers.{i}.k_codebook_d4b6": torch.zeros(1, 64, 3) for i in range(2)})), "not of shape"),
    (lambda s, t: (s.update(k=[["turboquant-d4b6"] * 2] * 2),
                   t.update({f"layers.{i}.k_codebook_d4b6": torch.full((1, 64, 4), float("nan")) for i in range(2)})),
     "NaN or Inf"),
])
def test_a_damaged_plan_is_refused_at_load(plan, tmp_path, tiny_lm, damage, match):
    from kvcalib.artifacts import load_artifact, save_artifact

    art = load_artifact(plan)
    settings, tensors = dict(art.settings), dict(art.tensors)
    damage(settings, tensors)
    save_artifact(tmp_path / "bad", "plan", settings, art.fingerprint, tensors, {})
    with pytest.raises(ArtifactError, match=match):
        build_method("plan", SHAPE, MethodSettings(), str(tmp_path / "bad"), tiny_lm)


def test_a_plan_needs_its_artifact():
    with pytest.raises(SettingsError, match="needs --artifacts"):
        build_method("plan", SHAPE, MethodSettings())


@pytest.mark.parametrize("kwargs,match", [({"budget": 1.0, "candidates": MIXED}, "below the cheapest plan"),
                                          ({"candidates": ("turboquant-5",)}, "1..4"),
                                          ({"candidates": ("kivi-2-g8",)}, "--anchor"),
                                          ({"candidates": ("turboquant-2", "kivi-2-g32")}, "multiple of --group-size 32"),
                                          ({"budget": float("nan")}, "--budget"), ({"windows": 0}, "--windows"),
                                          ({"items": "token"}, "--items")])
def test_bad_plan_settings_are_refused_before_anything_is_written(acts, tmp_path, tiny_lm, kwargs, match):
    args = {"budget": 2.25, "residual": 16, **kwargs}
    budget = args.pop("budget")
    with pytest.raises(SettingsError, match=match):
        make_plan(acts, budget, tmp_path / "plan", model=tiny_lm, **args)
    assert not (tmp_path / "plan").exists()


def test_the_kl_in_row_chunks_is_the_whole_windows():
    """The sensitivity's KL, KL_ROWS positions at a time (its memory), is the whole window's formula: the
    log-probabilities bit for bit (log-softmax is per row), the sum within float64 rounding of 700 x 300
    terms (relative 1e-12, far above 2^-52 x 210000 and far below any difference between two items)."""
    from kvcalib.methods import plan_fit

    g = torch.Generator().manual_seed(0)
    ref, item = torch.randn(700, 300, generator=g), torch.randn(700, 300, generator=g)  # 700: two whole chunks and part
    ref_logp = torch.log_softmax(ref.double(), -1)
    assert torch.equal(plan_fit.log_softmax64(ref), ref_logp)
    whole = (ref_logp.exp() * (ref_logp - torch.log_softmax(item.double(), -1))).sum()
    assert plan_fit.KL_ROWS < 700 and torch.allclose(plan_fit.kl_sum(ref_logp, ref_logp.exp(), item), whole, rtol=1e-12, atol=0)


def test_replaying_the_layers_before_the_item_changes_no_sensitivity(tiny_lm, monkeypatch):
    """The per-item forwards skip the decoder layers before the item (their reference outputs replayed):
    bit for bit what whole forwards give."""
    import kvcalib.methods.plan_fit as plan_module
    from kvcalib.models import attention_shape

    shape = attention_shape(tiny_lm.config)
    coders = {f"tq-{b}": TurboQuant(TurboQuantConfig(bits=b, residual=16), shape) for b in (1, 2, 3)}
    windows = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    replayed = measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2")
    monkeypatch.setattr(plan_module, "_decoder_layers", lambda model: [])
    assert torch.equal(replayed, measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2"))
    assert (replayed[..., 0] > replayed[..., 2]).all()  # 1 bit hurts more than 3 in every item and head


def test_the_layers_keep_their_own_forward_after_the_replays(tiny_lm):
    """A model spread by accelerate wraps each layer's forward on the instance (its device hooks): the replays
    put that forward back, so the hooks still run after the measurement, and the measurement is the same."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    import kvcalib.methods.plan_fit as plan_module
    from kvcalib.models import attention_shape

    class Counting(ModelHook):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    shape = attention_shape(tiny_lm.config)
    coders = {f"tq-{b}": TurboQuant(TurboQuantConfig(bits=b, residual=16), shape) for b in (1, 2)}
    windows = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2")
    layers = plan_module._decoder_layers(tiny_lm.model)
    hooks = [Counting() for _ in layers]
    for layer, hook in zip(layers, hooks):
        add_hook_to_module(layer, hook)
    try:
        hooked = measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2")
        # a window runs layer i once in the reference forward and once for each of the 2 (i + 1) items at or after
        # it (the layers before an item replay their outputs, their hooks not called)
        assert [h.calls for h in hooks] == [len(windows) * (1 + 2 * (i + 1)) for i in range(len(layers))]
        with torch.no_grad():
            tiny_lm.model(windows[:1], use_cache=False)
        assert [h.calls for h in hooks] == [len(windows) * (1 + 2 * (i + 1)) + 1 for i in range(len(layers))]
    finally:
        for layer in layers:
            remove_hook_from_module(layer)
            layer.__dict__.pop("forward", None)  # accelerate leaves the bound class forward there: the fixture as it was
    assert torch.equal(plain, hooked)


def test_coders_under_different_flush_rules_are_not_measured_together(tiny_lm):
    from kvcalib.models import attention_shape

    shape = attention_shape(tiny_lm.config)
    coders = {"a": TurboQuant(TurboQuantConfig(bits=2, residual=16), shape),
              "b": TurboQuant(TurboQuantConfig(bits=2, residual=32), shape)}
    with pytest.raises(ValueError, match="different rules"):
        measure_sensitivity(tiny_lm, coders, torch.zeros(1, 8, dtype=torch.long), anchor="a")


def test_counting_a_windows_first_positions_gives_what_the_window_cut_there_gives(tiny_lm):
    """`positions` counts some positions' predictions and attention outputs, the whole window still run. A
    causal model's first k positions read only the first k tokens, and under the decode-exact flush rule each
    query's cache is its own: counting only them gives the sensitivity of the window cut to k tokens. Bit for
    bit here; 1e-6 relative allowed, as the forwards' products run over other lengths (a BLAS may sum them in
    another order), far below the 1 against 2 bits gap the other tests check. Fails where either the KL or
    the attention errors count every position."""
    from kvcalib.models import attention_shape

    shape = attention_shape(tiny_lm.config)
    coders = {f"tq-{b}": TurboQuant(TurboQuantConfig(bits=b, residual=16), shape) for b in (1, 2)}
    windows = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(1))
    k = 32  # whole flush blocks (16 tokens): the blocks flushed for the first k queries hold only their tokens
    first = torch.zeros(windows.shape, dtype=torch.bool)
    first[:, :k] = True
    cut = measure_sensitivity(tiny_lm, coders, windows[:, :k].contiguous(), anchor="tq-2")
    counted = measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2", positions=first)
    assert (cut > 0).all() and torch.allclose(counted, cut, rtol=1e-6, atol=0), (counted - cut).abs().max()
    whole = measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2")
    assert not torch.allclose(whole, cut, rtol=1e-2, atol=0)  # the later positions count when all do
    assert torch.equal(measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2",
                                           positions=torch.ones_like(first)), whole)
    with pytest.raises(ValueError, match="the windows' shape"):
        measure_sensitivity(tiny_lm, coders, windows, anchor="tq-2", positions=first[:, :k])


def test_keys_and_values_take_only_the_schemes_their_own_lists_allow(acts, tmp_path, tiny_lm):
    """--key-candidates and --value-candidates bar schemes from one part: with KIVI-4 barred from the keys and
    KIVI-2 from the values, no key takes KIVI-4 and no value KIVI-2, where the same budget makes an unrestricted
    plan take both (checked first). The sensitivities are measured as without the lists (every candidate on
    both parts)."""
    common = dict(model=tiny_lm, candidates=("kivi-2-g8", "kivi-4-g8"), anchor="kivi-2-g8", windows=1, seq_len=32,
                  residual=16)
    # G = 8, on keys and values alike: KIVI-2 costs 2 + 32 / 8 = 6 bits per element, KIVI-4 8, plus a sink token's
    # 16 / 1024 (the manifest's cost_bits_per_element): KIVI-2 keys with KIVI-4 values 7.016, all KIVI-4 8.016
    [free] = make_plan(acts, 7.1, tmp_path / "free", **common)
    [split] = make_plan(acts, 7.1, tmp_path / "split", key_candidates=("kivi-2-g8",), value_candidates=("kivi-4-g8",),
                        **common)
    free, split = (json.loads((p / "manifest.json").read_text()) for p in (free, split))
    taken = lambda m, p: {n for heads in m["settings"][p] for n in heads}  # noqa: E731
    assert taken(free, "k") | taken(free, "v") == {"kivi-2-g8", "kivi-4-g8"}
    assert taken(split, "k") == {"kivi-2-g8"} and taken(split, "v") == {"kivi-4-g8"}
    assert split["extra"]["candidates_per_part"] == {"k": ["kivi-2-g8"], "v": ["kivi-4-g8"]}
    assert split["extra"]["sensitivity_per_kv_head"] == free["extra"]["sensitivity_per_kv_head"]
    assert split["extra"]["cost_bits_per_element"] == free["extra"]["cost_bits_per_element"]  # true costs recorded
    assert split["extra"]["predicted_bits_per_element"] <= 7.1


@pytest.mark.parametrize("kwargs,match", [({"key_candidates": ("kivi-4-g8",)}, "--key-candidates: kivi-4-g8 not among"),
                                          ({"value_candidates": ()}, "--value-candidates must name"),
                                          ({"key_candidates": ("kivi-4-g8x",)}, "kivi-4-g8x")])
def test_a_part_list_outside_the_candidates_is_refused_before_anything_is_written(acts, tmp_path, tiny_lm, kwargs, match):
    with pytest.raises(SettingsError, match=match):
        make_plan(acts, 6.0, tmp_path / "plan", model=tiny_lm, candidates=("kivi-2-g8",), anchor="kivi-2-g8",
                  residual=16, **kwargs)
    assert not (tmp_path / "plan").exists()


def test_by_default_keys_take_only_the_scalar_candidates_and_values_all(acts, tmp_path, tiny_lm):
    """Without --key-candidates the keys may take only the candidates without a vector codebook (vector codes on
    keys miscopied RULER's needles at 4k: defaults.PLAN_VECTOR_KEYS); the values may take every candidate, and a
    budget below what scalar values cost makes them take a vector one."""
    candidates = ("turboquant-2", "turboquant-d4b6", "vecinfer-d4b6")
    [path] = make_plan(acts, 2.5, tmp_path / "plan", model=tiny_lm, candidates=candidates, windows=1, seq_len=32,
                       iters=3, residual=16, kmeans="torch")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["extra"]["candidates_per_part"] == {"k": ["turboquant-2"], "v": list(candidates)}
    keys, values = ({n for heads in manifest["settings"][p] for n in heads} for p in ("k", "v"))
    assert keys == {"turboquant-2"} and values - {"turboquant-2"}
