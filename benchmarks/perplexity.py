"""Run a recipe and append the table of its eval steps, with the command, to RESULTS.md.

Collect and fit steps run first, in recipe order, producing what the evaluations read.

    python benchmarks/perplexity.py recipes/baselines/baselines.toml [--seq-len 1024] [--num-samples 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcalib.recipes import load_recipe, run_step
from kvcalib.report import result_table
from results import publish

def bits_breakdown(results, labels) -> str:
    """Where the effective bits go, for methods with shared tensors (codebooks, smoothing factors)."""
    rows = [(label, r.bits_breakdown) for label, r in zip(labels, results)
            if r.bits_breakdown.get("shared_bits_per_element")]
    if not rows:
        return ""
    lines = ["", "", "| method | cache bits/element (codes + float16 residual) | shared bits/element (codebooks, λ; once) |",
             "|---|---:|---:|"]
    lines += [f"| {label} | {b['cache_bits_per_element']:.3f} | {b['shared_bits_per_element']:.3f} |" for label, b in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/baselines/baselines.toml")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--num-samples", type=int)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    labels, results = [], []
    for step in load_recipe(args.recipe):
        if step.command != "eval":
            run_step(step)  # collect or fit the artifacts the evaluations read
            continue
        results.append(run_step(step, seq_len=args.seq_len, num_samples=args.num_samples))
        labels.append(step.label)
    r = results[0]
    title = f"{Path(args.recipe).stem}: {r.model}, {r.dataset} evaluation part, {r.num_samples} x {r.seq_len} tokens"
    table = result_table(results, labels) + bits_breakdown(results, labels)
    publish(title, table, sys.argv, not args.no_record)


if __name__ == "__main__":
    main()
