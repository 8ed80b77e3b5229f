"""What a method declares to have its flushed blocks read by the INT2 kernel: `Int2Coded`, a class its own class
takes (KIVI's, which OScaR and KVLinC inherit). `format.py` beside it reads a method through `declared`."""

from __future__ import annotations

from typing import Any

import torch

from ...quant import Quantized
from .layout import Int2Spec


class Int2Coded:
    """Its blocks in the INT2 layout (`layout.py`)."""

    def int2_spec(self) -> Int2Spec | None:
        """The flushed blocks as the INT2 kernel reads them, or None where this instance's are not (KIVI beyond 2
        bits, which the codebook layout reads)."""
        raise NotImplementedError(f"{type(self).__name__} declares no INT2 layout")

    def int2_parts(self, packed: Any) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        """(keys, values, per-token key norms or None) of a flushed block in the layout of kvcalib.quant."""
        raise NotImplementedError(f"{type(self).__name__} has no INT2 parts")


def declared(method) -> Int2Spec | None:
    """`method`'s INT2 declaration: None where its class does not take `Int2Coded`."""
    return method.int2_spec() if isinstance(method, Int2Coded) else None
