"""Run a recipe with train-adapters and eval steps (recipes/kvlinc/kvlinc.toml); print the perplexity table,
the per-layer attention error of each eval and the training time, and append them to RESULTS.md.

    OMP_NUM_THREADS=1 python benchmarks/kvlinc.py recipes/kvlinc/kvlinc.toml
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvcalib.artifacts import RUN, load_artifact
from kvcalib.recipes import _commands, load_recipe
from kvcalib.report import result_table
from results import publish


def layer_table(labels: list[str], results: list) -> str:
    rows = ["| layer | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for i in range(len(results[0].per_layer_attention_rel_error)):
        rows.append(f"| {i} | " + " | ".join(f"{r.per_layer_attention_rel_error[i]:.4f}" for r in results) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/kvlinc/kvlinc.toml")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    commands = _commands()
    evals, trainings = [], []
    for step in load_recipe(args.recipe):
        start = time.perf_counter()
        out = commands[step.command](**step.arguments)
        if step.command == "eval":
            evals.append((step.label, out))
        elif step.command == "train-adapters":
            extra = load_artifact(out).extra
            train_seconds = json.loads((Path(out) / RUN).read_text())["train_seconds"]
            before, after = extra["heldout_ce_uncorrected"], extra["heldout_ce_corrected"]
            heads = extra["heads_lowered"]
            trainings.append(f"| {step.label} | {len(before)} | {train_seconds:.0f} | "
                             f"{time.perf_counter() - start:.0f} | {sum(before) / len(before):.4f} | "
                             f"{sum(after) / len(after):.4f} | {sum(a < b for a, b in zip(after, before))}/{len(before)} | "
                             f"{sum(heads)}/{len(heads) * len(extra['heldout_head_error_corrected'][0])} | "
                             f"{sum(h > 0 for h in heads)}/{len(heads)} |")
    labels, results = [label for label, _ in evals], [r for _, r in evals]
    train_table = "\n".join(["| adapters | layers | train s | total s | held-out KL uncorrected | held-out KL corrected "
                             "| layers with lower KL | heads with lower output error (kept by the gate) | layers kept |",
                             "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *trainings])
    table = (f"{result_table(results, labels)}\n\nTraining on this machine (torch threads: "
             f"{torch.get_num_threads()}), mean held-out attention KL over the trained layers:\n\n{train_table}"
             f"\n\nPer-layer attention error ‖o − o_ref‖/‖o_ref‖:\n\n{layer_table(labels, results)}")
    title = f"{args.recipe}: {results[0].model}, {results[0].num_samples} x {results[0].seq_len} tokens"
    publish(title, table, sys.argv, not args.no_record)


if __name__ == "__main__":
    main()
