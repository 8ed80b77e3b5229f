"""A plan (`kvcalib plan`, `methods/plan_fit.py`): every layer's keys and every layer's values coded by a
scheme of their own, chosen under a bit budget from several method families.

Schemes (`parse_scheme`; one string each, as the plan's settings and `--candidates` spell them):

| scheme             | keys and values as                                                        |
|--------------------|---------------------------------------------------------------------------|
| `turboquant-{b}`   | TurboQuant, b bits, the plan's own calibrated per-coordinate codebooks    |
| `kivi-{b}-g{G}`    | KIVI, b bits, key groups of G tokens, value groups of min(G, d) channels  |
| `oscar-{b}-g{G}`   | OScaR (Hadamard rotation, l2 per-token key scaling), b bits, groups of G  |

Format: a flushed block is the pair (packed by the keys' scheme, packed by the values' scheme), each in
that method's own layout (`kivi.py`, `oscar.py`, `turboquant.py`); its stored bits are the keys' part of
the first and the values' part of the second (`Method.part_bits`). The reference reads each back with
its scheme, in the original basis (OScaR's `decompress` rotates back), so the plan declares no rotated
basis and no INT2 layout: the runtime runs the torch reference over it.

All schemes of a plan flush under one rule (`kvcalib.methods`): blockwise, blocks of R; sliding, steps
of `flush_step`, the least common multiple of every candidate's step when the plan was measured, so
that a KIVI key group is always whole.

Artifact (method `plan`): settings `k` and `v` (a scheme per layer), `budget`, `granularity` of the
TurboQuant codebooks, `rotation_seed`, `flush_step`, `sink_tokens`, `residual_mode`; tensors
`layers.{i}.k_codebook` / `layers.{i}.v_codebook` (G, d, 2^b) float16 for the items coded by
TurboQuant only, counted once, 16 bits per centroid (`constant_bits`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..artifacts import load_artifact
from ..errors import ArtifactError, SettingsError
from ..models import AttentionShape, LoadedModel
from . import Method, MethodSettings
from .kivi import Kivi, KiviConfig
from .oscar import Oscar, OscarConfig
from .turboquant import BITS, ROTATION_SEED, TurboQuant, TurboQuantConfig, checked_codebook

_SCHEME = re.compile(r"(?P<family>turboquant)-(?P<bits>\d+)|(?P<grouped>kivi|oscar)-(?P<gbits>\d+)-g(?P<group>\d+)")
PARTS = ("k", "v")


@dataclass(frozen=True)
class Scheme:
    family: str  # turboquant, kivi or oscar
    bits: int
    group_size: int | None = None  # kivi and oscar

    def __str__(self) -> str:
        return f"{self.family}-{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")


def parse_scheme(text: str) -> Scheme:
    """A scheme from its name (module docstring); SettingsError for anything else."""
    m = _SCHEME.fullmatch(text.strip())
    if m is None:
        raise SettingsError(f"unknown scheme {text!r}: write turboquant-B, kivi-B-gG or oscar-B-gG (e.g. oscar-2-g128)")
    if m["family"]:
        scheme = Scheme("turboquant", int(m["bits"]))
        if scheme.bits not in BITS:
            raise SettingsError(f"scheme {text}: TurboQuant takes 1..4 bits")
        return scheme
    scheme = Scheme(m["grouped"], int(m["gbits"]), int(m["group"]))
    KiviConfig(bits=scheme.bits, group_size=scheme.group_size, residual=scheme.group_size)  # refuses bad bits or G
    return scheme


def scheme_coder(scheme: Scheme, shape: AttentionShape, residual: int,
                 books: list[tuple[torch.Tensor, torch.Tensor]] | None = None, granularity: str | None = None) -> Method:
    """The method that codes one scheme: TurboQuant with the given calibrated codebooks (per layer, keys
    and values), KIVI, or OScaR with its defaults (l2 scaling, rotation)."""
    if scheme.family == "turboquant":
        if books is None:
            raise SettingsError(f"scheme {scheme} needs calibrated codebooks")
        return TurboQuant(TurboQuantConfig(bits=scheme.bits, residual=residual), shape, books, granularity)
    if scheme.family == "kivi":
        return Kivi(KiviConfig(bits=scheme.bits, group_size=scheme.group_size, residual=residual), shape)
    return Oscar(OscarConfig(bits=scheme.bits, group_size=scheme.group_size, residual=residual), shape)


def common_flush_step(coders: list[Method]) -> int:
    """The least common multiple of the coders' flush steps: one sliding flush that keeps every group whole."""
    return math.lcm(*(c.flush_step() for c in coders))


@dataclass
class PlanPacked:
    layer: int
    k: Any  # the block as the keys' scheme packs it
    v: Any  # the block as the values' scheme packs it (the same object when both parts share a scheme)


class Plan(Method):
    name = "plan"

    def __init__(self, shape: AttentionShape, schemes: dict[str, list[Scheme]], residual: int, flush_step: int,
                 books: dict[str, torch.Tensor], granularity: str):
        """schemes: `k` and `v`, one scheme per layer; books: `layers.{i}.{k,v}_codebook` of every item
        coded by TurboQuant."""
        self.shape, self.schemes, self.books, self.granularity = shape, schemes, books, granularity
        self.block, self.residual, self._flush_step = residual, residual, flush_step
        self.coders: dict[str, list[Method]] = {part: [] for part in PARTS}
        shared: dict[Scheme, Method] = {}  # KIVI and OScaR coders carry no per-layer data: one per scheme
        for i in range(shape.num_layers):
            for part in PARTS:
                scheme = schemes[part][i]
                if scheme.family == "turboquant":  # this item's codebook serves both slots; the other is never read
                    book = books[f"layers.{i}.{part}_codebook"]
                    self.coders[part].append(scheme_coder(scheme, shape, residual, [(book, book)] * shape.num_layers,
                                                          granularity))
                else:
                    self.coders[part].append(shared.setdefault(scheme, scheme_coder(scheme, shape, residual)))

    def flush_step(self) -> int:
        return self._flush_step

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PlanPacked:
        ck, cv = self.coders["k"][layer], self.coders["v"][layer]
        pk = ck.compress(layer, k, v)
        return PlanPacked(layer=layer, k=pk, v=pk if cv is ck else cv.compress(layer, k, v))

    def decompress(self, layer: int, packed: PlanPacked) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.coders["k"][layer], self.coders["v"][layer]
        if cv is ck:
            return ck.decompress(layer, packed.k)
        return ck.decompress(layer, packed.k)[0], cv.decompress(layer, packed.v)[1]

    def part_bits(self, packed: PlanPacked) -> tuple[int, int]:
        ck, cv = self.coders["k"][packed.layer], self.coders["v"][packed.layer]
        return ck.part_bits(packed.k)[0], cv.part_bits(packed.v)[1]

    def constant_bits(self) -> int:
        return 16 * sum(t.numel() for t in self.books.values())

    def settings(self) -> dict:
        return {"k": [str(s) for s in self.schemes["k"]], "v": [str(s) for s in self.schemes["v"]],
                "residual": self.residual, "flush_step": self._flush_step, "granularity": self.granularity}


SETTINGS = ("residual",)


def load(path: str, shape: AttentionShape, settings: MethodSettings, model=None) -> Plan:
    """A plan from its artifact, every scheme and codebook checked against the model's shape."""
    art = load_artifact(path, Plan.name, model)
    s = art.settings
    schemes = {}
    for part in PARTS:
        names = s.get(part)
        if not isinstance(names, list) or len(names) != shape.num_layers:
            raise ArtifactError(f"artifact {path}: its plan must name one scheme per layer ({shape.num_layers}) "
                                f"for {part}; make the plan again")
        try:
            schemes[part] = [parse_scheme(str(n)) for n in names]
        except SettingsError as e:
            raise ArtifactError(f"artifact {path}: {e}") from None
    granularity, step = s.get("granularity"), s.get("flush_step")
    if s.get("rotation_seed") != ROTATION_SEED or granularity not in ("layer", "head") or not isinstance(step, int) or step < 1:
        raise ArtifactError(f"artifact {path} has invalid plan settings {s}; make the plan again")
    groups = 1 if granularity == "layer" else shape.num_kv_heads
    books = {}
    for i in range(shape.num_layers):
        for part in PARTS:
            scheme = schemes[part][i]
            if scheme.family == "turboquant":
                name = f"layers.{i}.{part}_codebook"
                books[name] = checked_codebook(art.tensors, name, (groups, shape.head_dim, 1 << scheme.bits), path).float()
    extra = sorted(set(art.tensors) - set(books))
    if extra:
        raise ArtifactError(f"artifact {path} holds tensors its plan does not use ({extra[0]}, ...); make the plan again")
    fixed = {"residual": s["residual"]} if isinstance(s.get("residual"), int) else {}  # measured at this R
    residual = settings.resolve(Plan.name, SETTINGS, fixed, path)["residual"]
    method = Plan(shape, schemes, residual, step, books, granularity)
    method.sink = int(s.get("sink_tokens", 0))  # made with float16 sinks: it keeps them
    method.fitted_residual_mode = s.get("residual_mode")  # and the flush rule it was measured under
    return method


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Plan:
    if artifacts is None:
        raise SettingsError("--method plan needs --artifacts: a plan written by `kvcalib plan`")
    return load(artifacts, shape, settings, model.model if model is not None else None)
