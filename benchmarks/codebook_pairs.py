"""The codebook kernel one pair of schemes at a time: which of a plan's (key scheme, value scheme) pairs cost what.

A plan's layer is one launch per group of KV heads that share a pair. This benchmark times each pair a shipped plan
holds alone over all 8 KV heads of the 8B shape (32 q / 8 KV heads, d=128, residual 100, the plan's float16 sink),
as decode.py times a plan's layer (`plan_layer`: random words in every buffer, the same timing, read floor and
float64 reference), so that each pair's time stands beside its own read floor and KIVI-2's INT2 kernel. The last
rows weigh the pairs by their share of the plan's (layer, KV head) items: the mean layer the plan would cost if every
group filled the GPU alone, against decode.py's most-grouped layer of the mapped plan.

    cd benchmarks && python codebook_pairs.py [--plan ../artifacts/smollm2-135m/plan-2.25] [--lengths 32768]
                                              [--batches 1,8] [--top 12] [--results FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

from decode import D, HKV, HQ, RESIDUAL, copy_bandwidth, layer_bytes, plan_layer, read_floor, timed, tq_bytes, worst_row
from kvcalib.formats.codebook.launch import codebook_decode
from kvcalib.formats.codebook.layout import reference_decode
from kvcalib.formats.int2.launch import fused_decode
from kvcalib.formats.int2.layout import pack
from results import RESULTS, publish


def plan_settings(plan_dir: str) -> dict:
    """A shipped plan's settings (its manifest's): per layer, each KV head's key and value scheme, and the rest."""
    return json.loads((Path(plan_dir) / "manifest.json").read_text())["settings"]


def one_pair_plan(settings: dict, key: str, value: str, root: Path) -> str:
    """A plan directory under `root` whose every item takes the pair (key, value), its settings otherwise
    `settings` (what `mapped_plan` reads of a manifest)."""
    d = root / f"{key}+{value}"
    d.mkdir(parents=True, exist_ok=True)
    rows = [len(x) for x in settings["k"]]
    one = dict(settings, k=[[key] * r for r in rows], v=[[value] * r for r in rows])
    (d / "manifest.json").write_text(json.dumps({"settings": one}))
    return str(d)


def pair_plans(settings: dict, top: int, root: Path) -> list[tuple[str, str, int, str]]:
    """The plan's `top` most common (key scheme, value scheme) pairs, each as `one_pair_plan`: (key, value, items,
    directory)."""
    pairs = collections.Counter((k, v) for ks, vs in zip(settings["k"], settings["v"]) for k, v in zip(ks, vs))
    return [(k, v, n, one_pair_plan(settings, k, v, root)) for (k, v), n in pairs.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=str(Path(__file__).resolve().parent.parent / "artifacts/smollm2-135m/plan-2.25"))
    parser.add_argument("--lengths", default="32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--top", type=int, default=12, help="the most common pairs timed (the rest: their share only)")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    bw = copy_bandwidth()
    root = Path(tempfile.mkdtemp(prefix="pairs"))
    settings = plan_settings(args.plan)
    total_items = sum(len(x) for x in settings["k"])
    pairs = pair_plans(settings, args.top, root)
    rows = []  # (b, length, name, items, µs, bytes, err)
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            torch.manual_seed(0)
            copies = max(2, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2))))
            q = [torch.randn(b, HQ, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
            res = [(torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16),
                    torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16)) for _ in range(copies)]
            # KIVI-2 G=128 on the INT2 kernel, the plan's yardstick: random codes (its time does not depend on them)
            kivi = []
            for kr, vr in res:
                kf = torch.randn(b, HKV, length, D, device="cuda")
                kivi.append(pack(kf, torch.randn_like(kf), kr, vr, 128, 128))
                del kf
            us = timed(lambda i: fused_decode(q[i], kivi[i], D**-0.5), copies)
            rows.append((b, length, "KIVI-2 G=128 (INT2 kernel)", None, us, layer_bytes(kivi[0], q[0]), None))
            del kivi
            torch.cuda.empty_cache()
            for k, v, n, d in [(None, None, None, args.plan)] + pairs:
                layers = [plan_layer(b, length, d, kr, vr) for kr, vr in res]
                us = timed(lambda i: codebook_decode(q[i], layers[i][0], D**-0.5), copies)
                err = worst_row(codebook_decode(q[0], layers[0][0], D**-0.5, checked=True),
                                reference_decode(q[0], layers[0][0], D**-0.5))
                name = (f"the mapped plan's layer {layers[0][1]} ({len(layers[0][0].groups)} groups of heads)"
                        if k is None else f"{k} + {v}")
                rows.append((b, length, name, n, us, tq_bytes(layers[0][0], q[0]), err))
                del layers
                torch.cuda.empty_cache()
    floors = {nbytes: read_floor(nbytes) for nbytes in sorted({r[5] for r in rows})}
    timed_items = sum(n for _, _, n, _ in pairs)
    lines = [f"copy bandwidth measured: {bw:.0f} GB/s. Plan {Path(args.plan).name}: {total_items} items, the "
             f"{len(pairs)} pairs timed hold {timed_items}. Read floor: decode.py's.", "",
             "| B | L | key + value scheme | items | µs | read floor µs | x floor | x KIVI-2 | worst row err |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b in sorted({r[0] for r in rows}):
        for length in sorted({r[1] for r in rows}):
            mine = [r for r in rows if r[:2] == (b, length)]
            kivi_us = mine[0][4]
            for _, _, name, n, us, nbytes, err in mine:
                lines.append(f"| {b} | {length} | {name} | {'' if n is None else n} | {us:.1f} | "
                             f"{floors[nbytes]:.1f} | {us / floors[nbytes]:.1f}x | {us / kivi_us:.2f}x | "
                             f"{'' if err is None else f'{err:.1e}'} |")
            weighed = [(n, us, floors[nbytes]) for _, _, _, n, us, nbytes, _ in mine if n]
            w = sum(n for n, _, _ in weighed)
            mean_us, mean_floor = (sum(n * x for n, x, _ in weighed) / w, sum(n * f for n, _, f in weighed) / w)
            lines.append(f"| {b} | {length} | the pairs weighed by their items | {w} | {mean_us:.1f} | "
                         f"{mean_floor:.1f} | {mean_us / mean_floor:.1f}x | {mean_us / kivi_us:.2f}x | |")
    title = (f"The codebook kernel a pair of schemes at a time, {torch.cuda.get_device_name()}, {HQ} q / {HKV} kv "
             f"heads, d={D}")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
