"""The codebook layout as the caches hold it (`kvcalib.formats.base.Format`): TurboQuant, KIVI and OScaR beyond
2 bits or with sinks, VecInfer in a plan, and a plan's groups of KV heads."""

from __future__ import annotations

import dataclasses

import torch

from ...attention import compute_dtype
from ..base import Format, query_for_kernel
from .coded import declared
from .launch import HEAD_DIMS, codebook_decode, supports
from .layout import BUFFERS, CodebookLayer, append_block, flushed_kv, rows_like


class CodebookFormat(Format):
    name = "codebook"
    head_dims = HEAD_DIMS
    holds_sinks = True
    holds_state = False

    def declaration(self, method, layer: int):
        """The layer's groups of heads (`CodebookCoded.codebook_groups`)."""
        return declared(method, layer)

    def supports(self, declaration, head_dim, device, gqa=1, opts=None) -> bool:
        return supports(None if declaration is None else [g.spec for g in declaration], head_dim, device, gqa, opts)

    def on(self, declaration, device):
        return None if declaration is None else [g.to(device) for g in declaration]

    def append(self, layout, method, layer, declaration, packed, sink_k, sink_v, residual_k, residual_v):
        return append_block(layout, declaration, method.codebook_blocks(packed), sink_k, sink_v, residual_k, residual_v)

    def flushed_kv(self, layout: CodebookLayer):
        return flushed_kv(layout)

    def attend(self, method, layer, q, layout, scaling, state, counts=None, softcap=None):
        """The kernel takes the query into the keys' basis and the output back; it soft-caps the scores where asked."""
        return codebook_decode(query_for_kernel(q).contiguous(), layout, scaling, counts=counts,
                               softcap=softcap).to(compute_dtype(q)).unsqueeze(2)

    def slots(self, layout: CodebookLayer):
        return [(g, n) for g in layout.groups for n in BUFFERS] + [(layout, "ksink"), (layout, "vsink")]

    def copy(self, layout: CodebookLayer):
        out = dataclasses.replace(layout)
        out.groups = [dataclasses.replace(g) for g in layout.groups]
        return out

    def side_by_side(self, layouts, method) -> bool:
        # every row that flushed holds the same sinks (a block holds them all: `static_refusal`'s limit)
        return all(x.sinks == min(method.sink, method.block) for x in layouts)

    def allocate(self, method, layer, declaration, batch, room, capacity, residual, kv_heads, head_dim, device):
        blank = torch.zeros(1, kv_heads, residual, head_dim, device=device)
        blocks = method.codebook_blocks(method.compress(layer, blank, blank))
        rows = [rows_like(group, block, batch, room, device) for group, block in zip(declaration, blocks)]
        s = method.sink  # sink rows, and as many of slack for the masked write of the first flush
        zeros = lambda n: torch.zeros(batch, kv_heads, n, head_dim, dtype=torch.float16, device=device)  # noqa: E731
        return CodebookLayer(rows, zeros(2 * s), zeros(2 * s), zeros(residual), zeros(residual), capacity, residual, s)

    def flush_parts(self, method, packed):
        return [getattr(b, n) for b in method.codebook_blocks(packed) for n in b.present()]

    def buffers(self, layout: CodebookLayer):
        return [(getattr(g, n), g.unit(n)) for g in layout.groups for n in g.present()]

    def static_refusal(self, method, declaration):
        if method.sink > method.block:
            return f"its {method.sink} float16 sink tokens must lie in the first block of {method.block}"
        return None
