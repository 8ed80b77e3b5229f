"""A kernel file's source as the compiler reads it, without CuPy (the loader compiles it; tests/test_codebook_layout.py
checks its register use with nvcc where the machine has no GPU)."""

from __future__ import annotations

from pathlib import Path


SHARED = Path(__file__).parent  # the kernels every format shares (decode_common.cuh, mma_tiles.cuh) and the runtime's


def source_of(filename: str | Path) -> str:
    """A kernel file's text with each `#include "name"` inlined (once per name), so that the source hash covers what
    the compiler reads and NVRTC needs no include path. `filename`: a file of this folder by name, or a path (a
    format's kernel in its own folder, `kvcalib/formats/<format>/`); an include is looked up beside the file that
    names it, then in this folder."""
    seen: set[str] = set()

    def expand(path: Path) -> str:
        if path.name in seen:
            return ""
        seen.add(path.name)
        lines = path.read_text().splitlines(keepends=True)
        return "".join(expand(_include(path, line.split('"')[1])) if line.startswith('#include "') else line
                       for line in lines)

    first = Path(filename)
    return expand(first if first.parent != Path(".") else SHARED / first)


def _include(including: Path, name: str) -> Path:
    beside = including.parent / name
    return beside if beside.exists() else SHARED / name
