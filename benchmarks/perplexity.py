"""Run the eval steps of a recipe, print one table, and append it with its command to RESULTS.md.

    python benchmarks/perplexity.py recipes/baselines.toml [--seq-len 1024] [--num-samples 4]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from kvcalib.recipes import load_recipe
from kvcalib.report import result_table

RESULTS = Path(__file__).with_name("RESULTS.md")


def record(title: str, table: str, argv: list[str]) -> None:
    command = "python " + " ".join(shlex.quote(a) for a in argv)
    stamp = time.strftime("%Y-%m-%d")
    with RESULTS.open("a") as f:
        f.write(f"\n## {title} ({stamp})\n\n`{command}`\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/baselines.toml")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--num-samples", type=int)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    from kvcalib.evaluate import evaluate

    labels, results = [], []
    for step in load_recipe(args.recipe):
        if step.command != "eval":
            continue
        overrides = {k: v for k, v in (("seq_len", args.seq_len), ("num_samples", args.num_samples)) if v is not None}
        results.append(evaluate(**(step.arguments | overrides)))
        labels.append(step.label)
    r = results[0]
    title = f"{Path(args.recipe).stem}: {r.model}, {r.dataset} evaluation part, {r.num_samples} x {r.seq_len} tokens"
    table = result_table(results, labels)
    print(f"\n{title}\n\n{table}")
    if not args.no_record:
        record(title, table, sys.argv)


if __name__ == "__main__":
    main()
