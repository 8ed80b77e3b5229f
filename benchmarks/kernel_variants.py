"""The codebook kernel's variants side by side over a mapped plan's layers, as a static cache's step launches them.

Each SOURCE is a copy of kvcalib/formats/codebook/codebook_decode.cu with one change (the first: the one compared
against, usually the file itself). For each layer of the mapped plan (decode.py's `plan_layer`: random words in every
buffer), B rows of a padded batch (flushed tokens from L down to L / 8, residual windows of different fill), counts
on the device as the static cache passes them (so its splits spread the batch's tokens over the wave, `SPREAD` 2),
one launch a group of heads side by side: each source's µs (decode.py's timing: graphs of rotating copies behind a
spin kernel, medians), summed over the layers, which is the attention's share of a captured step. Beside each
variant: the largest difference of its output from the first source's, over the output's largest element (the
variants change roundings, not the math: a broken one shows here; its exactness is the GPU tests' to show).

    cd benchmarks && python kernel_variants.py SOURCE [SOURCE ...] [--plan ../artifacts/smollm2-135m/plan-2.25]
                                               [--batch 8] [--length 32768] [--layers all] [--results FILE]
                                               [--compile-only]

`--compile-only` calls each source once a layer and times nothing: run once per source side by side first, so that
the timed run finds every kernel in CuPy's on-disk cache (the compiles, one a pair of schemes and source, otherwise
take most of its time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from decode import D, HKV, HQ, RESIDUAL, mapped, plan_layer, timed
from kvcalib.formats.codebook import launch as codebook_launch
from kvcalib.formats.codebook.launch import codebook_decode
from results import RESULTS, publish


def padded_counts(b: int, length: int, residual: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(flushed, residual) int32: row i flushed from `length` down to `length` / 8 in whole 128-token blocks, its
    residual window filled to a different count each row (1 to `residual`)."""
    span = length - length // 8
    flushed = [length - (span * i // max(1, b - 1)) // 128 * 128 for i in range(b)]
    windows = [residual - (37 * i) % residual for i in range(b)]
    return (torch.tensor(flushed, dtype=torch.int32, device=device),
            torch.tensor(windows, dtype=torch.int32, device=device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shipped = Path(__file__).resolve().parent.parent / "artifacts/smollm2-135m/plan-2.25"
    parser.add_argument("sources", nargs="+", help="kernel sources, the first compared against")
    parser.add_argument("--plan", default=str(shipped))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--layers", default="all", help="comma-separated layer indices of the mapped plan, or all")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    sources = [str(Path(s).resolve()) for s in args.sources]
    plan, _ = mapped(args.plan)
    layers = range(plan.shape.num_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    b, length = args.batch, args.length
    torch.manual_seed(0)
    copies = 1 if args.compile_only else max(2, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2))))
    q = [torch.randn(b, HQ, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
    res = [(torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16),
            torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16)) for _ in range(copies)]
    counts = padded_counts(b, length, RESIDUAL)
    names = [Path(s).name for s in sources]
    lines = ["| layer | groups | " + " | ".join(f"{n} µs" for n in names) + " | "
             + " | ".join(f"{n} differs" for n in names[1:]) + " |",
             "|---:|---:|" + "---:|" * (2 * len(names) - 1)]
    totals, worst = [0.0] * len(sources), [0.0] * len(sources)
    for index in layers:
        built = [plan_layer(b, length, args.plan, kr, vr, index)[0] for kr, vr in res]
        times, outs = [], []
        for source in sources:
            codebook_launch.KERNEL = source
            call = lambda i: codebook_decode(q[i], built[i], D**-0.5, counts=counts)  # noqa: E731
            outs.append(call(0).float())
            times.append(0.0 if args.compile_only else timed(call, copies))
        scale = outs[0].abs().max().item()
        diffs = [(o - outs[0]).abs().max().item() / scale for o in outs[1:]]
        for j, t in enumerate(times):
            totals[j] += t
        for j, d in enumerate(diffs, 1):
            worst[j] = max(worst[j], d)
        lines.append(f"| {index} | {len(built[0].groups)} | " + " | ".join(f"{t:.1f}" for t in times) + " | "
                     + " | ".join(f"{d:.1e}" for d in diffs) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
        del built
        torch.cuda.empty_cache()
    if args.compile_only:
        return
    lines.append(f"| all {len(layers)} | | " + " | ".join(f"{t:.1f}" for t in totals) + " | "
                 + " | ".join(f"{d:.1e}" for d in worst[1:]) + " |")
    lines.append(f"| over the first | | " + " | ".join(f"{t / totals[0]:.3f}" for t in totals) + " |"
                 + " |" * (len(names) - 1))
    title = (f"The codebook kernel's variants over the mapped plan's layers, {torch.cuda.get_device_name()}, {HQ} q / "
             f"{HKV} kv heads, d={D}, B={b} padded from L={length}, counts on the device")
    publish(title, "\n".join(lines), sys.argv, path=args.results)


if __name__ == "__main__":
    main()
