"""`eval`: perplexity and per-layer attention error with a compressed cache, at honest effective bits.

Decode-exact perplexity. The cache of n tokens holds floor(n/R)*R tokens compressed and the rest in
the float16 residual (`attention.flushed_counts`). When token t is predicted, the cache holds
tokens 0..t, so every key/value older than the last flush boundary at or before t+1 is read exactly
as the compressed cache stores it (compress, then decompress), and the newer ones in float16. One
forward pass per window evaluates all positions at once, each query with its own boundary; a test
checks this against token-by-token decoding.

Effective bits per cached element = every stored bit of the cache after the whole window (codes,
scales, zero points, norms, correction states, the float16 residual) summed over layers and windows,
plus the method's shared tensors (codebooks, adapters) once, divided by the number of cached
elements (windows x layers x 2 x kv_heads x seq_len x head_dim). A model's sliding layers are kept
as it computes them by default (`--sliding-layers float16`, `Method.float16_layers`): never compressed,
each holding the last min(seq_len, window) tokens at 16 bits, which the count includes.

Attention error: for each layer, ||o - o_ref|| / ||o_ref|| over all windows, where o is the layer's
attention output with the compressed cache and o_ref with the exact float keys and values, both
computed from the same queries inside the compressed run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from .atomic import ensure_writable_file, write_json
from .attention import AttentionOptions, flushed_counts, flushed_length, intercept, mixed_attention
from .collect import tokens_per_second
from .data import DEFAULT_DATASET, token_windows
from .methods import MethodSettings, build_method, float16_window, hold, settings_used
from .models import DEFAULT_MODEL, LoadedModel, attention_shape, check_seq_len, load_model
from .parallel import merged, on_rank0, placement, share, world

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    method: str
    settings: dict
    perplexity: float
    effective_bits: float
    tokens: int
    per_layer_attention_rel_error: list[float]
    model: str
    dataset: str
    num_samples: int
    seq_len: int
    seconds: float
    bits_breakdown: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def decode_bits(stored_bits: int, elements: int, seq_len: int, block: int, shared: float,
                window: int = 0, float16_windows: list[int] = (), layers: int = 1) -> dict[str, float]:
    """The two bit counts a reader compares across methods, per cached element:
    `compressed_part_bits_per_element`: the flushed blocks alone (codes and metadata, float16 sinks),
    from a window of `seq_len` tokens whose `stored_bits` (over `elements` cached elements) include a
    float16 residual of the seq_len - `flushed_length` newest tokens; `decode_averaged_bits_per_element`:
    the cache's bits per element averaged over every decode step t = 1 .. seq_len, its float16 window
    (t - `flushed_length(t)` tokens) included, plus the shared tensors. None of the first when nothing was
    flushed. `float16_windows`: the windows of the layers (of `layers`) kept uncompressed (`Method.float16_layers`),
    each holding its last min(t, window) tokens at 16 bits, in `stored_bits` and in the average, never in the first."""
    flushed = flushed_length(seq_len, block, window)
    per_layer = elements / seq_len / layers  # cached elements a token and layer (K and V, KV heads, head_dim, windows)
    compressed_layers = layers - len(float16_windows)
    kept_bits = sum(16 * per_layer * min(seq_len, w) for w in float16_windows)
    residual_bits = 16 * per_layer * compressed_layers * (seq_len - flushed)
    compressed = ((stored_bits - kept_bits - residual_bits) / (per_layer * compressed_layers * flushed)
                  if flushed and compressed_layers else None)
    t = torch.arange(1, seq_len + 1, dtype=torch.float64)
    f = flushed_length(t, block, window)
    kept = sum((16 * t.clamp(max=w) for w in float16_windows), torch.zeros_like(t))
    held = (compressed_layers * ((compressed or 0.0) * f + 16 * (t - f)) + kept) / (layers * t)
    return {"compressed_part_bits_per_element": compressed, "decode_averaged_bits_per_element": held.mean().item() + shared}


def settings_of(method) -> dict:
    """A method's settings as results name them (eval's JSON, lm-eval's, the report pairs them)."""
    return method.settings() | ({"sink_tokens": method.sink} if method.sink else {})


def decode_exact(method, observe=None):
    """The attention handler (`kvcalib.attention.intercept`) that scores `method` as a decoder holds it: each
    query attends over the cache of its own position, floor(n/R)*R tokens compressed and the rest float16
    (module docstring). `observe(layer, q, k, v, opts, held, out)`, where given, sees every call (eval's error
    sums and bits; lm-eval's loglikelihoods need none)."""
    def attend(layer: int, q, k, v, opts: AttentionOptions):
        held = hold(method, layer, k, v)
        if float16_window(method, layer) is not None:  # a sliding layer kept as the model computes it
            out = mixed_attention(q, k, v, opts)
        else:
            flushed = flushed_counts(q.shape[-2], k.shape[-2], method.block, device=q.device, window=method.window)
            out = method.attend(layer, q, k, v, held, flushed, opts)
        if observe is not None:
            observe(layer, q, k, v, opts, held, out)
        return out

    return attend


def evaluate(model: str | LoadedModel = DEFAULT_MODEL, dataset: str = DEFAULT_DATASET, text_field: str = "text",
             num_samples: int = 4, seq_len: int = 1024, method: str = "fp16", bits: int | None = None,
             group_size: int | None = None, residual: int | None = None, scaling: str | None = None,
             rotation: bool | None = None, sink_tokens: int | None = None, residual_mode: str | None = None,
             keys: str | None = None, sliding_layers: str | None = None,
             artifacts: str | None = None, json_path: str | None = None, trust_remote_code: bool = False,
             device: str | None = None, device_map: str | None = None,
             max_memory: dict[int | str, str] | None = None, dtype: str | None = None) -> EvalResult:
    """Score `method` on `num_samples` windows of `seq_len` tokens of the evaluation text.

    Method options left None take the artifact's value, else `kvcalib.defaults.DEFAULTS`; one the
    method does not use, or one that contradicts the artifact, is refused (`MethodSettings.resolve`)."""
    settings = MethodSettings(bits=bits, group_size=group_size, residual=residual, scaling=scaling, rotation=rotation, keys=keys,
                              sink_tokens=sink_tokens, residual_mode=residual_mode, sliding_layers=sliding_layers)
    settings.resolve(method, settings_used(method))  # an option the method does not use: refused before any work
    if json_path is not None:
        ensure_writable_file(json_path, "--json")
    rank, size = world()
    lm = load_model(model, **placement(device, device_map, max_memory, size), dtype=dtype,
                    trust_remote_code=trust_remote_code)
    shape = attention_shape(lm.config)
    cache = build_method(method, shape, settings, artifacts=artifacts, model=lm)
    check_seq_len(lm.config, seq_len)
    windows = token_windows(lm.tokenizer, dataset, "evaluation", num_samples, seq_len, text_field)

    err_sq = torch.zeros(shape.num_layers, dtype=torch.float64)
    ref_sq = torch.zeros(shape.num_layers, dtype=torch.float64)
    stored_bits = 0

    def observe(layer: int, q, k, v, opts: AttentionOptions, held, out) -> None:
        nonlocal stored_bits
        stored_bits += held.stored_bits
        ref = mixed_attention(q, k, v, opts)
        err_sq[layer] += (out - ref).double().pow(2).sum().cpu()
        ref_sq[layer] += ref.double().pow(2).sum().cpu()

    attend = decode_exact(cache, observe)

    device = next(lm.model.parameters()).device
    start = time.perf_counter()
    scored: dict[int, tuple[float, torch.Tensor, torch.Tensor, int]] = {}  # window -> its NLL, error sums, bits
    # under torchrun each rank scores its share of the windows (`kvcalib.parallel`)
    with torch.no_grad(), intercept(lm.model, attend):
        mine = share(list(range(len(windows))), rank, size)
        bar = tqdm(total=len(mine), unit="window", position=rank,
                   desc=f"eval {method}" + ("" if size == 1 else f", rank {rank} of {size}"))
        for w in mine:
            err_sq.zero_()
            ref_sq.zero_()
            stored_bits = 0
            ids = windows[w].unsqueeze(0).to(device)
            logits = lm.model(ids, use_cache=False).logits.float()
            targets = ids[0, 1:].to(logits.device)  # spread over GPUs (--device-map auto), the logits are on the last
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], targets, reduction="sum").item()
            scored[w] = (nll, err_sq.clone(), ref_sq.clone(), stored_bits)
            tokens_per_second(bar, seq_len)
            bar.update(1)
        bar.close()
    scored = merged(scored, size)
    # summed in window order whichever rank scored each: the same sums, in the same order, as one process
    nll, count, stored_bits = 0.0, 0, 0
    err_sq.zero_()
    ref_sq.zero_()
    for w in range(len(windows)):
        nll += scored[w][0]
        err_sq += scored[w][1]
        ref_sq += scored[w][2]
        stored_bits += scored[w][3]
        count += seq_len - 1
    elements = num_samples * shape.num_layers * 2 * shape.num_kv_heads * seq_len * shape.head_dim
    constant = cache.constant_bits()
    kept = cache.float16_layers or {}  # sliding layers kept as the model computes them, counted in `stored_bits`
    result = EvalResult(
        method=method,
        settings=settings_of(cache)
        | ({"residual_mode": "sliding"} if cache.window else {}),
        perplexity=math.exp(nll / count),
        effective_bits=(stored_bits + constant) / elements,
        tokens=count,
        per_layer_attention_rel_error=(err_sq / ref_sq.clamp_min(1e-30)).sqrt().tolist(),
        model=lm.spec,
        dataset=dataset,
        num_samples=num_samples,
        seq_len=seq_len,
        seconds=time.perf_counter() - start,
        bits_breakdown={"cache_bits_per_element": stored_bits / elements, "shared_bits_per_element": constant / elements,
                        "float16_layers": len(kept), **decode_bits(stored_bits, elements, seq_len, cache.block,
                                                                   constant / elements, cache.window,
                                                                   list(kept.values()), shape.num_layers)},
    )
    if json_path is not None:
        on_rank0(lambda: write_json(json_path, result.to_json()), rank, size)
    return result
