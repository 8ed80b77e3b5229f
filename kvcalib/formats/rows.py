"""What every layout's append shares: flushed buffers that grow by doubling (`grow`), and the float16 rows a layout
keeps beside its codes, the sink tokens and the residual window (`take_rows`)."""

from __future__ import annotations

import torch


def grow(buf: torch.Tensor, add: torch.Tensor, used: int) -> torch.Tensor:
    """`buf` (B, H, N, ...) with `add` written along dim 2 after its first `used` rows; a full buffer is
    replaced by one of twice the rows (or as many as needed), its used rows copied over."""
    if used + add.shape[2] > buf.shape[2]:
        bigger = buf.new_zeros(*buf.shape[:2], max(2 * buf.shape[2], used + add.shape[2]), *buf.shape[3:])
        bigger[:, :, :used] = buf[:, :, :used]
        buf = bigger
    buf[:, :, used : used + add.shape[2]] = add
    return buf


def take_rows(layer, flushed: int, sink_k: torch.Tensor, sink_v: torch.Tensor, residual_k: torch.Tensor,
              residual_v: torch.Tensor) -> None:
    """After `flushed` more tokens of `layer` were coded: its float16 sinks among them ((B, H, 0, d) when none)
    appended, and its residual window replaced (the layer's `ksink`, `vsink`, `sinks`, `length`, `kres`, `vres`,
    `residual`)."""
    if sink_k.shape[2]:
        layer.ksink = torch.cat([layer.ksink[:, :, : layer.sinks], sink_k.half()], 2)
        layer.vsink = torch.cat([layer.vsink[:, :, : layer.sinks], sink_v.half()], 2)
        layer.sinks += sink_k.shape[2]
    layer.length += flushed
    layer.kres, layer.vres = residual_k.half().contiguous(), residual_v.half().contiguous()
    layer.residual = residual_k.shape[2]
