"""A kernel file's source as the compiler reads it, without CuPy (the loader compiles it; tests/test_codebook_layout.py
checks its register use with nvcc where the machine has no GPU)."""

from __future__ import annotations

from pathlib import Path


def source_of(filename: str) -> str:
    """A kernel file's text with each `#include "name"` of this folder inlined (once per name), so that the
    source hash covers what the compiler reads and NVRTC needs no include path."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        lines = (Path(__file__).parent / name).read_text().splitlines(keepends=True)
        return "".join(expand(line.split('"')[1]) if line.startswith('#include "') else line for line in lines)

    return expand(filename)
