"""The calibration commands on CUDA: collect (one GPU, and spread by --device-map auto),
train-adapters, diagnose and fit-codebook with `--device cuda`, each against its CPU run on the same tiny
collection. A float16 model on the GPU and a float32 one on the CPU do not give equal bits; what must
hold is stated per test."""

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: these tests compare the commands' CUDA runs with their CPU runs", allow_module_level=True)

from kvcalib import models  # noqa: E402
from kvcalib.collect import Activations, collect  # noqa: E402


@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_model_dir, text_file):
    """One CPU collection both devices' fits read (the fits' inputs are then equal)."""
    models._load_cached.cache_clear()
    return collect(tmp_path_factory.mktemp("acts") / "acts", model=str(tiny_model_dir), dataset=str(text_file),
                   num_samples=6, seq_len=64, device="cpu")


def test_collect_on_a_gpu_and_spread_by_device_map_auto_record_the_same_bytes(tmp_path, tiny_model_dir, text_file):
    """One GPU with `--device cuda` and `--device-map auto` on a machine of one GPU place every layer on the
    same device and run the same kernels: the shards are equal byte for byte. Against the float32 CPU
    run the float16 GPU run's keys differ by float16 rounding of a float16 forward: within 2% of the
    keys' norm (a forward of a few layers in float16, u = 2^-11 per operation)."""
    args = dict(model=str(tiny_model_dir), dataset=str(text_file), num_samples=3, seq_len=64)
    runs = {}
    for name, placement in (("cuda", {"device": "cuda"}), ("auto", {"device_map": "auto"}), ("cpu", {"device": "cpu"})):
        models._load_cached.cache_clear()
        runs[name] = Activations(collect(tmp_path / name, **args, **placement))
    models._load_cached.cache_clear()
    for layer in range(runs["cpu"].num_layers):
        a, b, c = (runs[n].layer(layer) for n in ("cuda", "auto", "cpu"))
        for name in ("q", "k", "v"):
            assert torch.equal(a[name], b[name]), (layer, name)
            err = (a[name].float() - c[name].float()).norm() / c[name].float().norm()
            assert err < 0.02, (layer, name, err.item())
    assert json.loads((tmp_path / "cuda" / "plan.json").read_text())["model_dtype"] == "float16"


def test_adapters_trained_on_a_gpu_lower_the_held_out_loss_as_on_the_cpu(tmp_path, acts):
    """train-adapters --device cuda: the same initial draws (a CPU generator), the same data; Adam's path
    differs by float rounding. Held to: every layer's correction lowers the held-out attention KL on
    the GPU wherever it does on the CPU, and the two corrected losses are within 10% of each other."""
    from kvcalib.methods.kvlinc_fit import train_adapters

    runs = {}
    for device in ("cpu", "cuda"):
        path = train_adapters(acts, tmp_path / device, rank=16, steps=20, group_size=8, residual=16, tokens=48,
                              device=device)
        runs[device] = json.loads((path / "manifest.json").read_text())["extra"]
    for layer, (before, after) in enumerate(zip(runs["cuda"]["heldout_ce_uncorrected"], runs["cuda"]["heldout_ce_corrected"])):
        if runs["cpu"]["heldout_ce_corrected"][layer] < runs["cpu"]["heldout_ce_uncorrected"][layer]:
            assert after < before, layer
        assert abs(after - runs["cpu"]["heldout_ce_corrected"][layer]) <= 0.1 * runs["cpu"]["heldout_ce_corrected"][layer]


def test_diagnose_on_a_gpu_reports_the_cpu_numbers(tmp_path, acts):
    """diagnose --device cuda: norms and quantiles in float64 (equal to the CPU's up to summation order),
    quantization errors of float32 round trips (float32 sums in another order): every number within 1e-4
    relative of the CPU's (float32's u = 6e-8 times the sqrt of the ~1e5 terms of the largest sum, 2e-5,
    with room)."""
    from kvcalib.diagnose import diagnose

    reports = {d: json.loads((diagnose(acts, tmp_path / d, device=d, plot_layers=[0]) / "report.json").read_text())
               for d in ("cpu", "cuda")}

    def close(a, b, where):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                close(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{where}[{i}]")
        elif isinstance(a, float):
            assert abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12), (where, a, b)
        else:
            assert a == b, (where, a, b)

    close(reports["cpu"]["summary"], reports["cuda"]["summary"], "summary")


def test_fit_codebook_device_cpu_keeps_k_means_on_the_cpu_and_cuda_fits_on_the_gpu(tmp_path, acts):
    """fit-codebook --device cpu runs faiss on the CPU; --device cuda runs k-means on the GPU: faiss's GPU
    build where installed, else kvcalib's own torch k-means (`--kmeans auto`); the artifact says which.
    The torch fit on the GPU against the same fit on the CPU (same seed, same sampled points, same start):
    float32 sums in another order move a centroid by a few float32 units of its size, which can move a
    point across a boundary between iterations, so the codebooks are compared by how well they encode the
    keys, within 1% (k-means' own run-to-run spread is about 1%: tests/test_vecinfer.py)."""
    faiss = pytest.importorskip("faiss", reason="fit-codebook needs faiss (pip install kvcalib[cpu])")
    from safetensors.torch import load_file

    from kvcalib import vq
    from kvcalib.methods.vecinfer_fit import fit_codebook

    runs = {"cpu": {"device": "cpu"}, "cuda": {"device": "cuda"}, "torch-cpu": {"device": "cpu", "kmeans": "torch"}}
    paths = {name: fit_codebook(acts, tmp_path / name, k_config="d4b6", v_config="d2b5", iters=5,
                                max_points_per_centroid=64, **args) for name, args in runs.items()}
    extra = {name: json.loads((p / "manifest.json").read_text())["extra"]["kmeans"] for name, p in paths.items()}
    assert extra["cpu"]["gpu"] is False and extra["cpu"]["library"].startswith("faiss")
    assert extra["cuda"]["gpu"] is True
    assert extra["cuda"]["library"].startswith("faiss" if faiss.get_num_gpus() > 0 else "torch")
    if faiss.get_num_gpus() == 0:
        books = {name: load_file(str(paths[name] / "tensors.safetensors")) for name in ("cuda", "torch-cpu")}
        from kvcalib.methods.vecinfer import keys_to_codec

        codec = keys_to_codec(Activations(acts).layer(0)["k"], books["torch-cpu"]["layers.0.k_smooth"], True)
        sub = codec.reshape(-1, 4)  # the keys as the codebooks were fitted on them, in sub-vectors of 4
        errs = [vq.inertia(sub, books[n]["layers.0.k_codebook"][0].float()) for n in ("cuda", "torch-cpu")]
        assert abs(errs[0] - errs[1]) <= 0.01 * errs[1], errs


def test_plan_on_a_gpu_fits_its_vector_codebooks_there_without_faiss(tmp_path, acts, tiny_model_dir, text_file, no_faiss):
    """plan on CUDA with faiss absent (the lent GPUs have no faiss-gpu): `--kmeans auto` takes kvcalib's own
    k-means on the model's GPU, the manifest says so, and the plan's vector codebooks are that fit's, to
    within what the CPU and GPU runs of it differ by (the test above: about 1% of the keys' coding error);
    eval reads the plan on the GPU."""
    import math

    from kvcalib import vq
    from kvcalib.artifacts import load_artifact
    from kvcalib.evaluate import evaluate
    from kvcalib.methods.plan import codebook_name
    from kvcalib.methods.plan_fit import make_plan
    from kvcalib.methods.turboquant_fit import _rotated_units, fit_vector_codebooks
    from kvcalib.models import AttentionShape

    [path] = make_plan(acts, 8.0, tmp_path / "plan", model=str(tiny_model_dir), candidates=("turboquant-d4b6",),
                       anchor="turboquant-d4b6", windows=1, seq_len=32, iters=5, residual=16, device="cuda")
    kmeans = json.loads((path / "manifest.json").read_text())["extra"]["kmeans"]
    assert kmeans["library"].startswith("torch ") and kmeans["gpu"] is True
    cpu = fit_vector_codebooks(Activations(acts), (vq.VQConfig(4, 6),), "layer", 5, library="torch")["d4b6"]
    fp = Activations(acts).fingerprint
    shape = AttentionShape(fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    points = _rotated_units(Activations(acts).layer(0), "k", shape, "layer").reshape(-1, 4)
    book = load_artifact(path).tensors[codebook_name(0, "k", "d4b6")]
    errs = [vq.inertia(points, b[0].float()) for b in (book, cpu["layers.0.k_codebook"])]
    assert abs(errs[0] - errs[1]) <= 0.01 * errs[1], errs
    result = evaluate(str(tiny_model_dir), str(text_file), num_samples=1, seq_len=32, method="plan",
                      artifacts=str(path), residual=16, device="cuda")
    assert math.isfinite(result.perplexity)
