import dataclasses
import json
import math

import pytest
import torch

from kvcalib import vq
from kvcalib.cli import main
from kvcalib.collect import collect
from kvcalib.errors import KvcalibError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.methods.vecinfer import (VecInfer, VecInferConfig, LayerCodebooks, fit_codebook, keys_from_codec,
                                      keys_to_codec, queries_to_codec, smoothing_factors)
from kvcalib.models import AttentionShape
from conftest import tiny_config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


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


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dim,bits", [(2, 4), (4, 8), (8, 6)])
def test_encode_picks_the_float64_nearest_centroid_and_decode_returns_it(groups, dim, bits, monkeypatch):
    monkeypatch.setattr(vq, "_DISTANCE_ENTRIES", 1000)  # force many chunks
    codebooks = torch.randn(groups, 1 << bits, dim)
    x = torch.randn(2, 3, 50, 16)
    codes = vq.encode(x, codebooks)
    sub = x.unflatten(-1, (16 // dim, dim)).double()
    per_head = codebooks.double().repeat_interleave(3 // groups, 0)
    dist = (sub.unsqueeze(-2) - per_head[None, :, None, None]).pow(2).sum(-1)
    best = dist.argmin(-1)
    assert (codes == best).float().mean() > 0.999  # float32 ties aside
    decoded = vq.decode(codes, codebooks)
    assert torch.equal(decoded.unflatten(-1, (-1, dim)), per_head.float()[torch.arange(3)[None, :, None, None], codes])
    assert torch.equal(vq.encode(decoded, codebooks), codes)


@pytest.mark.parametrize("head_dim", [16, 64, 96])
@pytest.mark.parametrize("smooth,hadamard", [(True, True), (True, False), (False, True)])
def test_smoothing_and_rotation_leave_q_dot_k_unchanged(head_dim, smooth, hadamard):
    q, k = torch.randn(2, 6, 9, head_dim) * 3, torch.randn(2, 2, 11, head_dim)
    k[..., 3] *= 40  # an outlier channel
    lam = smoothing_factors(k) if smooth else None
    ref = q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2)
    kt = keys_to_codec(k, lam, hadamard)
    got = queries_to_codec(q, lam, hadamard) @ kt.repeat_interleave(3, 1).transpose(-1, -2)
    assert _rel(got, ref) < 1e-5
    assert _rel(keys_from_codec(kt, lam, hadamard), k) < 1e-6
    if smooth:
        assert kt.abs().amax() < k.abs().amax() / 5  # the outlier channel is tamed


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


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("smooth,hadamard", [(True, True), (False, False)])
def test_lut_scores_equal_dequantize_then_dot(groups, smooth, hadamard):
    method = _random_method(groups, smooth=smooth, hadamard=hadamard)
    k, v, q = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 4, 5, 16)
    packed = method.compress(0, k, v)
    k_hat, _ = method.decompress(0, packed)
    ref = q.double() @ k_hat.double().repeat_interleave(2, 1).transpose(-1, -2)
    assert _rel(method.key_scores(0, q, packed), ref) < 1e-5


def test_compress_round_trips_centroid_vectors_and_counts_code_bytes_only():
    method = _random_method(2, k="d4b6", v="d2b5", smooth=True, hadamard=True)
    k, v = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    k_hat, v_hat = method.decompress(0, method.compress(0, k, v))
    # Decoded vectors are centroids already: compressing them again changes nothing (up to float error).
    k_again, v_again = method.decompress(0, method.compress(0, k_hat, v_hat))
    assert _rel(k_again, k_hat) < 1e-5 and torch.equal(v_again, v_hat)
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
    torch.testing.assert_close(tensors["layers.0.k_smooth"], smoothing_factors(rest))
    method = build_method("vecinfer", AttentionShape(2, 4, 2, 16), MethodSettings(residual=16), str(path), tiny_lm)
    assert method.sink == 2 and method.settings()["sink_tokens"] == 2
    # Without --exclude-sinks the fit sees every token; the cache still keeps the sinks in float16.
    assert not torch.equal(smoothing_factors(rest), smoothing_factors(layer["k"]))  # the sinks matter here
    seen = load_file(str(_fit(acts, tmp_path / "all", sink_tokens=2) / "tensors.safetensors"))
    torch.testing.assert_close(seen["layers.0.k_smooth"], smoothing_factors(layer["k"]))
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


def test_eval_with_vecinfer_counts_codes_residual_and_codebooks_once(acts, tmp_path, tiny_lm, text_file):
    path = _fit(acts, tmp_path / "art")
    result = evaluate(tiny_lm, str(text_file), num_samples=2, seq_len=40, method="vecinfer", residual=16,
                      artifacts=str(path))
    elements = 2 * 2 * 2 * 2 * 40 * 16
    # Per head and window: 32 flushed tokens of 3 key bytes + 5 value bytes, 8 residual tokens float16.
    cache = 2 * 2 * 2 * (32 * 8 * (3 + 5) + 8 * 2 * 16 * 16)
    shared = 16 * 2 * (64 * 4 + 32 * 2 + 2 * 16)
    assert result.effective_bits == pytest.approx((cache + shared) / elements)
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
