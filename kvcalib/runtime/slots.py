"""The static cache's writes into its slots, on the device and in place: a decode step's new token into each
sequence's residual window (`write_token`, which the captured step swaps for its compiled form:
`kvcalib.runtime.captured`), a flush's rows into each sequence's packed buffers where its window filled
(`masked_write`, `flush_writes`), a sliding layer's new token into its ring of the window's last tokens
(`write_ring`), and the step's attention over that ring (`ring_attention`). Functions of tensors alone, so that one
compiled region serves every layer."""

from __future__ import annotations

import torch

from ..attention import as_float16, capped_attention
from ..quant import steps
from ..streams import side_by_side


def masked_write(buf: torch.Tensor, new: torch.Tensor, start: torch.Tensor, take: torch.Tensor,
                 slot: torch.Tensor | None = None) -> None:
    """buf[b, :, start[b] : start[b] + n] = new[b] where take[b], on the device (no host sync); a row not
    taken writes into the last n positions of buf instead, the slack that nothing reads.
    buf (B, H, N, ...), new (B, H, n, ...), start (B,), take (B,) bool; or, given `slot` (1,) int64, new
    (1, H, n, ...), start and take (1,): the one row buf[slot].

    Through `index_put_`, which Inductor lowers to a write into `buf` itself: its `scatter_` (and a
    gather of the old rows) makes a copy of the whole buffer, every packed buffer at every step."""
    b, h, n = new.shape[:3]
    batch = _batch_rows(b, buf.device) if slot is None else slot.view(1, 1, 1)
    buf.index_put_((batch, _head_rows(h, buf.device), _rows(buf, n, start, take)), new)


def flush_writes(writes: list[tuple[torch.Tensor, torch.Tensor, int]], flushed: torch.Tensor,
                 take: torch.Tensor, slot: torch.Tensor | None = None) -> None:
    """`masked_write` of a flush's buffers, each (buf, new, unit): new's rows stand for `unit` tokens each and go
    to row flushed[b] // unit (given `slot`, of that one row, as `masked_write`'s). Each index is made once for the
    writes that share it (a start per unit, positions per (unit, buffer length, rows), heads per count): a flushing
    step runs eagerly inside the captured step, where each of a layer's 6 (KIVI-2) to 16 (a plan's groups) buffers
    written alone took 8 launches, 1 here and the indices' few (benchmarks/flush_cost.py counts them), the buffers'
    writes side by side on a GPU (`streams.side_by_side`: they touch buffers of their own). Where every
    buffer's slack block starts at the same token (as a static layer's do: at the capacity), the rows not taken are
    sent there once, in tokens, rather than buffer by buffer."""
    slack = {(buf.shape[2] - new.shape[2]) * unit for buf, new, unit in writes}
    shared = len(slack) == 1 and all(next(iter(slack)) % unit == 0 for _, _, unit in writes)
    if shared:  # every buffer's slack block starts at the same token (the capacity): where a row goes, chosen once
        flushed, take = torch.where(take, flushed, next(iter(slack))), None
    starts: dict[int, torch.Tensor] = {}
    rows: dict[tuple[int, int, int], torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    batch = _batch_rows(flushed.shape[0], flushed.device) if slot is None else slot.view(1, 1, 1)
    for buf, new, unit in writes:
        h, n = new.shape[1], new.shape[2]
        if unit not in starts:
            starts[unit] = torch.div(flushed, unit, rounding_mode="floor").long()  # `_rows` takes it as it is
        if (unit, buf.shape[2], n) not in rows:
            rows[unit, buf.shape[2], n] = _rows(buf, n, starts[unit], take)
        if h not in heads:
            heads[h] = _head_rows(h, buf.device)
    # The writes touch buffers of their own: side by side, each on a stream of its own (a plan's layer has 16)
    side_by_side(flushed.device, [
        lambda buf=buf, new=new, unit=unit: buf.index_put_((batch, heads[new.shape[1]],
                                                            rows[unit, buf.shape[2], new.shape[2]]), new)
        for buf, new, unit in writes])


def _rows(buf: torch.Tensor, n: int, start: torch.Tensor, take: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, n) positions along buf's dim 2 of each row's n new rows: from start[b] where take[b], else the slack
    (take None: start already says where, the slack's rows included)."""
    at = start if take is None else torch.where(take, start.long(), buf.shape[2] - n)
    return at.view(-1, 1, 1) + steps(n, 1, buf.device)


# The index ranges, held once a device where a tensor may be kept (`quant.steps`): an eager flush inside the
# captured step then launches nothing to make them.
def _batch_rows(b: int, device: torch.device) -> torch.Tensor:
    return steps(b, 1, device).view(b, 1, 1)


def _head_rows(h: int, device: torch.device) -> torch.Tensor:
    return steps(h, 1, device).view(1, h, 1)


def write_token(kres: torch.Tensor, vres: torch.Tensor, residual: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Each sequence's new token, k and v (B, H, 1, D), into its residual window (kres, vres (B, H, R, D)) at its
    own count `residual` (B,), and the counts one up: what every decode step appends. A module-level function of
    tensors, so that one compiled region serves every layer (`kvcalib.runtime.captured`). At R = 128, 127 steps
    in 128 append with this write alone; compiled by default, it took 7 kernels a layer off the step (8B shape,
    benchmarks/RESULTS.md)."""
    b, h = k.shape[:2]
    rows = (steps(b, 1, k.device).view(b, 1), steps(h, 1, k.device).view(1, h), residual.long().view(b, 1))
    for buf, x in ((kres, k), (vres, v)):
        buf.index_put_(rows, as_float16(x[:, :, 0]))  # in place under Inductor too (`masked_write`)
    residual += 1


def write_ring(kvwin: torch.Tensor, count: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Each sequence's new token, k and v (B, H, 1, D), into its ring of the last W tokens (kvwin (2, B, H, W, D):
    keys, then values, the model's dtype) at position count mod W, `count` (B,) the tokens it has seen, then the
    counts one up: one write for keys and values (compiled, one kernel a layer where two writes took two). The
    ring's order is not the tokens' (attention over a set of keys does not depend on their order)."""
    b, h, w = k.shape[0], k.shape[1], kvwin.shape[3]
    rows = (torch.arange(2, device=k.device).view(2, 1, 1), torch.arange(b, device=k.device).view(1, b, 1),
            torch.arange(h, device=k.device).view(1, 1, h), torch.remainder(count.long(), w).view(1, b, 1))
    kvwin.index_put_(rows, torch.stack([k[:, :, 0], v[:, :, 0]]).to(kvwin.dtype))
    count += 1


def ring_attention(query: torch.Tensor, kwin: torch.Tensor, vwin: torch.Tensor, count: torch.Tensor,
                   scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Each sequence's step query (B, Hq, 1, D) over the min(count, W) tokens its ring holds (`write_ring`), SDPA in
    the model's dtype, or where the model soft-caps its scores (Gemma 2) its eager attention's products
    (`kvcalib.attention.capped_attention`). A module-level function of tensors, like `write_token`, so that one compiled
    region serves every sliding layer: eager, its mask and grouped-query SDPA are several kernels a layer."""
    held = torch.arange(kwin.shape[2], device=query.device).view(1, -1) < count.view(-1, 1)  # (B, W)
    if softcap:
        return capped_attention(query, kwin, vwin, held[:, None, None, :], scaling, softcap)
    return torch.nn.functional.scaled_dot_product_attention(query, kwin, vwin, attn_mask=held[:, None, None, :],
                                                            scale=scaling, enable_gqa=True)
