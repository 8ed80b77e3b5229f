"""What the VecInfer decode kernel's time is made of (kernels_cupy/vq_decode.cu): the kernel as planned,
then with its packed tokens' value gathers, key gathers and tensor-core products knocked out (`KNOCKOUT`: each
replaced by a few integer operations on the same inputs, the output meaningless), beside one launch that only reads
the same bytes (decode.py's read floor). On decode.py's inputs (32 q / 8 KV heads, d=128, residual 100, random
codes), median of graph replays. Prints a table; `--results FILE` records it.

    python benchmarks/vq_decode_knockouts.py [--configs d4b8,d8b12] [--cases 1x131072,8x131072,1x32768]
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvcalib.runtime.vq_kernel as vk
from decode import D, read_floor, timed, vq_bytes, vq_inputs, vq_layer
from results import record

KNOCKOUTS = {"as planned": 0, "no value gathers": 1, "no key gathers": 2, "no gathers": 3, "no mma": 4,
             "no gathers, no mma": 7}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="d4b8,d8b12")
    parser.add_argument("--cases", default="1x131072,8x131072,1x32768", help="BxL, comma-separated")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        b, length = map(int, case.split("x"))
        copies, res, q = vq_inputs(b, length)
        for config in args.configs.split(","):
            layers = [vq_layer(b, length, config, k, v) for k, v in res]
            floor = read_floor(vq_bytes(layers[0], q[0]))
            times = []
            for name, bits in KNOCKOUTS.items():
                vk.TUNING.clear()
                if bits:
                    vk.TUNING["KNOCKOUT"] = bits
                times.append(timed(lambda i: vk.vq_decode(q[i], layers[i], D**-0.5), copies))
            vk.TUNING.clear()
            rows.append(f"| {b} | {length} | {config} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {floor:.1f} |")
            del layers
            torch.cuda.empty_cache()
    lines = ["| B | L | config | " + " | ".join(KNOCKOUTS) + " | read floor |", "|---:|---:|---|" + "---:|" * (len(KNOCKOUTS) + 1),
             *rows]
    print("\n".join(lines))
    if args.results:
        record(f"VecInfer kernel with parts knocked out, µs, {torch.cuda.get_device_name()}", "\n".join(lines), sys.argv,
               args.results)


if __name__ == "__main__":
    main()
