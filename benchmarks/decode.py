"""Decode attention on the GPU: torch SDPA fp16 (the peer), dequantize-then-SDPA, the fused INT2
kernels over the packed cache, the fused VecInfer kernel over codebook codes (`--vecinfer`), and the fused
codebook kernel over TurboQuant's codes (`--turboquant`: its oblivious codebook of each width, and 3 bits with
calibrated codebooks per KV head) and over a plan's layer (`--plan`: a shipped plan mapped onto the 8B shape as
generate_calls.py maps it, its layer of the most groups of heads, every group's codes random), 32 query / 8 KV heads,
d=128.

    python benchmarks/decode.py [--lengths 4096,32768,131072] [--batches 1,8] [--vecinfer d4b8,d8b12]
                                [--turboquant 2,3,4] [--plan DIR,...] [--results FILE]

Each figure is the median of device-event timings of CUDA-graph replays after warm-up, rotating
over enough copies of the inputs that they do not fit in L2. A spin kernel queued before the start
event keeps the GPU busy while the host submits the event and the replay, so the interval holds the
GPU's work only, as in a decode step whose kernels queue behind each other; without it, every figure
also held the host's submission latency (an empty graph measured 13.5 µs on the H100). The table's
header gives the empty graph's figure. GB/s counts the bytes each variant must read (codes, scales,
zero points, norms, residual, query) and write (output); "% copy" divides that by the
device-to-device copy bandwidth measured in the same run; "read floor" is one launch that only
reads the row's bytes (kernels_cupy/stream_read.cu), timed the same way. "worst row err" is the
accuracy the speed was bought with: max over (batch, query head) of ‖o − o_ref‖/‖o_ref‖ against the
float64 `reference_decode` of the same packed cache, on these diffuse (unit randn) inputs; for SDPA
rows, SDPA fp16 over the KIVI-2 G=128 cache dequantized, against the same reference (the peer's
error on the same cache).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

from kvcalib.quant import dequantize, quantize
from kvcalib.formats.int2.layout import pack, reference_decode
from kvcalib.formats.int2.launch import fused_decode
from kvcalib.formats.vq.launch import vq_decode
from kvcalib.formats.vq.layout import reference_decode as vq_reference
from results import RESULTS, publish

HQ, HKV, D, RESIDUAL = 32, 8, 128, 100
SPIN_CYCLES = 200_000  # ~0.1 ms of GPU clock: longer than the host takes to submit an event, a replay and an event


def timed(fn, copies: int, reps: int = 30) -> float:
    """Median microseconds of fn(i) over rotating copies i, each captured once in a CUDA graph
    so that Python launch overhead stays out of the figure, and replayed behind a spin kernel so
    that the host's submission latency does too. Each copy runs three times before its capture: once, the
    first SDPA of a run was captured at 181 µs where it takes 17 (B=1, 4k)."""
    for _ in range(3):
        for i in range(copies):
            fn(i)
    torch.cuda.synchronize()
    graphs = []
    for i in range(copies):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(i)
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    times = []
    for r in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        graphs[r % copies].replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000)
    return statistics.median(times)


def copy_bandwidth() -> float:
    x = torch.randint(0, 255, (2**30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = timed(lambda i: y.copy_(x), 1, 20)
    return 2 * x.numel() / (us * 1e-6) / 1e9


def read_floor(nbytes: int) -> float:
    """Median µs of one launch of kernels_cupy/stream_read.cu reading `nbytes` once (one wave of
    512-thread blocks, four loads in flight per thread): what the same bytes cost with nothing else
    to do, launch included. Rotates over enough buffers that they do not stay in L2."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    n16 = -(-nbytes // 16)
    copies = max(2, min(64, -(-400 * 2**20 // (16 * n16))))
    bufs = [torch.randint(-2**31, 2**31 - 1, (n16, 4), dtype=torch.int32, device="cuda") for _ in range(copies)]
    blocks = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    read = kernel("stream_read.cu", {}, "stream_read")

    def fn(i):
        with torch_stream():
            launch(read, (blocks,), (512,), (cupy.uint64(bufs[i].data_ptr()), cupy.int64(n16), cupy.uint64(sink.data_ptr())))

    us = timed(fn, copies)
    del bufs
    torch.cuda.empty_cache()
    return us


def sdpa_us(q: list[torch.Tensor], tokens: int, generator: torch.Generator | None = None) -> tuple[float, int]:
    """Median µs of torch SDPA fp16 over `tokens` random tokens a row, q (B, HQ, D) copies rotated over as many
    copies of the cache as keep it out of L2 (at most len(q)), and the bytes it reads and writes: the peer a
    kernel's speedup is against. `generator`: the cache drawn from it on the CPU (a script's seeded draws)."""
    b = q[0].shape[0]
    nbytes = 2 * b * HKV * tokens * D * 2
    n = max(1, min(len(q), -(-400 * 2**20 // nbytes)))
    shape = (b, HKV, tokens, D)
    kv = [[torch.randn(shape, device="cuda", dtype=torch.float16) if generator is None else
           torch.randn(shape, generator=generator).half().cuda() for _ in "kv"] for _ in range(n)]
    q4 = [x[:, :, None] for x in q]
    us = timed(lambda i: torch.nn.functional.scaled_dot_product_attention(q4[i], *kv[i], enable_gqa=True), n)
    del kv
    torch.cuda.empty_cache()
    return us, nbytes + 4 * q[0].numel()


def kivi2_us(q: list[torch.Tensor], res: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> tuple[float, int]:
    """Median µs of KIVI-2 G=128 on the INT2 kernel over `length` packed tokens of random codes (its time does not
    depend on them) and each copy's residual window res[i] (keys, values), q[i] its query; and the bytes it moves."""
    b = q[0].shape[0]
    kivi = []
    for kr, vr in res:
        kf = torch.randn(b, HKV, length, D, device="cuda")
        kivi.append(pack(kf, torch.randn_like(kf), kr, vr, 128, 128))
        del kf
    us = timed(lambda i: fused_decode(q[i], kivi[i], D**-0.5), len(kivi))
    nbytes = layer_bytes(kivi[0], q[0])
    del kivi
    torch.cuda.empty_cache()
    return us, nbytes


def worst_row(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows (batch, query head) of ‖got − ref‖/‖ref‖."""
    return ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def layer_bytes(layer, q) -> int:
    t, r, g = layer.length, layer.residual, layer.group_size
    used = [layer.kcodes[:, :, : t // 16], layer.kscale[:, :, : t // g], layer.kzero[:, :, : t // g],
            layer.vcodes[:, :, :t], layer.vscale[:, :, :t], layer.vzero[:, :, :t],
            layer.kres[:, :, :r], layer.vres[:, :, :r]]
    if layer.knorm is not None:
        used.append(layer.knorm[:, :, :t])
    return sum(x.numel() * x.element_size() for x in used) + 2 * q.numel() * q.element_size()


def vq_layer(b: int, length: int, config: str, kres: torch.Tensor, vres: torch.Tensor):
    """A VecInfer layer (`kvcalib.formats.vq.layout`) of `length` flushed tokens: random codes under random
    per-layer codebooks of `config` for keys and values (the bytes a step reads do not depend on their
    values; the error column compares the kernel with the float64 reference over these same codes)."""
    from kvcalib import vq
    from kvcalib.formats.vq.layout import append_block

    c = vq.VQConfig.parse(config)
    books = [torch.randn(1, c.centroids, c.dim, device="cuda").half() for _ in "kv"]
    codes = [vq.pack_codes(torch.randint(0, c.centroids, (b, HKV, length, D // c.dim), device="cuda"), c.bits)
             for _ in "kv"]
    none = kres[:, :, :0]
    smooth = (0.5 + torch.rand(HKV, D, device="cuda")).half()  # the keys' λ: the kernel transforms q with it
    # The residual window in buffers of its own, as a cache holds it (a strided view of the fp16 tensors
    # would make every call copy it first).
    return append_block(None, *codes, *books, c.bits, c.bits, none, none, kres.contiguous(), vres.contiguous(),
                        smooth, True)


def vq_inputs(b: int, length: int) -> tuple[int, list, list]:
    """Rotating copies for timing the VecInfer kernel alone (vq_decode_plans.py): enough
    that their codes (half a byte a channel at d4b8) pass 400 MB, 2 to 8; each copy's float16 residual keys and
    values (B, HKV, RESIDUAL, D) and query (B, HQ, D), seeded. `vq_layer` makes each copy's codes."""
    copies = max(2, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2))))
    torch.manual_seed(0)
    res = [(torch.randn(b, HKV, RESIDUAL, D, device="cuda").half(), torch.randn(b, HKV, RESIDUAL, D, device="cuda").half())
           for _ in range(copies)]
    q = [torch.randn(b, HQ, D, device="cuda").half() for _ in range(copies)]
    return copies, res, q


def vq_bytes(layer, q) -> int:
    """What a VecInfer step reads and writes: code rows, both codebooks, the residual, the query, the output."""
    used = [layer.kcodes[:, :, : layer.length], layer.vcodes[:, :, : layer.length], layer.kbook, layer.vbook,
            layer.kres[:, :, : layer.residual], layer.vres[:, :, : layer.residual]]
    return sum(x.numel() * x.element_size() for x in used) + 2 * q.numel() * q.element_size()


def tq_layer(b: int, length: int, bits: int, kres: torch.Tensor, vres: torch.Tensor, per_head: bool = False):
    """A TurboQuant layer in the codebook layout (`kvcalib.formats.codebook.layout`) of `length` flushed tokens:
    random codes and norms (the bytes a step reads do not depend on their values; the error column compares the
    kernel with the float64 reference over these same codes), the oblivious codebook of `bits` or, `per_head`,
    random sorted per-coordinate codebooks of each KV head."""
    from kvcalib.formats.codebook.layout import CodedBlock, HeadGroup, append_block
    from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig
    from kvcalib.models import AttentionShape
    from kvcalib.quant import pack_stream

    shape = AttentionShape(num_layers=1, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    books = None
    if per_head:
        books = [tuple((torch.randn(HKV, D, 1 << bits).sort(-1).values * D**-0.5).half() for _ in "kv")]
    method = TurboQuant(TurboQuantConfig(bits=bits), shape, books, "head" if per_head else None)
    spec = method.codebook_spec(0).to("cuda")
    codes = [pack_stream(torch.randint(0, 1 << bits, (b, HKV, length, D), device="cuda"), bits) for _ in "kv"]
    norms = [(1 + 3 * torch.rand(b, HKV, length, device="cuda")).half() for _ in "kv"]
    none = kres[:, :, :0]
    return append_block(None, [HeadGroup(None, spec)], [CodedBlock(codes[0], norms[0], codes[1], norms[1])], none, none,
                        kres.contiguous(), vres.contiguous())


@functools.lru_cache(maxsize=None)
def mapped(plan_dir: str):
    """A shipped plan mapped onto the 8B shape (generate_calls.py's `mapped_plan`, 32 layers of 8 KV heads: seeded,
    the same at every length and batch), and its layer with the most groups of heads; once per plan."""
    from generate import llama8b_config
    from generate_calls import mapped_plan

    plan = mapped_plan(llama8b_config(0), plan_dir)
    return plan, max(range(plan.shape.num_layers), key=lambda i: len(plan.codebook_groups(i)))


def plan_layer(b: int, length: int, plan_dir: str, kres: torch.Tensor, vres: torch.Tensor, index: int | None = None):
    """The layer of a shipped plan mapped onto this shape (`mapped`) with the most groups of heads (or layer `index`),
    in the codebook layout of `length` flushed tokens: every buffer the static cache
    allocates for it filled with random words (every bit pattern is a code or an fp16 number of the right kind:
    norms and scales in [0.5, 1.5), zeros in [-1, 1)), the plan's float16 sink rows random: (the layer, its index).
    The bytes a step reads do not depend on the codes' values; the error column compares the kernel with the float64
    reference over these same codes."""
    from kvcalib.formats.codebook.format import CodebookFormat

    plan, layer = mapped(plan_dir)
    layer = layer if index is None else index
    fmt = CodebookFormat()
    groups = fmt.on(plan.codebook_groups(layer), "cuda")
    out = fmt.allocate(plan, layer, groups, b, length, length, plan.residual, HKV, D, "cuda")  # a block of R packs
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in out.groups:
        for name in rows.present():
            t = getattr(rows, name)
            if t.dtype == torch.int32:
                t.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=g, device="cuda", dtype=torch.int32))
            elif name in ("kzero", "vzero"):
                t.copy_(2 * torch.rand(t.shape, generator=g, device="cuda") - 1)
            else:
                t.copy_(0.5 + torch.rand(t.shape, generator=g, device="cuda"))
    for t in (out.ksink, out.vsink):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
    out.kres, out.vres, out.length, out.residual = kres.contiguous(), vres.contiguous(), length, kres.shape[2]
    return out, layer


def tq_bytes(layer, q) -> int:
    """What a codebook step reads and writes: code rows, norms, the residual, the query, the output (the books and
    bases, read from L2 by every block, count once)."""
    n, r = layer.length, layer.residual
    used = [layer.kres[:, :, :r], layer.vres[:, :, :r]]
    for g in layer.groups:
        units = {"kscale": g.unit("kscale"), "kzero": g.unit("kzero")}
        used += [getattr(g, x)[:, :, : -(-n // units.get(x, 1))] for x in g.present()]
        used += [g.spec.key.book, g.spec.value.book]
    return sum(x.numel() * x.element_size() for x in used) + 2 * q.numel() * q.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,32768,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--vecinfer", default="d4b8,d8b12",
                        help="VecInfer configurations for the fused VecInfer kernel's rows (empty: none)")
    parser.add_argument("--turboquant", default="2,3,4",
                        help="TurboQuant widths for the fused codebook kernel's rows (empty: none)")
    parser.add_argument("--plan", default="",
                        help="shipped plans (comma-separated directories) whose most-grouped layer, mapped onto this "
                        "shape, the codebook kernel reads (empty: none)")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    bw = copy_bandwidth()
    rows = []
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            torch.manual_seed(0)
            total = length + RESIDUAL
            fp16_bytes = 2 * b * HKV * total * D * 2
            copies = max(1, min(8, -(-400 * 2**20 // fp16_bytes)))
            q = [torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
            kv = [(torch.randn(b, HKV, total, D, device="cuda", dtype=torch.float16),
                   torch.randn(b, HKV, total, D, device="cuda", dtype=torch.float16)) for _ in range(copies)]
            sdpa = lambda i: torch.nn.functional.scaled_dot_product_attention(q[i], *kv[i], enable_gqa=True)  # noqa: E731
            t_sdpa = timed(sdpa, copies)
            sdpa_row = [b, length, "SDPA fp16", t_sdpa, fp16_bytes + 4 * q[0].numel(), None]
            rows.append(sdpa_row)
            variants = {"KIVI-2 G=32": (32, False), "KIVI-2 G=128": (128, False), "OScaR-2 G=32 (norms)": (32, True)}
            layers, plain = {}, []  # plain: KIVI-2 G=128 in the kvcalib.quant layout, for dequantize + SDPA
            for name, (group, norms) in variants.items():
                layers[name] = []
                for k, v in kv:
                    kf, vf = k[:, :, :length].float(), v[:, :, :length].float()
                    kn = kf.norm(dim=-1) if norms else None
                    if norms:
                        kf = kf / kn[..., None]
                    layers[name].append(pack(kf, vf, k[:, :, length:], v[:, :, length:], group, min(group, D), kn,
                                             rotated_keys=norms, rotated_values=norms))  # OScaR's rotated blocks
                    if name == "KIVI-2 G=128":
                        plain.append((quantize(kf, 2, group, "tokens"), quantize(vf, 2, min(group, D), "channels")))
                    del kf, vf
                torch.cuda.empty_cache()

            def dequant_sdpa(i, name="KIVI-2 G=128"):
                layer = layers[name][i]
                kd = torch.cat([dequantize(plain[i][0], torch.float16), layer.kres[:, :, : layer.residual]], 2)
                vd = torch.cat([dequantize(plain[i][1], torch.float16), layer.vres[:, :, : layer.residual]], 2)
                return torch.nn.functional.scaled_dot_product_attention(q[i], kd, vd, enable_gqa=True)

            ref = reference_decode(q[0][:, :, 0], layers["KIVI-2 G=128"][0], D**-0.5)
            sdpa_row[5] = worst_row(dequant_sdpa(0)[:, :, 0], ref)
            rows.append([b, length, "dequantize + SDPA (KIVI-2 G=128)", timed(dequant_sdpa, copies, 10),
                         layer_bytes(layers["KIVI-2 G=128"][0], q[0]), sdpa_row[5]])
            for name, ls in layers.items():
                us = timed(lambda i: fused_decode(q[i][:, :, 0], ls[i], D**-0.5), copies)
                ref = reference_decode(q[0][:, :, 0], ls[0], D**-0.5)
                err = worst_row(fused_decode(q[0][:, :, 0], ls[0], D**-0.5, checked=True), ref)
                rows.append([b, length, f"fused {name}", us, layer_bytes(ls[0], q[0]), err])
                del ref
            del layers, plain
            torch.cuda.empty_cache()
            for config in filter(None, args.vecinfer.split(",")):
                vls = [vq_layer(b, length, config, k[:, :, length:], v[:, :, length:]) for k, v in kv]
                qf = [x[:, :, 0] for x in q]
                us = timed(lambda i: vq_decode(qf[i], vls[i], D**-0.5), copies)
                err = worst_row(vq_decode(qf[0], vls[0], D**-0.5, checked=True), vq_reference(qf[0], vls[0], D**-0.5))
                rows.append([b, length, f"fused VecInfer {config}", us, vq_bytes(vls[0], q[0]), err])
                del vls
                torch.cuda.empty_cache()
            from kvcalib.formats.codebook.launch import codebook_decode
            from kvcalib.formats.codebook.layout import reference_decode as tq_reference

            tq = [(int(bits), False) for bits in filter(None, args.turboquant.split(","))]
            for bits, per_head in tq + ([(3, True)] if tq else []):
                tls = [tq_layer(b, length, bits, k[:, :, length:], v[:, :, length:], per_head) for k, v in kv]
                qf = [x[:, :, 0] for x in q]
                us = timed(lambda i: codebook_decode(qf[i], tls[i], D**-0.5), copies)
                err = worst_row(codebook_decode(qf[0], tls[0], D**-0.5, checked=True),
                                tq_reference(qf[0], tls[0], D**-0.5))
                name = f"fused TurboQuant-{bits}" + (" (books per KV head)" if per_head else "")
                rows.append([b, length, name, us, tq_bytes(tls[0], q[0]), err])
                del tls
                torch.cuda.empty_cache()
            for plan_dir in filter(None, args.plan.split(",")):
                pls = [plan_layer(b, length, plan_dir, k[:, :, length:], v[:, :, length:]) for k, v in kv]
                qf = [x[:, :, 0] for x in q]
                us = timed(lambda i: codebook_decode(qf[i], pls[i][0], D**-0.5), copies)
                err = worst_row(codebook_decode(qf[0], pls[0][0], D**-0.5, checked=True),
                                tq_reference(qf[0], pls[0][0], D**-0.5))
                name = f"fused {Path(plan_dir).name}, layer {pls[0][1]} ({len(pls[0][0].groups)} groups of heads)"
                rows.append([b, length, name, us, tq_bytes(pls[0][0], q[0]), err])
                del pls
                torch.cuda.empty_cache()
    floors = {nbytes: read_floor(nbytes) for nbytes in sorted({r[4] for r in rows})}
    title = f"Decode attention, {torch.cuda.get_device_name()}, {HQ} q / {HKV} kv heads, d={D}, residual {RESIDUAL} tokens"
    empty = timed(lambda i: None, 1)
    lines = [f"copy bandwidth measured: {bw:.0f} GB/s (read + write); an empty graph measures {empty:.1f} µs. "
             "Read floor: one launch that only reads the row's bytes (kernels_cupy/stream_read.cu).", "",
             "| B | L (flushed) | variant | µs | speedup vs SDPA fp16 | bytes (MB) | GB/s | % copy | read floor µs | worst row err |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    sdpa_us = {(b, n): us for b, n, name, us, _, _ in rows if name == "SDPA fp16"}
    for b, n, name, us, nbytes, err in rows:
        gbs = nbytes / (us * 1e-6) / 1e9
        lines.append(f"| {b} | {n} | {name} | {us:.1f} | {sdpa_us[(b, n)] / us:.2f}x | {nbytes / 1e6:.1f} | "
                     f"{gbs:.0f} | {100 * gbs / bw:.0f}% | {floors[nbytes]:.1f} | {err:.1e} |")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
