"""A random-initialised model of a real model's shape, saved as a local directory that `--model` takes:
for benchmarks and tests where no model hub is reachable, never for accuracy.

    kvcalib make-model --shape llama-3.1-8b --out runs/models/llama-3.1-8b-random
    kvcalib make-model --shape my-config.json --out DIR      # any transformers config, as JSON

Shapes (`SHAPES`): Llama-3.1-8B and -70B, Qwen3-8B, Mistral-7B, Phi-3-mini, Gemma-2-9B, Gemma-3-4B and
Gemma-3-27B as their published configs give them (layers, widths, heads, head_dim, RoPE and its scaling, sliding
windows, soft caps, context). The tokenizer is the embedded model's (SmolLM2's),
saved beside the weights, so the vocabulary is its (49152 tokens, where Llama 3.1 has 128256: the
embedding and output matrices are smaller, every layer is the real one).

Weights are drawn with the scale transformers initialises these models with: std `initializer_range` (0.02),
norm weights 1, biases 0 (`kvcalib/random_weights.py`: a counter-based near-normal draw). Each tensor is keyed
by `--seed` and its name, so the bytes depend on nothing else, not even the device that draws them. They are written one shard at a time (at most `SHARD_BYTES` each, with
transformers' `model.safetensors.index.json`), so a 70B model (141 GB in bfloat16) never needs more host
memory than a shard; the directory is written under a temporary name and renamed once complete.

`--weights generated` writes no weights: the directory holds the config, the tokenizer and
`kvcalib-weights.json` (seed, dtype), and `--model DIR` draws the same tensors when it loads
(`generated_model`), each straight onto the device that holds it (`--device-map auto` included). For a model
no disk holds beside its activations: a 70B model is 139 GB in bfloat16, the lent two-GPU machine's disk 137 GB.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .atomic import atomic_path, ensure_writable_dir
from .errors import SettingsError
from .random_weights import DTYPES, FORMAT, GENERATED, SHARD_BYTES, initial


_LLAMA_31 = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0,
                 max_position_embeddings=131072, initializer_range=0.02, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
_GEMMA_2 = dict(model_type="gemma2", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=8192, initializer_range=0.02, tie_word_embeddings=True, head_dim=256,
                query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0)
# Gemma 3: five layers of six slide over 1024 tokens (local rope 10k), the sixth attends in full (rope 1M, scaled by 8)
_GEMMA_3 = dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=131072, initializer_range=0.02,
                tie_word_embeddings=True)
SHAPES = {
    "llama-3.1-8b": _LLAMA_31 | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-3.1-70b": _LLAMA_31 | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, initializer_range=0.02, tie_word_embeddings=False, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128),
    "mistral-7b": dict(model_type="mistral", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                       max_position_embeddings=32768, initializer_range=0.02, tie_word_embeddings=False,
                       sliding_window=None, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128),  # v0.3
    "phi-3-mini": dict(model_type="phi3", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
                       hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32),  # 4k context; head_dim 96
    "gemma-2-9b": _GEMMA_2 | dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                  num_attention_heads=16, num_key_value_heads=8),
    "gemma-3-4b": _GEMMA_3 | dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "gemma-3-27b": _GEMMA_3 | dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                                   num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                                   query_pre_attn_scalar=168),
}


def _config_fields(shape: str) -> dict:
    if shape in SHAPES:
        return dict(SHAPES[shape])
    path = Path(shape)
    if path.suffix != ".json":
        raise SettingsError(f"--shape {shape!r}: name one of {', '.join(SHAPES)}, or give a transformers config as a "
                            ".json file")
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"--shape {shape}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(f"--shape {shape}: not a readable JSON config ({err})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise SettingsError(f"--shape {shape}: a transformers config needs its model_type")
    return fields


def make_model(shape: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
               shard_bytes: int = SHARD_BYTES, tokenizer: str | None = None, weights: str = "written",
               device: str = "cpu") -> Path:
    """Write the random model of module docstring to `out`; returns it. `tokenizer`: a directory holding a
    saved tokenizer to use instead of the embedded model's (a machine without the GGUF, e.g. one reached
    by carrying a few MB: `AutoTokenizer.from_pretrained(...).save_pretrained(DIR)` where the GGUF is).
    `device`: where written weights are drawn, the same bytes anywhere (a GPU draws a 70B model's in seconds,
    where 16 CPU cores take many minutes), one tensor at a time, then written from host memory."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .models import DEFAULT_MODEL, _resolve

    if dtype not in DTYPES:
        raise SettingsError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if weights not in ("written", "generated"):
        raise SettingsError(f"--weights must be written or generated, got {weights!r}")
    fields = _config_fields(shape)
    out = ensure_writable_dir(out)
    if tokenizer is None:
        target, kwargs = _resolve(DEFAULT_MODEL)
        tokenizer = AutoTokenizer.from_pretrained(target, **kwargs)
    else:
        if not (Path(tokenizer) / "tokenizer_config.json").is_file():
            raise SettingsError(f"--tokenizer {tokenizer}: not a directory holding a saved tokenizer "
                                "(tokenizer_config.json)")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    model_type = fields.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **fields | {"vocab_size": len(tokenizer),
                                                                "bos_token_id": tokenizer.bos_token_id,
                                                                "eos_token_id": tokenizer.eos_token_id})
    except (ValueError, TypeError) as err:
        raise SettingsError(f"--shape {shape}: transformers refuses this config ({str(err).splitlines()[0]})") from None
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = [(name, tuple(t.shape)) for name, t in skeleton.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")]
    size = DTYPES[dtype].itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, dims in tensors:
        nbytes = size * int(torch.Size(dims).numel())
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, dims))
        used += nbytes
    std = getattr(config, "initializer_range", 0.02)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        weight_map = {}
        if weights == "generated":
            (tmp / GENERATED).write_text(json.dumps({"format": FORMAT, "seed": seed, "dtype": dtype}, indent=2) + "\n")
            shards = []
        for i, shard in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({name: initial(name, dims, std, seed, device).to(DTYPES[dtype]).cpu() for name, dims in shard},
                      tmp / file,
                      metadata={"format": "pt"})
            weight_map |= {name: file for name, _ in shard}
        if len(shards) > 1:
            total = sum(size * int(torch.Size(d).numel()) for _, d in tensors)
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out
