"""What a method declares to have its flushed blocks read by the VecInfer kernel: `VQCoded`, a class its own class
takes (VecInfer's). `format.py` beside it reads a method through `declared`."""

from __future__ import annotations

from typing import Any

import torch

from .layout import VQBooks


class VQCoded:
    """Its blocks in the VecInfer layout (`layout.py`)."""

    def vq_books(self, layer: int) -> VQBooks | None:
        """The layer's codebooks and the keys' transform as the VecInfer kernel reads them, with `vq_parts` giving a
        block's code rows; or None."""
        raise NotImplementedError(f"{type(self).__name__} declares no VecInfer layout")

    def vq_parts(self, packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(key codes, value codes) of a flushed block, `kvcalib.vq`'s packed rows (B, Hkv, T, R) uint8."""
        raise NotImplementedError(f"{type(self).__name__} has no VecInfer parts")


def declared(method, layer: int) -> VQBooks | None:
    """`method`'s VecInfer declaration for `layer`: None where its class does not take `VQCoded`."""
    return method.vq_books(layer) if isinstance(method, VQCoded) else None
