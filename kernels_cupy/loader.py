"""Compile `.cu` files of this folder with cupy.RawModule, once per (source, #defines, options).

Kernels are specialised by `#define`s prepended to the source (head_dim, group sizes, ...). CuPy
caches the compiled binary on disk as well; this cache keeps the loaded module per process.
`launch` runs a kernel and, when `checked` (tests), synchronises and raises on any CUDA error.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cupy

OPTIONS = ("-std=c++17", "--use_fast_math")
_BY_SOURCE: dict[str, cupy.RawModule] = {}
_BY_DEFINES: dict[tuple, cupy.RawModule] = {}  # fast path for the decode loop: no file read, no hashing


def module(filename: str, defines: dict[str, object]) -> cupy.RawModule:
    fast = (filename, tuple(sorted(defines.items())))
    if fast not in _BY_DEFINES:
        source = (Path(__file__).parent / filename).read_text()
        code = "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items())) + source
        key = hashlib.sha256((code + "\0".join(OPTIONS)).encode()).hexdigest()
        if key not in _BY_SOURCE:
            _BY_SOURCE[key] = cupy.RawModule(code=code, options=OPTIONS)
        _BY_DEFINES[fast] = _BY_SOURCE[key]
    return _BY_DEFINES[fast]


def kernel(filename: str, defines: dict[str, object], name: str) -> cupy.RawKernel:
    return module(filename, defines).get_function(name)


def launch(kernel: cupy.RawKernel, grid: tuple, block: tuple, args: tuple, checked: bool = False) -> None:
    kernel(grid, block, args)  # launch-configuration errors raise here
    if checked:
        cupy.cuda.get_current_stream().synchronize()  # faults inside the kernel raise here
