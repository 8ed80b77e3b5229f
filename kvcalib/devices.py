"""The device arguments every command takes, checked before anything loads: `--device` (`resolve_device`),
`--device-map` with it (`check_spread`), and `--max-memory` (`parse_max_memory`). No model here: `kvcalib.models`
loads on what these resolve, and `kvcalib.parallel` places each torchrun process by them."""

from __future__ import annotations

import re

import torch

from .errors import SettingsError


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None) -> str:
    """`--device`: `auto` (or None) is CUDA where torch sees a GPU, else the CPU; `cpu`; `cuda` or `cuda:N`,
    refused in one line where this machine has no such GPU."""
    if device in (None, "auto"):
        return default_device()
    if device == "cpu":
        return device
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise SettingsError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    count = torch.cuda.device_count()
    if int(match[1] or 0) >= count:
        raise SettingsError(f"--device {device}: " + ("this machine has no CUDA device (torch sees none)" if count == 0
                                                      else f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"))
    return device


def parse_max_memory(text: str | None) -> dict[int | str, str] | None:
    """`--max-memory 0=70GiB,1=70GiB,cpu=100GiB` as accelerate's `max_memory` (GPU indices as ints)."""
    if text is None:
        return None
    out: dict[int | str, str] = {}
    for part in text.split(","):
        key, sep, size = part.strip().partition("=")
        if not sep or not re.fullmatch(r"\d+|cpu", key) or not re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]i?B", size.strip()):
            raise SettingsError(f"--max-memory takes DEVICE=SIZE pairs such as 0=70GiB,1=70GiB,cpu=100GiB; got {part!r}")
        out[int(key) if key.isdigit() else key] = size.strip()
    return out


def check_spread(device: str | None, device_map: str | None) -> None:
    """`device_map` is auto or none, and auto takes no `device` of its own (it spreads the model over every GPU)."""
    if device_map not in (None, "none", "auto"):
        raise SettingsError(f"--device-map must be auto or none, got {device_map!r}")
    if device_map == "auto" and device not in (None, "auto"):
        raise SettingsError(f"--device {device} and --device-map auto: give one (auto spreads the model over every GPU)")
