"""`generate`: a prompt continued through a compressed KV cache, tokens streamed as they come.

    kvcalib generate --method oscar --artifacts artifacts/smollm2-135m/oscar --prompt "What is a list?"

The prompt goes through the model's chat template where it has one, then `model.generate` (greedy, or
sampling with transformers' own logits processors) with the cache `runtime_cache` picks: on CUDA the
static cache whose decode steps replay one captured CUDA graph, where it holds the method
(`kvcalib.runtime.static_cache`); elsewhere `KvcalibCache`, whose steps run the fused kernels where the
method has one on CUDA and the torch reference otherwise. `--method fp16` decodes with transformers'
own float16 cache, for comparison.

Under torchrun (`torchrun --nproc-per-node N -m kvcalib generate --model DIR ...`) the model is loaded under
transformers' tensor parallelism, each rank holding its share of every layer's heads on its own GPU, and each
rank's cache its own KV heads; the ranks decode together and rank 0 streams the text. This is the fast way to
decode a model larger than one GPU (benchmarks/RESULTS.md, "Several GPUs of one host"). From Python, a model
loaded with `device_map="auto"` (the layers in sequence over the GPUs) decodes too, 4 to 7x slower.
"""

from __future__ import annotations

import os
from typing import TextIO

import torch
from transformers import TextStreamer

from .errors import SettingsError
from .methods import Method, MethodSettings, build_method
from .devices import resolve_device
from .models import DEFAULT_MODEL, LoadedModel, attention_shape, load_model, max_context
from .parallel import local_device


def runtime_cache(model: LoadedModel, method: Method, max_batch: int, max_length: int):
    """The fastest kvcalib cache for `method` on the model's device: `StaticKvcalibCache` (one captured step)
    where it holds the method, otherwise `KvcalibCache`; None for fp16 (transformers' own cache)."""
    from .runtime.cache import KvcalibCache, check_static
    from .runtime.static_cache import StaticKvcalibCache

    if method.name == "fp16":
        return None
    shape = attention_shape(model.config)
    device = next(model.model.parameters()).device
    try:
        check_static(method, shape.head_dim, device, shape.num_heads // shape.num_kv_heads, shape.num_layers,
                     model.config)
    except SettingsError:  # on CUDA the dynamic cache says why itself (`where_layers_run`)
        return KvcalibCache(model, method)
    return StaticKvcalibCache(model, method, max_batch=max_batch, max_length=max_length)


def chat_ids(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    """`prompt` as the model's input: a user turn through its chat template where it has one, else as text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def generate(prompt: str, model: str | LoadedModel = DEFAULT_MODEL, method: str = "kivi",
             settings: MethodSettings = MethodSettings(), artifacts: str | None = None, max_new_tokens: int = 128,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 50,
             repetition_penalty: float = 1.0, seed: int = 0, device: str | None = None,
             trust_remote_code: bool = False, stream: TextIO | None = None, dtype: str | None = None) -> str:
    """The continuation of `prompt` (module docstring), written to `stream` token by token where given."""
    if not prompt.strip():
        raise SettingsError("the prompt is empty: give --prompt TEXT or --prompt-file FILE")
    if max_new_tokens < 1:
        raise SettingsError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if do_sample and (temperature <= 0 or not 0 < top_p <= 1 or top_k < 0):
        raise SettingsError(f"sampling takes --temperature > 0, 0 < --top-p <= 1 and --top-k >= 0; got "
                            f"{temperature}, {top_p}, {top_k}")
    lm = _load(model, device, trust_remote_code, dtype)
    if lm.tokenizer is None:
        raise SettingsError(f"{lm.spec} has no tokenizer: generate needs one to read the prompt and write the text")
    compressed = build_method(method, attention_shape(lm.config), settings, artifacts, lm)
    inputs = {k: v.to(lm.model.device) for k, v in chat_ids(lm.tokenizer, prompt).items()}
    length = inputs["input_ids"].shape[1] + max_new_tokens
    limit = max_context(lm.config)
    if limit is not None and length > limit:
        raise SettingsError(f"the prompt's {length - max_new_tokens} tokens and --max-new-tokens {max_new_tokens} "
                            f"pass the model's context of {limit}: shorten one")
    cache = runtime_cache(lm, compressed, max_batch=1, max_length=length)
    from .runtime.cache import tensor_parallel_rank

    lead = tensor_parallel_rank(lm.model) == 0  # under tensor parallelism one rank writes the text
    streamer = None if stream is None or not lead else _Streamer(lm.tokenizer, stream)
    torch.manual_seed(seed)  # the same on every rank: tensor-parallel ranks sample the same tokens
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else {}
    try:
        with torch.no_grad():
            out = lm.model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens,
                                    do_sample=do_sample, repetition_penalty=repetition_penalty, streamer=streamer,
                                    pad_token_id=lm.tokenizer.pad_token_id or lm.tokenizer.eos_token_id, **sampling)
    finally:
        if hasattr(cache, "close"):  # a static cache's captured graphs, freed now (under tensor parallelism they
            cache.close()            # hold NCCL collectives, which must be gone before the process group is)
    return lm.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _load(model: str | LoadedModel, device: str | None, trust_remote_code: bool,
          dtype: str | None = None) -> LoadedModel:
    """The model on `device`; under torchrun (several processes) under tensor parallelism (`load_model`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or isinstance(model, LoadedModel):
        return load_model(model, device, dtype, trust_remote_code=trust_remote_code)
    here = local_device(resolve_device(device))  # refuses --device cuda:N: every rank takes its own GPU
    if here == "cpu" and torch.cuda.is_available():
        raise SettingsError("--device cpu under torchrun on a machine with GPUs: tensor parallelism puts each rank "
                            "on its own GPU (give --device auto or cuda), or run without torchrun")
    return load_model(model, dtype=dtype, trust_remote_code=trust_remote_code, tensor_parallel=True)


class _Streamer(TextStreamer):
    """transformers' TextStreamer (words out as soon as they are whole), onto `stream` rather than print."""

    def __init__(self, tokenizer, stream: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stream = stream

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.stream.write(text + ("\n" if stream_end else ""))
        self.stream.flush()
