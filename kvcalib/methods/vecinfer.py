"""VecInfer: vector quantization of the KV cache with smoothed, Hadamard-rotated keys.

Keys are smoothed per channel, k / λ with λ_i = sqrt(max |K_i|) over the calibration activations
(per KV head and channel), then rotated by the normalized Walsh–Hadamard matrix H (block-diagonal
when head_dim is not a power of two, see `kvcalib.hadamard`): k̃ = (k / λ) H. Queries take the
inverse scaling and the same rotation, q̃ = (q λ) H, so q̃ · k̃ = q · k. Values are quantized as they
are. Each transformed key and each value is cut into sub-vectors and stored as codes of k-means
centroids (`kvcalib.vq`, which defines the packed code layout next to `kvcalib.quant`'s table).
Keys and values take separate `dNbM` configurations.

Attention sinks (`--sink-tokens S`, 0 by default): the first S tokens of every sequence draw much
of the attention and their keys are far from the others (`kvcalib diagnose` shows it). With S > 0
the cache keeps them in float16 beside their codes (`Method.sink`), counted at 16 bits per element.
This is our addition to the paper's method. The fit still sees them unless `--exclude-sinks`
(measured: excluding them did not help, benchmarks/RESULTS.md).

The most recent tokens stay float16 in a residual window flushed in blocks of R (R = 128 by
default, `--residual`), as for KIVI. The evaluation reads decompressed keys back in the original
space (undoing the rotation and smoothing), which is mathematically the same as rotating and scaling
the queries; `VecInfer.key_scores` is the lookup-table form, q̃ · codebookᵀ indexed by the codes, and is
tested against dequantize-then-dot. On CUDA the runtime decodes with the fused kernel
(kvcalib/formats/vq/vq_decode.cu, `kvcalib.formats.vq.launch`), which the method declares by `vq_books` and
`vq_parts`; the layout it reads, the float64 reference of its whole computation (sinks and residual
included) and the transforms into and out of the codec basis (`keys_to_codec`, `keys_from_codec`,
`queries_to_codec`, which this module uses) are `kvcalib.formats.vq.layout`.

Artifact (`kvcalib.artifacts`), per layer i: `layers.{i}.k_codebook` and `layers.{i}.v_codebook`
float16 (G, 2^M, N) with G = 1 (granularity "layer") or the KV head count ("head"), and, when
smoothing is on, `layers.{i}.k_smooth` float16 (Hkv, head_dim).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import vq
from ..artifacts import load_artifact
from ..defaults import DEFAULTS
from ..errors import ArtifactError, SettingsError
from ..formats.codebook.coded import CodebookCoded
from ..formats.codebook.layout import CodebookSpec, CodedBlock, CodedPart
from ..formats.vq.coded import VQCoded
from ..formats.vq.layout import VQBooks, keys_from_codec, keys_to_codec, queries_to_codec
from ..hadamard import hadamard, rotate
from ..models import AttentionShape, LoadedModel
from ..quant import bytes_as_words
from .base import DeviceCopies, Method, MethodSettings

log = logging.getLogger(__name__)

GRANULARITIES = ("layer", "head")


@dataclass(frozen=True)
class VecInferConfig:
    k_config: str = "d4b8"
    v_config: str = "d4b8"
    granularity: str = "layer"
    smooth: bool = True
    hadamard: bool = True
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise SettingsError(f"--sink-tokens must be 0 or more, got {self.sink_tokens}")
        vq.VQConfig.parse(self.k_config)  # parse both now: a bad configuration fails before any work
        vq.VQConfig.parse(self.v_config)
        if self.granularity not in GRANULARITIES:
            raise SettingsError(f"--granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")

    @property
    def k(self) -> vq.VQConfig:
        return vq.VQConfig.parse(self.k_config)

    @property
    def v(self) -> vq.VQConfig:
        return vq.VQConfig.parse(self.v_config)

    def check(self, shape: AttentionShape) -> None:
        self.k.check(shape.head_dim)
        self.v.check(shape.head_dim)
        if self.hadamard:
            rotate(torch.zeros(1, shape.head_dim))  # refuses an odd head_dim with a clear line

    def groups(self, shape: AttentionShape) -> int:
        return shape.num_kv_heads if self.granularity == "head" else 1


def smoothing_factors(k: torch.Tensor) -> torch.Tensor:
    """λ (Hkv, d) = sqrt(max |K|) per KV head and channel over keys k (S, Hkv, T, d), as float16."""
    # A channel that is zero everywhere gets λ = 1 instead of a division by zero.
    peak = k.float().abs().amax(dim=(0, 2))
    return torch.where(peak > 0, peak.sqrt(), 1.0).half()


@dataclass
class VecInferPacked:
    k: torch.Tensor  # uint8 (B, Hkv, T, row bytes), layout in kvcalib.vq
    v: torch.Tensor


@dataclass
class LayerCodebooks:
    k: torch.Tensor  # float16 (G, 2^M, N)
    v: torch.Tensor
    smooth: torch.Tensor | None  # float16 (Hkv, d)

    def to(self, device: torch.device) -> "LayerCodebooks":
        return LayerCodebooks(self.k.to(device), self.v.to(device), None if self.smooth is None else self.smooth.to(device))


class VecInfer(Method, VQCoded, CodebookCoded):
    name = "vecinfer"

    def __init__(self, config: VecInferConfig, layers: list[LayerCodebooks], shape: AttentionShape,
                 residual: int = DEFAULTS["residual"]):
        if residual < 1:
            raise SettingsError("--residual must be positive")
        self.config = config
        self.layers = layers
        self._copies = DeviceCopies()
        self.shape = shape
        self.block = self.residual = residual
        self.sink = config.sink_tokens

    @property
    def per_kv_head(self) -> bool:
        return self.config.granularity == "head" or any(b.smooth is not None for b in self.layers)

    def for_kv_heads(self, start: int, stop: int) -> "VecInfer":
        """Each layer's smoothing (and codebooks, one per KV head with granularity head) of these heads alone."""
        own = lambda t, per_head: t if t is None or not per_head else t[start:stop]  # noqa: E731
        head = self.config.granularity == "head"
        return self._heads_part(start, stop, layers=[LayerCodebooks(own(b.k, head), own(b.v, head), own(b.smooth, True))
                                                     for b in self.layers])

    def books(self, layer: int, device: torch.device) -> LayerCodebooks:
        """The layer's codebooks and smoothing on `device`, its layer's (`DeviceCopies`)."""
        books = self.layers[layer]
        if books.k.device == device:
            return books
        return self._copies.on(layer, books, device)

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> VecInferPacked:
        c, books = self.config, self.books(layer, k.device)
        keys = keys_to_codec(k, books.smooth, c.hadamard)
        if vq.on_the_encode_kernel(k):  # the codes and their bytes in one launch a part
            return VecInferPacked(k=vq.encode_on_gpu(keys, c.k.bits, books=books.k, as_bytes=True)[0],
                                  v=vq.encode_on_gpu(v, c.v.bits, books=books.v, as_bytes=True)[0])
        k_codes = vq.encode(keys, books.k)
        v_codes = vq.encode(v.float(), books.v)
        return VecInferPacked(k=vq.pack_codes(k_codes, c.k.bits), v=vq.pack_codes(v_codes, c.v.bits))

    def codes(self, packed: torch.Tensor, which: str) -> torch.Tensor:
        config = self.config.k if which == "k" else self.config.v
        return vq.unpack_codes(packed, config.bits, self.shape.head_dim // config.dim)

    def decompress(self, layer: int, packed: VecInferPacked) -> tuple[torch.Tensor, torch.Tensor]:
        books = self.books(layer, packed.k.device)
        k = vq.decode(self.codes(packed.k, "k"), books.k)
        v = vq.decode(self.codes(packed.v, "v"), books.v)
        return keys_from_codec(k, books.smooth, self.config.hadamard), v

    def key_scores(self, layer: int, q: torch.Tensor, packed: VecInferPacked) -> torch.Tensor:
        """q · k̂ᵀ (B, Hq, Tq, Tk), unscaled, by table lookup: LUT[j, e] = q̃_j · codebook[e] per sub-vector j,
        score = Σ_j LUT[j, code_j]: what the fused VecInfer kernel computes (kvcalib/formats/vq/vq_decode.cu, which
        takes the same sums on the tensor cores from the gathered centroids)."""
        books = self.books(layer, q.device)
        n = self.config.k.dim
        hq, hkv = q.shape[1], packed.k.shape[1]  # the heads held (a tensor-parallel rank's own)
        qt = queries_to_codec(q, books.smooth, self.config.hadamard).unflatten(-1, (-1, n))  # (B, Hq, Tq, c, N)
        codebook = books.k.float().repeat_interleave(hq // books.k.shape[0], dim=0)  # (Hq, 2^M, N)
        lut = torch.einsum("bhqcn,hen->bhcqe", qt, codebook)  # (B, Hq, c, Tq, 2^M)
        codes = self.codes(packed.k, "k").repeat_interleave(hq // hkv, dim=1).transpose(-1, -2)  # (B, Hq, c, Tk)
        index = codes.unsqueeze(-2).expand(*lut.shape[:-1], codes.shape[-1])
        return lut.gather(-1, index).sum(2)

    def vq_books(self, layer: int) -> VQBooks:
        books, c = self.layers[layer], self.config
        return VQBooks(books.k, books.v, c.k.bits, c.v.bits, books.smooth if c.smooth else None, c.hadamard)

    def vq_parts(self, packed: VecInferPacked) -> tuple[torch.Tensor, torch.Tensor]:
        return packed.k, packed.v

    def codebook_spec(self, layer: int) -> CodebookSpec:
        """Vector codes without norms: values as coded, keys k = (y H) λ, so B = H diag(λ) per KV head
        (`kvcalib.formats.codebook.layout`)."""
        c, books = self.config, self.layers[layer]
        d, device = self.shape.head_dim, books.k.device
        basis = hadamard(d, torch.float32, device) if c.hadamard else None
        if books.smooth is not None:
            lam = books.smooth.float().to(device)  # (Hkv, d)
            basis = (basis[None] if basis is not None else torch.eye(d, device=device)[None]) * lam[:, None, :]
        elif basis is not None:
            basis = basis[None]
        return CodebookSpec(CodedPart(c.k.bits, c.k.dim, books.k.float()[:, None], False, basis),
                            CodedPart(c.v.bits, c.v.dim, books.v.float()[:, None], False, None))

    def codebook_parts(self, packed: VecInferPacked) -> CodedBlock:
        return CodedBlock(bytes_as_words(packed.k), None, bytes_as_words(packed.v), None)

    def part_bits(self, packed: VecInferPacked) -> tuple[int, int]:
        return 8 * packed.k.numel(), 8 * packed.v.numel()

    def constant_bits(self) -> int:
        tensors = [t for books in self.layers for t in (books.k, books.v, books.smooth) if t is not None]
        return 16 * sum(t.numel() for t in tensors)

    def settings(self) -> dict:
        c = self.config
        return {"k": c.k_config, "v": c.v_config, "granularity": c.granularity, "smooth": c.smooth,
                "hadamard": c.hadamard, "sink_tokens": self.sink, "residual": self.residual}


def load(path: str | Path, shape: AttentionShape, model=None, residual: int = DEFAULTS["residual"]) -> VecInfer:
    """Load a fitted artifact and check it is complete and consistent with `shape`."""
    art = load_artifact(path, VecInfer.name, model)
    try:
        names = ("k_config", "v_config", "granularity", "smooth", "hadamard")
        config = VecInferConfig(**{k: art.settings[k] for k in names}, sink_tokens=art.settings.get("sink_tokens", 0))
    except (KeyError, TypeError, SettingsError) as err:
        raise ArtifactError(f"artifact {path} has invalid VecInfer settings ({err}); fit it again") from err
    groups = config.groups(shape)
    layers = []
    for i in range(shape.num_layers):
        expected = {"k_codebook": (groups, config.k.centroids, config.k.dim),
                    "v_codebook": (groups, config.v.centroids, config.v.dim)}
        if config.smooth:
            expected["k_smooth"] = (shape.num_kv_heads, shape.head_dim)
        for what, want in expected.items():
            name = f"layers.{i}.{what}"
            if name not in art.tensors or tuple(art.tensors[name].shape) != want:
                raise ArtifactError(f"artifact {path}: tensor {name} is missing or not of shape {want}; fit it again")
        layers.append(LayerCodebooks(k=art.layer(i, "k_codebook"), v=art.layer(i, "v_codebook"),
                                     smooth=art.layer(i, "k_smooth") if config.smooth else None))
    return VecInfer(config, layers, shape, residual)


SETTINGS = ("residual",)  # the codebooks fix the codes; the flush block is the decoder's choice


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> VecInfer:
    if artifacts is None:
        raise SettingsError("--method vecinfer needs --artifacts: fit one with `kvcalib fit-codebook`")
    residual = settings.resolve("vecinfer", SETTINGS)["residual"]
    return load(artifacts, shape, model.model if model is not None else None, residual)
