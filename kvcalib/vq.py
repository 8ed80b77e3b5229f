"""Vector quantization: k-means codebooks (faiss, or kvcalib's own on a GPU) and the packed codes of sub-vectors.

A configuration `dNbM` cuts every head_dim vector into c = head_dim / N sub-vectors of N elements
and replaces each by the index of its nearest centroid in a codebook of 2^M entries: M / N bits per
element (d4b8 = 2, d8b12 = 1.5, d8b16 = 2, d2b8 = 4).

Packed code layout (the vector counterpart of the scalar table in `kvcalib.quant`)
=================================================================================

| what       | dtype   | shape                        | meaning                                          |
|------------|---------|------------------------------|--------------------------------------------------|
| `codes`    | uint8   | `(B, H, T, ceil(c * M / 8))` | per token and head: its c codes as one bitstream  |
| `codebook` | float16 | `(G, 2^M, N)`                | in the artifact; G = 1 (per layer) or H (per head) |

- Code j of a token occupies bits `[M * j, M * j + M)` of its row, least significant first; bit b
  of the row is bit `b % 8` of byte `b // 8`. So M = 8 is one uint8 per code, M = 16 is one
  little-endian uint16 per code (two bytes; view the row as int16/uint16), M = 12 puts two codes in
  three bytes, M = 4 two codes per byte.
- A row whose c * M bits are not a multiple of 8 is zero-padded to a whole byte; the padding is
  counted in the stored bits, which are exactly `8 * codes.numel()`: codes carry no scales.
- A sub-vector j of a token is elements `[N * j, N * j + N)` of the (transformed) head vector; all
  c sub-vectors of a head share its codebook. Codebooks and any smoothing factors are shared
  tensors, counted once over all sequences (`Method.constant_bits`).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .errors import SettingsError
from .quant import CUPY_FOUND, held, steps, stream_bytes

log = logging.getLogger(__name__)

# Rows of points per nearest-centroid chunk are chosen so one chunk's distance matrix holds at most
# this many float32 entries (64 MiB), whatever the context length.
_DISTANCE_ENTRIES = 1 << 24


@dataclass(frozen=True)
class VQConfig:
    """`dNbM`: sub-vectors of `dim` elements, codebooks of 2^`bits` centroids."""

    dim: int
    bits: int

    @classmethod
    def parse(cls, text: str) -> VQConfig:
        match = re.fullmatch(r"d(\d+)b(\d+)", text)
        if not match:
            raise SettingsError(f"vector configuration {text!r} must look like dNbM, e.g. d4b8 or d8b12")
        config = cls(int(match[1]), int(match[2]))
        if config.dim < 1 or not 1 <= config.bits <= 16:
            raise SettingsError(f"vector configuration {text}: need N >= 1 and M in 1..16")
        return config

    def __str__(self) -> str:
        return f"d{self.dim}b{self.bits}"

    @property
    def centroids(self) -> int:
        return 1 << self.bits

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's codes for a head of `head_dim`: its head_dim / dim codes as one bitstream."""
        return -(-(head_dim // self.dim) * self.bits // 8)

    def check(self, head_dim: int) -> None:
        if head_dim % self.dim:
            raise SettingsError(f"{self}: sub-vectors of {self.dim} elements do not tile head_dim {head_dim}")

    def check_points(self, count: int) -> None:
        if count < self.centroids:
            raise SettingsError(f"{self}: {count} sub-vectors per codebook cannot fill {self.centroids} centroids; "
                                "collect more tokens or use fewer bits")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., c) < 2^bits to the bitstream rows (..., ceil(c * bits / 8)) uint8 of the layout
    (`quant.stream_bytes`)."""
    return stream_bytes(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_codes`: rows (..., bytes) uint8 to `count` codes (..., count) int64."""
    stream = ((packed.to(torch.int64).unsqueeze(-1) >> steps(8, 1, packed.device)) & 1).flatten(-2)
    stream = stream[..., : count * bits].unflatten(-1, (count, bits))
    return (stream << steps(bits, 1, packed.device)).sum(-1)


def nearest(points: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) of every row of points (P, N); (P,) int64: `nearest_heads`
    of one head, chunked over points so memory stays bounded at any context length."""
    return nearest_heads(points[None], codebook[None])[0]


def inertia(points: torch.Tensor, codebook: torch.Tensor) -> float:
    """Sum of squared distances of the points to their nearest centroid (float64)."""
    nearest_centroids = codebook.double()[nearest(points, codebook)]
    return (points.double() - nearest_centroids).pow(2).sum().item()


def _check_training(points: torch.Tensor, config: VQConfig) -> None:
    """Refuse fewer points than centroids; warn below faiss's 39 per centroid (its own warning, printed
    here once per call for both k-means)."""
    config.check_points(points.shape[0])
    if points.shape[0] < 39 * config.centroids:
        log.warning("%s: only %.1f training points per centroid", config, points.shape[0] / config.centroids)


@dataclass
class KMeansFit:
    codebook: torch.Tensor  # (2^M, N) float32
    seconds: float
    training_points: int


def kmeans(points: torch.Tensor, config: VQConfig, iters: int, seed: int, max_points_per_centroid: int,
           gpu: bool | None = None) -> KMeansFit:
    """faiss k-means of points (P, N) into 2^M centroids; on the GPU when faiss sees one (a faiss-gpu
    build), unless `gpu` is False (`--device cpu`).

    faiss samples at most `max_points_per_centroid * 2^M` points (with `seed`) to train on.
    """
    import faiss

    k = config.centroids
    _check_training(points, config)
    x = np.ascontiguousarray(points.float().cpu().numpy())
    # min_points_per_centroid=1: the warning above replaces faiss's own, printed once per call.
    gpu = faiss.get_num_gpus() > 0 if gpu is None else gpu and faiss.get_num_gpus() > 0
    km = faiss.Kmeans(config.dim, k, niter=iters, seed=seed, gpu=gpu,
                      max_points_per_centroid=max_points_per_centroid, min_points_per_centroid=1, verbose=False)
    start = time.perf_counter()
    km.train(x)
    return KMeansFit(codebook=torch.from_numpy(km.centroids.copy()), seconds=time.perf_counter() - start,
                     training_points=min(x.shape[0], k * max_points_per_centroid))


def kmeans_device(library: str, device: str) -> torch.device:
    """Where the points of a k-means by `library` go: `device` for kvcalib's own, the host for faiss (it takes
    host arrays, and moves them to its GPU itself)."""
    return torch.device(device) if library == "torch" else torch.device("cpu")


def kmeans_by(library: str, points: torch.Tensor, config: VQConfig, iters: int, seed: int,
              max_points_per_centroid: int, gpu: bool | None = None) -> KMeansFit:
    """k-means of points (P, N) by `library` (`methods.vecinfer_fit.kmeans_library` chooses it): "torch",
    kvcalib's own (`kmeans_torch`) on the points' device; "faiss" (`kmeans`, on a GPU as `gpu` says)."""
    if library == "torch":
        return kmeans_torch(points, config, iters, seed, max_points_per_centroid)
    return kmeans(points, config, iters, seed, max_points_per_centroid, gpu)


# faiss's perturbation when it splits a cluster to re-seed an empty one (faiss/Clustering.cpp, EPS).
SPLIT_EPS = 1 / 1024


def kmeans_torch(points: torch.Tensor, config: VQConfig, iters: int, seed: int, max_points_per_centroid: int) -> KMeansFit:
    """Lloyd's k-means of points (P, N) into 2^M centroids with torch, on the points' device: kvcalib's
    own, for a GPU where faiss has no GPU build (faiss-gpu has no wheel for current CUDA; `--kmeans`).

    faiss's procedure: at most `max_points_per_centroid * 2^M` points sampled without replacement
    (seeded), the centroids started at 2^M distinct sampled points, `iters` rounds of nearest-centroid
    assignment (`nearest`) and cluster means, and an empty cluster re-seeded by splitting the largest
    one (faiss picks a large one at random; here the largest, first by index). The seeds of the sampling
    are faiss's in kind, not in value: the codebooks differ from faiss's as two seeds' do. A cluster's
    sum is `cluster_sums`': a difference of a float64 running sum over the points sorted by cluster, never
    atomic additions: the same points on the same device give the same codebook, bit for bit."""
    k = config.centroids
    _check_training(points, config)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    n = points.shape[0]
    m = min(n, k * max_points_per_centroid)
    x = points if m == n else points[torch.randperm(n, generator=g)[:m].to(points.device)]
    x = x.float().contiguous()
    centroids = x[torch.randperm(m, generator=g)[:k].to(x.device)].clone()
    for _ in range(iters):
        assign = nearest(x, centroids)
        counts = torch.bincount(assign, minlength=k)
        sums = cluster_sums(x, assign, counts)
        filled = counts > 0
        centroids = torch.where(filled[:, None], sums / counts.clamp(min=1)[:, None].float(), centroids)
        _split_into_empty(centroids, counts.cpu())
    return KMeansFit(codebook=centroids.cpu(), seconds=time.perf_counter() - start, training_points=m)


def cluster_sums(x: torch.Tensor, assign: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per cluster, the sum of its points x (P, N) (assign (P,) the cluster of each, counts its bincount), in
    float64 then rounded to x's dtype: the points sorted by cluster (a stable sort), a running sum, and the
    difference at each cluster's two ends. Deterministic on every device (no atomic additions), and linear in
    the points: a one-hot product (what this replaced) costs points x clusters, 150x this at 4096 clusters
    and 262k points on a 2-core CPU. The running sum reaches P max|x| before the differences: float64 keeps their error near
    P max|x| 2^-53, far below the float32 result's rounding."""
    order = torch.argsort(assign, stable=True)
    # the running sum along the last, contiguous dimension: a scan along dim 0 of a (P, N) tensor is slow on CUDA
    running = torch.cumsum(x[order].double().T.contiguous(), 1)
    running = torch.cat([running.new_zeros(x.shape[1], 1), running], 1)
    ends = torch.cumsum(counts, 0)
    return (running[:, ends] - running[:, ends - counts]).T.to(x.dtype)


def _split_into_empty(centroids: torch.Tensor, counts: torch.Tensor) -> None:
    """Re-seed each empty cluster, in place, by splitting the largest: both take its centroid, moved
    apart by ±SPLIT_EPS of itself in alternating dimensions, and half its points (faiss's rule)."""
    sign = torch.ones(centroids.shape[1], device=centroids.device)
    sign[1::2] = -1
    for empty in (counts == 0).nonzero().flatten().tolist():
        big = int(counts.argmax())
        centroids[empty] = centroids[big] * (1 + SPLIT_EPS * sign)
        centroids[big] = centroids[big] * (1 - SPLIT_EPS * sign)
        counts[empty] = counts[big] // 2
        counts[big] -= counts[empty]


def encode(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Codes (B, H, T, c) of x (B, H, T, d) against codebooks (G, 2^M, N), head h using h // (H / G).

    Every head at once (`nearest_heads`, the heads that share a book in one batch entry): a static cache's flush
    encodes a layer's window inside the captured step, eagerly, where a loop over heads took some 11 launches a head.
    The books' float32 copy and their centroids' squared norms are made once a book (`prepared`)."""
    b, h, t, d = x.shape
    g, n = codebooks.shape[0], codebooks.shape[-1]
    books, norms = prepared(codebooks)
    points = x.unflatten(-1, (d // n, n)).transpose(0, 1).reshape(g, h // g * b * t * (d // n), n)
    return nearest_heads(points, books, norms).view(h, b, t, d // n).transpose(0, 1).contiguous()


_PREPARED = WeakTensorKeyDictionary()  # a book -> (its float32 copy, its centroids' squared norms), while it lives


def prepared(codebooks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(books (G, E, N) float32, their centroids' squared norms (G, 1, E)) of `codebooks`, `quant.held` once a book
    (made anew, they took a flush four launches an encode)."""
    def make():  # a tensor of its own (a float32 book's `.float()` is the book itself: held, it would never go)
        books = codebooks.float() if codebooks.dtype != torch.float32 else codebooks.detach()
        return books, books.pow(2).sum(-1).unsqueeze(1)
    return held(_PREPARED, codebooks, make)


ENCODE_ROWS = 4  # rows a block of `kernels_cupy/codebook_encode.cu` takes (a rotation's rows read once for 4)


def on_the_encode_kernel(x: torch.Tensor) -> bool:
    """Whether x's vectors (B, H, T, D) are coded by `kernels_cupy/codebook_encode.cu`: on CUDA with CuPy, eager or
    compiled (an opaque op to torch.compile, so that a compiled flush codes what an eager one does)."""
    return x.is_cuda and x.dim() == 4 and CUPY_FOUND


def encode_on_gpu(x: torch.Tensor, bits: int, rotation: torch.Tensor | None = None,
                  bounds: torch.Tensor | None = None, books: torch.Tensor | None = None, as_bytes: bool = False,
                  checked: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes, norms) of x (B, H, T, D) in one launch (`kernels_cupy/codebook_encode.cu`, whose opening comment has
    the layout): with `rotation` Π (D, D) float64, x / |x| rotated by it (TurboQuant's `unit_rotated`, with the norms
    (B, H, T, 1) float16), else x as given; coded a coordinate at a time by `bounds` ((L - 1,) shared, or (G, D, L - 1)) or a sub-vector at a time by
    `books` (G, 2^bits, n); packed as one bit stream a row, int32 words (`pack_stream`) or bytes (`as_bytes`,
    `quant.stream_bytes`). Head h reads book h // (H / G)."""
    b, h, t, d = x.shape
    if not _rows_laid_out(x):  # laid out anew, row after row (attention's keys come transposed, in float16)
        x = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    if books is None:
        book, book_norms, xdim = bounds.float().contiguous(), None, 1
    else:
        (book, book_norms), xdim = prepared(books), books.shape[-1]
    unit = 8 if as_bytes else 32
    out = torch.empty(b, h, t, -(-(d // xdim) * bits // unit), dtype=torch.uint8 if as_bytes else torch.int32,
                      device=x.device)
    rotate = rotation is not None
    norms = torch.empty(b, h, t, 1 if rotate else 0, dtype=torch.float16, device=x.device)
    rt = rotation.double().mT.contiguous() if rotate else None  # Πᵀ row-major: a view of the held Π (column-major)
    torch.ops.kvcalib.codebook_encode(x, out, norms, rt, book if books is None else None,
                                      book if books is not None else None, book_norms, bits, checked)
    return out, norms if rotate else None


def _rows_laid_out(x: torch.Tensor) -> bool:
    """Whether x (B, H, T, D) is float32 with each (T, D) laid out row after row, as the encode kernel reads it
    (batch and heads may stride: a plan's group of heads); a stride is not checked along a length of one or none."""
    t, d = x.shape[-2:]
    return x.dtype == torch.float32 and (d <= 1 or x.stride(-1) == 1) and (t <= 1 or x.stride(-2) == d)


def _encode_refusal(x, out, norms, rotation, bounds, books, book_norms) -> str | None:
    """Why `kvcalib::codebook_encode` cannot take these tensors (None: it can): x (B, H, T, D) float32 with each (T, D)
    row after row, contiguous float32 books or bounds whose groups G divide H, a contiguous float64 rotation, every
    tensor on x's device (the kernel takes raw pointers: another device's would fault, leaving the CUDA context
    unusable, where torch ops raise)."""
    h = x.shape[1]
    coded = bounds if books is None else books
    given = {"out": out, "norms": norms, "rotation": rotation, "bounds": bounds, "books": books,
             "book_norms": book_norms}
    elsewhere = [f"{name} on {a.device}" for name, a in given.items() if a is not None and a.device != x.device]
    if _rows_laid_out(x) and all(a is None or (a.is_contiguous() and a.dtype == dtype) for a, dtype in (
            (rotation, torch.float64), (bounds, torch.float32), (books, torch.float32), (book_norms, torch.float32))
    ) and not h % (coded.shape[0] if coded.dim() > 1 else 1) and not elsewhere:
        return None
    return (f"codebook_encode takes x (B, H, T, D) float32 with (T, D) contiguous, contiguous float32 books or bounds "
            f"(G dividing H) and a contiguous float64 rotation, all on x's device; got x {tuple(x.shape)} {x.dtype} "
            f"strides {x.stride()} on {x.device}, {tuple(coded.shape)} {coded.dtype}"
            + "".join(f", {e}" for e in elsewhere))


@torch.library.custom_op("kvcalib::codebook_encode", mutates_args=("out", "norms"))
def _codebook_encode(x: torch.Tensor, out: torch.Tensor, norms: torch.Tensor, rotation: torch.Tensor | None,
                     bounds: torch.Tensor | None, books: torch.Tensor | None, book_norms: torch.Tensor | None,
                     bits: int, checked: bool) -> None:
    """`encode_on_gpu`'s launch, its tensors made by the caller (a custom op: torch.compile keeps it whole), `rotation`
    the transposed Π row-major (`kernels_cupy/codebook_encode.cu`'s RT). A block
    takes ENCODE_ROWS rows, 128 threads: a thread a coordinate (the norm, the rotation), then a code, then an output
    element; the rows are read once, the codes written once. Its tensors are checked first (`_encode_refusal`)."""
    if (why := _encode_refusal(x, out, norms, rotation, bounds, books, book_norms)) is not None:
        raise ValueError(why)
    b, h, t, d = x.shape
    rows = b * h * t
    coded = bounds if books is None else books
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    defines = {"D": d, "XDIM": 1 if books is None else books.shape[-1], "BITS": bits, "NB": coded.shape[-2 if books
               is not None else -1], "ROTATE": int(rotation is not None), "PER_COORD": int(books is None and
               bounds.dim() > 1), "OUT_BYTES": int(out.dtype == torch.uint8), "RB": ENCODE_ROWS, "NT": 128}
    groups = coded.shape[0] if coded.dim() > 1 else 1
    ptr = lambda a: cupy.uint64(0 if a is None else a.data_ptr())  # noqa: E731
    with torch_stream(x.device):
        if rows:
            launch(kernel("codebook_encode.cu", defines, "encode_rows"), (-(-rows // ENCODE_ROWS),), (128,),
                   (ptr(x), ptr(rotation), ptr(bounds), ptr(books), ptr(book_norms), ptr(out), ptr(norms),
                    cupy.int32(rows), cupy.int32(t), cupy.int32(h), cupy.int32(groups), cupy.int64(x.stride(0)),
                    cupy.int64(x.stride(1))), checked)


@_codebook_encode.register_fake
def _(x, out, norms, rotation, bounds, books, book_norms, bits, checked) -> None:
    return None


def nearest_heads(points: torch.Tensor, books: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """(H, P) int64: for each head h, the index of the nearest centroid (squared Euclidean) of books[h] (E, N) to
    every row of points[h] (P, N); `nearest` for H codebooks in one batched product, chunked over points so that a
    chunk's distances hold at most _DISTANCE_ENTRIES numbers. `norms`: the centroids' squared norms (H, 1, E), where
    the caller holds them."""
    books = books.float()
    if norms is None:
        norms = books.pow(2).sum(-1).unsqueeze(1)  # (H, 1, E); |x|^2 does not change the argmin
    rows = max(1, _DISTANCE_ENTRIES // (books.shape[0] * books.shape[1]))
    total = points.shape[1]
    if total <= rows:
        return torch.baddbmm(norms, points.float(), books.transpose(1, 2), alpha=-2).argmin(-1)
    out = torch.empty(points.shape[:2], dtype=torch.int64, device=points.device)
    for start in range(0, total, rows):
        chunk = points[:, start : start + rows].float()
        out[:, start : start + rows] = torch.baddbmm(norms, chunk, books.transpose(1, 2), alpha=-2).argmin(-1)
    return out


def decode(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode`: the centroids (B, H, T, c * N) float32 that the codes name."""
    h = codes.shape[1]
    per_head = codebooks.float().repeat_interleave(h // codebooks.shape[0], dim=0)  # (H, 2^M, N)
    heads = torch.arange(h, device=codes.device)[None, :, None, None]
    return per_head[heads, codes].flatten(-2)
