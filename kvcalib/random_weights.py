"""The weights of a random-initialised model (`kvcalib make-model`, kvcalib/random_model.py): how each tensor is
drawn, for the directory make-model writes and, with `--weights generated`, for the model `--model DIR`
loads without any weights on disk (`generated_model`): the same rule, so the same bytes for the same seed.

Each tensor is drawn as transformers initialises these models, norm weights 1, biases 0, the others with std
`initializer_range` and mean 0; from a counter-based generator keyed by the seed and the tensor's name
(`initial`). Its bits come from integer operations alone, so any device, and any chunking of a tensor, gives
the same bytes: a generated model is drawn on its GPUs, the written one on the CPU, and they agree. (Torch's
CPU generator, one thread per tensor, drew a 70B-shaped model at about 250 MB/s on an H100 machine; this
rule drew the GPU's 72 GB of it in 45 s with the CPU's chunk size, before a GPU got larger chunks.)
The draw is the sum of four uniform 16-bit integers, centred and scaled (Irwin-Hall: normal to within its
tails, which stop at 3.46 std): weights for timing and memory, never for accuracy.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .errors import SettingsError

SHARD_BYTES = 2 * 2**30
# float32 bytes drawn at a time for a generated model before they go to their devices: what a command on a
# `--weights generated` model holds of them in host memory, beside its own (the largest tensor alone may pass it)
GENERATE_BYTES = 2**29
GENERATED = "kvcalib-weights.json"  # what a `--weights generated` directory holds instead of weights
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


FORMAT = 2  # of GENERATED: 2 the counter-based draw (1, torch's CPU generator, is refused: run make-model again)
_M32 = 0xFFFFFFFF
_IRWIN_HALL_STD = (4 * (65536**2 - 1) / 12) ** 0.5  # std of the sum of four uniform 16-bit integers
_IRWIN_HALL_MEAN = 4 * 65535 // 2
DRAW_CHUNK = 1 << 18  # elements drawn at a time on a CPU (int64 counters of 4 MiB: in cache)
DRAW_CHUNK_GPU = 1 << 24  # on a GPU, where cache does not matter and each chunk costs launches (2^18: 72 GB in 45 s)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values held in int64, in place: xorshift-multiply rounds whose odd multipliers are
    below 2^31, so that no int64 product overflows. Integer operations only: every device gives the same bits."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def initial(name: str, shape: tuple[int, ...], std: float, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor `name` (float32, on `device`): element i hashes the counters 2i and 2i + 1 offset by the
    tensor's key (seed and name) into four 16-bit integers, whose centred sum times std / its std (one float32
    product of an exact integer) is the value. At most 2^31 elements a tensor (distinct counters)."""
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    if "norm" in name.split(".")[-2]:  # RMSNorm / LayerNorm weights
        return torch.ones(shape, device=device)
    n = int(torch.Size(shape).numel())
    if n > 2**31:
        raise SettingsError(f"{name}: {n} elements, over the 2^31 a generated tensor may hold")
    key = int(_mix32(torch.tensor([(seed * 1_000_003 + zlib.crc32(name.encode())) & _M32]))[0])
    scale = torch.tensor(std / _IRWIN_HALL_STD, dtype=torch.float32, device=device)
    out = torch.empty(n, dtype=torch.float32, device=device)
    chunk = DRAW_CHUNK if out.device.type == "cpu" else DRAW_CHUNK_GPU  # the same bytes either way
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        h = _mix32(torch.arange(2 * start, 2 * stop, dtype=torch.int64, device=device).add_(key).bitwise_and_(_M32))
        total = ((h & 0xFFFF) + (h >> 16)).view(-1, 2).sum(1) - _IRWIN_HALL_MEAN  # counters 2i, 2i + 1: element i
        torch.mul(total.to(torch.float32), scale, out=out[start:stop])
    return out.view(shape)


def generated_settings(directory: Path) -> dict:
    """The seed and dtype of a `--weights generated` directory, checked; one clear line where they are off."""
    path = Path(directory) / GENERATED
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(f"{path} is not readable ({err}); run `kvcalib make-model --weights generated` again") from None
    if not (isinstance(settings, dict) and settings.get("format") == FORMAT and isinstance(settings.get("seed"), int)
            and settings.get("dtype") in DTYPES):
        raise SettingsError(f"{path} must hold format {FORMAT}, an integer seed and a dtype of {', '.join(DTYPES)}; "
                            "run `kvcalib make-model --weights generated` again")
    return settings


def _on(where) -> torch.device:
    """A device map's entry as a device: an int is a GPU index."""
    return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)


def generated_model(directory: Path, dtype: torch.dtype, device: str,
                    max_memory: dict[int | str, str] | None = None, threads: int | None = None):
    """The model of a `--weights generated` directory: every tensor drawn as `make_model` writes it (`initial`,
    the directory's seed; rounded to its dtype, then to `dtype`), placed straight on its device: `device`, or
    with `device` "auto-map" the layers spread as `from_pretrained(device_map="auto")` spreads them
    (accelerate's balanced map, within `max_memory`). Each tensor is drawn on the device it is placed on (a
    GPU's tensors never pass through host memory), several at a time on `threads` threads (the bytes depend on
    neither the threads nor the device), at most about `GENERATE_BYTES` of them (float32) at once. Buffers the
    model makes itself (RoPE's frequencies) are made for real and moved to their device."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = generated_settings(directory)
    config = AutoConfig.from_pretrained(directory)
    with init_empty_weights():  # parameters on the meta device; buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if device == "auto-map":
        unsplit = model._no_split_modules
        memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=unsplit, dtype=dtype)
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=unsplit, dtype=dtype)
        if "disk" in device_map.values():
            raise SettingsError(f"the generated model of {directory} does not fit in the GPUs' and host memory "
                                "(--max-memory): its weights are drawn into memory, never offloaded to disk")
    else:
        device_map = {"": device}
    std = getattr(config, "initializer_range", 0.02)
    stored = DTYPES[settings["dtype"]]

    def place(name: str):
        parts = name.split(".")
        for cut in range(len(parts), -1, -1):
            key = ".".join(parts[:cut])
            if key in device_map:
                return device_map[key]
        raise SettingsError(f"the device map places no module holding {name}")

    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]  # a tied weight once
    batch, used = [], 0
    with ThreadPoolExecutor(threads or min(32, os.cpu_count() or 1)) as pool:
        def flush() -> None:
            drawn = pool.map(lambda item: initial(item[0], item[1], std, settings["seed"], _on(place(item[0])))
                             .to(stored).to(dtype), batch)
            for (name, _), value in zip(batch, drawn):
                set_module_tensor_to_device(model, name, place(name), value=value)
            batch.clear()

        for name, dims in params:
            batch.append((name, dims))
            used += torch.Size(dims).numel() * 4
            if used >= GENERATE_BYTES:
                flush()
                used = 0
        flush()
    for name, buf in list(model.named_buffers()):
        set_module_tensor_to_device(model, name, place(name), value=buf)
    model.tie_weights()
    if len(set(device_map.values())) > 1:
        dispatch_model(model, device_map=device_map)  # hooks that move activations between the devices
    return model
