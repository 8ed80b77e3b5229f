"""A/B of the VecInfer decode kernel's launch plans (kvcalib/formats/vq/vq_decode.cu): warps per block,
pipeline stages, conflict-free book copies, blocks per SM, against the plan `kvcalib.formats.vq.launch.plan`
picks, on decode.py's inputs (32 q / 8 KV heads, d=128, residual 100, random codes, median of graph
replays). Prints a table; `--results FILE` records it.

    python benchmarks/vq_decode_plans.py [--configs d4b8,d8b12] [--batches 1,8] [--lengths 32768,131072]
        [--plans "chosen;16 warps"]
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvcalib.formats.vq.launch as vk
from decode import D, HKV, HQ, timed, vq_bytes, vq_inputs, vq_layer, worst_row
from kvcalib.formats.vq.layout import reference_decode
from results import record

PLANS = {  # name: the launch parameters set by hand (`formats.vq.launch.plan`'s tuning)
    "chosen": {},
    "4 warps, 2 stages": {"WARPS": 4, "TILES": 2, "NSTAGE": 2},
    "4 warps, 4 stages": {"WARPS": 4, "TILES": 2, "NSTAGE": 4},
    "single books": {"KREPL": 1, "VREPL": 1},
    "2 stages": {"NSTAGE": 2},
    "3 stages": {"NSTAGE": 3},
    "2 tiles": {"TILES": 2},
    "2 tiles, 3 stages": {"TILES": 2, "NSTAGE": 3},
    "2 tiles, 4 stages": {"TILES": 2, "NSTAGE": 4},
    "3 tiles, 3 stages": {"TILES": 3, "NSTAGE": 3},
    "16 warps, 2 tiles, 2 stages": {"WARPS": 16, "TILES": 2, "NSTAGE": 2},
    "16 warps, 2 tiles, 3 stages": {"WARPS": 16, "TILES": 2, "NSTAGE": 3},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="d4b8,d8b12")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--plans", default=None, help="names of PLANS, ';'-separated (default: all)")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    rows = []
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            copies, res, q = vq_inputs(b, length)
            for config in args.configs.split(","):
                layers = [vq_layer(b, length, config, k, v) for k, v in res]
                ref = reference_decode(q[0], layers[0], D**-0.5)
                for name, tuning in PLANS.items():
                    if args.plans and name not in args.plans.split(";"):
                        continue
                    try:
                        p = vk.plan(layers[0], HQ // HKV, tuning)
                        if p["SMEM"] > vk.SHARED_LIMIT or p["SMEM"] * p["BLOCKS_PER_SM"] > vk.SM_SHARED:
                            continue
                        us = timed(lambda i: vk.vq_decode(q[i], layers[i], D**-0.5, tuning=tuning), copies)
                        err = worst_row(vk.vq_decode(q[0], layers[0], D**-0.5, checked=True, tuning=tuning), ref)
                    except Exception as e:  # a plan the device refuses: say so in the table
                        rows.append(f"| {b} | {length} | {config} | {name} | failed: {type(e).__name__} | | | |")
                        continue
                    plan = ", ".join(f"{k}={v}" for k, v in p.items() if k != "SMEM")
                    gbs = vq_bytes(layers[0], q[0]) / (us * 1e-6) / 1e9
                    rows.append(f"| {b} | {length} | {config} | {name} | {us:.1f} | {gbs:.0f} | {plan}, {p['SMEM'] // 1024} KiB | {err:.1e} |")
                del layers
                torch.cuda.empty_cache()
    lines = ["| B | L | config | plan | µs | GB/s | defines, shared memory | worst row err |",
             "|---:|---:|---|---|---:|---:|---|---:|", *rows]
    print("\n".join(lines))
    if args.results:
        record(f"VecInfer kernel launch plans, {torch.cuda.get_device_name()}", "\n".join(lines), sys.argv,
               args.results)


if __name__ == "__main__":
    main()
