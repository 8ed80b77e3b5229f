"""A plan's layer, its groups' launches side by side: does a wave shared by heads leave SMs idle while the costlier
groups finish? (An experiment: the launch gives each group of heads its heads' share of one wave.)

Its launches take no counts, so each row splits over one wave (`spread` 1). A static cache's launch at B > 1 reads
its counts on the device and already splits over twice that (`spread` 2, as `x2` here): that `x2` gained 5.3% over
`heads` (H200, B=8, 32k, RESULTS.md) is what the static cache has, and `x4` (what it would take with two waves more)
gained nothing beyond it; a plan's B=8 step through `generate` with its groups on two waves read 9.62 ms, 9.61 on one.

A layer of several groups of KV heads (a plan's) is one launch a group on streams of their own, each splitting its
tokens over its heads' share of one wave (`kvcalib.formats.codebook.launch`). A split's time is its tokens times its
pair of schemes' cost a token, and pairs differ (`codebook_pairs.py`: 141 to 191 µs over 8 heads at B=8, 32k), so
a layer of unlike groups may end when its costliest group does, the others' SMs idle. For each layer of the mapped
plan (decode.py's `plan_layer`: random words in every buffer), at B and L:
- `heads`: the layer as the launch splits it;
- each group alone with the same share (its blocks' time, which its pair's cost sets);
- `weighed`: the layer with each group's share of the wave in proportion to its heads times its time alone (the
  share overridden here, in this process only), so that every group's splits take about as long;
- `x2`, `x4` (`--waves`): heads' shares of two or four waves, shorter splits that the hardware hands out as blocks
  finish (no cost model, more partials to merge and more copies of the books).
`bound`: the sum of each group's time alone times its share (the layer's work over the whole wave, were it spread
without idling). Same timing as decode.py (graphs of rotating copies behind a spin kernel, medians).

    cd benchmarks && python group_shares.py [--plan ../artifacts/smollm2-135m/plan-2.25] [--batch 8] [--length 32768]
                                            [--layers all] [--results FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from decode import D, HKV, HQ, RESIDUAL, mapped, plan_layer, timed
from kvcalib.formats.codebook import launch as codebook_launch
from kvcalib.formats.codebook.launch import codebook_decode
from results import RESULTS, publish

SHARE_ARG = 32  # `_launch_group`'s positional argument `share`
OVERRIDE: dict[int, float] = {}  # a group's key codes' address -> its share of the wave, in this process
_launch_group = codebook_launch._launch_group


def _overridden(*args):
    args = list(args)
    share = OVERRIDE.get(args[2].data_ptr())
    if share is not None:
        args[SHARE_ARG] = share
    return _launch_group(*args)


codebook_launch._launch_group = _overridden


def scheme_words(scheme) -> str:
    """A plan's scheme in the manifest's words: family, width, then a group size or a sub-vector's length."""
    extra = f"-g{scheme.group_size}" if scheme.group_size else (f"-d{scheme.dim}" if scheme.dim else "")
    return f"{scheme.family}-{scheme.bits}{extra}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shipped = Path(__file__).resolve().parent.parent / "artifacts/smollm2-135m/plan-2.25"
    parser.add_argument("--plan", default=str(shipped))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--layers", default="all", help="comma-separated layer indices of the mapped plan, or all")
    parser.add_argument("--waves", default="2,4", help="heads' shares of this many waves, comma-separated ('': none)")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    plan, _ = mapped(args.plan)
    layers = range(plan.shape.num_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    b, length = args.batch, args.length
    torch.manual_seed(0)
    copies = max(2, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2))))
    q = [torch.randn(b, HQ, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
    res = [(torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16),
            torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16)) for _ in range(copies)]
    waves = [int(w) for w in args.waves.split(",") if w]
    lines = ["| layer | groups: heads x (key, value) | each alone µs | heads µs | weighed µs | "
             + "".join(f"x{w} µs | " for w in waves) + "bound µs | weighed / heads |",
             "|---:|---|---|---:|---:|" + "---:|" * len(waves) + "---:|---:|"]
    totals = [0.0] * (3 + len(waves))
    for index in layers:
        built = [plan_layer(b, length, args.plan, kr, vr, index)[0] for kr, vr in res]
        groups = plan.codebook_groups(index)  # a group's heads and spec, in the launch's order
        heads_of = [rows.kcodes.shape[1] for rows in built[0].groups]
        OVERRIDE.clear()
        whole = timed(lambda i: codebook_decode(q[i], built[i], D**-0.5), copies)
        alone = [timed(lambda i, g=g: codebook_decode(q[i], dataclasses.replace(built[i], groups=[built[i].groups[g]]),
                                                      D**-0.5), copies) for g in range(len(heads_of))]
        shares = [n / HKV for n in heads_of]
        work = [n * t for n, t in zip(heads_of, alone)]
        for layer in built:
            for rows, w in zip(layer.groups, work):
                OVERRIDE[rows.kcodes.data_ptr()] = w / sum(work)
        weighed = timed(lambda i: codebook_decode(q[i], built[i], D**-0.5), copies)
        more = []
        for w in waves:
            for layer in built:
                for rows, share in zip(layer.groups, shares):
                    OVERRIDE[rows.kcodes.data_ptr()] = w * share
            more.append(timed(lambda i: codebook_decode(q[i], built[i], D**-0.5), copies))
        bound = sum(s * t for s, t in zip(shares, alone))
        names = ", ".join(f"{len(g.heads)} x ({scheme_words(plan.schemes['k'][index][g.heads[0]])}, "
                          f"{scheme_words(plan.schemes['v'][index][g.heads[0]])})" for g in groups)
        lines.append(f"| {index} | {names} | {', '.join(f'{t:.1f}' for t in alone)} | {whole:.1f} | {weighed:.1f} | "
                     + "".join(f"{t:.1f} | " for t in more) + f"{bound:.1f} | {weighed / whole:.3f} |")
        print(lines[-1], file=sys.stderr, flush=True)
        for j, t in enumerate([whole, weighed, *more, bound]):
            totals[j] += t
        OVERRIDE.clear()
        del built
        torch.cuda.empty_cache()
    lines.append(f"| all {len(layers)} | | | " + "".join(f"{t:.1f} | " for t in totals)
                 + f"{totals[1] / totals[0]:.3f} |")
    title = (f"A plan's layer, groups' shares of the wave by heads or by their cost, {torch.cuda.get_device_name()}, "
             f"{HQ} q / {HKV} kv heads, d={D}, B={b}, L={length}")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
