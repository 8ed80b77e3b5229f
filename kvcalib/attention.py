"""Reference attention math, and interception of a transformers model's attention.

`intercept(model, handler)` routes every attention call of a transformers decoder through
`handler(layer, q, k, v, opts)`. transformers calls the registered attention function after RoPE and
any q/k norm and before the keys are repeated for GQA, so `k` and `v` are exactly what the KV cache
holds: q (B, Hq, Tq, d), k and v (B, Hkv, Tk, d). This works for every model whose attention goes
through `ALL_ATTENTION_FUNCTIONS` (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3 and most others).

Inputs are unpadded windows, so the mask is built here (causal, plus a sliding window when the
layer has one) instead of read from the model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .errors import SettingsError
from .quant import FLOAT16_MAX

IMPLEMENTATION = "kvcalib"
_HANDLER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("kvcalib_attention", default=None)
_QUERY_CHUNK = 512


@dataclass(frozen=True)
class AttentionOptions:
    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None

    @classmethod
    def of_call(cls, query: torch.Tensor, scaling: float | None, kwargs: dict) -> "AttentionOptions":
        """The options of one call of a transformers attention function."""
        return cls(scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
                   softcap=kwargs.get("softcap"), sliding_window=kwargs.get("sliding_window"))


def _dispatch(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    handler = _HANDLER.get()
    if handler is None:
        raise RuntimeError("kvcalib attention called outside kvcalib.attention.intercept()")
    if kwargs.get("s_aux") is not None:
        raise SettingsError("models with attention sinks (s_aux) are not supported yet")
    out = handler(module.layer_idx, query, key, value, AttentionOptions.of_call(query, scaling, kwargs))
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _dispatch)


@contextlib.contextmanager
def intercept(model, handler: Callable) -> Iterator[None]:
    """Run `model` with every attention call going through `handler`."""
    _register()
    previous = model.config._attn_implementation
    token = _HANDLER.set(handler)
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _HANDLER.reset(token)


def flushed_length(n, block: int, window: int = 0):
    """Tokens in compressed storage when the cache holds n (an int or a tensor of counts). The one flush
    rule: eval, the decoder's cache and `hold` call it. Tokens are flushed in whole blocks, counted from
    the first token, as soon as a block is complete and at least `window` newer tokens follow it:
    floor(max(n - window, 0) / block) * block are compressed, the newest window..window+block-1 wait in
    float16. Blockwise residual (window 0): a block is flushed as soon as it fills, 0..block-1 wait.
    Sliding residual (`--residual-mode sliding`, window R): the newest R tokens are always float16."""
    m = n - window
    m = m.clamp(min=0) if isinstance(m, torch.Tensor) else max(m, 0)
    return m // block * block


def flushed_counts(num_queries: int, num_keys: int, block: int, device=None, window: int = 0) -> torch.Tensor:
    """How many tokens sit in compressed storage when each query attends (`flushed_length`).

    Query i is token num_keys - num_queries + i, so the cache holds n = that + 1 tokens when it attends.
    """
    return flushed_length(torch.arange(num_keys - num_queries + 1, num_keys + 1, device=device), block, window)


BFLOAT16_BELOW_FLOAT16_MAX = 65280.0  # bfloat16's largest number float16 holds (65504 rounds to 65536 there)


def as_float16(x: torch.Tensor) -> torch.Tensor:
    """Keys or values as a cache holds them in float16: a bfloat16 or float32 number past float16's range held at its
    edge (+-65504; +-65280 from bfloat16), where a plain cast gives inf (and one inf key or value makes its row's
    scores or outputs NaN); float16 as it is. Every number in range is the plain cast's."""
    if x.dtype == torch.float16:
        return x
    limit = BFLOAT16_BELOW_FLOAT16_MAX if x.dtype == torch.bfloat16 else FLOAT16_MAX
    return x.clamp(-limit, limit).half()


def held_in_float16(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a float16 cache holds them (`as_float16`), back in their own dtype: what a prompt attends
    over and what eval's and the plan's caches compute from."""
    return as_float16(k).to(k.dtype), as_float16(v).to(v.dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The precision attention is computed in: float32, or float64 for float64 inputs (which the tests
    use to check the cache's logic free of float32 round-off)."""
    return torch.promote_types(x.dtype, torch.float32)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh, on the CPU through float64 for float32: torch's float32 tanh there now and then returned a whole row
    about 2e-4 off (relative) for the same input, seen in 4 of 30 runs of tests/test_attention.py (two calls in one
    process differed; softmax and matmul did not); the float64 tanh rounds to float32 within an ulp."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.tanh(x.double()).float()
    return torch.tanh(x)


def mixed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions,
                    k_held: torch.Tensor | None = None, v_held: torch.Tensor | None = None,
                    flushed: torch.Tensor | None = None, return_lse: bool = False,
                    key_start: torch.Tensor | None = None):
    """Causal attention where key j is read from `k_held`/`v_held` when j < flushed[i], else from k/v.

    q (B, Hq, Tq, d); k, v, k_held, v_held (B, Hkv, Tk, d); flushed (Tq,). Query i sits at absolute
    position Tk - Tq + i. Computed in `compute_dtype(q)` in chunks of queries; returns (B, Hq, Tq, d).
    With k_held None this is plain causal attention. With `return_lse` it also returns the
    log-sum-exp of each query's scores (B, Hq, Tq), so a caller can add terms to the unnormalized
    sums (KVLinC's correction). `key_start` (B,): row b's keys before it are padding, never attended (a
    batch of sequences of different lengths, each right-aligned).
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    dt = compute_dtype(q)
    qf = q.to(dt).reshape(b, hkv, g, tq, d)
    kf, vf = k.to(dt).unsqueeze(2), v.to(dt).unsqueeze(2)
    if k_held is not None:
        kh, vh = k_held.to(dt).unsqueeze(2), v_held.to(dt).unsqueeze(2)
    j = torch.arange(tk, device=q.device)
    out = torch.empty(b, hkv, g, tq, v.shape[-1], device=q.device, dtype=dt)
    lse = torch.empty(b, hkv, g, tq, device=q.device, dtype=dt) if return_lse else None
    for start in range(0, tq, _QUERY_CHUNK):
        stop = min(start + _QUERY_CHUNK, tq)
        pos = torch.arange(tk - tq + start, tk - tq + stop, device=q.device)
        qc = qf[..., start:stop, :]
        s = qc @ kf.transpose(-1, -2)
        if k_held is not None:
            held = j[None, :] < flushed[start:stop, None]
            if k_held is not k:  # the held keys are the keys themselves (only the values held): the same scores
                s = torch.where(held, qc @ kh.transpose(-1, -2), s)
        s = s * opts.scaling
        if opts.softcap:
            s = opts.softcap * _tanh(s / opts.softcap)
        visible = j[None, :] <= pos[:, None]
        if opts.sliding_window:
            visible &= j[None, :] > pos[:, None] - opts.sliding_window
        if key_start is not None:
            visible = visible & (j >= key_start.to(q.device).view(b, 1, 1, 1, 1))
        s = s.masked_fill(~visible, float("-inf"))
        if return_lse:
            lse[..., start:stop] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        if k_held is None:
            out[..., start:stop, :] = p @ vf
        else:
            out[..., start:stop, :] = (p * held) @ vh + (p * ~held) @ vf
    out = out.reshape(b, hq, tq, -1)
    return (out, lse.reshape(b, hq, tq)) if return_lse else out


def capped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores as Gemma 2's eager attention computes it (there in the model's dtype, here
    scores, cap and softmax in float32): queries (B, Hq, Tq, D) over keys and values (B, H, Tk, D) (Hq a multiple
    of H, grouped), s = q.k scale, softcap tanh(s / softcap), the positions `mask` (broadcast to (B, Hq, Tq, Tk),
    True where attended) kept; the output in the values' dtype."""
    b, hq, tq, d = query.shape
    h = key.shape[1]
    q = query.float().reshape(b, h, hq // h, tq, d)
    s = torch.matmul(q, key.float().unsqueeze(2).transpose(-1, -2)) * scale  # (B, H, G, Tq, Tk)
    s = softcap * torch.tanh(s / softcap)
    mask = mask.expand(b, hq, tq, key.shape[2]).reshape(b, h, hq // h, tq, key.shape[2])
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).to(value.dtype)
    return torch.matmul(p, value.unsqueeze(2)).reshape(b, hq, tq, -1)
