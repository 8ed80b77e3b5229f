"""Calibrated TurboQuant (`fit-turboquant`, `--method turboquant --artifacts`): Lloyd's algorithm per
rotated coordinate, the per-coordinate codebooks in the cache, the artifact and its bit count."""

import json
import math

import pytest
import torch

from kvcalib.collect import collect
from kvcalib.errors import ArtifactError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings, build_method
from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig, codebook, nearest_per_coordinate
from kvcalib.methods.turboquant_fit import fit_turboquant, lloyd_per_coordinate
from kvcalib.models import AttentionShape

from tolerances import U16, U32, U64, gamma

SHAPE = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _brute_mse(y: torch.Tensor, c: torch.Tensor) -> float:
    """Mean squared error of y (G, N, d) against its nearest per-coordinate centroids c (G, d, L)."""
    codes = nearest_per_coordinate(y.double(), c.double())  # (G, N, d)
    rec = c.double().gather(-1, codes.transpose(1, 2)).transpose(1, 2)
    return (y.double() - rec).pow(2).mean().item()


def _unit_sphere(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).float()


# ---- Lloyd per coordinate ----

def test_prefix_sum_error_equals_the_brute_force_error_and_never_increases():
    d, n = 16, 4000
    y = (_unit_sphere(n, d, 0) * torch.linspace(0.2, 3.0, d)).unsqueeze(0)  # anisotropic coordinates
    init = codebook(d, 2).float().expand(1, d, 4)
    c, history = lloyd_per_coordinate(y, init, 30)
    # Both are float64 sums of N·d squares: they agree within 2·γ_{N·d}·Σ(squares) / (N·d) = 2·γ·mse.
    bound = 2 * gamma(n * d + 4, U64) * history[-1] * 4
    assert abs(history[-1] - _brute_mse(y, c)) <= bound
    assert abs(history[0] - _brute_mse(y, init)) <= 2 * gamma(n * d + 4, U64) * history[0] * 4
    assert all(b <= a * (1 + 1e-12) for a, b in zip(history, history[1:])), history  # Lloyd never moves up
    assert history[-1] < 0.8 * history[0]  # these coordinates are far from the sphere's density: fitting pays
    assert (c.diff(dim=-1) >= 0).all()


def test_samples_of_the_sphere_give_back_the_oblivious_lloyd_max_codebook():
    d, n, bits = 16, 200_000, 2
    y = _unit_sphere(n, d, 1).unsqueeze(0)  # rotated coordinates of uniform unit vectors: exactly TurboQuant's density
    exact = codebook(d, bits)
    start = (exact * 1.3).float().expand(1, d, 1 << bits)  # started away from it
    c, _ = lloyd_per_coordinate(y, start, 200)
    # Each centroid is a cell mean of ~n / 4 samples whose spread within the cell is below 1 / sqrt(d)
    # (the coordinate's standard deviation): 6 standard errors of a mean, per coordinate.
    tol = 6 / math.sqrt(d) / math.sqrt(n / (1 << bits))
    assert (c[0] - exact).abs().max().item() <= tol


def test_a_fit_stopped_before_its_first_step_does_not_reach_the_codebook():
    """The test above can fail: with the start unmoved (Lloyd stopped at once), 1.3x is far outside."""
    d, n, bits = 16, 200_000, 2
    exact = codebook(d, bits)
    start = (exact * 1.3).float().expand(1, d, 1 << bits)
    tol = 6 / math.sqrt(d) / math.sqrt(n / (1 << bits))
    assert (start[0].double() - exact).abs().max().item() > tol


# ---- the cache with per-coordinate codebooks ----

def _books(c: torch.Tensor, groups: int = 1):
    return [(c.expand(groups, *c.shape[1:]).clone(), c.expand(groups, *c.shape[1:]).clone())] * SHAPE.num_layers


def test_the_oblivious_codebook_per_coordinate_codes_and_decodes_exactly_as_turboquant():
    config = TurboQuantConfig(bits=2, residual=16)
    plain = TurboQuant(config, SHAPE)
    books = codebook(16, 2).half().float().expand(1, 16, 4)  # the oblivious centroids as TurboQuant holds them
    calibrated = TurboQuant(config, SHAPE, _books(books, 2), "head")
    k, v = torch.randn(2, 2, 48, 16), torch.randn(2, 2, 48, 16)
    a, b = plain.compress(1, k, v), calibrated.compress(1, k, v)
    assert torch.equal(a.k.codes, b.k.codes) and torch.equal(a.v.codes, b.v.codes)
    assert torch.equal(plain.decompress(1, a)[0], calibrated.decompress(1, b)[0])
    moved = books.clone()
    moved[0, 5, 1] += 0.05  # one centroid of one coordinate
    shifted = TurboQuant(config, SHAPE, _books(moved, 2), "head").compress(1, k, v)
    assert not torch.equal(a.k.codes, shifted.k.codes)


def test_each_kv_head_uses_its_own_codebook():
    config = TurboQuantConfig(bits=1, residual=16)
    c = torch.tensor([-0.2, 0.2]).expand(2, 16, 2).clone()
    c[1] *= 2  # head 1's centroids twice head 0's
    method = TurboQuant(config, SHAPE, [(c, c)] * 2, "head")
    x = torch.randn(1, 2, 16, 16)
    k, _ = method.decompress(0, method.compress(0, x, x))
    # ‖decoded‖ = ‖x‖ · ‖centroid vector‖ (the rotation keeps norms): head 0 reads 0.2·sqrt(16) = 0.8,
    # head 1 twice that; within the float16 norm's rounding U16 and float32 rotations (2·γ_16(U32)).
    ratio = k.norm(dim=-1) / x.norm(dim=-1)
    tol = U16 + 2 * gamma(16, U32)
    assert ((ratio[0, 0] - 0.8).abs() / 0.8).max() <= tol
    assert ((ratio[0, 1] - 1.6).abs() / 1.6).max() <= tol


# ---- fit, artifact, eval ----

@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_lm, text_file):
    out = tmp_path_factory.mktemp("acts") / "acts"
    return collect(out, model=tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


@pytest.mark.parametrize("granularity,groups", [("layer", 1), ("head", 2)])
def test_fit_writes_ascending_codebooks_that_lower_the_error_on_the_collection(acts, tmp_path, tiny_lm,
                                                                               granularity, groups):
    path = fit_turboquant(acts, tmp_path / "art", bits=2, granularity=granularity, iters=20)
    method = build_method("turboquant", SHAPE, MethodSettings(residual=16), str(path), tiny_lm)
    for k, v in method.books:
        assert k.shape == v.shape == (groups, 16, 4)
        assert (k.diff(dim=-1) >= 0).all() and (v.diff(dim=-1) >= 0).all()
    ratios = json.loads((path / "manifest.json").read_text())["extra"]["mse_calibrated_over_oblivious_per_layer"]
    assert all(r <= 1.0 for which in ("k", "v") for r in ratios[which])  # Lloyd started at the oblivious codebook
    assert method.settings()["calibrated"] is True and method.settings()["granularity"] == granularity


def test_eval_counts_the_codebooks_once(acts, tmp_path, tiny_lm, text_file):
    path = fit_turboquant(acts, tmp_path / "art", bits=2, iters=5)
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=32, method="turboquant",
                      residual=16, artifacts=str(path))
    elements = 2 * 2 * 2 * 32 * 16  # layers, K and V, KV heads, tokens, head_dim
    cache = 2 * 2 * 2 * 32 * (32 + 16)  # one word of 2-bit codes and a float16 norm per vector
    shared = 16 * 2 * 2 * (1 * 16 * 4)  # float16 centroids: layers, K and V, (1, d, 4)
    assert result.effective_bits == (cache + shared) / elements
    assert math.isfinite(result.perplexity)


def test_settings_that_contradict_the_artifact_are_refused(acts, tmp_path):
    path = fit_turboquant(acts, tmp_path / "art", bits=2, iters=2)
    with pytest.raises(SettingsError, match="--bits 3 contradicts the artifact"):
        build_method("turboquant", SHAPE, MethodSettings(bits=3), str(path))


def test_a_codebook_out_of_order_or_of_another_shape_is_refused(acts, tmp_path):
    from safetensors.torch import load_file, save_file

    path = fit_turboquant(acts, tmp_path / "art", bits=2, iters=2)
    tensors = load_file(str(path / "tensors.safetensors"))
    tensors["layers.1.v_codebook"] = tensors["layers.1.v_codebook"].flip(-1)
    save_file(tensors, str(path / "tensors.safetensors"))
    manifest = json.loads((path / "manifest.json").read_text())
    from kvcalib.artifacts import _checksum

    manifest["tensors"]["layers.1.v_codebook"]["sha256"] = _checksum(tensors["layers.1.v_codebook"])
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="layers.1.v_codebook"):
        build_method("turboquant", SHAPE, MethodSettings(), str(path))


@pytest.mark.parametrize("kwargs,match", [({"bits": 5}, "--bits"), ({"granularity": "token"}, "--granularity"),
                                          ({"iters": 0}, "--iters")])
def test_bad_fit_settings_are_refused_before_anything_is_written(acts, tmp_path, kwargs, match):
    with pytest.raises(SettingsError, match=match):
        fit_turboquant(acts, tmp_path / "art", **kwargs)
    assert not (tmp_path / "art").exists()
