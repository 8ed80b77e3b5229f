"""`fit-turboquant`: calibrated TurboQuant. From a `collect` collection, per layer, for keys and for
values: the unit vectors x / ‖x‖ rotated by TurboQuant's Π, and for each rotated coordinate (of
every KV head pooled, or of each KV head) the 2^b-level scalar quantizer that Lloyd's algorithm
fits to them, started from the oblivious Lloyd-Max codebook of `kvcalib.methods.turboquant`. The
format, rotation and norms are TurboQuant's: only the centroids differ. Saved as the artifact
`--method turboquant --artifacts` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..artifacts import save_artifact
from .. import vq
from ..atomic import ensure_writable_dir
from ..collect import Activations
from ..errors import SettingsError
from ..models import AttentionShape
from .turboquant import BITS, ROTATION_SEED, TurboQuant, codebook, midpoints, unit_rotated

GRANULARITIES = ("layer", "head")
LLOYD_TOL = 1e-7  # stop when no centroid moves by more than this (units of a unit vector's coordinate, ~1/sqrt(d) wide)


@dataclass
class SortedSamples:
    """Samples of every coordinate sorted, (G, d, N) float64, with prefix sums of them and of their
    squares (G, d, N + 1): prepared once, fitted at several bit widths."""

    ys: torch.Tensor
    s1: torch.Tensor
    s2: torch.Tensor

    @classmethod
    def of(cls, y: torch.Tensor) -> "SortedSamples":
        """From samples y (G, N, d)."""
        # each coordinate's samples contiguous before the sort (along a strided row it took twice as long on a CPU);
        # searchsorted needs the result contiguous too
        ys = y.transpose(1, 2).contiguous().double().sort(-1).values.contiguous()
        zero = torch.zeros(*ys.shape[:-1], 1, dtype=torch.float64)
        return cls(ys, torch.cat([zero, ys.cumsum(-1)], -1), torch.cat([zero, (ys * ys).cumsum(-1)], -1))


def lloyd_per_coordinate(y: torch.Tensor | SortedSamples, init: torch.Tensor,
                         iters: int) -> tuple[torch.Tensor, list[float]]:
    """Lloyd's algorithm for every coordinate at once. y (G, N, d) samples, init (G, d, L) ascending.
    Returns the centroids (G, d, L) and the mean squared error before each iteration and at the end
    (non-increasing: each step re-assigns to the nearest centroid, then moves it to its cell's mean).
    A cell that holds no sample keeps its centroid.

    On sorted samples a cell is a contiguous run: the sample y belongs to cell j when
    bound_{j-1} < y <= bound_j (bounds: midpoints of neighbouring centroids, as
    `nearest_per_coordinate` assigns), so its count, sum and sum of squares come from prefix sums
    (float64) at `searchsorted` positions: O(L log N) per coordinate and iteration."""
    samples = y if isinstance(y, SortedSamples) else SortedSamples.of(y)
    ys, s1, s2 = samples.ys, samples.s1, samples.s2
    n = ys.shape[-1]
    c = init.double().clone()

    def cells(c: torch.Tensor):
        bounds = midpoints(c).contiguous()
        inner = torch.searchsorted(ys, bounds, right=True)  # samples <= each bound
        idx = torch.cat([torch.zeros_like(inner[..., :1]), inner, torch.full_like(inner[..., :1], n)], -1)
        count = (idx[..., 1:] - idx[..., :-1]).double()
        total = s1.gather(-1, idx[..., 1:]) - s1.gather(-1, idx[..., :-1])
        squares = s2.gather(-1, idx[..., 1:]) - s2.gather(-1, idx[..., :-1])
        mse = ((squares - 2 * c * total + c * c * count).sum() / ys.numel()).item()
        return count, total, mse

    history = []
    for _ in range(iters):
        count, total, mse = cells(c)
        history.append(mse)
        new = torch.where(count > 0, total / count.clamp_min(1), c)
        moved = (new - c).abs().max().item()
        c = new
        if moved <= LLOYD_TOL:
            break
    history.append(cells(c)[2])
    return c, history


def check_fit_settings(bits_list: tuple[int, ...], granularity: str, iters: int) -> None:
    """Refuse, before any work, the fit settings `fit_codebooks` cannot take."""
    if any(b not in BITS for b in bits_list):
        shown = bits_list[0] if len(bits_list) == 1 else list(bits_list)
        raise SettingsError(f"--bits must be in 1..4 for TurboQuant, got {shown}")
    if granularity not in GRANULARITIES:
        raise SettingsError(f"--granularity must be layer or head, got {granularity!r}")
    if iters < 1:
        raise SettingsError("--iters must be positive")


def _rotated_units(data: dict[str, torch.Tensor], which: str, shape: AttentionShape, granularity: str) -> torch.Tensor:
    """A collected layer's keys or values as TurboQuant codes them, its rotated unit vectors, grouped by
    codebook: (Hkv, N, d) with granularity head, (1, Hkv N, d) with layer."""
    x = data[which].transpose(1, 2).reshape(-1, shape.num_kv_heads, shape.head_dim)  # (N, Hkv, d)
    y = unit_rotated(x)[0].transpose(0, 1)  # (Hkv, N, d)
    return y.reshape(1, -1, shape.head_dim) if granularity == "layer" else y


def fit_codebooks(acts: Activations, bits_list: tuple[int, ...], granularity: str = "layer", iters: int = 50,
                  desc: str = "fit-turboquant") -> tuple[dict[int, dict[str, torch.Tensor]], dict]:
    """Per bit width in `bits_list`: the artifact tensors `layers.{i}.{k,v}_codebook` (G, d, 2^b) float16
    of every layer, fitted to the collection `acts`; and, per bit width, keys and values, each layer's
    mean squared error after the fit over before it (from the oblivious codebook)."""
    check_fit_settings(bits_list, granularity, iters)
    fp = acts.fingerprint
    shape = AttentionShape(fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    tensors: dict[int, dict[str, torch.Tensor]] = {b: {} for b in bits_list}
    report: dict[int, dict[str, list[float]]] = {b: {"k": [], "v": []} for b in bits_list}
    for i in tqdm(range(shape.num_layers), desc=f"{desc} {','.join(map(str, bits_list))} bits", unit="layer"):
        data = acts.layer(i, ("k", "v"))  # the queries (most of a layer's bytes) are not fitted
        for which in ("k", "v"):
            y = _rotated_units(data, which, shape, granularity)
            groups = y.shape[0]
            samples = SortedSamples.of(y)
            for bits in bits_list:
                levels = 1 << bits
                if y.shape[1] < levels:
                    raise SettingsError(f"the collection holds {y.shape[1]} vectors per codebook, fewer than the "
                                        f"{levels} centroids of {bits} bits: collect more")
                start = codebook(shape.head_dim, bits).float().expand(groups, shape.head_dim, levels)
                centroids, history = lloyd_per_coordinate(samples, start, iters)
                tensors[bits][f"layers.{i}.{which}_codebook"] = centroids.half()
                report[bits][which].append(history[-1] / history[0])
    return tensors, report


VECTOR_POINTS_PER_CENTROID = 256  # k-means trains on at most this many sub-vectors per centroid (faiss samples them)
VECTOR_SEED = 0


def fit_vector_codebooks(acts: Activations, configs: tuple[vq.VQConfig, ...], granularity: str = "layer",
                         iters: int = 50, desc: str = "fit vector codebooks", library: str = "faiss",
                         gpu: bool | None = None, device: str = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    """Per configuration (tag `d{D}b{B}`): the tensors `layers.{i}.{k,v}_codebook` (G, 2^B, D) float16 of
    every layer (on the CPU), k-means centroids of the sub-vectors of D coordinates of the collection's
    rotated unit vectors (every sub-vector position pooled; every KV head pooled, or each KV head's own
    with granularity head), as `TurboQuantVQ` codes them. k-means: faiss's (`vq.kmeans`, on a GPU with
    `gpu`), or, with `library="torch"`, kvcalib's own (`vq.kmeans_torch`) on `device`."""
    if granularity not in GRANULARITIES:
        raise SettingsError(f"--granularity must be layer or head, got {granularity!r}")
    fp = acts.fingerprint
    shape = AttentionShape(fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    for config in configs:
        config.check(shape.head_dim)
    tensors: dict[str, dict[str, torch.Tensor]] = {str(c): {} for c in configs}
    on = vq.kmeans_device(library, device)
    for i in tqdm(range(shape.num_layers), desc=f"{desc} {','.join(map(str, configs))}", unit="layer"):
        data = acts.layer(i, ("k", "v"))  # the queries (most of a layer's bytes) are not fitted
        for which in ("k", "v"):
            y = _rotated_units(data, which, shape, granularity).to(on)
            for config in configs:
                points = y.reshape(y.shape[0], -1, config.dim)
                books = [vq.kmeans_by(library, g, config, iters, VECTOR_SEED, VECTOR_POINTS_PER_CENTROID, gpu).codebook
                         for g in points]
                tensors[str(config)][f"layers.{i}.{which}_codebook"] = torch.stack(books).half().cpu()
    return tensors


def fit_turboquant(activations: str | Path, out: str | Path, bits: int = 2, granularity: str = "layer",
                   iters: int = 50) -> Path:
    """Fit per-coordinate codebooks for keys and values of every layer; save them as an artifact."""
    check_fit_settings((bits,), granularity, iters)
    out = ensure_writable_dir(out)
    acts = Activations(activations)
    tensors, report = fit_codebooks(acts, (bits,), granularity, iters)
    settings = {"bits": bits, "granularity": granularity, "rotation_seed": ROTATION_SEED, "iters": iters}
    extra = {"activations": str(activations), "calibration": acts.manifest["settings"],
             "mse_calibrated_over_oblivious_per_layer": report[bits]}
    return save_artifact(out, TurboQuant.name, settings, acts.fingerprint, tensors[bits], extra)
