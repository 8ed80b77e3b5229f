"""The VecInfer layout as the caches hold it (`kvcalib.formats.base.Format`)."""

from __future__ import annotations

import torch

from ...attention import compute_dtype
from ..base import Format, query_for_kernel
from .coded import declared
from .launch import HEAD_DIMS, supports, vq_decode
from .layout import VQLayer, append_block, flushed_kv


class VQFormat(Format):
    name = "VecInfer"
    head_dims = HEAD_DIMS
    holds_state = False

    def declaration(self, method, layer: int):
        return declared(method, layer)

    def supports(self, declaration, head_dim, device, gqa=1, opts=None) -> bool:
        return supports(declaration, head_dim, device, gqa, opts)

    def append(self, layout, method, layer, declaration, packed, sink_k, sink_v, residual_k, residual_v):
        books, device = declaration, residual_k.device
        return append_block(layout, *method.vq_parts(packed), books.kbook.to(device), books.vbook.to(device),
                            books.k_bits, books.v_bits, sink_k, sink_v, residual_k, residual_v,
                            None if books.smooth is None else books.smooth.to(device), books.hadamard)

    def flushed_kv(self, layout: VQLayer):
        return flushed_kv(layout)

    def attend(self, method, layer, q, layout, scaling, state, counts=None, softcap=None):
        """Keys coded in the codec basis: the kernel transforms the query."""
        if softcap:  # `supports` refuses soft-capped calls
            raise ValueError("the VQ kernel does not soft-cap scores")
        lengths, residuals = counts if counts is not None else (None, None)
        return vq_decode(query_for_kernel(q), layout, scaling, lengths=lengths,
                         residuals=residuals).to(compute_dtype(q)).unsqueeze(2)

    def slots(self, layout):
        return [(layout, "kcodes"), (layout, "vcodes")]

    def side_by_side(self, layouts, method) -> bool:
        return all(x.sinks == 0 for x in layouts)  # the stacked rows hold no float16 sinks of their own

    def allocate(self, method, layer, declaration, batch, room, capacity, residual, kv_heads, head_dim, device):
        books = declaration
        blank = torch.zeros(1, kv_heads, residual, head_dim, device=device)
        kc, vc = method.vq_parts(method.compress(layer, blank, blank))

        def zeros(*shape, dtype=torch.float16):
            return torch.zeros(*shape, dtype=dtype, device=device)

        none = zeros(batch, kv_heads, 0, head_dim)
        return VQLayer(zeros(batch, kv_heads, room, kc.shape[-1], dtype=torch.uint8),
                       zeros(batch, kv_heads, room, vc.shape[-1], dtype=torch.uint8),
                       books.kbook.to(device), books.vbook.to(device), none, none,
                       zeros(batch, kv_heads, residual, head_dim), zeros(batch, kv_heads, residual, head_dim), capacity,
                       residual, 0, books.k_bits, books.v_bits,
                       None if books.smooth is None else books.smooth.to(device), books.hadamard)

    def flush_parts(self, method, packed):
        return list(method.vq_parts(packed))

    def buffers(self, layout: VQLayer):
        return [(layout.kcodes, 1), (layout.vcodes, 1)]
