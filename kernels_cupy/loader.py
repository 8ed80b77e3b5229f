"""Compile `.cu` files with cupy.RawModule, once per (source, #defines, options): a file of this folder by name
(the runtime's own kernels), or by path (a format's kernel, in its folder of `kvcalib/formats/`).

Kernels are specialised by `#define`s prepended to the source (head_dim, group sizes, ...); a file's
`#include "name"` is inlined first, looked up beside the file, then in this folder (`source_of`). CuPy
caches the compiled binary on disk as well; this cache keeps the loaded module per process.
`launch` runs a kernel and, when `checked` (tests), synchronises and raises on any CUDA error;
`torch_stream(device)` makes the tensors' GPU CuPy's current device and torch's current stream there
CuPy's stream, so every launch inside it runs on its tensors' GPU (whichever device is current
outside, as on a model spread over several GPUs) and orders with torch's work there. Kernels are
loaded per device: `kernel` inside `torch_stream` gives the function of that device's module.
"""

from __future__ import annotations

import functools
import hashlib

import cupy

from .source import source_of

OPTIONS = ("-std=c++17", "--use_fast_math")
_BY_SOURCE: dict[tuple[str, int], cupy.RawModule] = {}  # (source hash, device)
_BY_DEFINES: dict[tuple, cupy.RawModule] = {}  # fast path for the decode loop: no file read, no hashing


def module(filename: str, defines: dict[str, object]) -> cupy.RawModule:
    """The compiled module on CuPy's current device (a module loads its binary on one device)."""
    device = cupy.cuda.runtime.getDevice()
    fast = (filename, tuple(sorted(defines.items())), device)
    if fast not in _BY_DEFINES:
        source = source_of(filename)
        code = "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items())) + source
        key = (hashlib.sha256((code + "\0".join(OPTIONS)).encode()).hexdigest(), device)
        if key not in _BY_SOURCE:
            _BY_SOURCE[key] = cupy.RawModule(code=code, options=OPTIONS)
        _BY_DEFINES[fast] = _BY_SOURCE[key]
    return _BY_DEFINES[fast]


_FUNCTIONS: dict[tuple, cupy.RawKernel] = {}


def kernel(filename: str, defines: dict[str, object], name: str) -> cupy.RawKernel:
    """The kernel `name` of `filename` compiled with `defines` (every compile option is the launch's own
    argument, keyed here: there is no switch that changes later compiles), on CuPy's current device."""
    key = (filename, tuple(sorted(defines.items())), name, cupy.cuda.runtime.getDevice())
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = module(filename, defines).get_function(name)
    return _FUNCTIONS[key]


def launch(kernel: cupy.RawKernel, grid: tuple, block: tuple, args: tuple, checked: bool = False,
           shared_mem: int = 0) -> None:
    """`shared_mem`: bytes of dynamic shared memory per block (beyond 48 KiB the kernel's
    `max_dynamic_shared_size_bytes` must allow it)."""
    kernel(grid, block, args, shared_mem=shared_mem)  # launch-configuration errors raise here
    if checked:
        cupy.cuda.get_current_stream().synchronize()  # faults inside the kernel raise here


class _OnDevice:
    """CuPy's current device and stream set to a torch stream's for a `with` block, then put back."""

    def __init__(self, ptr: int, device: int):
        self.device = cupy.cuda.Device(device)
        self.stream = cupy.cuda.ExternalStream(ptr, device)

    def __enter__(self) -> cupy.cuda.ExternalStream:
        self.device.__enter__()
        try:
            return self.stream.__enter__()
        except BaseException:
            self.device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.stream.__exit__(*exc)
        finally:
            self.device.__exit__(*exc)


@functools.lru_cache(maxsize=64)
def _on_device(ptr: int, device: int) -> _OnDevice:
    return _OnDevice(ptr, device)


def torch_stream(device=None) -> _OnDevice:
    """Launch on `device` (a tensor's), in torch's current stream there: `with torch_stream(t.device):
    launch(kernel(...), ...)`. The one place a launch meets its device: CuPy's current device is switched
    to it inside the block (CuPy launches on its current device, and its streams refuse another one), and
    back after. One object per stream: building one costs more than a short kernel."""
    import torch

    stream = torch.cuda.current_stream(device)
    return _on_device(stream.cuda_stream, stream.device.index)
