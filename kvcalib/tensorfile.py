"""safetensors files read without trusting them, and written through Python's own file writes.

A safetensors file opens with an 8-byte little-endian header length, then that many bytes of JSON
naming each tensor's dtype, shape and byte range. `read_tensors` checks the length against the bytes
really there (and a cap) and every range against the data before the library allocates anything.
`check_finite`, called once checksums hold, refuses NaN or Inf, which no activation or artifact
kvcalib uses may hold. `tensor_bytes` serializes in memory so that the write itself is Python's, where
a full disk is an `OSError` that `kvcalib.atomic` turns into one line.

Large files (activation shards, tens of GB a collection) go without the serialized copy:
`write_tensors` writes the bytes safetensors' own `save` would (same layout, same header) straight from
the tensors' memory, hashing the file and each tensor in the same pass; `read_header` and `read_into`
read back only the tensors a caller needs, straight into its buffer, each checked against its own hash.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .errors import ArtifactError

_HEADER_CAP = 100 * 2**20  # the safetensors library's own limit on the JSON header


def _check_header(raw: bytes, what: str) -> None:
    if len(raw) < 8:
        raise ArtifactError(f"{what} is corrupted: {len(raw)} bytes, too short for a safetensors file")
    n = int.from_bytes(raw[:8], "little")
    if n > min(len(raw) - 8, _HEADER_CAP):
        raise ArtifactError(f"{what} is corrupted: its header claims {n} bytes, but the file holds {len(raw)}")
    _parsed(raw[8 : 8 + n], len(raw) - 8 - n, what)


def _parsed(text: bytes, data: int, what: str) -> dict:
    """The header's JSON, each tensor's byte range checked against the `data` bytes after it."""
    try:  # JSON that nests too deep or holds an integer of thousands of digits raises the last two
        header = json.loads(text)
        ranges = [entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError, KeyError, ValueError, RecursionError):
        raise ArtifactError(f"{what} is corrupted: its safetensors header is not valid JSON") from None
    if any(not isinstance(r, list) or len(r) != 2 or not all(type(x) is int for x in r) or not 0 <= r[0] <= r[1] <= data
           for r in ranges):
        raise ArtifactError(f"{what} is corrupted: a tensor's byte range lies beyond the file's {data} data bytes")
    return header


# A float is NaN or Inf exactly when its exponent bits are all set: |bits| (the sign masked off) at least
# these. The integer test reads each element once, without isfinite's float16 conversion (25x faster on
# an 8B model's float16 activations on the CPU: benchmarks/shard_io.py).
_NONFINITE = {torch.float16: (torch.int16, 0x7FFF, 0x7C00), torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
              torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
              torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def _finite(t: torch.Tensor) -> bool:
    bits = _NONFINITE.get(t.dtype)
    if bits is None or t.numel() == 0 or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    view, mask, least = bits
    return bool((t.view(view) & mask).max() < least)


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not _finite(t):
            raise ArtifactError(f"{what} holds NaN or Inf in {name}; it cannot be used: make it again from a model "
                                "and data that give finite values")


def read_tensors(raw: bytes, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, validated; `what` names the file in errors."""
    _check_header(raw, what)
    try:
        tensors = load(raw)
    except SafetensorError as err:
        raise ArtifactError(f"{what} is corrupted: {str(err).splitlines()[0]}") from None
    return tensors


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({name: t.contiguous() for name, t in tensors.items()})


# safetensors' dtype names, and the order of its Dtype enum: `save` lays tensors out by dtype, that order
# descending (the widest alignment first), then by name; `write_tensors` does the same.
_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
_ORDER = ["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"]
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}
HEADER = "__header__"  # the key of the header's own hash (its 8-byte length and JSON) among the tensors' hashes
_PIECE = 8 * 2**20  # bytes hashed and written at a time: both hashes read a piece while it is in cache


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_tensors(f: BinaryIO, tensors: dict[str, torch.Tensor]) -> tuple[str, dict[str, str]]:
    """Write `tensors` (contiguous, on the CPU) to the open file `f` as safetensors' `save` would (the same
    bytes), from their own memory. Returns the file's SHA-256 and each tensor's (and, under HEADER, the
    header's), computed while writing: one pass over the data."""
    items = sorted(tensors.items(), key=lambda kv: (-_ORDER.index(_NAMES[kv[1].dtype]), kv[0]))
    header, offset = {}, 0
    for name, t in items:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"write_tensors writes contiguous CPU tensors; {name} is not one")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces to a multiple of 8
    head = len(text).to_bytes(8, "little") + text
    whole, sums = hashlib.sha256(head), {HEADER: hashlib.sha256(head).hexdigest()}
    f.write(head)
    for name, t in items:
        data, one = _raw(t), hashlib.sha256()
        for start in range(0, len(data), _PIECE):
            piece = data[start : start + _PIECE]
            whole.update(piece)
            one.update(piece)
            f.write(piece)
        sums[name] = one.hexdigest()
    return whole.hexdigest(), sums


def read_header(f: BinaryIO, what: str, size: int, sha256: str | None = None) -> tuple[dict, int]:
    """The checked header of the open safetensors file `f` of `size` bytes: ({name: (dtype, shape, begin,
    end)}, where the data starts). With `sha256` (the HEADER entry of `write_tensors`), the header's bytes
    must hash to it."""
    first = f.read(8)
    n = int.from_bytes(first, "little") if len(first) == 8 else -1
    if n < 0 or n > min(size - 8, _HEADER_CAP):
        raise ArtifactError(f"{what} is corrupted: its header is cut short or claims more bytes than the file holds")
    text = f.read(n)
    if sha256 is not None and hashlib.sha256(first + text).hexdigest() != sha256:
        raise ArtifactError(f"{what} is corrupted (checksum mismatch in its header)")
    entries = {}
    for name, entry in _parsed(text, size - 8 - n, what).items():
        if name == "__metadata__":
            continue
        name_of_dtype, shape = entry.get("dtype"), entry.get("shape")
        dtype = _DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        begin, end = entry["data_offsets"]
        if (dtype is None or not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape)
                or math.prod(shape) * dtype.itemsize != end - begin):
            raise ArtifactError(f"{what} is corrupted: tensor {name}'s dtype or shape disagrees with its byte range")
        entries[name] = (dtype, tuple(shape), begin, end)
    return entries, 8 + n


def read_into(f: BinaryIO, start: int, entry: tuple, out: torch.Tensor, what: str, sha256: str) -> None:
    """Read one tensor (`read_header`'s entry; data starting at `start`) from `f` straight into `out` (a
    contiguous CPU tensor of its dtype and shape) and check it against its `sha256`."""
    dtype, shape, begin, end = entry
    if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"read_into: out must be a contiguous CPU {dtype} tensor of shape {shape}")
    f.seek(start + begin)
    view = _raw(out)
    if f.readinto(view) != end - begin:
        raise ArtifactError(f"{what} is corrupted: it ends inside a tensor")
    if hashlib.sha256(view).hexdigest() != sha256:
        raise ArtifactError(f"{what} is corrupted (checksum mismatch)")
