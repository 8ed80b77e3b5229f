"""The uncompressed baseline: every token is held in float16 as soon as it is cached."""

from __future__ import annotations

import torch

from ..attention import as_float16
from ..errors import SettingsError
from ..models import AttentionShape, LoadedModel
from .base import Method, MethodSettings


class Fp16(Method):
    name = "fp16"
    block = 1

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return as_float16(k), as_float16(v)

    def decompress(self, layer: int, packed: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return packed

    def part_bits(self, packed: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
        return 16 * packed[0].numel(), 16 * packed[1].numel()

    def settings(self) -> dict:
        return {}


SETTINGS: tuple[str, ...] = ()


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Fp16:
    if artifacts is not None:
        raise SettingsError("--method fp16 takes no --artifacts")
    return Fp16()
