"""TurboQuant (MSE variant): the Lloyd-Max codebook of the rotated-coordinate density, the seeded
orthogonal rotation, the round trip's distortion, the stored bits and the flush rule."""

import math

import pytest
import torch

from kvcalib.errors import ArtifactError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings, build_method, hold, turboquant
from kvcalib.methods.turboquant import LLOYD_STOP, TurboQuantConfig, codebook, expected_distortion, midpoints, rotation
from kvcalib.models import AttentionShape
from kvcalib.quant import pack_bits, pack_stream, unpack_bits

from test_methods import _moved_beyond_float16_rounding
from tolerances import U16, U32, U64, gamma

BITS = (1, 2, 3, 4)


def _shape(d: int) -> AttentionShape:
    return AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=d)


def _method(d: int, bits: int, residual: int = 16):
    return build_method("turboquant", _shape(d), MethodSettings(bits=bits, residual=residual))


# ---- the codebook: a fixed point of Lloyd-Max on the exact density ----

def _simpson_cell_means(c: torch.Tensor, d: int, step: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """The conditional mean of f(t) ∝ (1 − t²)^((d−3)/2) over every nearest-centroid cell of c, by
    composite Simpson in θ = asin t (an integration independent of the module's closed forms), in an
    even number of steps of at most `step` per cell, and a bound on its error.

    With t = sin θ the cell integrals are M0 = ∫ g0, g0 = cosⁿ θ, and M1 = ∫ g1, g1 = sin θ cosⁿ θ,
    n = d − 2. Truncation: cosⁿ θ = E[e^{iSθ}] for S a sum of n independent ±1 signs, so |g0⁗| <=
    E[S⁴] = 3n² − 2n, and |g1⁗| <= 3(n+1)² − 2(n+1) likewise with n + 1 signs; Simpson errs by at most
    w h⁴ max|g⁗| / 180 on a cell of width w in steps h. Round-off, per node: the angle is within
    (3π/2) u64 of its place (asin of the edge, the grid's product and sum), which moves g by |g'| times
    that, |g0'| <= n cos^(n−1) θ |sin θ|, |g1'| <= (n+1) cos^(n−1) θ; cos, sin, the power and the
    product add (n + 3) u64 |g|; the weight h/3 two roundings. The sums are `math.fsum`, correctly
    rounded (u64 |M|), and every g is of one sign in a cell (0 is an edge). M1 / M0 then errs by
    (A1 + |t| A0) / (M0 − A0), |t| <= 1.
    """
    n = d - 2
    edges = torch.cat([torch.tensor([-1.0], dtype=torch.float64), (c[1:] + c[:-1]) / 2,
                       torch.tensor([1.0], dtype=torch.float64)])
    theta = torch.asin(edges)
    means, errors = [], []
    for a, b in zip(theta[:-1].tolist(), theta[1:].tolist()):
        intervals = 2 * math.ceil((b - a) / step / 2)
        h = (b - a) / intervals
        simpson = torch.ones(intervals + 1, dtype=torch.float64)
        simpson[1:-1:2], simpson[2:-1:2] = 4, 2
        grid = a + h * torch.arange(intervals + 1, dtype=torch.float64)
        cos, sin = torch.cos(grid), torch.sin(grid)
        w = simpson * (h / 3)
        g0 = cos**n
        g1 = sin * g0
        slope0 = n * cos.clamp_min(0) ** (n - 1) * sin.abs()
        slope1 = (n + 1) * cos.clamp_min(0) ** (n - 1)
        m0, m1 = math.fsum((w * g0).tolist()), math.fsum((w * g1).tolist())
        node = 1.5 * math.pi * U64
        round0 = (w * (slope0 * node + (n + 3) * U64 * g0.abs())).sum().item() + 3 * U64 * abs(m0)
        round1 = (w * (slope1 * node + (n + 3) * U64 * g1.abs())).sum().item() + 3 * U64 * abs(m1)
        a0 = (b - a) * h**4 * (3 * n**2 - 2 * n) / 180 + round0
        a1 = (b - a) * h**4 * (3 * (n + 1) ** 2 - 2 * (n + 1)) / 180 + round1
        means.append(m1 / m0)
        errors.append((a1 + a0) / (m0 - a0))
    return torch.tensor(means, dtype=torch.float64), torch.tensor(errors, dtype=torch.float64)


def _closed_form_error(c: torch.Tensor, d: int) -> torch.Tensor:
    """A bound on how far the module's float64 Lloyd map T(c) (closed forms, `cell_moments`) is from
    the exact conditional means, per cell.

    1 − t² carries an absolute error of u64, relative u64 / (1 − t²), which a power p multiplies by p.
    I(t) = w asin t (or w t) + t Σ_k w_k/k (1 − t²)^((k−1)/2): powers up to (n−1)/2, coefficients from
    n/2 products, a sum of n/2 terms of one sign, so a relative error of (n−1) u64 / (1 − t²) +
    γ_{2n+4}(u64); at t = ±1 the powers are exactly 0. P(t) = (1 − t²)^((d−1)/2) / (d−1): relative
    (d−1) u64 / (1 − t²) + 3 u64, exactly 0 at ±1. A cell's M0 = I(b) − I(a) and M1 = P(a) − P(b) add
    one rounding; M1 / M0 errs by (δM1 + |c| δM0) / (M0 − δM0), plus the division and the symmetrization's
    averaging (2 u64 |c|).
    """
    n = d - 2
    edges = torch.cat([torch.tensor([-1.0], dtype=torch.float64), (c[1:] + c[:-1]) / 2,
                       torch.tensor([1.0], dtype=torch.float64)])
    inner = edges.abs() < 1
    inv = torch.where(inner, 1 / (1 - edges**2).clamp_min(U64), 0.0)
    i_val = turboquant.cos_power_integral(edges, n).abs()
    i_err = ((n - 1) * U64 * inv + gamma(2 * n + 4, U64)) * i_val
    p_val = (1 - edges**2).clamp_min(0) ** ((d - 1) / 2) / (d - 1)
    p_err = ((d - 1) * U64 * inv + 3 * U64) * p_val
    m0, m1, _ = turboquant.cell_moments(edges, d)
    dm0 = i_err[:-1] + i_err[1:] + U64 * m0.abs()
    dm1 = p_err[:-1] + p_err[1:] + U64 * m1.abs()
    return (dm1 + c.abs() * dm0) / (m0 - dm0) + 2 * U64 * c.abs()


def _fixed_point_excess(c: torch.Tensor, d: int) -> float:
    """max over cells of |conditional mean − centroid| / tolerance: <= 1 at a Lloyd-Max fixed point.
    The tolerance: the module's stopping residual `LLOYD_STOP` (measured with its closed forms), their
    error, and this test's quadrature error."""
    means, quad_err = _simpson_cell_means(c, d)
    tol = LLOYD_STOP + _closed_form_error(c, d) + quad_err
    return ((means - c).abs() / tol).max().item()


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("bits", BITS)
def test_codebook_is_the_lloyd_max_fixed_point_of_the_rotated_coordinate_density(d, bits):
    c = codebook(d, bits)
    assert c.shape == (1 << bits,) and bool((c.diff() > 0).all()) and torch.equal(c, -c.flip(0))
    assert _fixed_point_excess(c, d) <= 1
    method = _method(d, bits)  # it reads back float16 centroids; its thresholds are their midpoints
    held = c.half().float()
    assert torch.equal(method._centroids32, held) and torch.equal(method._thresholds32, (held[1:] + held[:-1]) / 2)
    assert ((held.double() - c).abs() <= 2.0**-11 * c.abs()).all()  # rounded once: u16 of each centroid


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("bits", BITS)
def test_a_centroid_moved_by_a_billionth_breaks_the_fixed_point_check(d, bits):
    c = codebook(d, bits).clone()
    c[-1] += 1e-9  # the spacing of the centroids is ~0.01 to 1
    assert _fixed_point_excess(c, d) > 10


def test_the_tolerance_of_the_fixed_point_check_is_far_below_the_centroids_spacing():
    c = codebook(64, 4)
    _, quad_err = _simpson_cell_means(c, 64)
    assert (LLOYD_STOP + _closed_form_error(c, 64) + quad_err).max().item() < 1e-9 * c.diff().min().item()


# ---- the rotation ----

def _orthogonality_excess(p: torch.Tensor) -> float:
    """max |Π Πᵀ − I| / bound for the float32 Π the method uses.

    Π is a float64 Householder QR factor, orthogonal to O(d u64) (Higham, Theorem 19.4), allowed
    d² u64; rounding it to float32 moves each entry by u32 relative, so (Π Πᵀ)_ij moves by at most
    (2 u32 + u32²) Σ_k |Π_ik||Π_jk| <= (2 u32 + u32²) ‖Π_i‖‖Π_j‖ (Cauchy–Schwarz, rows of norm 1);
    the test's float64 product adds γ_d(u64) of the same sum."""
    d = p.shape[0]
    p = p.double()
    bound = 2 * U32 + U32**2 + gamma(d, U64) + d * d * U64
    return ((p @ p.T - torch.eye(d, dtype=torch.float64)).abs() / bound).max().item()


@pytest.mark.parametrize("d", [16, 64, 96, 128])
def test_rotation_is_orthogonal_and_the_same_on_every_call(d):
    p = rotation(d)
    assert _orthogonality_excess(p) <= 1
    assert torch.equal(p, turboquant._rotation64(d, turboquant.ROTATION_SEED).float())


@pytest.mark.parametrize("d", [16, 64])
def test_a_rotation_with_one_flipped_sign_breaks_the_orthogonality_bound(d):
    p = rotation(d).clone()
    p[0, 0] = -p[0, 0]
    assert _orthogonality_excess(p) > 1000


# ---- the round trip: its distortion is the codebook's ----

def _unit_vectors(n: int, d: int) -> torch.Tensor:
    x = torch.randn(n, d, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).float()


def _distortion_excess(errors: torch.Tensor, expected: float, eps: float) -> float:
    """|mean of per-vector errors ‖x̂ − x‖² − d·D| / tolerance, for unit vectors x uniform on the sphere.

    For any fixed orthogonal Π, Π x is uniform on the sphere, so every coordinate has the codebook's
    density and E‖x̂ − x‖² = d·D exactly. The vectors are independent: the mean's standard error is
    sd / sqrt(N), and 5 of them leave a false failure once in ~2·10⁶ runs. Arithmetic: with ε a bound on
    the float32 pipeline's error in ‖y‖ and ‖x̂‖ for a unit x, each vector's sqrt-error moves by at most
    3ε (ε for y, ε for x̂, ε because codes nearest to the computed y are at most 2ε worse than the
    nearest to the exact y), so its error by 6ε sqrt(e) + 9ε², whose mean is <= 6ε sqrt(d·D) + 9ε².
    """
    se = errors.double().std().item() / math.sqrt(errors.numel())
    tol = 5 * se + 6 * eps * math.sqrt(expected) + 9 * eps**2
    return abs(errors.double().mean().item() - expected) / tol


def _float32_eps(d: int, norm_u: float = 0.0) -> float:
    """ε of `_distortion_excess`: two float32 rotations of unit vectors (2 sqrt(d) γ_d(u32), as in
    test_oscar's round trip), Π's own float32 rounding (‖Π₃₂ − Π‖_F <= sqrt(d) u32, twice), the
    normalization, the centroids' rounding and the final scaling (u32 each, one more to spare), and
    the norm's float16 rounding (`norm_u`: 0 for a unit vector, whose float32 norm is within
    (d+1) u32 of 1 and so rounds to 1 in float16)."""
    return 2 * math.sqrt(d) * (gamma(d, U32) + U32) + 4 * U32 + norm_u


def _round_trip_errors(method, x: torch.Tensor) -> torch.Tensor:
    half = x.shape[0] // 2  # keys and values: the same codec, two independent halves
    k, v = x[:half].reshape(1, 1, half, -1), x[half:2 * half].reshape(1, 1, half, -1)
    kq, vq = method.decompress(0, method.compress(0, k, v))
    return torch.cat([(kq - k).pow(2).sum(-1).flatten(), (vq - v).pow(2).sum(-1).flatten()])


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_of_random_unit_vectors_is_the_codebooks_expected_distortion(d, bits):
    method = _method(d, bits)
    expected = d * expected_distortion(d, codebook(d, bits))
    errors = _round_trip_errors(method, _unit_vectors(20_000, d))
    assert _distortion_excess(errors, expected, _float32_eps(d)) <= 1


def _one_code_off(method, monkeypatch):
    """Every vector's first code moved to a neighbouring level (its lowest bit flipped)."""
    encode = method.encode_vectors

    def planted(x, centroids=None):
        coded = encode(x, centroids)
        codes = unpack_bits(coded.codes, method.config.bits, -1, method.head_dim)
        codes[..., 0] ^= 1
        coded.codes = pack_bits(codes, method.config.bits, -1)
        return coded
    monkeypatch.setattr(method, "encode_vectors", planted)


def _codebook_of_one_bit_less(method, monkeypatch):
    c = codebook(method.head_dim, method.config.bits - 1)
    monkeypatch.setattr(method, "_centroids32", c.half().float())
    monkeypatch.setattr(method, "_thresholds32", midpoints(c.half().float()))


def _read_back_with_pi_not_its_transpose(method, monkeypatch):
    def planted(coded, centroids=None):
        codes = unpack_bits(coded.codes, method.config.bits, -1, method.head_dim)
        return (method._centroids32[codes] @ rotation(method.head_dim).T) * coded.norm.float()
    monkeypatch.setattr(method, "decode_vectors", planted)


PLANTS = {"one code off": _one_code_off, "codebook of one bit less": _codebook_of_one_bit_less,
          "Π instead of Πᵀ to read back": _read_back_with_pi_not_its_transpose}


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("bits", [2, 4])
def test_planted_codec_errors_break_the_distortion_check(plant, bits, monkeypatch):
    d = 64
    method = _method(d, bits)
    expected = d * expected_distortion(d, codebook(d, bits))
    PLANTS[plant](method, monkeypatch)
    errors = _round_trip_errors(method, _unit_vectors(20_000, d))
    assert _distortion_excess(errors, expected, _float32_eps(d)) > 1


# ---- what the cache holds and what it costs ----

def _bits_per_vector(d: int, bits: int) -> int:
    """The codes as one bit stream in whole 32-bit words (`kvcalib.quant.pack_stream`) and a float16 norm."""
    return 32 * -(-d * bits // 32) + 16


@pytest.mark.parametrize("d", [16, 64, 96])
@pytest.mark.parametrize("bits", BITS)
def test_stored_bits_count_whole_words_of_codes_and_a_float16_norm_per_vector(d, bits):
    method = _method(d, bits, residual=8)
    k, v = torch.randn(1, 2, 21, d), torch.randn(1, 2, 21, d)
    held = hold(method, 0, k, v)
    vectors = 2 * 2 * 16  # keys and values, 2 KV heads, 16 flushed tokens
    assert held.stored_bits == vectors * _bits_per_vector(d, bits) + 16 * 2 * 2 * 5 * d


def test_two_bits_at_head_dim_64_cost_two_and_a_quarter_bits_per_element():
    method = _method(64, 2)
    k, v = torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64)
    held = hold(method, 0, k, v)
    assert held.flushed == 32
    assert held.stored_bits / (k.numel() + v.numel()) == 2.25  # integer counts, dyadic ratio: exact


def _held_as_the_flush_rule_says(held, method, k, v, flushed: int) -> bool:
    """Tokens from `flushed` on exactly float16; those before, exactly the codec's round trip of their
    float16 values, which moves them beyond float16 rounding."""
    k16, v16 = k.half().float(), v.half().float()
    kq, vq = method.decompress(0, method.compress(0, k16[..., :flushed, :], v16[..., :flushed, :]))
    return (held.flushed == flushed
            and torch.equal(held.k[..., flushed:, :], k16[..., flushed:, :])
            and torch.equal(held.v[..., flushed:, :], v16[..., flushed:, :])
            and torch.equal(held.k[..., :flushed, :], kq) and torch.equal(held.v[..., :flushed, :], vq)
            and _moved_beyond_float16_rounding(held.k[..., :flushed, :], k[..., :flushed, :])
            and _moved_beyond_float16_rounding(held.v[..., :flushed, :], v[..., :flushed, :]))


def test_hold_keeps_the_last_partial_block_in_float16_and_compresses_whole_blocks():
    method = _method(16, 2, residual=8)
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    assert _held_as_the_flush_rule_says(hold(method, 0, k, v), method, k, v, flushed=16)
    # one rotation and codebook for every layer: the same tokens are held alike in layer 3
    assert torch.equal(hold(method, 3, k, v).k, hold(method, 0, k, v).k)


def test_a_flush_block_one_token_short_breaks_the_flush_rule_check():
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    short = _method(16, 2, residual=7)  # flushes all 21 tokens
    assert not _held_as_the_flush_rule_says(hold(short, 0, k, v), _method(16, 2, residual=8), k, v, flushed=16)


def test_a_zero_vector_reads_back_as_zero():
    method = _method(16, 3)
    x = torch.zeros(1, 1, 8, 16)
    kq, vq = method.decompress(0, method.compress(0, x, x))
    assert torch.equal(kq, x) and torch.equal(vq, x)


# ---- settings ----

@pytest.mark.parametrize("kwargs", [dict(bits=0), dict(bits=5), dict(bits=8), dict(residual=0)])
def test_invalid_turboquant_settings_are_refused(kwargs):
    with pytest.raises(SettingsError):
        TurboQuantConfig(**kwargs)


@pytest.mark.parametrize("option", [dict(group_size=32), dict(scaling="l2"), dict(rotation=False)])
def test_options_turboquant_does_not_use_are_refused(option):
    with pytest.raises(SettingsError, match="is not an option of --method turboquant"):
        build_method("turboquant", _shape(16), MethodSettings(**option))


def test_turboquant_with_a_path_that_is_no_artifact_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not a kvcalib artifact"):
        build_method("turboquant", _shape(16), MethodSettings(), str(tmp_path / "nothing-here"))


def test_eval_runs_turboquant_and_counts_its_bits(tiny_lm, text_file):
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=32, method="turboquant", bits=2,
                      residual=16)
    assert result.settings["bits"] == 2 and result.settings["residual"] == 16
    # head_dim 16, 32 tokens in two flushed blocks: one 32-bit word of codes and a float16 norm per vector
    assert result.effective_bits == (32 + 16) / 16
    assert math.isfinite(result.perplexity)


# ---- against the public `turboquant` package (its TurboQuantMSE), when it is importable ----

def _relative_errors(x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    """‖x̂ − x‖² / ‖x‖² per vector: the error of the unit vector x / ‖x‖, whatever the norm."""
    return ((xh.double() - x.double()).pow(2).sum(-1) / x.double().pow(2).sum(-1)).flatten()


@pytest.mark.parametrize("bits", BITS)
def test_against_the_turboquant_package_on_the_same_vectors(bits, monkeypatch):
    """Both rotate, code each coordinate by its nearest centroid and scale by the norm, so on the same
    vectors each one's error is its own codebook's expected distortion, and our codec given the
    package's codebook errs as the package does. The package's codebook (0.2.0) is not Lloyd-Max: for
    b >= 2 its cells are the 2^b equal-probability quantiles of the density, with their conditional means
    as centroids (one half-step of Lloyd), and for b = 1 the large-d limit ±sqrt(2 / (π d)). So at 1 bit
    the two agree (expected distortions within 0.01% at d = 64), and at 2, 3, 4 bits the package's
    error is 1.10, 1.43, 2.05 times ours (ours: the paper's 0.117, 0.03, 0.009)."""
    package = pytest.importorskip("turboquant", reason="the public turboquant package is not installed "
                                  "(pip download --no-deps turboquant; unpack; PYTHONPATH=...)")
    import numpy as np

    if not hasattr(np, "trapz"):  # the package calls np.trapz, which NumPy 2.4 removed
        monkeypatch.setattr(np, "trapz", np.trapezoid, raising=False)
    d = 64
    theirs = package.TurboQuantMSE(d, bits, device="cpu", seed=42)
    x = torch.randn(1, 1, 20_000, d)  # isotropic: Π x / ‖x‖ is uniform on the sphere for any fixed Π
    codes, norms = theirs.quantize(x)
    errors_theirs = _relative_errors(x, theirs.dequantize(codes, norms))
    method = _method(d, bits)
    errors_ours = _relative_errors(x, method.decompress(0, method.compress(0, x, x))[0])
    expected_ours = d * expected_distortion(d, codebook(d, bits))
    expected_theirs = d * expected_distortion(d, theirs.codebook.double())
    # Ours stores the norm in float16 (u16 relative); theirs in float32, and adds 1e-10 to it.
    assert _distortion_excess(errors_ours, expected_ours, _float32_eps(d, norm_u=U16)) <= 1
    assert _distortion_excess(errors_theirs, expected_theirs, _float32_eps(d)) <= 1
    swapped = theirs.codebook.double()
    monkeypatch.setattr(method, "_centroids32", swapped.float())
    monkeypatch.setattr(method, "_thresholds32", ((swapped[1:] + swapped[:-1]) / 2).float())
    errors_swapped = _relative_errors(x, method.decompress(0, method.compress(0, x, x))[0])
    assert _distortion_excess(errors_swapped, expected_theirs, _float32_eps(d, norm_u=U16)) <= 1
    if bits == 1:
        assert abs(expected_theirs - expected_ours) <= 1e-4 * expected_ours
    else:
        assert errors_ours.mean() < errors_theirs.mean()


def test_unit_rotation_divides_a_zero_vector_to_zero_and_any_other_by_its_norm_bit_for_bit():
    """`unit_rotated` divides by the norm clamped at float64's least normal number: the same bits as dividing a zero
    vector by 1 and any other by its norm (float32 and float16 inputs: their norms all lie above that number)."""
    from kvcalib.methods.turboquant import unit_rotated

    x = torch.randn(5, 3, 64)
    x[1, 2] = 0.0
    x[3, 0] = 1e-30
    y, norm = unit_rotated(x)
    x64 = x.double()
    n64 = x64.norm(dim=-1, keepdim=True)
    want = ((x64 / torch.where(n64 > 0, n64, 1.0)) @ rotation(64, torch.float64).T).float()
    assert torch.equal(y, want) and torch.equal(norm, n64.float())
    assert torch.equal(y[1, 2], torch.zeros(64)) and norm[1, 2].item() == 0.0


def test_calibrated_thresholds_are_held_for_the_book_a_flush_reads_and_made_anew_for_a_replaced_one():
    """`TurboQuant._bounds`: the midpoints of a layer's calibrated book, made once for the book object the flushes
    read (its device copy), not per flush; the codes equal those of thresholds made each call; a new book object
    (the layer's books replaced) gets its own."""
    shape = AttentionShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64)
    gen = torch.Generator().manual_seed(3)
    books = [(torch.randn(1, 64, 4, generator=gen).sort(-1).values, torch.randn(1, 64, 4, generator=gen).sort(-1).values)]
    method = turboquant.TurboQuant(TurboQuantConfig(bits=2, residual=16), shape, books=books)
    k = torch.randn(1, 1, 16, 64, generator=gen)
    book = method._layer_books(0, k.device)[0]
    first = method._bounds(book)
    assert method._bounds(book) is first and torch.equal(first, midpoints(book))
    packed = method.compress(0, k, k)
    y, _ = turboquant.unit_rotated(k)
    fresh = turboquant.nearest_per_coordinate(y, book)  # thresholds made in the call
    assert torch.equal(packed.k.codes, pack_stream(fresh, 2))
    other = book.clone()
    other[..., 0] -= 1.0
    assert not torch.equal(method._bounds(other), first) and torch.equal(method._bounds(other), midpoints(other))
    held = len(method._held_bounds)
    del other
    assert len(method._held_bounds) == held - 1  # a book no longer alive is not kept by its thresholds

