"""Atomic file output: write under a temporary name in the same directory, then rename.

A reader therefore sees either the previous file or the complete new one, never a half-written one,
and an interrupted run leaves only `.tmp-*` names behind, which loaders ignore.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import SettingsError


def tmp_name(path: Path) -> Path:
    return path.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{path.name}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path (file or directory) that replaces `path` when the block succeeds."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked writable by `ensure_writable_file` first
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ensure_writable_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Check, before any work, that `path` (a directory, maybe not yet existing) can be written."""
    path = Path(path)
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise SettingsError(f"{what} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SettingsError(f"{what} {path}: directory {probe} is not writable")
    try:  # os.access trusts permission bits; root, /proc and read-only mounts need a real attempt
        os.rmdir(tempfile.mkdtemp(prefix=".kvcalib-probe-", dir=probe))
    except OSError as err:
        raise SettingsError(f"{what} {path}: cannot create anything in {probe} ({err.strerror})") from None
    return path


def ensure_writable_file(path: str | os.PathLike, what: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise SettingsError(f"{what} {path} is a directory; give a file name")
    ensure_writable_dir(path.parent, what)
    return path
