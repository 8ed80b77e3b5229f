"""Record a benchmark's table, under a title and with the exact command and commit that printed it,
in benchmarks/RESULTS.md (or another file, for runs whose output comes back from another machine).

RESULTS.md holds the current table of each benchmark: a table whose title is already there replaces
that section in place, and the old section moves, verbatim, to benchmarks/history/<its date>.md.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HISTORY = Path(__file__).with_name("history")  # RESULTS.md's; another file's history is the folder beside it


def _commit() -> str:
    """The checkout's commit, marked when the working tree differs from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=RESULTS.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=RESULTS.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return sha + (" with uncommitted changes" if dirty else "")


def record(title: str, table: str, argv: list[str], path: str | Path = RESULTS) -> None:
    command = "python " + " ".join(shlex.quote(a) for a in argv)
    today = time.strftime("%Y-%m-%d")
    section = f"### {title} ({today})\n\nCommit {_commit()}.\n\n`{command}`\n\n{table}\n"
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    heading = re.compile(rf"^### {re.escape(title)} \((\d{{4}}-\d{{2}}-\d{{2}})\)$", re.M)
    old = heading.search(text)
    if old is None:
        path.write_text(text + ("\n" if text else "") + section)
        return
    following = re.compile(r"^#{2,3} ", re.M).search(text, old.end())
    end = following.start() if following else len(text)
    history = path.with_name("history")  # HISTORY for RESULTS.md; a scratch file's own, never the repository's
    history.mkdir(exist_ok=True)
    archive = history / f"{old.group(1)}.md"
    with open(archive, "a") as f:
        f.write(("" if archive.exists() and archive.stat().st_size else f"# Benchmark history, {old.group(1)}\n") +
                "\n" + text[old.start():end].rstrip("\n") + "\n")
    path.write_text(text[: old.start()] + section + "\n" + text[end:].lstrip("\n"))


def publish(title: str, table: str, argv: list[str], record_it: bool = True, path: str | Path = RESULTS) -> None:
    """Print the table under its title and, unless told not to (--no-record), `record` it in `path`."""
    print(f"\n{title}\n\n{table}")
    if record_it:
        record(title, table, argv, path)
