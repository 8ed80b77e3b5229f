"""What a cache holds of a kernel family (`Format`): one interface, one implementation per folder of `formats/`,
registered once in `formats/registry.py`. The caches (`kvcalib.runtime.cache`, `kvcalib.runtime.static_cache`) hold
a format and its layout and never name a family.

A format reads a method's declaration of its flushed blocks (`declaration`: what the method gives through the format's
declaration class, `coded.py` in the format's folder, or None where its class does not take it), says whether its kernel
reads them (`supports`), and then, for `KvcalibCache`, appends each flushed block (`append`), reads the blocks back for
the torch path (`flushed_kv`), lists its flushed buffers so that a padded batch's rows can stand side by side in one
launch (`slots`, `side_by_side`), and launches (`attend`); for `StaticKvcalibCache`, allocates capacity-sized buffers
(`allocate`), gives a flush's parts (`flush_parts`) in the order of its buffers (`buffers`). Each layout keeps its
residual window as `kres`, `vres`, `residual` and, where it holds float16 sink tokens, `ksink`, `vsink`, `sinks`. The
float64 reference of each kernel is its layout module's `reference_decode`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Format(ABC):
    name: str  # as `where_layers_run` says it
    holds_sinks = False  # a static cache's layout keeps float16 sink tokens
    holds_state = True  # a decoding state (KVLinC's) may live beside its blocks
    head_dims: tuple[int, ...] = ()  # the head_dims its kernel reads (its launch's HEAD_DIMS)

    @abstractmethod
    def declaration(self, method, layer: int) -> Any:
        """The method's declaration of its blocks in this format (through the format's `coded.py`), None for none."""

    @abstractmethod
    def supports(self, declaration: Any, head_dim: int, device: torch.device, gqa: int = 1, opts=None) -> bool:
        """Whether the kernel reads blocks so declared (the family's `launch.supports`)."""

    def on(self, declaration: Any, device: torch.device) -> Any:
        """The declaration with its tensors on `device` (a layer's, made once by the cache)."""
        return declaration

    # ---- KvcalibCache ----
    @abstractmethod
    def append(self, layout: Any, method, layer: int, declaration: Any, packed: Any, sink_k: torch.Tensor,
               sink_v: torch.Tensor, residual_k: torch.Tensor, residual_v: torch.Tensor) -> Any:
        """`layout` (None: a new one) with a flushed block (`method.compress`'s), the float16 sink tokens among its
        tokens, and the residual window that follows it."""

    @abstractmethod
    def flushed_kv(self, layout: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The flushed tokens dequantized (B, H, T, d) float32 in the model's basis, sinks as held."""

    @abstractmethod
    def attend(self, method, layer: int, q: torch.Tensor, layout: Any, scaling: float, state: Any,
               counts: tuple[torch.Tensor, torch.Tensor] | None = None, softcap: float | None = None) -> torch.Tensor:
        """One new query per head, q (B, Hq, 1, D), through the kernel over `layout`; (B, Hq, 1, D) in the compute
        dtype. `counts`: each sequence's (flushed, residual) int32 (B,) on the device (a static cache's);
        `softcap`: the scores capped before the softmax (Gemma 2), only where `supports` said so for the call."""

    @abstractmethod
    def slots(self, layout: Any) -> list[tuple[Any, str]]:
        """Where the layout keeps its flushed buffers (B, H, capacity, ...), as (holder, attribute)."""

    def copy(self, layout: Any) -> Any:
        """A copy of the layout whose buffers may be replaced without touching the original's."""
        import dataclasses

        return dataclasses.replace(layout)

    def side_by_side(self, layouts: list[Any], method) -> bool:
        """Whether these rows' layouts (B=1 each, every one flushed) decode in one launch side by side."""
        return True

    # ---- StaticKvcalibCache ----
    @abstractmethod
    def allocate(self, method, layer: int, declaration: Any, batch: int, room: int, capacity: int, residual: int,
                 kv_heads: int, head_dim: int, device: torch.device) -> Any:
        """Buffers for `batch` sequences of `capacity` flushed tokens (`room`: with a block of slack, where the
        masked flush writes what it does not take) and a residual window of `residual`."""

    @abstractmethod
    def flush_parts(self, method, packed: Any) -> list[torch.Tensor]:
        """A flush's parts (`method.compress`'s block) in `buffers`' order."""

    @abstractmethod
    def buffers(self, layout: Any) -> list[tuple[torch.Tensor, int]]:
        """The flushed buffers with the tokens each of their rows along dim 2 stands for."""

    def static_refusal(self, method, declaration: Any) -> str | None:
        """Why a static cache cannot hold the method in this format beyond what `supports` says; None: it can."""
        return None


def query_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """The single new position of q (B, Hq, 1, D), in fp16 or bf16 as the kernels take it (a float32 or float64
    model's queries are rounded to fp16)."""
    q1 = q[:, :, 0]
    return q1 if q1.dtype in (torch.float16, torch.bfloat16) else q1.half()
