"""Independent pieces of GPU work run side by side on streams of their own, joined back before their results are
read: a plan's layer decodes its groups of heads so (`formats.codebook.launch`) and compresses them so at a flush
(`methods.plan`), and a flush writes its buffers so (`runtime.slots.flush_writes`). Captured into a CUDA graph, the
streams become its parallel branches, and a branch's small kernels no longer wait for the other groups' (a flush
runs eagerly inside the captured step, where a plan's layer launched 48 to 66 kernels in turn:
benchmarks/flush_cost.py)."""

from __future__ import annotations

from typing import Any, Callable

import torch

_HELD: dict[torch.device, list] = {}


def side_streams(device: torch.device, n: int) -> list:
    """n streams of `device`, made once and kept (a capture's warm-up makes them before the capture runs)."""
    held = _HELD.setdefault(device, [])
    while len(held) < n:
        held.append(torch.cuda.Stream(device))
    return held[:n]


def side_by_side(device: torch.device, calls: list[Callable[[], Any]]) -> list[Any]:
    """Each of `calls` (no arguments) on a side stream of its own, after what the current stream has queued; the
    current stream then waits for them all, also where a call raised. Their results, in order, are read after that
    (on the current stream, or on side streams forked from it again): what a call allocated is freed after its
    readers, and a side stream's next work here waits for the current stream's first. A tensor a call keeps for
    later calls (an index range, a device copy of a book) must be whole before a sibling reads it: `settled`.
    Off CUDA, for one call, and while torch.compile traces: in turn on the current stream."""
    if device.type != "cuda" or len(calls) < 2 or torch.compiler.is_compiling():
        return [call() for call in calls]
    main = torch.cuda.current_stream(device)
    sides = side_streams(device, len(calls))
    out, forked = [], []
    try:
        for call, side in zip(calls, sides):
            side.wait_stream(main)
            forked.append(side)
            with torch.cuda.stream(side):
                out.append(call())
    finally:
        for side in forked:
            main.wait_stream(side)
    return out


def settled(kept: Any) -> Any:
    """`kept` (a tensor, or a tuple of them), made to be kept and read by later calls, whole before this returns
    where it is on a GPU and no graph captures: made on one side stream (`side_by_side`), it would otherwise be read
    by a sibling's stream while its kernel runs. Once per kept tensor, at its making (a capture's warm-up)."""
    if torch.compiler.is_compiling():
        return kept
    tensors = kept if isinstance(kept, (tuple, list)) else (kept,)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(t.device).synchronize()
            break
    return kept
