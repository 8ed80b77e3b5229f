"""`kvcalib.streams.side_by_side` on CUDA: each call on a side stream of its own, the current stream waiting for
them all; a plan's flush packed so (`Plan.compress`, its groups side by side) gives the bits it gives packed in turn,
eagerly and replayed from a CUDA graph."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: side streams exist only on a GPU", allow_module_level=True)

from kvcalib.methods import plan as plan_module  # noqa: E402
from kvcalib.models import AttentionShape  # noqa: E402
from kvcalib.streams import side_by_side  # noqa: E402

DEV = torch.device("cuda")
SLEEP = 20_000_000  # GPU cycles a call spins before it writes (~10 ms): a read not made to wait sees the old value


@pytest.mark.parametrize("n", [2, 4])
def test_each_call_runs_after_the_current_streams_work_on_a_side_stream_and_the_current_stream_waits_for_them_all(n):
    """Fork: each call copies what the current stream wrote after spinning (a call not made to wait copies zeros).
    Join: each call spins before it writes, and the current stream reads every write."""
    main = torch.cuda.current_stream(DEV)
    src, got, out = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    torch.cuda._sleep(SLEEP)
    src.copy_(torch.arange(1, n + 1, device=DEV, dtype=torch.float32))
    seen = []

    def call(i):
        seen.append(torch.cuda.current_stream(DEV))
        got[i].copy_(src[i])
        torch.cuda._sleep(SLEEP * (i + 1))
        out[i].fill_(10 * (i + 1))
        return i

    assert side_by_side(DEV, [lambda i=i: call(i) for i in range(n)]) == list(range(n))
    assert torch.cuda.current_stream(DEV) == main and all(s != main for s in seen)
    assert got.tolist() == [float(i + 1) for i in range(n)]  # forked after the current stream's write
    assert out.tolist() == [10.0 * (i + 1) for i in range(n)]  # joined: read on the current stream after every write


def test_the_current_stream_waits_for_the_calls_that_ran_when_one_raises():
    main = torch.cuda.current_stream(DEV)
    out = torch.zeros(1, device=DEV)

    def slow():
        torch.cuda._sleep(SLEEP)
        out.fill_(1)

    def fails():
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        side_by_side(DEV, [slow, fails])
    assert torch.cuda.current_stream(DEV) == main and out.item() == 1.0


def test_a_kept_tensor_one_call_makes_is_whole_when_a_sibling_reads_it():
    """`quant.held` (through `streams.settled`): a tensor made on one side stream behind a spin and kept, read at once
    by the next call on its own stream, holds its values there."""
    from kvcalib.quant import held

    table = {}
    want = torch.arange(4096, dtype=torch.float32) * 0.25 + 7.125

    def make():
        torch.cuda._sleep(SLEEP)  # then kernels, no copy from the host (which would wait for the spin)
        return torch.arange(4096, device=DEV, dtype=torch.float32) * 0.25 + 7.125

    # The kernels loaded once before: CUDA's lazy loading of a kernel first launched while the spin runs waits for
    # it (the whole device), which would hide a sibling's early read.
    torch.cuda.synchronize()
    warm = (torch.arange(4096, device=DEV, dtype=torch.float32) * 0.25 + 7.125).clone()
    torch.cuda.synchronize()
    assert torch.equal(warm.cpu(), want)
    first = lambda: held(table, "kept", make)  # noqa: E731
    second = lambda: held(table, "kept", make).clone()  # noqa: E731
    _, copy = side_by_side(DEV, [first, second])
    assert torch.equal(copy.cpu(), want)


def _flat(method, packed):
    return [getattr(b, name) for b in method.codebook_blocks(packed) for name in b.present()]


def test_a_plans_flush_packs_the_same_bits_side_by_side_as_in_turn_eagerly_and_captured(monkeypatch):
    from test_runtime_cache import _plan

    shape = AttentionShape(num_layers=3, num_heads=8, num_kv_heads=4, head_dim=64)
    method = _plan(shape, 32, "head")
    g = torch.Generator(device=DEV).manual_seed(3)
    k = torch.randn(8, 4, 64, 64, device=DEV, generator=g).half().float()  # a flush of two windows, B=8
    v = torch.randn(8, 4, 64, 64, device=DEV, generator=g).half().float()
    in_turn = lambda device, calls: [call() for call in calls]  # noqa: E731
    for layer in range(shape.num_layers):
        groups = {(id(c), tuple(h)) for part in ("k", "v") for h, c in method.groups[part][layer]}
        side = _flat(method, method.compress(layer, k, v))
        with monkeypatch.context() as m:
            m.setattr(plan_module, "side_by_side", in_turn)
            turn = _flat(method, method.compress(layer, k, v))
        assert len(side) == len(turn) and all(torch.equal(a, b) for a, b in zip(side, turn)), layer
        if len(groups) < 2:
            continue
        stream = torch.cuda.Stream(DEV)  # a capture's warm-up, then the capture, off the default stream
        stream.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(stream):
            method.compress(layer, k, v)
        torch.cuda.current_stream(DEV).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            held = _flat(method, method.compress(layer, k, v))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(held, turn)), layer
    assert any(len({(id(c), tuple(h)) for p in ("k", "v") for h, c in method.groups[p][i]}) > 1
               for i in range(shape.num_layers))  # some layer packs several groups side by side


def test_a_flushs_writes_side_by_side_land_where_masked_write_puts_them_buffer_by_buffer(monkeypatch):
    """`slots.flush_writes` on CUDA, its `index_put_`s each on a side stream, the rows written by the current stream
    behind a spin: every buffer holds what `masked_write` of it alone holds, and what the writes in turn hold (a
    plan's 16 buffers of a layer: units 1 and 16, 1 to 3 heads)."""
    from kvcalib.runtime import slots
    from kvcalib.runtime.slots import flush_writes, masked_write

    g = torch.Generator(device=DEV).manual_seed(1)
    flushed = torch.tensor([0, 32, 64, 4096, 96, 0, 32, 128], dtype=torch.int32, device=DEV)
    take = torch.tensor([True, False, True, True, False, True, True, True], device=DEV)
    specs = [(1 + i % 3, 4096 + 32, 32, 1, 8 + i) if i % 4 else (1 + i % 3, 256 + 2, 2, 16, 2) for i in range(16)]
    bufs = [torch.randint(-9, 9, (8, h, big, last), device=DEV, generator=g, dtype=torch.int32)
            for h, big, _, _, last in specs]
    rows = [torch.randint(100, 200, (8, h, n, last), device=DEV, generator=g, dtype=torch.int32)
            for h, _, n, _, last in specs]
    want = [b.clone() for b in bufs]
    for buf, new, (_, _, _, unit, _) in zip(want, rows, specs):
        masked_write(buf, new, torch.div(flushed, unit, rounding_mode="floor"), take)
    in_turn = [b.clone() for b in bufs]
    with monkeypatch.context() as m:
        m.setattr(slots, "side_by_side", lambda device, calls: [call() for call in calls])
        flush_writes([(b, n, spec[3]) for b, n, spec in zip(in_turn, rows, specs)], flushed, take)
    torch.cuda._sleep(SLEEP)
    news = [r + 0 for r in rows]  # written by the current stream after the spin: read by the side streams after it
    flush_writes([(b, n, spec[3]) for b, n, spec in zip(bufs, news, specs)], flushed, take)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want))
    assert all(torch.equal(b, w) for b, w in zip(bufs, in_turn))
