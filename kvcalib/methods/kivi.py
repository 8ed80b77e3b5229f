"""KIVI (Liu et al., 2024): keys per-channel in groups of G tokens, values per-token in groups of G
channels, asymmetric 2-bit by default; the most recent tokens stay float16 and are flushed in
blocks of R. Layout: `kvcalib.quant` (keys axis="tokens", values axis="channels").

A value group cannot be wider than a head: with G > head_dim, values are grouped per whole head
(KIVI's own code requires G to divide head_dim; we clamp instead and count the extra metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..defaults import DEFAULTS
from ..errors import SettingsError
from ..formats.codebook.coded import CodebookCoded
from ..formats.codebook.layout import CodebookSpec, CodedBlock, affine_part
from ..formats.int2.coded import Int2Coded
from ..formats.int2.layout import Int2Spec
from ..models import AttentionShape, LoadedModel
from ..quant import Quantized, codes_as_stream, dequantize, quantize
from .base import Method, MethodSettings


@dataclass(frozen=True)
class KiviConfig:
    bits: int = DEFAULTS["bits"]
    group_size: int = DEFAULTS["group_size"]
    residual: int = DEFAULTS["residual"]

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise SettingsError(f"--bits must be in 1..8, got {self.bits}")
        if self.group_size < 1 or self.residual < 1:
            raise SettingsError("--group-size and --residual must be positive")
        if self.residual % self.group_size:
            raise SettingsError(
                f"--residual {self.residual} must be a multiple of --group-size {self.group_size}: "
                "key groups are formed from whole flushed blocks"
            )


@dataclass
class KiviPacked:
    k: Quantized
    v: Quantized


class Kivi(Method, Int2Coded, CodebookCoded):
    name = "kivi"

    def __init__(self, config: KiviConfig, shape: AttentionShape):
        self.config = config
        self.block = config.residual
        self.value_group = min(config.group_size, shape.head_dim)
        if shape.head_dim % self.value_group:
            raise SettingsError(f"--group-size {config.group_size} must divide head_dim {shape.head_dim} for values")

    def flush_step(self) -> int:
        return self.config.group_size  # keys are quantized per channel over groups of G tokens

    def int2_spec(self) -> Int2Spec:
        c = self.config
        return Int2Spec(c.bits, c.group_size, self.value_group, self.block, self.sink)

    def int2_parts(self, packed: KiviPacked) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        return packed.k, packed.v, None

    def codebook_spec(self, layer: int) -> CodebookSpec | None:
        """Affine keys per channel over groups of G tokens, affine values per token over groups of channels, in the
        model's basis (`kvcalib.formats.codebook.layout`); OScaR adds its key scale as the norm and its rotation."""
        c = self.config
        return CodebookSpec(affine_part(c.bits, token_group=c.group_size),
                            affine_part(c.bits, channel_group=self.value_group))

    def codebook_parts(self, packed: KiviPacked) -> CodedBlock:
        return affine_block(packed.k, packed.v)

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KiviPacked:
        c = self.config
        return KiviPacked(
            k=quantize(k, c.bits, c.group_size, "tokens"),
            v=quantize(v, c.bits, self.value_group, "channels"),
        )

    def decompress(self, layer: int, packed: KiviPacked) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize(packed.k), dequantize(packed.v)

    def part_bits(self, packed: KiviPacked) -> tuple[int, int]:
        return packed.k.stored_bits(), packed.v.stored_bits()

    def settings(self) -> dict:
        return {"bits": self.config.bits, "group_size": self.config.group_size,
                "value_group_size": self.value_group, "residual": self.config.residual}


def affine_block(k: Quantized, v: Quantized, knorm: torch.Tensor | None = None) -> CodedBlock:
    """Blocks in `kvcalib.quant`'s layout as the codebook layout holds them: each token's codes one bit stream
    (keys are packed along tokens there: unpacked and packed again along channels), scales and zeros as they are."""
    kc, vc = codes_as_stream(k), codes_as_stream(v)
    return CodedBlock(kc, knorm, vc, None, kscale=k.scale.half(), kzero=k.zero.half(), vscale=v.scale.half(),
                      vzero=v.zero.half())


SETTINGS = ("bits", "group_size", "residual")


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Kivi:
    if artifacts is not None:
        raise SettingsError("--method kivi takes no --artifacts (it fits nothing)")
    return Kivi(KiviConfig(**settings.resolve("kivi", SETTINGS)), shape)
