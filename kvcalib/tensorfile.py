"""safetensors files read without trusting them, and written through Python's own file writes.

A safetensors file opens with an 8-byte little-endian header length, then that many bytes of JSON
naming each tensor's dtype, shape and byte range. `read_tensors` checks the length against the bytes
really there (and a cap) and every range against the data before the library allocates anything.
`check_finite`, called once checksums hold, refuses NaN or Inf, which no activation or artifact
kvcalib uses may hold. `tensor_bytes` serializes in memory so that the write itself is Python's, where
a full disk is an `OSError` that `kvcalib.atomic` turns into one line.
"""

from __future__ import annotations

import json

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
    try:
        header = json.loads(raw[8 : 8 + n])
        ranges = [entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError, KeyError):
        raise ArtifactError(f"{what} is corrupted: its safetensors header is not valid JSON") from None
    data = len(raw) - 8 - n
    if any(not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data) for b, e in ranges):
        raise ArtifactError(f"{what} is corrupted: a tensor's byte range lies beyond the file's {data} data bytes")


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
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
