import dataclasses
import json
import math

import pytest
import torch

from kvcalib import vq
from kvcalib.formats.vq import layout as vq_layout
from kvcalib.cli import main
from kvcalib.collect import collect
from kvcalib.errors import KvcalibError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.hadamard import hadamard as hadamard_matrix
from kvcalib.methods import MethodSettings, build_method, hold, vecinfer
from kvcalib.methods.vecinfer import (LayerCodebooks, VecInfer, VecInferConfig, keys_from_codec, keys_to_codec,
                                      queries_to_codec, smoothing_factors)
from kvcalib.methods.vecinfer_fit import fit_codebook
from kvcalib.models import AttentionShape
from conftest import tiny_config
from tolerances import U32, gamma


def _abs_rotation(d: int, rotated: bool) -> torch.Tensor:
    """|H| in float64, or the identity without the rotation: what bounds a rotated vector elementwise."""
    return hadamard_matrix(d, torch.float64).abs() if rotated else torch.eye(d, dtype=torch.float64)


def _flipped_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H with the sign of H's first entry flipped: no longer orthogonal."""
    h = hadamard_matrix(x.shape[-1], x.dtype).clone()
    h[0, 0] = -h[0, 0]
    return x @ h


@pytest.mark.parametrize("bits", [3, 4, 8, 12, 16])
@pytest.mark.parametrize("count", [1, 5, 16])
def test_packed_codes_round_trip_in_exactly_ceil_c_times_m_over_8_bytes(bits, count):
    codes = torch.randint(0, 1 << bits, (2, 3, 7, count))
    packed = vq.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, 7, math.ceil(count * bits / 8))
    assert torch.equal(vq.unpack_codes(packed, bits, count), codes)


def test_eight_and_sixteen_bit_codes_are_plain_bytes_and_little_endian_halfwords():
    codes = torch.randint(0, 1 << 16, (5, 4))
    halfwords = vq.pack_codes(codes, 16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(halfwords, codes)
    small = torch.randint(0, 256, (5, 4))
    assert torch.equal(vq.pack_codes(small, 8).to(torch.int64), small)


def _tie_gap_over_bound(x: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor) -> float:
    """max over sub-vectors of (float64 distance of the chosen centroid − of the nearest) / bound.

    `vq.nearest` compares |c|² − 2 x·c in float32: the norm and the dot product are sums of N terms
    (γ_N of |c|² and of 2|x|·|c|), the difference one more rounding. A centroid can win over the float64
    nearest only if their distances differ by less than the two candidates' errors together; the extra
    u32 covers the float64 distances' own error and second-order products.
    """
    n = codebooks.shape[-1]
    sub = x.unflatten(-1, (-1, n)).double()  # (B, H, T, c, N)
    per_head = codebooks.double().repeat_interleave(x.shape[1] // codebooks.shape[0], 0)  # (H, 2^M, N)
    dist = (sub.unsqueeze(-2) - per_head[None, :, None, None]).pow(2).sum(-1)
    magnitude = per_head.pow(2).sum(-1)[None, :, None, None] + 2 * torch.einsum("bhtcn,hen->bhtce", sub.abs(), per_head.abs())
    err = (gamma(n, U32) + 2 * U32) * magnitude
    nearest = dist.argmin(-1, keepdim=True)
    chosen = codes.unsqueeze(-1)
    gap = dist.gather(-1, chosen) - dist.gather(-1, nearest)
    return (gap / (err.gather(-1, chosen) + err.gather(-1, nearest))).max().item()


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dim,bits", [(2, 4), (4, 8), (8, 6)])
def test_encode_picks_the_float64_nearest_centroid_and_decode_returns_it(groups, dim, bits, monkeypatch):
    monkeypatch.setattr(vq, "_DISTANCE_ENTRIES", 1000)  # force many chunks
    codebooks = torch.randn(groups, 1 << bits, dim)
    x = torch.randn(2, 3, 50, 16)
    codes = vq.encode(x, codebooks)
    per_head = codebooks.double().repeat_interleave(3 // groups, 0)
    assert _tie_gap_over_bound(x, codebooks, codes) <= 1  # the float64 nearest, or a float32 tie with it
    decoded = vq.decode(codes, codebooks)
    assert torch.equal(decoded.unflatten(-1, (-1, dim)), per_head.float()[torch.arange(3)[None, :, None, None], codes])
    assert torch.equal(vq.encode(decoded, codebooks), codes)


def test_a_code_swapped_for_the_second_nearest_centroid_breaks_the_tie_bound():
    codebooks, x = torch.randn(1, 64, 4), torch.randn(2, 3, 50, 16)
    codes = vq.encode(x, codebooks)
    dist = (x.unflatten(-1, (4, 4)).double().unsqueeze(-2) - codebooks.double()[0]).pow(2).sum(-1)
    two = dist.topk(2, -1, largest=False)
    at = (two.values[..., 1] - two.values[..., 0]).argmax()  # the clearest choice of all
    codes.view(-1)[at] = two.indices[..., 1].reshape(-1)[at]
    assert _tie_gap_over_bound(x, codebooks, codes) > 10


def _codec_errors_over_bounds(q, k, lam, hadamard, q_lam=None) -> tuple[float, float]:
    """(max over scores, max over key elements) of error / bound for q̃·k̃ against q·k and for the keys'
    round trip, all in float32; `q_lam` smooths the queries with other factors (a planted error).

    With a = |q λ||H| and b = |k / λ||H| (|H| the identity without the rotation), every rotated
    element is bounded by a or b. Scores: the two rotations and the dot product sum d terms each
    (γ_d), the roundings of q λ, k / λ and of H's entries (1/sqrt(32) for d = 96) one u32 each, the
    float64 reference and second-order products one more: |error| <= (3γ_d + 7u32) a·b.
    Round trip (k / λ) H H λ: two rotations (γ_d + u32 each) and the division are bounded by b|H|,
    then · λ, whose own rounding is u32 |k|: |error| <= (2γ_d + 4u32) λ (b|H|) + u32 |k|.
    """
    d, g = q.shape[-1], q.shape[1] // k.shape[1]
    habs = _abs_rotation(d, hadamard)
    lam64 = lam.double()[:, None, :] if lam is not None else torch.ones(k.shape[1], 1, d, dtype=torch.float64)
    kt = keys_to_codec(k, lam, hadamard)
    got = queries_to_codec(q, lam if q_lam is None else q_lam, hadamard) @ kt.repeat_interleave(g, 1).transpose(-1, -2)
    ref = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)
    a = (q.double() * lam64.repeat_interleave(g, 0)).abs() @ habs
    b = (k.double() / lam64).abs() @ habs
    scores_bound = (3 * gamma(d, U32) + 7 * U32) * (a @ b.repeat_interleave(g, 1).transpose(-1, -2))
    back = keys_from_codec(kt, lam, hadamard)
    keys_bound = (2 * gamma(d, U32) + 4 * U32) * lam64 * (b @ habs) + U32 * k.double().abs()
    return (((got.double() - ref).abs() / scores_bound).max().item(),
            ((back.double() - k.double()).abs() / keys_bound).max().item())


def _queries_and_outlier_keys(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = torch.randn(2, 6, 9, head_dim) * 3, torch.randn(2, 2, 11, head_dim)
    k[..., 3] *= 40  # an outlier channel
    return q, k


@pytest.mark.parametrize("head_dim", [16, 64, 96])
@pytest.mark.parametrize("smooth,hadamard", [(True, True), (True, False), (False, True)])
def test_smoothing_and_rotation_leave_q_dot_k_unchanged(head_dim, smooth, hadamard):
    q, k = _queries_and_outlier_keys(head_dim)
    lam = smoothing_factors(k) if smooth else None
    scores, keys = _codec_errors_over_bounds(q, k, lam, hadamard)
    assert scores <= 1 and keys <= 1
    if smooth:
        # Not round-off: λ = sqrt(max |k|) takes the 40x channel to about sqrt(40) times the others,
        # and H spreads it over sqrt(d)-sized sums; measured 8x smaller or more. 5x leaves room.
        assert keys_to_codec(k, lam, hadamard).abs().amax() < k.abs().amax() / 5  # the outlier channel is tamed


@pytest.mark.parametrize("head_dim", [16, 96])
@pytest.mark.parametrize("smooth", [True, False])
def test_a_hadamard_with_one_flipped_sign_breaks_the_score_and_round_trip_bounds(head_dim, smooth, monkeypatch):
    monkeypatch.setattr(vq_layout, "rotate", _flipped_rotate)  # where the codec's transforms live
    q, k = _queries_and_outlier_keys(head_dim)
    scores, keys = _codec_errors_over_bounds(q, k, smoothing_factors(k) if smooth else None, True)
    assert scores > 10 and keys > 10


@pytest.mark.parametrize("hadamard", [True, False])
def test_queries_smoothed_with_one_factor_one_float16_ulp_off_break_the_score_bound(hadamard):
    q, k = _queries_and_outlier_keys(16)
    lam = smoothing_factors(k)
    off = lam.clone()
    off.view(torch.int16)[:, 3] += 1  # the outlier channel's λ, one float16 ulp up, for the queries only
    scores, _ = _codec_errors_over_bounds(q, k, lam, hadamard, q_lam=off)
    assert scores > 10


def test_odd_head_dim_with_hadamard_is_refused_with_a_clear_line():
    shape = AttentionShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=15)
    with pytest.raises(SettingsError, match="odd"):
        VecInferConfig("d5b4", "d5b4").check(shape)
    VecInferConfig("d5b4", "d5b4", hadamard=False).check(shape)


def _random_method(groups: int, k="d4b6", v="d2b5", smooth=True, hadamard=True) -> VecInfer:
    shape = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    config = VecInferConfig(k, v, "head" if groups > 1 else "layer", smooth, hadamard)
    books = LayerCodebooks(k=torch.randn(groups, config.k.centroids, config.k.dim).half(),
                           v=torch.randn(groups, config.v.centroids, config.v.dim).half(),
                           smooth=(torch.rand(2, 16) + 0.5).half() if smooth else None)
    return VecInfer(config, [books], shape, residual=8)


def _lut_error_over_bound(method: VecInfer, q: torch.Tensor, packed, reference_packed) -> float:
    """max over scores of |key_scores(packed) − q · decompress(reference_packed)| / bound.

    Both sides compute ((q λ) H)·c = q·((c H) λ) for the centroids c that the codes name, in float32:
    the lookup table rounds q λ (u32), rotates it (d terms: γ_d, plus u32 for H's entries) and sums
    N-term sub-vector products over d/N sub-vectors (γ_N + γ_{d/N} <= γ_d); the reference rotates c
    (γ_d + u32) and multiplies by λ (u32). All are bounded by (|q λ||H|)·|c|: (3γ_d + 4u32) of it.
    """
    books, config = method.layers[0], method.config
    d, g = q.shape[-1], q.shape[1] // method.shape.num_kv_heads
    k_hat, _ = method.decompress(0, reference_packed)
    ref = q.double() @ k_hat.double().repeat_interleave(g, 1).transpose(-1, -2)
    lam = books.smooth.double().repeat_interleave(g, 0)[:, None, :] if config.smooth else 1.0
    a = (q.double() * lam).abs() @ _abs_rotation(d, config.hadamard)
    c = vq.decode(method.codes(reference_packed.k, "k"), books.k).double().abs()  # centroids in the codec's space
    bound = (3 * gamma(d, U32) + 4 * U32) * (a @ c.repeat_interleave(g, 1).transpose(-1, -2))
    return ((method.key_scores(0, q, packed).double() - ref).abs() / bound).max().item()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("smooth,hadamard", [(True, True), (False, False)])
def test_lut_scores_equal_dequantize_then_dot(groups, smooth, hadamard):
    method = _random_method(groups, smooth=smooth, hadamard=hadamard)
    k, v, q = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 4, 5, 16)
    packed = method.compress(0, k, v)
    assert _lut_error_over_bound(method, q, packed, packed) <= 1


@pytest.mark.parametrize("smooth,hadamard", [(True, True), (False, False)])
def test_lut_scores_with_one_key_code_flipped_break_the_bound(smooth, hadamard):
    method = _random_method(1, smooth=smooth, hadamard=hadamard)
    k, v, q = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 4, 5, 16)
    packed = method.compress(0, k, v)
    flipped = dataclasses.replace(packed, k=packed.k.clone())
    flipped.k[0, 1, 7, 0] ^= 1  # the lowest bit of one key's first code: another centroid
    assert _lut_error_over_bound(method, q, flipped, packed) > 10


def test_compress_round_trips_centroid_vectors_and_counts_code_bytes_only():
    method = _random_method(2, k="d4b6", v="d2b5", smooth=True, hadamard=True)
    k, v = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    k_hat, v_hat = method.decompress(0, method.compress(0, k, v))
    # Decoded vectors are centroids already: compressing them again picks the same centroids, and the
    # same codes decode to the same floats. Keys come back into the codec's space within float32
    # round-off (~1e-6 relative), far nearer their centroid than any other one (random float16
    # centroids in 4 dimensions: ~0.3 apart); values are the centroids themselves.
    k_again, v_again = method.decompress(0, method.compress(0, k_hat, v_hat))
    assert torch.equal(k_again, k_hat) and torch.equal(v_again, v_hat)
    held = hold(method, 0, torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16))
    # 16 flushed tokens: keys 4 codes x 6 bits = 3 bytes, values 8 codes x 5 bits = 5 bytes per head;
    # 5 residual tokens in float16.
    assert held.stored_bits == 16 * 2 * 8 * (3 + 5) + 5 * 2 * 2 * 16 * 16
    assert method.constant_bits() == 16 * (2 * 64 * 4 + 2 * 32 * 2 + 2 * 16)


@pytest.mark.parametrize("sink", [1, 5])
def test_sink_tokens_are_held_in_float16_and_cost_16_bits_beside_their_codes(sink):
    plain = _random_method(1)
    method = VecInfer(dataclasses.replace(plain.config, sink_tokens=sink), plain.layers, plain.shape, residual=8)
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    held, base = hold(method, 0, k, v), hold(plain, 0, k, v)
    assert torch.equal(held.k[..., :sink, :], k[..., :sink, :].half().float())
    assert torch.equal(held.v[..., :sink, :], v[..., :sink, :].half().float())
    assert torch.equal(held.k[..., sink:, :], base.k[..., sink:, :]) and torch.equal(held.v[..., sink:, :], base.v[..., sink:, :])
    assert not torch.equal(base.k[..., :sink, :], held.k[..., :sink, :])
    assert held.stored_bits == base.stored_bits + 16 * 2 * 2 * sink * 16
    # No flushed block yet: every token is in the float16 residual, nothing extra is counted.
    early = hold(method, 0, k[..., :7, :], v[..., :7, :])
    assert early.stored_bits == hold(plain, 0, k[..., :7, :], v[..., :7, :]).stored_bits


def test_fit_leaves_sink_tokens_out_of_smoothing_and_codebooks_only_when_asked(acts, tmp_path, tiny_lm):
    from safetensors.torch import load_file

    from kvcalib.collect import Activations

    layer = Activations(acts).layer(0)
    rest = layer["k"][:, :, 2:]
    path = _fit(acts, tmp_path / "sinks", sink_tokens=2, exclude_sinks=True)
    tensors = load_file(str(path / "tensors.safetensors"))
    # The same float16 activations, an exact max, a correctly rounded sqrt: equal to the bit.
    assert torch.equal(tensors["layers.0.k_smooth"], smoothing_factors(rest))
    method = build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(residual=16), str(path), tiny_lm)
    assert method.sink == 2 and method.settings()["sink_tokens"] == 2
    # Without --exclude-sinks the fit sees every token; the cache still keeps the sinks in float16.
    assert not torch.equal(smoothing_factors(rest), smoothing_factors(layer["k"]))  # the sinks matter here
    seen = load_file(str(_fit(acts, tmp_path / "all", sink_tokens=2) / "tensors.safetensors"))
    assert torch.equal(seen["layers.0.k_smooth"], smoothing_factors(layer["k"]))
    assert build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(residual=16),
                        str(tmp_path / "all"), tiny_lm).sink == 2


def test_sink_tokens_that_leave_nothing_to_fit_are_refused(acts, tmp_path):
    with pytest.raises(SettingsError, match="sink-tokens"):
        _fit(acts, tmp_path / "art", sink_tokens=64, exclude_sinks=True)
    assert not (tmp_path / "art").exists()


@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_lm, text_file):
    out = tmp_path_factory.mktemp("acts") / "acts"
    return collect(out, model=tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


def _fit(acts, out, **kwargs):
    args = dict(k_config="d4b6", v_config="d2b5", iters=5, max_points_per_centroid=64) | kwargs
    return fit_codebook(acts, out, **args)


@pytest.mark.parametrize("granularity,groups", [("layer", 1), ("head", 2)])
def test_fitted_artifact_holds_codebooks_and_smoothing_of_every_layer(acts, tmp_path, tiny_lm, granularity, groups):
    path = _fit(acts, tmp_path / "art", granularity=granularity)
    method = build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(residual=16), str(path), tiny_lm)
    for books in method.layers:
        assert books.k.shape == (groups, 64, 4) and books.k.dtype == torch.float16
        assert books.v.shape == (groups, 32, 2)
        assert books.smooth.shape == (2, 16)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["settings"]["max_points_per_centroid"] == 64
    assert manifest["settings"]["k_config"] == "d4b6"


def test_fit_is_deterministic_under_a_fixed_seed(acts, tmp_path):
    first = _fit(acts, tmp_path / "a", seed=3)
    again = _fit(acts, tmp_path / "b", seed=3)
    other = _fit(acts, tmp_path / "c", seed=4)
    from safetensors.torch import load_file

    a, b, c = (load_file(str(p / "tensors.safetensors")) for p in (first, again, other))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["layers.0.k_codebook"], c["layers.0.k_codebook"])


@pytest.mark.parametrize("config", ["d2b5", "d4b6"])
def test_kmeans_lowers_inertia_well_below_its_random_initialisation(config):
    vqc = vq.VQConfig.parse(config)
    points = torch.randn(64 * vqc.centroids, vqc.dim) * torch.rand(vqc.dim) * 3
    fit = vq.kmeans(points, vqc, iters=20, seed=1, max_points_per_centroid=64)
    assert fit.codebook.shape == (vqc.centroids, vqc.dim)
    sample = points[torch.randperm(points.shape[0])[: vqc.centroids]]
    assert vq.inertia(points, fit.codebook) < 0.85 * vq.inertia(points, sample)


@pytest.mark.parametrize("config", ["d4b6", "d4b8"])
def test_torch_kmeans_lands_within_the_spread_of_faiss_over_seeds(config):
    """kvcalib's own k-means (for a GPU without faiss-gpu) against faiss on the same points: Lloyd's
    method ends in a local optimum that depends on the seed, so the tolerance is faiss's own spread over
    five seeds (1.2% at most here, 64 points per centroid), widened by that spread on each side. Its
    starting centroids alone (0 iterations, the planted error) are far outside it."""
    pytest.importorskip("faiss", reason="the comparison is with faiss (pip install kvcalib[cpu])")
    vqc = vq.VQConfig.parse(config)
    points = torch.randn(64 * vqc.centroids, vqc.dim, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.5, 3, vqc.dim)
    faiss_runs = [vq.inertia(points, vq.kmeans(points, vqc, 20, seed, 64).codebook) for seed in range(5)]
    lo, hi = min(faiss_runs), max(faiss_runs)
    spread = hi - lo
    ours = vq.kmeans_torch(points, vqc, 20, 1, 64)
    assert ours.codebook.shape == (vqc.centroids, vqc.dim) and ours.training_points == points.shape[0]
    assert lo - spread <= vq.inertia(points, ours.codebook) <= hi + spread, (faiss_runs, vq.inertia(points, ours.codebook))
    start = vq.inertia(points, vq.kmeans_torch(points, vqc, 0, 1, 64).codebook)
    assert start > hi + spread


def test_torch_kmeans_is_bit_for_bit_repeatable_samples_its_training_points_and_follows_its_seed():
    vqc = vq.VQConfig.parse("d2b4")
    points = torch.randn(5000, 2, generator=torch.Generator().manual_seed(6))
    a, b = (vq.kmeans_torch(points, vqc, 10, 3, 100) for _ in range(2))
    assert torch.equal(a.codebook, b.codebook) and a.training_points == 16 * 100
    assert not torch.equal(a.codebook, vq.kmeans_torch(points, vqc, 10, 4, 100).codebook)


def test_torch_kmeans_reseeds_an_empty_cluster_by_splitting_the_largest():
    """Points at two places only (1 and 2), 2^2 centroids started at sampled points, all four at 1: the
    clusters that get no point are re-seeded beside the largest (±SPLIT_EPS of it, faiss's multiplicative
    rule), so no centroid stays a copy of another, and the point at 2 gets a centroid of its own. Without
    the re-seeding (the planted error, 0 iterations) every centroid sits at 1."""
    vqc = vq.VQConfig(1, 2)
    points = torch.cat([torch.ones(290, 1), torch.full((10, 1), 2.0)])
    assert vq.kmeans_torch(points, vqc, 0, 0, 1000).codebook.flatten().tolist() == [1.0] * 4
    fit = vq.kmeans_torch(points, vqc, 5, 0, 1000)
    book = fit.codebook.flatten()
    assert len(set(book.tolist())) == 4
    near = book[book < 1.5]
    assert len(near) == 3 and (near - 1).abs().max() < 4 * vq.SPLIT_EPS and (book == 2).sum() == 1
    assert vq.inertia(points, fit.codebook) < 290 * (4 * vq.SPLIT_EPS) ** 2


def test_fit_codebook_with_torch_kmeans_needs_no_faiss_and_says_so_in_the_artifact(acts, tmp_path, no_faiss):
    """`--kmeans torch` on the CPU (what `auto` picks on a GPU without faiss-gpu): an artifact whose codebooks
    reconstruct the keys about as well as faiss's (the k-means tolerance above), made with faiss absent."""
    from kvcalib.methods.vecinfer_fit import kmeans_library

    path = _fit(acts, tmp_path / "torch", kmeans="torch")
    extra = json.loads((path / "manifest.json").read_text())["extra"]
    assert extra["kmeans"]["library"].startswith("torch ") and extra["kmeans"]["gpu"] is False
    assert kmeans_library("auto", "cuda:0") == ("torch", True)  # a GPU and no faiss: kvcalib's own
    with pytest.raises(SettingsError, match="needs faiss"):
        kmeans_library("auto", "cpu")
    with pytest.raises(SettingsError, match="--kmeans must be one of"):
        kmeans_library("sometimes", "cpu")


def test_eval_with_vecinfer_counts_codes_residual_and_codebooks_once(acts, tmp_path, tiny_lm, text_file):
    path = _fit(acts, tmp_path / "art")
    result = evaluate(tiny_lm, str(text_file), num_samples=2, seq_len=40, method="vecinfer", residual=16,
                      artifacts=str(path))
    elements = 2 * 2 * 2 * 2 * 40 * 16
    # Per head and window: 32 flushed tokens of 3 key bytes + 5 value bytes, 8 residual tokens float16.
    cache = 2 * 2 * 2 * (32 * 8 * (3 + 5) + 8 * 2 * 16 * 16)
    shared = 16 * 2 * (64 * 4 + 32 * 2 + 2 * 16)
    assert result.effective_bits == (cache + shared) / elements  # the same integers divided: exact
    assert math.isfinite(result.perplexity)


def test_artifact_for_another_model_or_corrupted_is_refused(acts, tmp_path):
    path = _fit(acts, tmp_path / "art")
    with pytest.raises(KvcalibError, match="another model"):
        build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(), str(path),
                     type("M", (), {"model": tiny_config(num_hidden_layers=3)})())
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-5] ^= 0x21
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(KvcalibError, match="corrupted"):
        build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(), str(path))


def test_eval_without_artifacts_is_refused():
    with pytest.raises(SettingsError, match="fit-codebook"):
        build_method("vecinfer", AttentionShape(1, 4, 2, 16))


@pytest.mark.parametrize("args,message", [
    (["--k-config", "d3b8"], "do not tile"),
    (["--v-config", "4x8"], "dNbM"),
    (["--k-config", "d4b12"], "cannot fill"),
    (["--iters", "0"], "positive"),
])
def test_bad_fit_settings_give_one_line_and_write_nothing(acts, tmp_path, capsys, args, message):
    out = tmp_path / "art"
    with pytest.raises(SystemExit) as exc:
        main(["fit-codebook", "--activations", str(acts), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_missing_activations_give_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit-codebook", "--activations", str(tmp_path / "none"), "--out", str(tmp_path / "art")])
    assert exc.value.code == 2 and "collect" in capsys.readouterr().err


def test_eval_with_a_corrupted_or_missing_artifact_gives_one_line(acts, tmp_path, tiny_model_dir, text_file, capsys):
    path = _fit(acts, tmp_path / "art")
    (path / "manifest.json").write_text("{ not json")
    base = ["eval", "--model", str(tiny_model_dir), "--dataset", str(text_file), "--num-samples", "1",
            "--seq-len", "32", "--method", "vecinfer"]
    for extra, message in ((["--artifacts", str(path)], "corrupted"), ([], "needs --artifacts")):
        with pytest.raises(SystemExit) as exc:
            main(base + extra)
        lines = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and lines[-1].startswith("kvcalib: error: ") and message in lines[-1]
        assert "Traceback" not in "\n".join(lines)


def test_cluster_sums_are_the_float64_sums_of_each_clusters_points_rounded_once():
    """`cluster_sums` against the one-hot product in float64 (exact to 2^-53 relative here), clusters empty and
    full: each sum within one float32 rounding of the exact one (|s| 2^-24) plus the running sum's float64
    error (P max|x| 2^-53); bit for bit the same on a second call."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(20000, 8, generator=g) * 3
    assign = torch.randint(0, 300, (20000,), generator=g)
    assign[assign == 17] = 18  # an empty cluster
    counts = torch.bincount(assign, minlength=512)  # and 212 more, past the largest index
    want = torch.nn.functional.one_hot(assign, 512).double().T @ x.double()
    got = vq.cluster_sums(x, assign, counts)
    bound = want.abs() * 2.0**-24 + x.shape[0] * x.abs().max().double() * 2.0**-53
    assert ((got.double() - want).abs() <= bound).all()
    assert not got[17].any() and not got[300:].any()
    assert torch.equal(got, vq.cluster_sums(x, assign, counts))
    # A planted error: the unsorted points (each sum taken over the wrong rows) are far outside the bound.
    running = torch.cat([torch.zeros(1, 8, dtype=torch.float64), torch.cumsum(x.double(), 0)])
    ends = torch.cumsum(counts, 0)
    wrong = (running[ends] - running[ends - counts]).float()
    assert not ((wrong.double() - want).abs() <= bound).all()


def test_lut_scores_read_the_heads_the_codes_hold():
    """A tensor-parallel rank holds some of the KV heads, with a method that holds nothing per head (one codebook
    pair, no smoothing) and so keeps the whole model's shape: the scores take their head count from the codes,
    and equal the full cache's scores for those heads. Planted: counting heads from the method's shape, a rank
    holding two of four KV heads would pair its four query heads with the codes one to one, and the shapes would
    not meet."""
    method = _random_method(1, smooth=False, hadamard=True)
    method.shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=4, head_dim=16)
    k, v, q = torch.randn(1, 4, 24, 16), torch.randn(1, 4, 24, 16), torch.randn(1, 8, 5, 16)
    full = method.key_scores(0, q, method.compress(0, k, v))
    for rank in range(2):
        own = method.compress(0, k[:, 2 * rank : 2 * rank + 2], v[:, 2 * rank : 2 * rank + 2])
        assert torch.equal(method.key_scores(0, q[:, 4 * rank : 4 * rank + 4], own), full[:, 4 * rank : 4 * rank + 4])


def test_code_rows_read_as_words_are_the_stream_the_codebook_kernel_reads():
    """`bytes_as_words`: VecInfer's byte rows read as int32 words (padded to whole words) are the words built
    from their bytes, least significant first, for whole and partial words and strided rows; the same stream
    `pack_stream` writes for the codes (the codebook kernel's layout)."""
    from kvcalib.quant import bytes_as_words as byte_rows_as_words
    from kvcalib.quant import pack_stream

    g = torch.Generator().manual_seed(5)
    for shape in [(3, 5, 24), (2, 4, 7, 13), (2, 3, 1)]:
        rows = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        rows[..., 0] = 255  # a word whose top byte is 255 too where whole: its sign bit set
        words = byte_rows_as_words(rows)
        padded = torch.nn.functional.pad(rows, (0, -shape[-1] % 4)).long()
        built = padded[..., 0::4] | padded[..., 1::4] << 8 | padded[..., 2::4] << 16 | padded[..., 3::4] << 24
        assert words.dtype == torch.int32 and torch.equal(words.long() & 0xFFFFFFFF, built)
    strided = torch.randint(0, 256, (4, 16, 8), dtype=torch.uint8, generator=g).transpose(0, 1)
    assert torch.equal(byte_rows_as_words(strided), byte_rows_as_words(strided.contiguous()))
    rows = torch.randint(0, 256, (2, 9), dtype=torch.uint8, generator=g)[:, 1:]  # 8 bytes a row, at offset 1
    words = byte_rows_as_words(rows)
    assert torch.equal(words, byte_rows_as_words(rows.clone())) and words.data_ptr() != rows.data_ptr()
    codes = torch.randint(0, 64, (3, 32), generator=g)  # d4b6's 32 codes of 6 bits a row
    assert torch.equal(byte_rows_as_words(vq.pack_codes(codes, 6)), pack_stream(codes, 6))


def test_compiled_code_rows_as_words_trace_no_dtype_view_and_give_the_eager_words():
    """Under torch.compile `bytes_as_words` takes its arithmetic form (a dtype view that changes the element
    size fails Inductor's fake tensors on CUDA, torch 2.11: tests/test_quant.py), with the eager words."""
    from test_quant import _dtype_views

    from kvcalib.quant import bytes_as_words as byte_rows_as_words

    g = torch.Generator().manual_seed(6)
    for shape in [(3, 5, 24), (2, 7, 13)]:
        rows = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        assert _dtype_views(byte_rows_as_words, rows) == []
        compiled = torch.compile(byte_rows_as_words, fullgraph=True, dynamic=False)(rows)
        assert torch.equal(compiled, byte_rows_as_words(rows))
