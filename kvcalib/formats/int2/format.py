"""The INT2 layout as the caches hold it (`kvcalib.formats.base.Format`): KIVI, OScaR and KVLinC at 2 bits."""

from __future__ import annotations

from typing import Any

import torch

from ...attention import compute_dtype
from ..base import Format, query_for_kernel
from .coded import declared
from .launch import HEAD_DIMS, fused_decode, supports
from .layout import PackedLayer, append_block, kernel_parts

SLOTS = ("kcodes", "kscale", "kzero", "vcodes", "vscale", "vzero", "knorm")


class Int2Format(Format):
    name = "INT2"
    head_dims = HEAD_DIMS

    def declaration(self, method, layer: int):
        return declared(method)

    def supports(self, declaration, head_dim, device, gqa=1, opts=None) -> bool:
        return supports(declaration, head_dim, device, gqa, opts)

    def append(self, layout, method, layer, declaration, packed, sink_k, sink_v, residual_k, residual_v):
        return append_block(layout, *method.int2_parts(packed), residual_k, residual_v, method.rotated_keys,
                            method.rotated_values)

    def flushed_kv(self, layout: PackedLayer):
        return layout.flushed_kv(model_basis=True)

    def attend(self, method, layer, q, layout, scaling, state, counts=None, softcap=None):
        """The method's correction terms (KVLinC's) enter at the merge; everything in the model's basis: where the
        method stores blocks rotated, the kernel rotates the query for them and their partial outputs back."""
        if softcap:  # `supports` refuses soft-capped calls
            raise ValueError("the INT2 kernel does not soft-cap scores")
        terms = method.correction(layer, q, state)
        if terms is not None:
            terms = (terms[0][:, :, 0], terms[1][:, :, 0])  # the single new position
        return fused_decode(query_for_kernel(q), layout, scaling, terms, counts=counts).to(compute_dtype(q)).unsqueeze(2)

    def slots(self, layout):
        return [(layout, n) for n in SLOTS]

    def allocate(self, method, layer, declaration, batch, room, capacity, residual, kv_heads, head_dim, device):
        spec = declaration
        g, gv = spec.group_size, spec.value_group_size
        blank = torch.zeros(1, kv_heads, residual, head_dim, device=device)
        norms = method.int2_parts(method.compress(layer, blank, blank))[2] is not None

        def zeros(*shape, dtype=torch.float16):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return PackedLayer(
            kcodes=zeros(batch, kv_heads, room // 16, head_dim, dtype=torch.int32),
            kscale=zeros(batch, kv_heads, room // g, head_dim), kzero=zeros(batch, kv_heads, room // g, head_dim),
            vcodes=zeros(batch, kv_heads, room, head_dim // 16, dtype=torch.int32),
            vscale=zeros(batch, kv_heads, room, head_dim // gv), vzero=zeros(batch, kv_heads, room, head_dim // gv),
            kres=zeros(batch, kv_heads, residual, head_dim), vres=zeros(batch, kv_heads, residual, head_dim),
            length=capacity, residual=residual, group_size=g, value_group_size=gv,
            knorm=zeros(batch, kv_heads, room) if norms else None,
            rotated_keys=method.rotated_keys, rotated_values=method.rotated_values)

    def flush_parts(self, method, packed: Any):
        kq, vq, norms = method.int2_parts(packed)
        kcodes, vcodes, vscale, vzero = kernel_parts(kq, vq)
        return [kcodes, kq.scale, kq.zero, vcodes, vscale, vzero] + ([norms] if norms is not None else [])

    def buffers(self, layout: PackedLayer):
        g = layout.group_size
        norms = [(layout.knorm, 1)] if layout.knorm is not None else []
        return [(layout.kcodes, 16), (layout.kscale, g), (layout.kzero, g), (layout.vcodes, 1), (layout.vscale, 1),
                (layout.vzero, 1)] + norms

    def static_refusal(self, method, declaration):
        if method.block % 16 or method.block % declaration.group_size:
            return f"--residual {method.block} must be a multiple of 16 and of the key group {declaration.group_size}"
        return None
