"""The codebook kernel one pair of schemes at a time: which of a plan's (key scheme, value scheme) pairs cost what,
and what each scheme `kvcalib plan` can choose costs alone.

A plan's layer is one launch per group of KV heads that share a pair. This benchmark times each pair a shipped plan
holds alone over all 8 KV heads of the 8B shape (32 q / 8 KV heads, d=128, residual 100, the plan's float16 sink),
as decode.py times a plan's layer (`plan_layer`: random words in every buffer, the same timing, read floor and
float64 reference), so that each pair's time stands beside its own read floor, torch SDPA over the same tokens in
float16 and KIVI-2's INT2 kernel. The last rows weigh the plan's pairs by their share of the plan's (layer, KV head)
items: the mean layer the plan would cost if every group filled the GPU alone, against decode.py's most-grouped
layer of the mapped plan.

`--pairs candidates` times each of the plan's default candidates (`kvcalib.defaults.PLAN_CANDIDATES`) as the keys and
the values of every head instead (a family and width alone: the kernel table's rows for each scheme); `--pairs
KEY+VALUE,...` names the pairs.

    cd benchmarks && python codebook_pairs.py [--plan ../artifacts/smollm2-135m/plan-2.25] [--lengths 32768]
                                              [--batches 1,8] [--top 12] [--pairs candidates | KEY+VALUE,...]
                                              [--results FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

from decode import (D, HKV, HQ, RESIDUAL, copy_bandwidth, kivi2_us, mapped, plan_layer, read_floor, sdpa_us, timed,
                    tq_bytes, worst_row)
from kvcalib.formats.codebook.launch import codebook_decode
from kvcalib.formats.codebook.layout import reference_decode
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


def named_pairs(settings: dict, names: str, root: Path) -> list[tuple[str, str, int, str]]:
    """`--pairs`' pairs as `pair_plans` gives the plan's: `candidates` (each default candidate of `kvcalib plan` as
    both the keys' and the values' scheme) or KEY+VALUE,...; items: how many of the plan's items hold the pair."""
    from kvcalib.defaults import PLAN_CANDIDATES

    held = collections.Counter((k, v) for ks, vs in zip(settings["k"], settings["v"]) for k, v in zip(ks, vs))
    wanted = [(c, c) for c in PLAN_CANDIDATES] if names == "candidates" else \
        [tuple(x.split("+", 1)) for x in names.split(",") if x]
    if any(len(x) != 2 for x in wanted):
        raise SystemExit(f"--pairs: a pair is KEY+VALUE, got {names!r}")
    return [(k, v, held[(k, v)], one_pair_plan(settings, k, v, root)) for k, v in wanted]


def read_by_kernel(plan_dir: str) -> bool:
    """Whether the codebook kernel reads every layer of this one-pair plan mapped onto the 8B shape (`supports`; the
    mapping is decode.py's `mapped`, which `plan_layer` reads again from its cache)."""
    from kvcalib.formats.codebook.launch import supports

    plan, _ = mapped(plan_dir)
    return all(supports([g.spec for g in plan.codebook_groups(i) or []], D, torch.device("cuda"), HQ // HKV)
               for i in range(plan.shape.num_layers))


def cell(us: float, floor: float, sdpa: float) -> str:
    """A shape's cell: µs, then its multiple of its own read floor, then SDPA's time over it (the speedup)."""
    return f"{us:.1f} / {us / floor:.1f}x / {sdpa / us:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=str(Path(__file__).resolve().parent.parent / "artifacts/smollm2-135m/plan-2.25"))
    parser.add_argument("--lengths", default="32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--top", type=int, default=12, help="the most common pairs timed (the rest: their share only)")
    parser.add_argument("--pairs", default="", help="`candidates` (each default candidate as keys and values) or "
                        "KEY+VALUE,... in place of the plan's commonest pairs")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    bw = copy_bandwidth()
    root = Path(tempfile.mkdtemp(prefix="pairs"))
    settings = plan_settings(args.plan)
    total_items = sum(len(x) for x in settings["k"])
    pairs = named_pairs(settings, args.pairs, root) if args.pairs else pair_plans(settings, args.top, root)
    unread = [(k, v) for k, v, _, d in pairs if not read_by_kernel(d)]
    for k, v in unread:
        print(f"{k} + {v}: not read by the codebook kernel (`supports`), left out", file=sys.stderr)
    pairs = [x for x in pairs if x[:2] not in unread]
    rows = []  # (b, length, name, items, µs, bytes, err)
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            torch.manual_seed(0)
            copies = max(2, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2))))
            q = [torch.randn(b, HQ, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
            res = [(torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16),
                    torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16)) for _ in range(copies)]
            # torch SDPA over the same tokens in float16, the peer each cell's speedup is against
            us, nbytes = sdpa_us(q, length + RESIDUAL)
            rows.append((b, length, "SDPA fp16", None, us, nbytes, None))
            # KIVI-2 G=128 on the INT2 kernel, the plan's yardstick
            us, nbytes = kivi2_us(q, res, length)
            rows.append((b, length, "KIVI-2 G=128 (INT2 kernel)", None, us, nbytes, None))
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
    shapes = sorted({r[:2] for r in rows})
    names = list(dict.fromkeys(r[2] for r in rows))
    got = {(r[0], r[1], r[2]): r for r in rows}
    sdpa = {shape: got[(*shape, "SDPA fp16")][4] for shape in shapes}
    kivi = {shape: got[(*shape, "KIVI-2 G=128 (INT2 kernel)")][4] for shape in shapes}
    last = shapes[-1]
    lines = [f"copy bandwidth measured: {bw:.0f} GB/s. Plan {Path(args.plan).name}: {total_items} items, the "
             f"{len(pairs)} pairs timed hold {timed_items}. Read floor: decode.py's. A cell: µs / its multiple of "
             "its own read floor / SDPA's µs over it (the speedup).", "",
             "| key + value scheme | items | " + " | ".join(f"B={b}, {n // 1024}k" for b, n in shapes) +
             f" | x KIVI-2 (B={last[0]}, {last[1] // 1024}k) | worst row err |",
             "|---|---:|" + "---:|" * len(shapes) + "---:|---:|"]
    for name in names:
        mine = [got[(*shape, name)] for shape in shapes]
        n = mine[0][3]
        errs = [r[6] for r in mine if r[6] is not None]
        lines.append(f"| {name} | {'' if n is None else n} | " +
                     " | ".join(cell(r[4], floors[r[5]], sdpa[r[:2]]) for r in mine) +
                     f" | {mine[-1][4] / kivi[last]:.2f}x | {f'{max(errs):.1e}' if errs else ''} |")
    weighed = {shape: [(got[(*shape, f"{k} + {v}")], n) for k, v, n, _ in pairs if n] for shape in shapes}
    if not args.pairs and any(weighed.values()):  # the plan's pairs: a mean layer of the plan
        w = sum(n for _, n in weighed[last])
        means = {shape: (sum(n * r[4] for r, n in x) / w, sum(n * floors[r[5]] for r, n in x) / w)
                 for shape, x in weighed.items()}
        lines.append(f"| the pairs weighed by their items | {w} | " +
                     " | ".join(cell(means[s][0], means[s][1], sdpa[s]) for s in shapes) +
                     f" | {means[last][0] / kivi[last]:.2f}x | |")
    if unread:
        lines += ["", "Not read by the kernel, left out: " + ", ".join(f"{k} + {v}" for k, v in unread) + "."]
    title = (f"The codebook kernel a pair of schemes at a time, {torch.cuda.get_device_name()}, {HQ} q / {HKV} kv "
             f"heads, d={D}")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
