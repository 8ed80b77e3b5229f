"""Atomic file output: write under a temporary name in the same directory, then rename.

A reader therefore sees either the previous file or the complete new one, never a half-written one.
A run interrupted by an exception or Ctrl-C removes its temporary; a killed one leaves a `.tmp-{pid}-*`
name, which loaders ignore and the next write of the same path removes once that process is gone.
A full disk (or quota) while writing is an `OutputError` naming the path, with nothing left behind.
`exclusive` holds a lock file so that two processes never write into one directory at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import tempfile
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError, SettingsError

# Write errors that mean "no room here", not a bug: the user frees space or writes elsewhere.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def tmp_name(path: Path) -> Path:
    return path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, alive
        pass
    return True


def remove(path: Path) -> None:
    """Remove a file or a directory tree, whichever `path` is, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _remove_stale(path: Path) -> None:
    """Remove the temporaries that killed writers of `path` left beside it (their pid is gone)."""
    for tmp in path.parent.glob(f".tmp-*-*-{glob.escape(path.name)}"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path (file or directory) that replaces `path` when the block succeeds."""
    path = Path(path)
    _remove_stale(path)
    tmp = tmp_name(path)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except OSError as err:
        if err.errno in _FULL:
            raise OutputError(f"cannot write {path}: {err.strerror}; free space there or choose another "
                              "output location") from None
        raise
    finally:
        remove(tmp)


@contextlib.contextmanager
def exclusive(directory: Path, what: str) -> Iterator[None]:
    """Hold `directory/.lock` while the block runs; refuse at once if another process holds it.

    flock is released by the kernel when the holder dies, even by SIGKILL, so a killed run never
    leaves the directory locked. The file is removed on release; a process that opened it just
    before (and so locked a removed file) sees that its inode is no longer the path's and retries."""
    lock = directory / ".lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"another process is writing {what} {directory} (it holds {lock}); wait for it "
                              "to finish or choose another --out") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


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
