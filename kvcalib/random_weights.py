"""The weights of a random-initialised model (`kvcalib make-model`, kvcalib/random_model.py): how each tensor is
drawn, for the directory make-model writes and, with `--weights generated`, for the model `--model DIR`
loads without any weights on disk (`generated_model`): the same rule, so the same bytes for the same seed.

Each tensor is drawn as transformers initialises these models: normal with std `initializer_range`, norm
weights 1, biases 0; from its own generator, seeded by the seed and the tensor's name.
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


def initial(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The tensor `name` as transformers initialises it, from its own generator (float32)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name.split(".")[-2]:  # RMSNorm / LayerNorm weights
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).mul_(std)  # in place: the same values as `* std`, one buffer


def generated_settings(directory: Path) -> dict:
    """The seed and dtype of a `--weights generated` directory, checked; one clear line where they are off."""
    path = Path(directory) / GENERATED
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(f"{path} is not readable ({err}); run `kvcalib make-model --weights generated` again") from None
    if not (isinstance(settings, dict) and settings.get("format") == 1 and isinstance(settings.get("seed"), int)
            and settings.get("dtype") in DTYPES):
        raise SettingsError(f"{path} must hold format 1, an integer seed and a dtype of {', '.join(DTYPES)}; "
                            "run `kvcalib make-model --weights generated` again")
    return settings


def generated_model(directory: Path, dtype: torch.dtype, device: str,
                    max_memory: dict[int | str, str] | None = None, threads: int | None = None):
    """The model of a `--weights generated` directory: every tensor drawn as `make_model` writes it (`initial`,
    the directory's seed; rounded to its dtype, then to `dtype`), placed straight on its device: `device`, or
    with `device` "auto-map" the layers spread as `from_pretrained(device_map="auto")` spreads them
    (accelerate's balanced map, within `max_memory`), several tensors drawn at a
    time on `threads` threads (each its own generator: the bytes do not depend on the threads), at most about
    `GENERATE_BYTES` of them (float32) in host memory at once. Buffers the model makes itself (RoPE's frequencies) are
    made for real and moved to their device."""
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
            drawn = pool.map(lambda item: initial(item[0], item[1], std, settings["seed"]).to(stored).to(dtype), batch)
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
