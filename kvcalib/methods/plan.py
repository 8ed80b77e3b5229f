"""A plan (`kvcalib plan`, `methods/plan_fit.py`): every layer's keys and every layer's values coded by a
scheme of their own, chosen under a bit budget from several method families.

Schemes (`parse_scheme`; one string each, as the plan's settings and `--candidates` spell them):

| scheme             | keys and values as                                                        |
|--------------------|---------------------------------------------------------------------------|
| `turboquant-{b}`   | TurboQuant, b bits, the plan's own calibrated per-coordinate codebooks    |
| `turboquant-d{D}b{B}` | TurboQuant's norms and rotation, a calibrated vector codebook: 2^B centroids of D coordinates (`TurboQuantVQ`) |
| `kivi-{b}-g{G}`    | KIVI, b bits, key groups of G tokens, value groups of min(G, d) channels  |
| `oscar-{b}-g{G}`   | OScaR (Hadamard rotation, l2 per-token key scaling), b bits, groups of G  |
| `vecinfer-d{D}b{B}` | VecInfer: keys smoothed by λ and Hadamard-rotated, values as they are, k-means codebooks of 2^B centroids of D coordinates, no norms |

A plan chooses per layer and KV head (`kvcalib plan --items head`) or per layer (`--items layer`: every
head of a layer takes the same scheme). Format: a flushed block of a layer is, for its keys and for its
values, one block per group of KV heads that share a scheme, packed by that scheme in its own layout
(`kivi.py`, `oscar.py`, `turboquant.py`; KV heads are independent in all three); its stored bits are the
keys' parts of the key groups and the values' parts of the value groups (`Method.part_bits`). The reference reads each back with
its scheme, in the original basis (OScaR's `decompress` rotates back). Every scheme declares the codebook layout
(`kvcalib.formats.codebook.layout`), so the plan declares it per group of KV heads that share a key scheme and a
value scheme (`codebook_groups`, `codebook_blocks`): the runtime launches the codebook kernel once per such group,
each over its own heads' codes, reading the layer's float16 sinks and residual.

All schemes of a plan flush under one rule (`kvcalib.methods.base`): blockwise, blocks of R; sliding, steps
of `flush_step`, the least common multiple of every candidate's step when the plan was measured, so
that a KIVI key group is always whole.

Artifact (method `plan`): settings `k` and `v` (per layer, a scheme per KV head), `budget`, `items`,
`granularity` of the TurboQuant codebooks, `rotation_seed`, `flush_step`, `sink_tokens`,
`residual_mode`, `residual`; tensors `layers.{i}.{k,v}_codebook_b{b}` (G, d, 2^b) float16, one per
layer, part and width that TurboQuant codes, and `layers.{i}.{k,v}_codebook_d{D}b{B}` (G, 2^B, D) float16
for its vector codebooks, `layers.{i}.{k,v}_codebook_vecinfer_d{D}b{B}` (G, 2^B, D) for VecInfer's, and
`layers.{i}.k_smooth` (Hkv, d), VecInfer's λ, where a layer's keys take a VecInfer scheme; all counted
once, 16 bits per number (`constant_bits`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..artifacts import load_artifact
from ..errors import ArtifactError, SettingsError
from ..formats.codebook.coded import CodebookCoded
from ..formats.codebook.layout import CodebookSpec, CodedBlock, HeadGroup
from ..models import AttentionShape, LoadedModel
from ..streams import settled, side_by_side
from .. import vq
from .base import Method, MethodSettings, kv_head_part
from .kivi import Kivi, KiviConfig
from .oscar import Oscar, OscarConfig
from .turboquant import BITS, ROTATION_SEED, TurboQuant, TurboQuantConfig, TurboQuantVQ, checked_codebook
from .vecinfer import LayerCodebooks, VecInfer, VecInferConfig

_SCHEME = re.compile(r"(?P<family>turboquant|vecinfer)-(?:(?P<bits>\d+)|d(?P<dim>\d+)b(?P<vbits>\d+))"
                     r"|(?P<grouped>kivi|oscar)-(?P<gbits>\d+)-g(?P<group>\d+)")
VECTOR_BITS = 12  # the largest vector codebook a plan fits: 4096 centroids
PARTS = ("k", "v")


@dataclass(frozen=True)
class Scheme:
    family: str  # turboquant, vecinfer, kivi or oscar
    bits: int  # per element; a vector codebook: per code of `dim` elements
    group_size: int | None = None  # kivi and oscar
    dim: int | None = None  # a vector codebook (TurboQuant's or VecInfer's): coordinates per centroid

    def __str__(self) -> str:
        if self.dim:
            return f"{self.family}-d{self.dim}b{self.bits}"
        return f"{self.family}-{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")

    @property
    def book(self) -> str | None:
        """The tag of its codebook tensors (`codebook_name`): `b{bits}` or `d{D}b{B}` (TurboQuant),
        `vecinfer_d{D}b{B}`; None if it has none."""
        if self.family == "vecinfer":
            return f"vecinfer_d{self.dim}b{self.bits}"
        if self.family != "turboquant":
            return None
        return f"d{self.dim}b{self.bits}" if self.dim else f"b{self.bits}"

    def book_shape(self, groups: int, head_dim: int) -> tuple[int, int, int]:
        """The shape of one layer's and part's codebook: (G, d, 2^b) per coordinate, (G, 2^B, D) vector."""
        return (groups, 1 << self.bits, self.dim) if self.dim else (groups, head_dim, 1 << self.bits)


def parse_scheme(text: str) -> Scheme:
    """A scheme from its name (module docstring); SettingsError for anything else."""
    m = _SCHEME.fullmatch(text.strip())
    if m is None:
        raise SettingsError(f"unknown scheme {text!r}: write turboquant-B, turboquant-dDbB, vecinfer-dDbB, kivi-B-gG "
                            "or oscar-B-gG (e.g. oscar-2-g128)")
    if m["family"] == "vecinfer" and not m["dim"]:
        raise SettingsError(f"scheme {text}: write VecInfer as vecinfer-dDbB (e.g. vecinfer-d4b8)")
    if m["dim"]:
        scheme = Scheme(m["family"], int(m["vbits"]), dim=int(m["dim"]))
        if not scheme.dim >= 1 or not 1 <= scheme.bits <= VECTOR_BITS:
            raise SettingsError(f"scheme {text}: a vector codebook takes D >= 1 coordinates and 1..{VECTOR_BITS} bits")
        return scheme
    if m["family"]:
        scheme = Scheme("turboquant", int(m["bits"]))
        if scheme.bits not in BITS:
            raise SettingsError(f"scheme {text}: TurboQuant takes 1..4 bits")
        return scheme
    scheme = Scheme(m["grouped"], int(m["gbits"]), int(m["group"]))
    KiviConfig(bits=scheme.bits, group_size=scheme.group_size, residual=scheme.group_size)  # refuses bad bits or G
    return scheme


def scheme_coder(scheme: Scheme, shape: AttentionShape, residual: int,
                 books: list[tuple] | None = None, granularity: str | None = None) -> Method:
    """The method that codes one scheme: TurboQuant with the given calibrated codebooks (per layer, keys
    and values: per coordinate, or vector codebooks), VecInfer with them (per layer, keys, values and
    the keys' λ), KIVI, or OScaR with its defaults (l2 scaling, rotation)."""
    if scheme.family == "vecinfer":
        if books is None:
            raise SettingsError(f"scheme {scheme} needs calibrated codebooks")
        config = VecInferConfig(k_config=f"d{scheme.dim}b{scheme.bits}", v_config=f"d{scheme.dim}b{scheme.bits}",
                                granularity=granularity)
        config.check(shape)
        return VecInfer(config, [LayerCodebooks(k=k, v=v, smooth=lam) for k, v, lam in books], shape, residual)
    if scheme.family == "turboquant":
        if books is None:
            raise SettingsError(f"scheme {scheme} needs calibrated codebooks")
        if scheme.dim:
            return TurboQuantVQ(vq.VQConfig(scheme.dim, scheme.bits), residual, shape, books, granularity)
        return TurboQuant(TurboQuantConfig(bits=scheme.bits, residual=residual), shape, books, granularity)
    if scheme.family == "kivi":
        return Kivi(KiviConfig(bits=scheme.bits, group_size=scheme.group_size, residual=residual), shape)
    return Oscar(OscarConfig(bits=scheme.bits, group_size=scheme.group_size, residual=residual), shape)


def common_flush_step(coders: list[Method]) -> int:
    """The least common multiple of the coders' flush steps: one sliding flush that keeps every group whole."""
    return math.lcm(*(c.flush_step() for c in coders))


def smooth_name(layer: int) -> str:
    """The artifact tensor of a layer's VecInfer key smoothing λ (Hkv, d)."""
    return f"layers.{layer}.k_smooth"


def codebook_name(layer: int, part: str, book: int | str) -> str:
    """The artifact tensor of a layer's key or value codebook (`part` k or v): `book` is a scheme's tag
    (`Scheme.book`), or the width of a per-coordinate codebook."""
    return f"layers.{layer}.{part}_codebook_" + (f"b{book}" if isinstance(book, int) else book)


_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}  # `heads_of`'s index tensors, per device


def heads_of(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """x[:, index]: a slice where the heads are a run, else an index tensor made once per device (a captured step may
    not copy one from the host: the static cache's first flush, uncaptured, makes it)."""
    if index == list(range(index[0], index[0] + len(index))):
        return x[:, index[0] : index[0] + len(index)]
    key = (tuple(index), x.device)
    held = _INDEX.get(key)
    if held is None:
        held = _INDEX[key] = settled(torch.tensor(index, device=x.device))
    return x.index_select(1, held)


@dataclass
class PlanPacked:
    layer: int
    k: list[Any]  # per group of KV heads sharing a scheme (`Plan.groups`), the block as that scheme packs it
    v: list[Any]


class Plan(Method, CodebookCoded):
    name = "plan"
    per_kv_head = True  # a scheme per KV head

    def __init__(self, shape: AttentionShape, schemes: dict[str, list[list[Scheme]]], residual: int, flush_step: int,
                 books: dict[str, torch.Tensor], granularity: str):
        """schemes: `k` and `v`, per layer a scheme per KV head; books: `codebook_name(i, part, tag)`
        (`Scheme.book_shape`) for every layer, part and codebook that TurboQuant codes (G = 1, or one per KV
        head with granularity head)."""
        self.shape, self.schemes, self.books, self.granularity = shape, schemes, books, granularity
        self.block, self.residual, self._flush_step = residual, residual, flush_step
        # groups[part][layer]: (heads, coder) for each scheme the layer's heads take, heads in ascending order
        self.groups: dict[str, list[list[tuple[list[int], Method]]]] = {part: [] for part in PARTS}
        shared: dict[Scheme, Method] = {}  # KIVI and OScaR coders carry no per-layer data: one per scheme
        for i in range(shape.num_layers):
            for part in PARTS:
                layer_groups = []
                for scheme in dict.fromkeys(schemes[part][i]):
                    heads = [h for h, s in enumerate(schemes[part][i]) if s == scheme]
                    if scheme.book:  # one codebook serves both slots; the other is never read
                        book = books[codebook_name(i, part, scheme.book)]
                        book = book[heads] if granularity == "head" else book
                        slots = (book, book)
                        if scheme.family == "vecinfer":  # λ smooths keys only
                            slots += (books[smooth_name(i)][heads] if part == "k" else None,)
                        coder = scheme_coder(scheme, shape, residual, [slots] * shape.num_layers, granularity)
                    else:
                        coder = shared.setdefault(scheme, scheme_coder(scheme, shape, residual))
                    layer_groups.append((heads, coder))
                self.groups[part].append(layer_groups)

    def for_kv_heads(self, start: int, stop: int) -> "Plan":
        """The plan of these KV heads alone: their schemes, their smoothing, and their codebooks where each KV head
        has its own (granularity head)."""
        schemes = {part: [heads[start:stop] for heads in self.schemes[part]] for part in PARTS}
        books = {name: t[start:stop] if self.granularity == "head" or name.endswith("_smooth") else t
                 for name, t in self.books.items()}
        part = Plan(kv_head_part(self.shape, start, stop), schemes, self.residual, self._flush_step, books, self.granularity)
        for name in ("block", "window", "sink", "fitted_residual_mode", "float16_layers", "sliding_layers",
                     "fitted_sliding_layers"):  # the flush rule, sinks and kept layers as set on this one
            setattr(part, name, getattr(self, name))
        return part

    def flush_step(self) -> int:
        return self._flush_step

    def _pairs(self, layer: int) -> list[tuple[tuple[int, ...], int, list[int], int, list[int]]]:
        """The layer's KV heads grouped by (key group, value group) of `groups`: per pair, its heads in ascending
        order, the key group's index and their positions in it, the value group's and theirs."""
        where = {part: {h: (i, pos) for i, (heads, _) in enumerate(self.groups[part][layer]) for pos, h in enumerate(heads)}
                 for part in PARTS}
        pairs: dict[tuple[int, int], list[int]] = {}
        for h in range(self.shape.num_kv_heads):
            pairs.setdefault((where["k"][h][0], where["v"][h][0]), []).append(h)
        return [(tuple(heads), ki, [where["k"][h][1] for h in heads], vi, [where["v"][h][1] for h in heads])
                for (ki, vi), heads in pairs.items()]

    def codebook_groups(self, layer: int) -> list[HeadGroup] | None:
        """One group per pair of key and value schemes among the layer's KV heads: the key scheme's key part and the
        value scheme's value part, each for those heads (books and bases kept per head sliced)."""
        out = []
        for heads, ki, kpos, vi, vpos in self._pairs(layer):
            kspec = self.groups["k"][layer][ki][1].codebook_spec(layer)
            vspec = self.groups["v"][layer][vi][1].codebook_spec(layer)
            if kspec is None or vspec is None:
                return None
            out.append(HeadGroup(heads, CodebookSpec(kspec.key.heads(kpos), vspec.value.heads(vpos))))
        return out

    def codebook_blocks(self, packed: PlanPacked) -> list[CodedBlock]:
        layer, out = packed.layer, []
        parts: dict[int, CodedBlock] = {}  # each coder's block in the codebook layout, made once (pairs share them)

        def of(part: str, i: int) -> CodedBlock:
            block = getattr(packed, part)[i]
            if id(block) not in parts:
                parts[id(block)] = self.groups[part][layer][i][1].codebook_parts(block)
            return parts[id(block)]

        pick = lambda x, pos: None if x is None else heads_of(x, pos)  # noqa: E731
        for _, ki, kpos, vi, vpos in self._pairs(layer):
            kb, vb = of("k", ki), of("v", vi)
            out.append(CodedBlock(pick(kb.kcodes, kpos), pick(kb.knorm, kpos), pick(vb.vcodes, vpos), pick(vb.vnorm, vpos),
                                  pick(kb.kscale, kpos), pick(kb.kzero, kpos), pick(vb.vscale, vpos), pick(vb.vzero, vpos)))
        return out

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PlanPacked:
        """Each group's block, packed by its scheme over its heads: a group whose keys and values share heads and
        coder is packed once; a coder's part that no group reads is packed over no tokens (every scheme codes keys
        and values apart, so the part read is the same bits: half of a flush's work otherwise). On a GPU the groups
        are packed side by side, each on a stream of its own (`streams.side_by_side`): their kernels are small (a
        flush packs one window), and in turn they waited for each other's."""
        serves: dict[tuple, set[str]] = {}
        coders: dict[tuple, tuple] = {}
        for part in PARTS:
            for heads, coder in self.groups[part][layer]:
                serves.setdefault((id(coder), tuple(heads)), set()).add(part)
                coders[id(coder), tuple(heads)] = (heads, coder)

        def pack(key: tuple) -> Any:
            heads, coder = coders[key]
            kh, vh = heads_of(k, heads), heads_of(v, heads)
            return coder.compress(layer, kh if "k" in serves[key] else kh[..., :0, :],
                                  vh if "v" in serves[key] else vh[..., :0, :])

        done = dict(zip(serves, side_by_side(k.device, [lambda key=key: pack(key) for key in serves])))
        packed = {part: [done[id(coder), tuple(heads)] for heads, coder in self.groups[part][layer]] for part in PARTS}
        return PlanPacked(layer=layer, k=packed["k"], v=packed["v"])

    def decompress(self, layer: int, packed: PlanPacked) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for w, part in enumerate(PARTS):
            pieces = [(heads, coder.decompress(layer, p)[w])
                      for (heads, coder), p in zip(self.groups[part][layer], getattr(packed, part))]
            if len(pieces) == 1:
                out.append(pieces[0][1])
                continue
            b, _, t, d = pieces[0][1].shape
            x = pieces[0][1].new_empty(b, self.shape.num_kv_heads, t, d)
            for heads, piece in pieces:
                x[:, heads] = piece
            out.append(x)
        return out[0], out[1]

    def part_bits(self, packed: PlanPacked) -> tuple[int, int]:
        return tuple(sum(coder.part_bits(p)[w] for (_, coder), p in zip(self.groups[part][packed.layer], getattr(packed, part)))
                     for w, part in enumerate(PARTS))

    def constant_bits(self) -> int:
        return 16 * sum(t.numel() for t in self.books.values())

    def settings(self) -> dict:
        return {part: [[str(s) for s in heads] for heads in self.schemes[part]] for part in PARTS} | {
            "residual": self.residual, "flush_step": self._flush_step, "granularity": self.granularity}


SETTINGS = ("residual",)


def load(path: str, shape: AttentionShape, settings: MethodSettings, model=None) -> Plan:
    """A plan from its artifact, every scheme and codebook checked against the model's shape."""
    art = load_artifact(path, Plan.name, model)
    s = art.settings
    schemes = {}
    for part in PARTS:
        names = s.get(part)
        if (not isinstance(names, list) or len(names) != shape.num_layers
                or any(not isinstance(n, list) or len(n) != shape.num_kv_heads for n in names)):
            raise ArtifactError(f"artifact {path}: its plan must name one scheme per layer ({shape.num_layers}) and "
                                f"KV head ({shape.num_kv_heads}) for {part}; make the plan again")
        try:
            schemes[part] = [[parse_scheme(str(n)) for n in heads] for heads in names]
        except SettingsError as e:
            raise ArtifactError(f"artifact {path}: {e}") from None
    granularity, step = s.get("granularity"), s.get("flush_step")
    if s.get("rotation_seed") != ROTATION_SEED or granularity not in ("layer", "head") or not isinstance(step, int) or step < 1:
        raise ArtifactError(f"artifact {path} has invalid plan settings {s}; make the plan again")
    groups = 1 if granularity == "layer" else shape.num_kv_heads
    books = {}
    for i in range(shape.num_layers):
        for part in PARTS:
            for scheme in schemes[part][i]:
                if scheme.family == "vecinfer" and part == "k" and smooth_name(i) not in books:
                    books[smooth_name(i)] = checked_smooth(art.tensors, smooth_name(i), (shape.num_kv_heads, shape.head_dim), path)
                if scheme.book:
                    name = codebook_name(i, part, scheme.book)
                    if scheme.dim and shape.head_dim % scheme.dim:
                        raise ArtifactError(f"artifact {path}: scheme {scheme} does not tile head_dim {shape.head_dim}")
                    books[name] = checked_codebook(art.tensors, name, scheme.book_shape(groups, shape.head_dim), path,
                                                   ascending=not scheme.dim, remedy="make the plan again").float()
    extra = sorted(set(art.tensors) - set(books))
    if extra:
        raise ArtifactError(f"artifact {path} holds tensors its plan does not use ({extra[0]}, ...); make the plan again")
    fixed = {"residual": s["residual"]} if isinstance(s.get("residual"), int) else {}  # measured at this R
    residual = settings.resolve(Plan.name, SETTINGS, fixed, path)["residual"]
    method = Plan(shape, schemes, residual, step, books, granularity)
    method.sink = int(s.get("sink_tokens", 0))  # made with float16 sinks: it keeps them
    method.fitted_residual_mode = s.get("residual_mode")  # and the flush rule it was measured under
    method.fitted_sliding_layers = s.get("sliding_layers")  # and whether its sliding layers were items
    return method


def checked_smooth(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], path: str) -> torch.Tensor:
    """VecInfer's λ `name`, refused unless of `shape` and positive (keys are divided by it)."""
    t = tensors.get(name)
    if t is None or tuple(t.shape) != shape or not (t > 0).all():
        raise ArtifactError(f"artifact {path}: tensor {name} is missing, not of shape {shape} or not positive; "
                            "make the plan again")
    return t


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Plan:
    if artifacts is None:
        raise SettingsError("--method plan needs --artifacts: a plan written by `kvcalib plan`")
    return load(artifacts, shape, settings, model.model if model is not None else None)
