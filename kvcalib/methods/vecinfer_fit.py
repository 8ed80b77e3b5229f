"""`fit-codebook`: VecInfer's calibration. From a `collect` collection, the key smoothing factors
λ = sqrt(max |K|) per channel and k-means codebooks for keys (smoothed, Hadamard-rotated) and values of
every layer, saved as the artifact `kvcalib.methods.vecinfer` reads. k-means (`--kmeans`): faiss (on its GPU
build where installed, else on the CPU), or kvcalib's own in torch (`vq.kmeans_torch`), which `auto` takes
for `--device cuda` where faiss has no GPU: faiss-gpu has no wheel for current CUDA, and faiss-cpu's d8b12
k-means (4096 centroids, up to a million training points per codebook) is the slowest step of the pipeline
(60% of it for the embedded model: benchmarks/RESULTS.md, calibration pipeline)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import vq
from ..artifacts import save_artifact
from ..atomic import ensure_writable_dir
from ..collect import Activations, tokens_per_second
from ..defaults import KMEANS
from ..errors import SettingsError
from ..devices import resolve_device
from ..models import AttentionShape
from ..parallel import merged, on_rank0, share, world
from .vecinfer import VecInfer, VecInferConfig, keys_to_codec, smoothing_factors


def _without_sinks(data: dict[str, torch.Tensor], sink_tokens: int) -> dict[str, torch.Tensor]:
    """Keys and values of a collected layer as (1, Hkv, N, d), the tokens at positions < sink_tokens left out."""
    keep = data["positions"] >= sink_tokens  # (S, T)
    return {name: data[name].transpose(1, 2)[keep].transpose(0, 1)[None] for name in ("k", "v")}


def _subvectors(x: torch.Tensor, head: int | None, dim: int) -> torch.Tensor:
    """Rows of `dim` elements of x (S, H, T, d): every sub-vector of every token of one head, or of all."""
    x = x if head is None else x[:, head : head + 1]
    return x.reshape(-1, dim)


def _sources(data: dict[str, torch.Tensor], lam: torch.Tensor | None, hadamard: bool) -> dict[str, torch.Tensor]:
    """What VecInfer's codebooks are fitted on: the keys as the codec sees them (λ-smoothed, rotated), raw values."""
    return {"k": keys_to_codec(data["k"], lam, hadamard), "v": data["v"].float()}


def _fits(x: torch.Tensor, heads: list[int | None], config: vq.VQConfig, iters: int, seed: int,
          max_points_per_centroid: int, gpu: bool | None = None, library: str = "faiss") -> list:
    """k-means of the sub-vectors of x (S, H, T, d): one fit per KV head, or one for all (`heads` = [None]);
    `library` faiss (`vq.kmeans`, `gpu` as it takes it) or torch (`vq.kmeans_torch`, on x's device)."""
    return [vq.kmeans_by(library, _subvectors(x, h, config.dim), config, iters, seed, max_points_per_centroid, gpu)
            for h in heads]


def check_kmeans(kmeans: str) -> None:
    """Refuse a `--kmeans` that is none of `KMEANS`."""
    if kmeans not in KMEANS:
        raise SettingsError(f"--kmeans must be one of {', '.join(KMEANS)}, got {kmeans!r}")


def kmeans_library(kmeans: str, device: str) -> tuple[str, bool]:
    """(library, on a GPU) that `--kmeans` and the resolved `--device` choose (module docstring): faiss's
    GPU build where it sees a GPU and the device is CUDA; torch on the device for `torch`, and for `auto`
    on CUDA without a faiss GPU build; faiss on the CPU otherwise. faiss must be installed where chosen."""
    check_kmeans(kmeans)
    cuda = device.startswith("cuda")
    if kmeans == "torch":
        return "torch", cuda
    try:
        import faiss
    except ImportError:
        if kmeans == "auto" and cuda:
            return "torch", True
        raise SettingsError("k-means needs faiss, which is not installed: pip install kvcalib[cpu] (or [cuda12]), "
                            "or --kmeans torch") from None
    gpu = cuda and faiss.get_num_gpus() > 0
    if kmeans == "auto" and cuda and not gpu:
        return "torch", True
    return "faiss", gpu


def fit_plan_codebooks(acts: Activations, configs: tuple[vq.VQConfig, ...], granularity: str = "layer", iters: int = 30,
                       seed: int = 0, max_points_per_centroid: int = 256,
                       desc: str = "fit VecInfer codebooks", library: str = "faiss", gpu: bool | None = None,
                       device: str = "cpu") -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """VecInfer's fit (smoothing λ and Hadamard on keys, raw values; k-means by `library` as
    `kmeans_library` chose it, torch's on `device`) at several configurations at once, for a plan's
    `vecinfer-dDbB` schemes: per configuration `str(config)`, the tensors `layers.{i}.{k,v}_codebook`
    (G, 2^B, D) float16 on the CPU; and `layers.{i}.k_smooth` (Hkv, d), the λ every configuration's keys share."""
    fp = acts.fingerprint
    shape = AttentionShape(fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    VecInferConfig(granularity=granularity).check(shape)
    for config in configs:
        config.check(shape.head_dim)
    heads = [None] if granularity == "layer" else list(range(shape.num_kv_heads))
    books: dict[str, dict[str, torch.Tensor]] = {str(c): {} for c in configs}
    smooth = {}
    on = vq.kmeans_device(library, device)
    for i in tqdm(range(shape.num_layers), desc=f"{desc} {','.join(map(str, configs))}", unit="layer"):
        data = _without_sinks(acts.layer(i, ("k", "v", "positions"), device=on), 0)
        lam = smoothing_factors(data["k"])
        smooth[f"layers.{i}.k_smooth"] = lam.cpu()
        for config in configs:
            for which, x in _sources(data, lam, True).items():
                fits = _fits(x, heads, config, iters, seed, max_points_per_centroid, gpu, library)
                books[str(config)][f"layers.{i}.{which}_codebook"] = torch.stack([f.codebook for f in fits]).half().cpu()
    return books, smooth


def fit_codebook(activations: str | Path, out: str | Path, k_config: str = "d4b8", v_config: str = "d4b8",
                 granularity: str = "layer", smooth: bool = True, hadamard: bool = True, iters: int = 30,
                 seed: int = 0, max_points_per_centroid: int = 256, sink_tokens: int = 0,
                 exclude_sinks: bool = False, device: str | None = None, kmeans: str = "auto") -> Path:
    """Fit λ and faiss k-means codebooks for keys and values of every layer; save them as an artifact.

    The cache keeps the first `sink_tokens` tokens of a sequence in float16; with `exclude_sinks`
    those positions of every calibration sequence are also left out of λ and the codebooks. `device`:
    where the keys and values are transformed and k-means runs (`kmeans_library`: `kmeans` auto, faiss or
    torch)."""
    config = VecInferConfig(k_config, v_config, granularity, smooth, hadamard, sink_tokens)
    dev = resolve_device(device)
    library, gpu = kmeans_library(kmeans, dev)
    on = vq.kmeans_device(library, dev)
    if iters < 1 or max_points_per_centroid < 1:
        raise SettingsError("--iters and --max-points-per-centroid must be positive")
    out = ensure_writable_dir(out)
    acts = Activations(activations)
    fp = acts.fingerprint
    shape = AttentionShape(fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    config.check(shape)
    if exclude_sinks and sink_tokens >= acts.manifest["settings"]["seq_len"]:
        raise SettingsError(f"--sink-tokens {sink_tokens} leaves no token of the {acts.manifest['settings']['seq_len']}-token "
                            "calibration sequences to fit")
    heads = [None] if granularity == "layer" else list(range(shape.num_kv_heads))
    vectors = acts.manifest["tokens_per_layer"] * shape.num_kv_heads // len(heads)
    for vqc in (config.k, config.v):
        vqc.check_points(vectors * (shape.head_dim // vqc.dim))

    rank, size = world()
    fitted: dict[int, tuple[dict[str, torch.Tensor], dict[str, float], dict[str, int]]] = {}
    desc = f"fit-codebook K {config.k} V {config.v}" + ("" if size == 1 else f", rank {rank} of {size}")
    # under torchrun each rank fits its share of the layers (`kvcalib.parallel`); rank 0 writes the artifact
    mine = share(list(range(shape.num_layers)), rank, size)
    # the next layer is read (and checked) while this one's k-means runs
    bar = tqdm(acts.layers(mine, ("k", "v", "positions"), device=on), total=len(mine), desc=desc, unit="layer",
               position=rank)
    for i, data in bar:
        data = _without_sinks(data, sink_tokens if exclude_sinks else 0)
        lam = smoothing_factors(data["k"]) if smooth else None
        layer, seconds, points = {}, {}, {}
        if lam is not None:
            layer[f"layers.{i}.k_smooth"] = lam
        for which, x in _sources(data, lam, hadamard).items():
            fits = _fits(x, heads, config.k if which == "k" else config.v, iters, seed, max_points_per_centroid, gpu,
                         library)
            seconds[which] = sum(f.seconds for f in fits)
            points[which] = fits[-1].training_points
            layer[f"layers.{i}.{which}_codebook"] = torch.stack([f.codebook for f in fits]).half()
        fitted[i] = ({name: t.cpu() for name, t in layer.items()}, seconds, points)
        tokens_per_second(bar, acts.manifest["tokens_per_layer"])
    fitted = merged(fitted, size)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(shape.num_layers):  # in layer order, whichever rank fitted each
        tensors |= fitted[i][0]
    seconds = {w: sum(fitted[i][1][w] for i in fitted) for w in ("k", "v")}
    training_points = fitted[shape.num_layers - 1][2]
    settings = asdict(config) | {"iters": iters, "seed": seed, "max_points_per_centroid": max_points_per_centroid,
                                 "exclude_sinks": exclude_sinks}
    extra = {
        "activations": str(activations),
        "calibration": acts.manifest["settings"],
        "kmeans": {"library": library_version(library), "gpu": gpu, "training_points_per_codebook": training_points},
    }
    return on_rank0(lambda: save_artifact(out, VecInfer.name, settings, fp, tensors, extra, run={"fit_seconds": seconds}),
                    rank, size) or out


def library_version(library: str) -> str:
    """The k-means library and its version, as the artifact records it."""
    if library == "torch":
        return f"torch {torch.__version__} (kvcalib.vq.kmeans_torch)"
    import faiss

    return f"faiss {faiss.__version__}"
