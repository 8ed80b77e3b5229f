"""TurboQuant, MSE variant (Zandieh et al., 2025, "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", Algorithm 1). Data-oblivious by default: no calibration, no
artifact; calibrated codebooks are an option (below).

Every cached vector x (one token, one KV head, d = head_dim elements; keys and values alike) is
stored as its norm ‖x‖ in float16 and b-bit codes of its direction: the unit vector u = x / ‖x‖
is rotated, y = Π u, and each coordinate y_i is coded by the nearest of 2^b centroids. Reading back:
x̂ = ‖x‖ Πᵀ c[codes]. The most recent tokens stay float16 in a residual window flushed in blocks of
R (`--residual`), as for KIVI.

Rotation Π: one d x d random orthogonal matrix for every layer, KV head, keys and values, drawn
once from a fixed seed (`ROTATION_SEED`): Q of the QR factorization of a seeded float64 Gaussian
matrix, columns signed so that R has a positive diagonal, which makes Q Haar-distributed (Mezzadri,
"How to generate random matrices from the classical compact groups", 2007). The paper's guarantee
holds for each vector over the draw of Π, whatever the other vectors, so nothing is gained by a
draw per layer, and one matrix lets a decoder rotate a query once for all layers' keys.

Codebook: for u uniform on the sphere, each coordinate of Π u has the density
f(t) ∝ (1 − t²)^((d−3)/2) on [−1, 1] (the paper's Lemma 1; close to N(0, 1/d)). The codebook is
the Lloyd-Max quantizer of that density: thresholds at the midpoints of neighbouring centroids,
each centroid the mean of f over its cell. Lloyd's iteration runs on the exact density: with
t = sin θ, the cell masses are ∫ cos^(d−2) θ dθ, which the reduction formula
∫ cosⁿ = cosⁿ⁻¹ sin / n + (n−1)/n ∫ cosⁿ⁻² (Gradshteyn & Ryzhik 2.511.2) turns into a closed form,
and the first moments ∫ t f dt = −(1 − t²)^((d−1)/2) / (d−1) are closed already. It is computed once
per (d, b), in float64, and cached. Neither Π nor the codebook is stored: both are functions of
(d, b, seed) that a decoder recomputes, so `constant_bits` is 0 (as OScaR's Hadamard matrix).

Packed layout, per flushed block, for keys and for values alike (each vector's codes as one bit
stream, `kvcalib.quant.pack_stream`: code j at bits [b j, b (j + 1)) of the vector's int32 words,
least significant first, across word boundaries, the last word zero-padded):

| what    | dtype   | shape                                 | meaning                                 |
|---------|---------|---------------------------------------|-----------------------------------------|
| `codes` | int32   | `(B, Hkv, T, ceil(d b / 32))`         | index of the centroid of each y_i       |
| `norm`  | float16 | `(B, Hkv, T, 1)`                      | ‖x‖ of each token and KV head           |

Stored bits per vector: 32 ceil(d b / 32) + 16; for d = 64 that is b + 0.25 bits per element
(b = 2: 128 + 16 bits, 2.25; b = 3: 192 + 16 bits, 3.25).

Calibrated (with `--artifacts` from `kvcalib fit-turboquant`, `methods/turboquant_fit.py`): the same
format, rotation and norms, but each layer's keys and values have their own codebooks, one per
rotated coordinate (and per KV head with `--granularity head`), fitted by Lloyd's algorithm to the
collection's rotated unit vectors. Artifact tensors, per layer i, ascending along the last axis:

| name                    | dtype   | shape                  |
|-------------------------|---------|------------------------|
| `layers.{i}.k_codebook` | float16 | `(G, d, 2^b)`, G = 1 or Hkv |
| `layers.{i}.v_codebook` | float16 | `(G, d, 2^b)`          |

They are counted once, 16 bits per centroid (`constant_bits`), as VecInfer's codebooks.

A plan (`kvcalib plan`, `methods/plan.py`) may code each layer's keys or values with such a codebook
of its own width.

Vector codebooks (`TurboQuantVQ`, plan scheme `turboquant-d{D}b{B}`): the same norms, rotation and
unit vectors, but the rotated unit vector is cut into d / D sub-vectors of D coordinates, each coded by
the nearest of 2^B centroids of one codebook (G, 2^B, D) per layer, part (and KV head with granularity
head) that every sub-vector position shares, fitted by k-means to the collection (VecInfer's dDbB, on
TurboQuant's normalised, rotated vectors; `turboquant_fit.fit_vector_codebooks`). It codes at rates
between the scalar widths: B / D + 16 / d bits per element (d = 64: d4b6 1.75, d4b7 2.0, against 1.25
and 2.25 for 1 and 2 scalar bits). A codebook of its own per sub-vector position would fit better but
costs d / D times the shared bits. Codes: `codes` int32 `(B, Hkv, T, ceil(d B / (32 D)))`, the d / D
codes of each vector as one bit stream (`pack_stream`), and `norm` as above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..artifacts import load_artifact
from ..defaults import DEFAULTS
from ..errors import ArtifactError, SettingsError
from ..streams import settled
from ..formats.codebook.coded import CodebookCoded
from ..formats.codebook.layout import CodebookSpec, CodedBlock, CodedPart
from ..hadamard import held_matrix
from ..models import AttentionShape, LoadedModel
from .. import vq
from ..quant import FLOAT16_MAX, held, pack_stream, unpack_stream
from .base import DeviceCopies, Method, MethodSettings

ROTATION_SEED = 0
BITS = (1, 2, 3, 4)
LLOYD_STOP = 1e-12  # the codebook's fixed-point residual max_i |T(c)_i − c_i|, in units of t (float64 floor ~1e-14)
_LLOYD_MAX_ITERATIONS = 100_000  # 4 bits converge in ~700


# ---- the density of one coordinate of a random rotation of a unit vector, and its Lloyd-Max codebook ----

def cos_power_integral(t: torch.Tensor, n: int) -> torch.Tensor:
    """∫_0^{asin t} cosⁿ θ dθ = ∫_0^t (1 − s²)^((n−1)/2) ds for t in [−1, 1] (float64), by the unrolled
    reduction formula: Σ_k w_k / k · cos^(k−1) θ sin θ over k = n, n−2, ... > 1, plus w_{n mod 2} times
    θ (n even) or sin θ (n odd), with w_n = 1 and w_{k−2} = w_k (k−1) / k. All terms of one sign."""
    ks = range(n, 1, -2)
    weights, w = [], 1.0
    for k in ks:
        weights.append(w / k)
        w *= (k - 1) / k
    out = w * (torch.asin(t) if n % 2 == 0 else t)
    if weights:
        exponents = torch.tensor([(k - 1) / 2 for k in ks], dtype=torch.float64)
        cos_sq = (1 - t * t).clamp_min(0).unsqueeze(-1)
        out = out + t * (cos_sq**exponents @ torch.tensor(weights, dtype=torch.float64))
    return out


def cell_moments(edges: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """∫ tᵐ (1 − t²)^((d−3)/2) dt over each cell [edges[i], edges[i+1]], m = 0, 1, 2 (unnormalized)."""
    m0 = cos_power_integral(edges, d - 2).diff()
    m1 = -((1 - edges * edges).clamp_min(0) ** ((d - 1) / 2)).diff() / (d - 1)
    # sin² cosⁿ = cosⁿ − cosⁿ⁺²
    m2 = m0 - cos_power_integral(edges, d).diff()
    return m0, m1, m2


def midpoints(centroids: torch.Tensor) -> torch.Tensor:
    """The nearest-centroid thresholds of ascending centroids along the last axis: (c_j + c_{j+1}) / 2."""
    return (centroids[..., 1:] + centroids[..., :-1]) / 2


def cell_edges(centroids: torch.Tensor) -> torch.Tensor:
    """−1, the midpoints of neighbouring centroids (the nearest-centroid thresholds), 1."""
    one = torch.ones(1, dtype=centroids.dtype)
    return torch.cat([-one, midpoints(centroids), one])


def lloyd_step(centroids: torch.Tensor, d: int) -> torch.Tensor:
    """One Lloyd-Max iteration: the conditional mean of every nearest-centroid cell."""
    m0, m1, _ = cell_moments(cell_edges(centroids), d)
    return m1 / m0


@functools.lru_cache(maxsize=64)
def codebook(d: int, bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max centroids (float64, ascending, symmetric) of one coordinate of a randomly
    rotated unit vector in R^d; its fixed-point residual is at most `LLOYD_STOP`."""
    if d < 2:
        raise SettingsError(f"TurboQuant needs head_dim >= 2, got {d}")
    levels = 1 << bits
    # Start from the quantiles of N(0, 1/d), the density's large-d limit.
    c = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels) / math.sqrt(d)
    c = c.clamp(-1 + 1e-3, 1 - 1e-3)
    for _ in range(_LLOYD_MAX_ITERATIONS):
        new = lloyd_step(c, d)
        new = (new - new.flip(0)) / 2  # the density is even: keep the codebook exactly symmetric
        if (new - c).abs().max().item() <= LLOYD_STOP:
            return c
        c = new
    raise RuntimeError(f"Lloyd-Max did not converge for d={d}, bits={bits}")


def expected_distortion(d: int, centroids: torch.Tensor) -> float:
    """E[(t − c[q(t)])²] for one coordinate t of the density, q the nearest-centroid quantizer."""
    m0, m1, m2 = cell_moments(cell_edges(centroids), d)
    z = m0.sum()
    return ((m2 - 2 * centroids * m1 + centroids**2 * m0).sum() / z).item()


@functools.lru_cache(maxsize=16)
def _rotation64(d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # R with a positive diagonal: Q is Haar (Mezzadri 2007)


_ROTATIONS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # Π per (d, dtype, device), made once


def rotation(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Π, d x d orthogonal, the same for every layer, head, keys and values (seed `ROTATION_SEED`); a compiled flush
    reads the copy its cache made at creation (`kvcalib.hadamard.held_matrix`: a seeded Generator does not trace)."""
    return held_matrix(_ROTATIONS, d, dtype, device, lambda n: _rotation64(n, ROTATION_SEED))


# ---- the method ----

@dataclass(frozen=True)
class TurboQuantConfig:
    bits: int = DEFAULTS["bits"]
    residual: int = DEFAULTS["residual"]

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise SettingsError(f"--bits must be in 1..4 for --method turboquant, got {self.bits}")
        if self.residual < 1:
            raise SettingsError("--residual must be positive")


@dataclass
class Coded:
    """Vectors of one block as stored (module docstring)."""

    codes: torch.Tensor  # int32 (..., T, words)
    norm: torch.Tensor  # float16 (..., T, 1)
    bits: int

    def stored_bits(self) -> int:
        return 32 * self.codes.numel() + 16 * self.norm.numel()


@dataclass
class TurboQuantPacked:
    k: Coded
    v: Coded


def rotate_rows(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x @ r in float32, the same for a row whatever the number of rows: the product is taken in float64
    and rounded once. (A float32 matmul of one row and of many takes different kernels, whose sums
    differ in the last bits: a decoder flushing one token at a time would then hold other values than
    `eval`'s cache of the same tokens; in float64 they differ by ~1e-16 and round to the same float32.)"""
    return (x.double() @ r.double()).float()


def unit_rotated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Π x / ‖x‖, ‖x‖) in float32, rows of the last axis; a zero vector stays zero. The norm, the division and the
    rotation are taken in float64 and rounded once: a compiled flush (its own reduction order, and a division
    that Triton takes to 2 ulps in float32) then codes the same bits as an eager one."""
    x64 = x.double()
    norm = x64.norm(dim=-1, keepdim=True)
    # a zero norm divides by float64's least normal number instead (0 / it is 0; every norm of float32 or float16
    # numbers is larger): the same bits as dividing it by 1, one launch where the test and the choice took three
    unit = x64 / norm.clamp_min(torch.finfo(torch.float64).tiny)
    return (unit @ rotation(x.shape[-1], torch.float64, x.device).T).float(), norm.float()  # y = Π u, row form


def nearest_per_coordinate(y: torch.Tensor, centroids: torch.Tensor, bounds: torch.Tensor | None = None) -> torch.Tensor:
    """Codes of y (..., G or H, T, d) for per-coordinate codebooks (G, d, L) ascending: the number of
    cell boundaries (midpoints of neighbouring centroids, `bounds` (G, d, L - 1) where held) below each y_i, as
    `torch.bucketize` counts."""
    if bounds is None:
        bounds = midpoints(centroids)
    return (y.unsqueeze(-1) > bounds[:, None].to(y.device)).sum(-1)


class TurboQuant(Method, CodebookCoded):
    name = "turboquant"

    def __init__(self, config: TurboQuantConfig, shape: AttentionShape,
                 books: list[tuple[torch.Tensor, torch.Tensor]] | None = None, granularity: str | None = None):
        """books: per layer, calibrated (keys, values) codebooks (G, d, 2^b), or None for the oblivious one."""
        self.config = config
        self.block = config.residual
        self.head_dim = shape.head_dim
        self.centroids = codebook(shape.head_dim, config.bits)  # float64; computed now, not mid-evaluation
        # Read back as float16 numbers, as every codebook is held (a calibrated one is stored so): a fused kernel
        # gathers them into fp16 fragments and reads the very centroids this method decodes with. Rounding moves a
        # centroid by at most 2^-12 of itself; the cells' thresholds are the midpoints of the rounded centroids.
        self._centroids32 = self.centroids.half().float()
        self._thresholds32 = midpoints(self._centroids32)
        self.books = None if books is None else [(k.float(), v.float()) for k, v in books]
        self.granularity = granularity
        self._on_devices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._copies = DeviceCopies()
        self._held_bounds = WeakTensorKeyDictionary()  # a book (its device copy) -> its midpoints, while it lives

    @property
    def per_kv_head(self) -> bool:
        return self.books is not None and self.granularity == "head"

    def for_kv_heads(self, start: int, stop: int) -> "TurboQuant":
        """The calibrated codebooks of these KV heads alone (granularity head); the rest holds nothing per head."""
        if not self.per_kv_head:
            return self
        return self._heads_part(start, stop, books=[(k[start:stop], v[start:stop]) for k, v in self.books])

    def encode_vectors(self, x: torch.Tensor, centroids: torch.Tensor | None = None) -> Coded:
        """Codes of x (..., d): the oblivious codebook of `config.bits`, or per-coordinate `centroids` (G, d, 2^bits)."""
        bits = self.config.bits
        if vq.on_the_encode_kernel(x):
            bounds = self._tables(x.device)[0] if centroids is None else self._bounds(centroids)
            codes, norm = vq.encode_on_gpu(x, bits, rotation(x.shape[-1], torch.float64, x.device), bounds=bounds)
            return Coded(codes=codes, norm=norm, bits=bits)
        y, norm = unit_rotated(x)
        if centroids is None:  # the oblivious codebook: cells split at the midpoints of its centroids
            codes = torch.bucketize(y, self._tables(x.device)[0])
        else:
            codes = nearest_per_coordinate(y, centroids, self._bounds(centroids))
        return Coded(codes=pack_stream(codes, bits), norm=norm.clamp(max=FLOAT16_MAX).half(), bits=bits)

    def _bounds(self, centroids: torch.Tensor) -> torch.Tensor:
        """`midpoints` of a calibrated book as the layer's flushes read it (the device copy `_layer_books` holds),
        `quant.held` once a book (each made anew took a flush two launches)."""
        return held(self._held_bounds, centroids, lambda: midpoints(centroids))

    def decode_vectors(self, coded: Coded, centroids: torch.Tensor | None = None) -> torch.Tensor:
        d = self.head_dim
        codes = unpack_stream(coded.codes, coded.bits, d)
        if centroids is None:
            y = self._tables(codes.device)[1][codes]
        else:  # (G, d, L) -> the centroid of coordinate i in code codes[..., i]
            table = centroids[:, None].expand(*codes.shape, centroids.shape[-1])
            y = table.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
        return rotate_rows(y, rotation(d, torch.float32, codes.device)) * coded.norm.float()  # ‖x‖ Πᵀ ŷ

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(thresholds, centroids) of the oblivious codebook on `device`, copied once (a captured step may not copy
        from the host)."""
        held = self._on_devices.get(device)
        if held is None:
            held = self._on_devices[device] = settled((self._thresholds32.to(device), self._centroids32.to(device)))
        return held

    def _layer_books(self, layer: int, device=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's calibrated (keys, values) codebooks, on `device` where one is given (copied once)."""
        if self.books is None:
            return None, None
        k, v = self.books[layer]
        if device is None:
            return k, v
        return self._copies.on(2 * layer, k, device), self._copies.on(2 * layer + 1, v, device)

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> TurboQuantPacked:
        kc, vc = self._layer_books(layer, k.device)
        return TurboQuantPacked(k=self.encode_vectors(k, kc), v=self.encode_vectors(v, vc))

    def decompress(self, layer: int, packed: TurboQuantPacked) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self._layer_books(layer, packed.k.codes.device)
        return self.decode_vectors(packed.k, kc), self.decode_vectors(packed.v, vc)

    def part_bits(self, packed: TurboQuantPacked) -> tuple[int, int]:
        return packed.k.stored_bits(), packed.v.stored_bits()

    def codebook_spec(self, layer: int) -> CodebookSpec:
        """x = ‖x‖ ŷ Π: the codes' centroids, the norm, the rotation (`kvcalib.formats.codebook.layout`)."""
        basis = rotation(self.head_dim, torch.float32)[None].contiguous()  # QR's Q is column-major
        return CodebookSpec(*(self._coded_part(c, basis) for c in self._layer_books(layer)))

    def _coded_part(self, centroids: torch.Tensor | None, basis: torch.Tensor) -> CodedPart:
        """The oblivious codebook shared by every coordinate, or per-coordinate centroids (G, d, 2^b)."""
        book = self._centroids32.view(1, 1, -1, 1) if centroids is None else centroids.float().unsqueeze(-1)
        return CodedPart(self.config.bits, 1, book, True, basis)

    def codebook_parts(self, packed: TurboQuantPacked) -> CodedBlock:
        return CodedBlock(packed.k.codes, packed.k.norm[..., 0], packed.v.codes, packed.v.norm[..., 0])

    def constant_bits(self) -> int:
        return 0 if self.books is None else 16 * sum(k.numel() + v.numel() for k, v in self.books)

    def settings(self) -> dict:
        out = {"bits": self.config.bits, "residual": self.config.residual, "rotation_seed": ROTATION_SEED}
        if self.books is not None:
            out |= {"calibrated": True, "granularity": self.granularity}
        return out


class TurboQuantVQ(TurboQuant):
    """TurboQuant's norms and rotation with vector codebooks (module docstring): a plan's scheme, not a
    method of its own (`methods/plan.py` builds it with each layer's codebooks)."""

    def __init__(self, config: vq.VQConfig, residual: int, shape: AttentionShape,
                 books: list[tuple[torch.Tensor, torch.Tensor]], granularity: str):
        """books: per layer, (keys, values) codebooks (G, 2^B, D)."""
        config.check(shape.head_dim)
        self.vector, self.block, self.head_dim = config, residual, shape.head_dim
        self.config = TurboQuantConfig(bits=1, residual=residual)  # `settings` and the flush rule read it
        self.books = [(k.float(), v.float()) for k, v in books]
        self.granularity = granularity
        self._on_devices, self._copies = {}, DeviceCopies()

    def encode_vectors(self, x: torch.Tensor, centroids: torch.Tensor | None = None) -> Coded:
        """Codes of x (B, H, T, d) against `centroids` (G, 2^B, D): head h reads codebook h // (H / G)."""
        if vq.on_the_encode_kernel(x):
            codes, norm = vq.encode_on_gpu(x, self.vector.bits, rotation(x.shape[-1], torch.float64, x.device),
                                           books=centroids)
            return Coded(codes=codes, norm=norm, bits=self.vector.bits)
        y, norm = unit_rotated(x)
        codes = vq.encode(y, centroids)
        return Coded(codes=pack_stream(codes, self.vector.bits), norm=norm.clamp(max=FLOAT16_MAX).half(), bits=self.vector.bits)

    def decode_vectors(self, coded: Coded, centroids: torch.Tensor | None = None) -> torch.Tensor:
        d = self.head_dim
        codes = unpack_stream(coded.codes, coded.bits, d // self.vector.dim)
        y = vq.decode(codes, centroids)
        return rotate_rows(y, rotation(d, torch.float32, codes.device)) * coded.norm.float()

    def _coded_part(self, centroids: torch.Tensor | None, basis: torch.Tensor) -> CodedPart:
        """One codebook (G, 2^B, D) that every sub-vector shares."""
        return CodedPart(self.vector.bits, self.vector.dim, centroids.float()[:, None], True, basis)

    def settings(self) -> dict:
        return {"vector": str(self.vector), "residual": self.block, "rotation_seed": ROTATION_SEED,
                "calibrated": True, "granularity": self.granularity}


def load(path: str, shape: AttentionShape, settings: MethodSettings, model=None) -> TurboQuant:
    """A calibrated TurboQuant from a `fit-turboquant` artifact, checked complete and consistent."""
    art = load_artifact(path, TurboQuant.name, model)
    granularity = art.settings.get("granularity")
    if art.settings.get("rotation_seed") != ROTATION_SEED or granularity not in ("layer", "head"):
        raise ArtifactError(f"artifact {path} has invalid TurboQuant settings {art.settings}; fit it again")
    config = TurboQuantConfig(**settings.resolve("turboquant", SETTINGS, {"bits": art.settings.get("bits")}, path))
    groups = 1 if granularity == "layer" else shape.num_kv_heads
    books = [tuple(checked_codebook(art.tensors, f"layers.{i}.{which}_codebook", (groups, shape.head_dim, 1 << config.bits), path)
                   for which in ("k", "v")) for i in range(shape.num_layers)]
    return TurboQuant(config, shape, books, granularity)


def checked_codebook(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], path: str,
                     ascending: bool = True, remedy: str = "fit it again") -> torch.Tensor:
    """Artifact tensor `name`, refused unless of `shape`, finite and (a scalar codebook, `ascending`)
    ascending along its last axis; a vector codebook's centroids have no order."""
    t = tensors.get(name)
    if t is None or tuple(t.shape) != shape or not torch.isfinite(t).all() or (ascending and (t.diff(dim=-1) < 0).any()):
        raise ArtifactError(f"artifact {path}: tensor {name} is missing, not of shape {shape}, "
                            f"not finite{' or not ascending' if ascending else ''}; {remedy}")
    return t


SETTINGS = ("bits", "residual")


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None,
          model: LoadedModel | None) -> TurboQuant:
    if artifacts is not None:  # calibrated codebooks (`kvcalib fit-turboquant`)
        return load(artifacts, shape, settings, model.model if model is not None else None)
    return TurboQuant(TurboQuantConfig(**settings.resolve("turboquant", SETTINGS)), shape)
