"""Does KVLinC's correction lower the attention output error of every layer and head? Train each
layer's adapters as `train-adapters` does, on all but the last --held sequences of an activations
directory, then score the held-out sequences with the method's own attention per query head
(`kvcalib.methods.kvlinc_fit.gated`, what the gate compares): ‖o − o_ref‖/‖o_ref‖ over the queries that
see a flushed block, without and with the (ungated) correction, next to the held-out attention KL
the training minimizes. Print the table and append it
to RESULTS.md.

    OMP_NUM_THREADS=1 python benchmarks/kvlinc_heads.py runs/acts/pydoc-64x512 --held 8
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvcalib.collect import Activations
from kvcalib.models import AttentionShape
from kvcalib.methods.kvlinc_fit import TrainConfig, _layer_data, gated, heldout_loss, parse_layers, train_layer
from results import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("activations")
    parser.add_argument("--held", type=int, default=8, help="held-out sequences (the last ones)")
    parser.add_argument("--layers", default="all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    acts = Activations(args.activations)
    fp = acts.fingerprint
    shape = AttentionShape(acts.num_layers, fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    config = TrainConfig(steps=args.steps, bits=args.bits, group_size=args.group_size)
    scaling = shape.head_dim**-0.5
    rows, totals = [], torch.zeros(4)
    start = time.perf_counter()
    for i in parse_layers(args.layers, acts.num_layers):
        layer = acts.layer(i)
        data = _layer_data(layer, config)
        n = data.q.shape[0]
        train, held = data.take(torch.arange(n - args.held)), data.take(torch.arange(n - args.held, n))
        adapter = train_layer(train, config, scaling, i)
        kl = [heldout_loss(held, config, scaling, a) for a in (None, adapter)]
        _, *errs = gated(adapter, config, shape, i, {x: layer[x][n - args.held:] for x in "qkv"}, scaling)
        change = (errs[1] / errs[0] - 1) * 100
        before, after = (e.pow(2).mean().sqrt().item() for e in errs)
        totals += torch.tensor([kl[0], kl[1], before, after])
        rows.append(f"| {i} | {kl[0]:.4f} | {kl[1]:.4f} | {before:.4f} | {after:.4f} | {(after / before - 1) * 100:+.2f} | "
                    f"{int((change < 0).sum())}/{len(change)} | {change.min().item():+.2f} | {change.max().item():+.2f} |")
        print(rows[-1], flush=True)
    m = totals / len(rows)
    rows.append(f"| mean | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} | {m[3]:.4f} | {(m[3] / m[2] - 1) * 100:+.2f} | | | |")
    header = ["| layer | held-out KL uncorrected | corrected | output error uncorrected | corrected | change % "
              "| heads lowered | best head % | worst head % |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table = (f"KVLinC-{args.bits} G={args.group_size}, rank {config.rank}, {args.steps} steps, trained on "
             f"{acts.manifest['settings']['num_samples'] - args.held} sequences, scored on the {args.held} held out "
             f"({time.perf_counter() - start:.0f} s, torch threads {torch.get_num_threads()}):\n\n" + "\n".join(header + rows))
    title = f"benchmarks/kvlinc_heads.py: {args.activations}"
    publish(title, table, sys.argv, not args.no_record)


if __name__ == "__main__":
    main()
