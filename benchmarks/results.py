"""Append a benchmark's table, under a title and with the exact command that printed it, to
benchmarks/RESULTS.md (or another file, for runs whose output comes back from another machine)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def record(title: str, table: str, argv: list[str], path: str | Path = RESULTS) -> None:
    command = "python " + " ".join(shlex.quote(a) for a in argv)
    with open(path, "a") as f:
        f.write(f"\n## {title} ({time.strftime('%Y-%m-%d')})\n\n`{command}`\n\n{table}\n")


def publish(title: str, table: str, argv: list[str], record_it: bool = True) -> None:
    """Print the table under its title and, unless told not to (--no-record), `record` it."""
    print(f"\n{title}\n\n{table}")
    if record_it:
        record(title, table, argv)
