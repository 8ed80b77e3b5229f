"""A transformers Cache that holds the KV cache compressed by a kvcalib method.

    cache = KvcalibCache.from_artifacts("artifacts/smollm2-135m/oscar", model)   # or KvcalibCache(model, "kivi")
    model.generate(**inputs, past_key_values=cache)

Per layer, tokens arrive in float16; as soon as a block of them may be flushed (R of them waiting, or with
`--residual-mode sliding` a key group older than the newest R), they are compressed (`method.compress`)
and kept packed, exactly the flush rule `kvcalib eval` scores (`kvcalib.attention.flushed_length`). The
model's attention runs through the registered attention function `kvcalib_runtime`:
- a padded batch (an `attention_mask` with zeros, e.g. transformers' left-padded batch generation)
  keeps each sequence in a row of its own holding only its real tokens: its blocks flush at its own
  lengths, padding is never attended, stored nor counted, and each sequence decodes as it would alone
  (the mask reaches the cache through a forward pre-hook on the model). A decode step of such a batch is
  one call for every row: on the torch reference path each row's cache right-aligned over the longest, its
  padding masked (`_decode_rows`: exactly as alone); on a fused kernel's path, once every row holds flushed
  blocks (VecInfer's without float16 sinks), one launch over the rows' layouts side by side, each row's own
  counts read on the device (`_RowsSideBySide`: the kernel splits a row's tokens by the batch, and each split
  rounds its softmax weights to float16, so a row's output may differ from its lone launch by 2^-10 of its
  values' largest magnitude plus the two outputs' float16 roundings);
- a prompt into an empty cache attends in full precision, then is compressed;
- later tokens attend over the cache as held. The runtime asks the method what it is, never which
  class it is, and names no kernel family: each format of `kvcalib.formats.registry` (`kvcalib.formats.base.Format`)
  reads the method's declaration of its blocks, and on CUDA the first whose kernel reads them holds the layer's
  flushed blocks and launches (`kernel_format`: INT2 for kivi, kvlinc, oscar at 2 bits, VecInfer, then the codebook
  kernel for turboquant, kivi and oscar at other widths, a plan); elsewhere the torch reference (`Method.decode` over
  the dequantized blocks and the float16 residual) runs.
`from_artifacts` checks the artifact against the model (fingerprint, method) before anything runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from ..attention import (AttentionOptions, as_float16, compute_dtype, flushed_length, held_in_float16,
                         mixed_attention)
from ..errors import SettingsError
from ..formats.base import Format
from ..formats.registry import FORMATS
from ..formats.waves import MAX_GQA
from ..methods import Method, MethodSettings, build_method, keep_sinks, settle_float16_layers
from ..models import LoadedModel, attention_shape, sliding_windows

log = logging.getLogger(__name__)
IMPLEMENTATION = "kvcalib_runtime"
# The same attention for a model whose sliding layers are kept as it computes them: transformers makes the masks of
# SDPA for it (each sliding layer's window and the batch's padding, which `_model_attention` hands to SDPA). Compressed
# layers never read a mask; a model without such layers runs without any (none is made for a long prompt).
IMPLEMENTATION_MASKED = "kvcalib_runtime_masked"
# The layer a cache update hands to the attention call that follows it, per thread. A threading.local
# rather than a ContextVar: torch.compile traces its attributes (a ContextVar's set breaks the graph).
_CURRENT = threading.local()


class CompressedLayer(CacheLayerMixin):
    """One layer: compressed blocks (and, for the torch reference path, their dequantized float32
    form), the float16 residual, and the method's decoding state (KVLinC's S and P)."""

    is_sliding = False

    def __init__(self, method: Method, layer: int, use_fused: bool = True, padding: "_Padding | None" = None,
                 gqa: int = 1, softcap: float | None = None):
        """`gqa` and `softcap` (the model's query heads a KV head, its cap on the scores) pick the kernel's format
        as the decode step will call it (`kernel_format`)."""
        super().__init__()
        self.method, self.layer, self.use_fused = method, layer, use_fused
        self.gqa, self.softcap = gqa, softcap
        self.padding = padding if padding is not None else _Padding()
        self.rows: list[CompressedLayer] | None = None  # a padded batch: one B=1 layer per sequence
        self.side_by_side: _RowsSideBySide | None = None  # the rows' kernel layouts for one launch
        self.new_valid: torch.Tensor | None = None  # (B, T) which of the newest positions are real tokens (host)
        self.one_each = False  # the newest positions are one real token in every row
        self.rows_before: list[int] = []
        self.packed_bits = 0
        self.k_blocks: list[torch.Tensor] = []
        self.v_blocks: list[torch.Tensor] = []
        self.k_res: torch.Tensor | None = None
        self.v_res: torch.Tensor | None = None
        self.state: Any = None
        self.length = 0
        self.format: Format | None = None  # the format whose kernel reads the flushed blocks (CUDA only) ...
        self.layout: Any = None  # ... and its layout of them
        self.declaration: Any = None  # the method's declaration in that format, on the layer's device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.k_res = key_states.new_zeros(b, h, 0, d, dtype=torch.float16)
        self.v_res = value_states.new_zeros(b, h, 0, value_states.shape[-1], dtype=torch.float16)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self.length
        t = key_states.shape[-2]
        valid = self.padding.new_valid(t)  # on the host: one copy per forward, not a sync per layer
        if self.rows is None and valid is not None and not bool(valid.all()):
            if before:
                raise SettingsError("padding after the prompt is not supported: pad prompts, then append real tokens")
            self.rows = [CompressedLayer(self.method, self.layer, self.use_fused, gqa=self.gqa, softcap=self.softcap)
                         for _ in range(key_states.shape[0])]
        if self.rows is not None:
            self.new_valid = valid if valid is not None else torch.ones(key_states.shape[0], t, dtype=torch.bool)
            self.one_each = t == 1 and bool(self.new_valid.all())  # a decode step: one real token in every row
            self.rows_before = [row.length for row in self.rows]
            for b, row in enumerate(self.rows):
                if self.one_each:  # a decode step: the row's one token as it is (no index built and copied over)
                    row.append(key_states[b : b + 1], value_states[b : b + 1])
                    continue
                idx = self.new_valid[b].nonzero().squeeze(1).to(key_states.device)
                if len(idx):
                    row.append(key_states[b : b + 1, :, idx], value_states[b : b + 1, :, idx])
            self.length += t
        else:
            self.append(key_states, value_states)
        hand_to_attention(self, before)
        return key_states, value_states

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Hold these tokens: into the float16 residual, then every block that fills is compressed."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k_res = torch.cat([self.k_res, as_float16(key_states)], dim=-2)
        self.v_res = torch.cat([self.v_res, as_float16(value_states)], dim=-2)
        self.length += key_states.shape[-2]
        flush = flushed_length(self.k_res.shape[-2], self.method.block, self.method.window)  # it starts on a block boundary
        if flush:  # every full block at once: blocks are compressed independently of each other
            k16, v16 = self.k_res[..., :flush, :], self.v_res[..., :flush, :]
            packed = self.method.compress(self.layer, k16.float(), v16.float())
            kd, vd = self.method.decompress(self.layer, packed)
            start = self.length - self.k_res.shape[-2]  # the block's first position
            sinks = min(max(self.method.sink - start, 0), flush)  # its tokens kept in float16 (`keep_sinks`)
            kd, vd, sink_bits = keep_sinks(self.method, start, k16, v16, kd, vd)
            self.state = self.method.flush_state(self.layer, self.state, k16, kd, vd)
            self.packed_bits += self.method.stored_bits(packed) + sink_bits
            # clone, not a view: a view (even an empty one) would keep the whole pre-flush buffer alive
            self.k_res = self.k_res[..., flush:, :].clone()
            self.v_res = self.v_res[..., flush:, :].clone()
            if self.format is None and self.use_fused:
                self.format, declaration = kernel_format(self.method, self.layer, k16.shape[-1], k16.device, self.gqa,
                                                         self.softcap)
                self.declaration = None if self.format is None else self.format.on(declaration, k16.device)
            if self.format is not None:
                self.layout = self.format.append(self.layout, self.method, self.layer, self.declaration, packed,
                                                 k16[..., :sinks, :], v16[..., :sinks, :], self.k_res, self.v_res)
            else:  # the reference path reads the blocks dequantized, in float32 as the method defines them
                self.k_blocks.append(kd)
                self.v_blocks.append(vd)
        if self.layout is not None:  # the kernels read the residual as it came in (model's basis)
            self.layout.kres, self.layout.vres, self.layout.residual = self.k_res, self.v_res, self.k_res.shape[2]

    def held(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token as held: flushed blocks dequantized, then the float16 residual."""
        if self.layout is not None:  # rare on the fused path: several new positions onto a filled cache
            k, v = self.format.flushed_kv(self.layout)
            self.k_blocks, self.v_blocks = [k], [v]
        return (torch.cat([*(b.to(dtype) for b in self.k_blocks), self.k_res.to(dtype)], dim=-2),
                torch.cat([*(b.to(dtype) for b in self.v_blocks), self.v_res.to(dtype)], dim=-2))

    def get_seq_length(self, *args) -> int:
        return self.length

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.length + (query_length if isinstance(query_length, int) else query_length.shape[0]), 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.method, self.layer, self.use_fused, self.padding)

    def stored_bits(self) -> int:
        """Bits the cache holds now: packed blocks (method's count) plus the float16 residual."""
        if self.rows is not None:
            return sum(row.stored_bits() for row in self.rows)
        res = 16 * (self.k_res.numel() + self.v_res.numel()) if self.is_initialized else 0
        return self.packed_bits + res


class Float16WindowLayer(DynamicSlidingWindowLayer):
    """A sliding layer the method keeps as the model computes it (`Method.float16_layers`): transformers' own window
    layer (its last window - 1 tokens, in the model's dtype); the attention call that follows its update runs the
    model's own attention over it with transformers' mask (`_model_attention`)."""

    def __init__(self, layer: int, window: int):
        super().__init__(sliding_window=window)
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        hand_to_attention(self, None)
        return out

    def stored_bits(self) -> int:
        return 16 * (self.keys.numel() + self.values.numel()) if self.is_initialized else 0


class KvcalibCache(Cache):
    def __init__(self, model, method: str | Method = "kivi", settings: MethodSettings = MethodSettings(),
                 artifacts: str | None = None, fused: bool = True):
        """`fused=False` keeps the torch reference path on CUDA too (for comparisons). A model's sliding layers keep
        their window as it computes them unless the method says otherwise (`Method.float16_layers`)."""
        lm = model if isinstance(model, LoadedModel) else LoadedModel(model=model, tokenizer=None, spec="")
        shape = attention_shape(lm.config)
        self.method = build_method(method, shape, settings, artifacts, lm) if isinstance(method, str) else method
        settle_float16_layers(self.method, lm.config)
        self.method = for_this_rank(lm.model, self.method, shape)
        self.padding = _Padding()
        kept = self.method.float16_layers or {}
        gqa, cap = shape.num_heads // shape.num_kv_heads, model_softcap(lm.config)
        super().__init__(layers=[Float16WindowLayer(i, kept[i]) if i in kept else
                                 CompressedLayer(self.method, i, fused, self.padding, gqa, cap)
                                 for i in range(shape.num_layers)])
        device = next(lm.model.parameters()).device
        if device.type == "cuda":
            log.warning(where_layers_run(self.method, shape, device, fused, lm.config))
        register_attention()
        _watch_padding(lm.model)
        lm.model.set_attn_implementation(IMPLEMENTATION_MASKED if kept else IMPLEMENTATION)

    @classmethod
    def from_artifacts(cls, path: str, model) -> "KvcalibCache":
        """The cache an artifact describes, validated against `model` (fingerprint and method)."""
        from ..artifacts import load_artifact

        artifact = load_artifact(path, model=getattr(model, "model", model))  # format, checksums, fingerprint
        return cls(model, artifact.method, artifacts=path)

    def stored_bits(self) -> int:
        return sum(layer.stored_bits() for layer in self.layers)


def where_layers_run(method: Method, shape, device: torch.device, fused: bool = True, config=None) -> str:
    """One line: which of the method's layers a decode step reads through a fused kernel, which through the
    torch reference, and the faster cache where the static one can hold the method."""
    gqa, cap = shape.num_heads // shape.num_kv_heads, model_softcap(config)
    kept = method.float16_layers or {}
    kernel = [(kernel_format(method, i, shape.head_dim, device, gqa, cap)[0] if fused else None)
              for i in range(shape.num_layers) if i not in kept]
    kernel = ["torch" if f is None else f.name for f in kernel]
    where = ", ".join(f"{kernel.count(k)} layers on the {k if k == 'torch' else 'fused ' + k} path"
                      for k in dict.fromkeys(kernel))
    if kept:
        where += f", {len(kept)} sliding layers kept as the model computes them (their window only)"
    line = f"KvcalibCache({method.name}): {where}, decoded eagerly"
    try:
        check_static(method, shape.head_dim, device, gqa, shape.num_layers, config)
    except SettingsError as why:
        return f"{line} ({why})"
    return (f"{line}; StaticKvcalibCache(model, method, max_batch=B, max_length=N) in model.generate replays each "
            "step from one CUDA graph, several times faster")


def tensor_parallel_size(model) -> int:
    """Ranks the model's attention heads are split over (transformers' `tp_plan="auto"` under torchrun), 1 if none."""
    return int(getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1)


def tensor_parallel_rank(model) -> int:
    """This process's place among the ranks the model's heads are split over: its coordinate on the model's
    "tp" mesh dimension where transformers keeps one, else its rank in the default group (`tp_plan="auto"`
    under torchrun splits over every process)."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return int(mesh["tp"].get_local_rank())
    import torch.distributed as dist

    return dist.get_rank() % tensor_parallel_size(model) if dist.is_available() and dist.is_initialized() else 0


def for_this_rank(model, method: Method, shape) -> Method:
    """The method as this tensor-parallel rank holds it. Each rank's attention holds its own KV heads (transformers
    splits the key and value projections into equal contiguous parts), and so does its `KvcalibCache`, which takes
    its shapes from the keys it is given: a method with data per KV head (`Method.per_kv_head`) gives the rank its
    own heads' part (`Method.for_kv_heads`); any other serves as it is."""
    size = tensor_parallel_size(model)
    if size == 1 or not method.per_kv_head:
        return method
    if shape.num_kv_heads % size:
        raise SettingsError(f"tensor parallelism over {size} ranks splits {shape.num_kv_heads} KV heads unevenly: "
                            f"--method {method.name} holds data per KV head; use a rank count dividing them")
    per = shape.num_kv_heads // size
    rank = tensor_parallel_rank(model)
    return method.for_kv_heads(rank * per, (rank + 1) * per)


def kernel_format(method: Method, layer: int, head_dim: int, device: torch.device,
                  gqa: int = 1, softcap: float | None = None) -> tuple[Format | None, Any]:
    """The format whose kernel reads the layer's flushed blocks, the first of `FORMATS` whose `supports` holds the
    method's declaration (and, for a model that soft-caps its scores, `softcap`, the cap), and that declaration;
    (None, None): none does (the torch reference runs)."""
    opts = AttentionOptions(scaling=1.0, softcap=softcap) if softcap else None
    for fmt in FORMATS:
        declaration = fmt.declaration(method, layer)
        if fmt.supports(declaration, head_dim, device, gqa, opts):
            return fmt, declaration
    return None, None


def model_softcap(config) -> float | None:
    """The cap a model puts on its attention scores (Gemma 2's `attn_logit_softcapping`), None where it puts none."""
    config = getattr(config, "text_config", None) or config
    return getattr(config, "attn_logit_softcapping", None) or None


def attention_refusal(config, kept: dict[int, int] | None = None) -> str | None:
    """Why a model's attention is not what the static cache computes, from its config (transformers hands the
    options to each attention call; the static cache is chosen before any call): the fused kernels' plain softmax
    over every cached token in each compressed layer, and a sliding layer's window only where the method keeps it
    uncompressed (`kept`, `Method.float16_layers`: a ring of its last tokens). Refused: sliding layers the method
    compresses (--sliding-layers compress), or no compressed layer at all; None where the static cache computes the
    model's attention. Soft-capped scores (Gemma 2) are the kernels' to refuse (`check_static`)."""
    if config is None:
        return None
    config = getattr(config, "text_config", None) or config
    sliding = sliding_windows(config)
    if set(sliding) - set(kept or {}):
        return ("the method compresses layers that slide over a window (--sliding-layers compress), whose window "
                "the fused kernels do not apply; KvcalibCache serves them")
    if sliding and len(sliding) == config.num_hidden_layers:
        return "every layer of the model slides over a window and is kept uncompressed: there is nothing to compress"
    return None


def check_static(method: Method, head_dim: int, device: torch.device, gqa: int, layers: int = 1,
                 config=None) -> None:
    """Refuse, with the reason, a method, device or model (`config`: its attention, `attention_refusal`) the static
    cache cannot serve (`kvcalib.runtime.static_cache`'s docstring): every one of its `layers` must have one fused
    kernel, the same for all."""
    settle_float16_layers(method, config)  # a sliding layer kept uncompressed is held as it comes, no kernel's
    kept = method.float16_layers or {}
    cap = model_softcap(config)
    found = {kernel_format(method, i, head_dim, device, gqa, cap)[0] for i in range(layers) if i not in kept}
    fmt = found.pop() if len(found) == 1 else None
    dims = sorted({d for f in FORMATS for d in f.head_dims})  # the head_dims some fused kernel reads
    why = None
    if device.type != "cuda":
        why = "it runs on CUDA only (the fused kernel reads the counts on the device)"
    elif (refusal := attention_refusal(config, kept)) is not None:
        why = refusal
    elif fmt is None and cap and {kernel_format(method, i, head_dim, device, gqa)[0] for i in range(layers)
                                  if i not in kept} - {None}:
        why = (f"the model soft-caps its attention scores, which of the fused kernels only the codebook layout's "
               f"applies, and it does not read --method {method.name}'s blocks at these settings")
    elif fmt is None and head_dim not in dims:
        why = f"its head_dim {head_dim} is not one a fused kernel reads ({', '.join(map(str, dims))})"
    elif fmt is None and gqa > MAX_GQA:
        why = f"its {gqa} query heads per KV head are more than a fused kernel reads ({MAX_GQA})"
    elif fmt is None:
        why = (f"--method {method.name} has no fused layout at these settings, or not the same in every layer "
               f"({', '.join(f.name for f in FORMATS)}: `formats.*.launch.supports`)")
    elif method.window:
        why = "it flushes blockwise"
    elif method.sink and not fmt.holds_sinks:
        why = (f"float16 sink tokens are held by the {' and '.join(f.name for f in FORMATS if f.holds_sinks)} "
               "layout only")
    elif not fmt.holds_state and method.empty_state(0, 1, 1, head_dim) is not None:
        why = f"--method {method.name} keeps a decoding state, which the {fmt.name} kernel's layout does not hold"
    else:
        first = next(i for i in range(layers) if i not in kept)  # a compressed layer (the refusal above: one is)
        why = fmt.static_refusal(method, fmt.declaration(method, first))
    if why:
        raise SettingsError(f"a static cache cannot hold this: {why}")


def hand_to_attention(layer, arg) -> None:
    """Tell the attention call that follows a cache update which layer object it attends over, and
    its argument (`before` for a CompressedLayer, `prefill` for a static layer)."""
    _CURRENT.layer = (layer, arg)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The model's attention while a KvcalibCache is in use; plain exact attention otherwise."""
    opts = AttentionOptions.of_call(query, scaling, kwargs)
    current = getattr(_CURRENT, "layer", None)
    if current is None or current[0].layer != module.layer_idx:
        out = mixed_attention(query, key, value, opts)  # no compressed cache: exact attention
    else:
        layer, before = current
        _CURRENT.layer = None
        if isinstance(layer, Float16WindowLayer):  # kept as the model computes it: its own attention and masks
            return _model_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        if hasattr(layer, "attend"):  # a static cache's layer (kvcalib.runtime.static_cache) attends itself
            out = layer.attend(query, key, value, opts, before)
        elif layer.rows is None:
            out = _attend(layer, before, query, key, value, opts)
        elif _decodes_together(layer, query, opts):
            out = _decode_rows(layer, query, opts)
        elif (out := _fused_rows(layer, query, opts)) is not None:
            pass
        else:  # a padded batch: each sequence over its own real tokens; padded positions output zeros
            out = query.new_zeros(*query.shape[:-1], value.shape[-1], dtype=compute_dtype(query))
            for b, row in enumerate(layer.rows):
                idx = layer.new_valid[b].nonzero().squeeze(1).to(query.device)
                if len(idx):
                    one = slice(b, b + 1)
                    out[one, :, idx] = _attend(row, layer.rows_before[b], query[one, :, idx], key[one, :, idx],
                                               value[one, :, idx], opts).to(out.dtype)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _model_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """A layer kept as the model computes it: transformers' SDPA attention with the mask transformers made for the
    layer (its window, the batch's padding), or where the model soft-caps its scores, which SDPA does not, the eager
    attention of the model's own modeling file, given the causal mask where transformers made none."""
    if kwargs.get("softcap") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    import sys

    if attention_mask is None and query.shape[2] > 1:
        # transformers makes no mask where SDPA's `is_causal` would do (a lone prompt within the window); the eager
        # attention adds only the mask it is given, so the causal one is made here
        tq, tk = query.shape[2], key.shape[2]
        at = torch.arange(tk, device=query.device)
        attention_mask = (at <= at[tk - tq:, None])[None, None]  # (1, 1, Tq, Tk), as transformers shapes its masks
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # SDPA's mask; eager adds its mask
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _decodes_together(layer: CompressedLayer, query: torch.Tensor, opts: AttentionOptions) -> bool:
    """Whether a padded batch's decode step goes through the torch reference in one call for every row: one
    new real token in each row over a cache it already holds, every row on the reference path (no fused
    layout) and without a decoding state (KVLinC's S and P are a row's own), no sliding window."""
    return (_decode_step(layer) and not opts.sliding_window
            and all(row.layout is None and row.state is None for row in layer.rows))


def _decode_step(layer: CompressedLayer) -> bool:
    """Whether a padded batch's newest positions are a decode step: one new real token in each row, over a
    cache every row already holds."""
    return layer.one_each and all(before > 0 for before in layer.rows_before)


def _decode_rows(layer: CompressedLayer, query: torch.Tensor, opts: AttentionOptions) -> torch.Tensor:
    """One `Method.decode` for every row of a padded batch: each row's cache as held, right-aligned over the
    longest, its first `key_start` keys padding that no query attends."""
    held = [row.held(compute_dtype(query)) for row in layer.rows]
    lengths = [k.shape[-2] for k, _ in held]
    width = max(lengths)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))  # noqa: E731
    keys = torch.cat([pad(k) for k, _ in held])
    values = torch.cat([pad(v) for _, v in held])
    key_start = torch.tensor([width - n for n in lengths], device=query.device)
    return layer.method.decode(layer.layer, query, keys, values, opts, None, key_start=key_start)


class _RowsSideBySide:
    """A padded batch's rows' kernel layouts (one format's, B=1 each) as one layout of B rows, so that a decode step
    is one launch with each row's flushed and residual counts read on the device, as a static cache's slots are
    (`Format.attend(counts=)`).

    The flushed buffers are stacked once, padded to the largest capacity, and each row's own buffers become
    views of its row of the stack: a row's later flushes write into the stack in place (`formats.rows.grow`
    writes within capacity), so the stack is made again only when a row outgrows it (its buffers then are new
    tensors: a doubling, a few times over a sequence). The float16 residuals, which each append replaces, are
    copied side by side at every step (at most a block of tokens a row); the decoding states (KVLinC's S and
    P), which change at flushes only, are stacked again when a row's state is a new object."""

    def __init__(self):
        self.layout: Any = None
        self.held: list[tuple[torch.Tensor | None, ...]] = []  # each row's buffers as views of the stack
        self.states: tuple[list[Any], Any] = ([], None)  # the rows' states and their stack

    def layout_for(self, fmt: Format, parts: list[Any], residuals: list[tuple[torch.Tensor, torch.Tensor]],
                   counts: "_Counts") -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
        """The stacked layout, its `length` and `residual` the launch's sizes (the longest row's flushed tokens,
        the residual buffer's rows), and the counts (flushed, residual) int32 (B,) on the device."""
        slots = [fmt.slots(p) for p in parts]
        now = [tuple(getattr(o, n) for o, n in s) for s in slots]
        if self.layout is None or any(x is not y for a, b in zip(now, self.held) for x, y in zip(a, b)):
            self.layout = fmt.copy(parts[0])
            for i, (holder, n) in enumerate(fmt.slots(self.layout)):
                like = now[0][i]
                if like is None:  # e.g. no key norms (KIVI)
                    continue
                cap = max(row[i].shape[2] for row in now)
                out = like.new_zeros(len(parts), like.shape[1], cap, *like.shape[3:])
                for b, (row, s) in enumerate(zip(now, slots)):
                    out[b : b + 1, :, : row[i].shape[2]] = row[i]
                    setattr(*s[i], out[b : b + 1])  # the row now writes into the stack
                setattr(holder, n, out)
            self.held = [tuple(getattr(o, n) for o, n in s) for s in slots]
        k0 = residuals[0][0]
        width = max(16, -(-max(k.shape[2] for k, _ in residuals) // 16) * 16)
        kres = k0.new_zeros(len(parts), k0.shape[1], width, k0.shape[3], dtype=torch.float16)
        vres = torch.zeros_like(kres)
        for b, (k, v) in enumerate(residuals):
            kres[b : b + 1, :, : k.shape[2]] = k
            vres[b : b + 1, :, : v.shape[2]] = v
        flushed = [p.length for p in parts]
        self.layout.kres, self.layout.vres, self.layout.residual = kres, vres, width
        self.layout.length = max(flushed)
        return self.layout, counts.on(k0.device, flushed, [k.shape[2] for k, _ in residuals])

    def states_for(self, rows: list[CompressedLayer]) -> Any:
        """The rows' decoding states (dataclasses of tensors, batch first) as one of B rows; None where the method
        keeps none. Every row has flushed here, so each holds a state or none does."""
        states = [row.state for row in rows]
        if states[0] is None:
            return None
        if any(a is not b for a, b in zip(states, self.states[0])) or len(states) != len(self.states[0]):
            first = states[0]
            self.states = (states, type(first)(**{f.name: torch.cat([getattr(s, f.name) for s in states])
                                                  for f in dataclasses.fields(first)}))
        return self.states[1]


class _Counts:
    """The rows' counts on the device for one decode step, copied once for all the layers (they hold the same
    tokens), pinned and without waiting where the device is a GPU."""

    def __init__(self):
        self.last: tuple | None = None

    def on(self, device: torch.device, flushed: list[int], residual: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, tuple(flushed), tuple(residual))
        if self.last is None or self.last[0] != key:
            host = torch.tensor([flushed, residual], dtype=torch.int32)
            both = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
            self.last = (key, (both[0], both[1]))
        return self.last[1]


def _fused_rows(layer: CompressedLayer, query: torch.Tensor, opts: AttentionOptions) -> torch.Tensor | None:
    """A padded batch's decode step in one fused launch (`_RowsSideBySide`) where every row holds flushed
    blocks in one format whose layouts stand side by side (`Format.side_by_side`: VecInfer's without float16 sinks,
    the codebook layout's with the same sinks). None where that does not hold (a row yet without blocks, whose
    attention runs on the torch reference alone): the caller then attends row by row."""
    rows, method = layer.rows, layer.method
    if not _decode_step(layer):
        return None
    hkv, d = rows[0].k_res.shape[1], query.shape[-1]
    gqa = query.shape[1] // hkv
    residuals = [(row.k_res, row.v_res) for row in rows]
    if layer.side_by_side is None:
        layer.side_by_side = _RowsSideBySide()
    fmt = rows[0].format
    if (fmt is None or any(row.format is not fmt or row.layout is None for row in rows)
            or not fmt.supports(rows[0].declaration, d, query.device, gqa, opts)
            or not fmt.side_by_side([row.layout for row in rows], method)
            or (not fmt.holds_state and any(row.state is not None for row in rows))):
        return None
    packed, counts = layer.side_by_side.layout_for(fmt, [row.layout for row in rows], residuals, layer.padding.counts)
    return fmt.attend(method, layer.layer, query, packed, opts.scaling, layer.side_by_side.states_for(rows), counts,
                      softcap=opts.softcap)


def _attend(layer: "CompressedLayer", before: int, query, key, value, opts: AttentionOptions) -> torch.Tensor:
    """Attention of the newest positions of one layer (or one sequence's row) that held `before` tokens."""
    if before == 0:  # a prompt into an empty cache attends in full precision (the float16 it holds)
        k16, v16 = held_in_float16(key, value)
        if not opts.softcap and not opts.sliding_window:  # SDPA's fused kernels: no score matrix in memory
            return torch.nn.functional.scaled_dot_product_attention(
                query, k16, v16, is_causal=True, scale=opts.scaling, enable_gqa=True)
        return mixed_attention(query, k16, v16, opts)
    return decode(layer, query, opts)


class _Padding:
    """The 2D attention mask (B, past + new) of the forward in progress, shared by a cache's layers, with a host
    copy of its newest columns made once per forward, and the padded rows' counts on the device made once per
    decode step (`_Counts`)."""

    def __init__(self):
        self.mask: torch.Tensor | None = None
        self._new: tuple[int, torch.Tensor] | None = None
        self.counts = _Counts()

    def set(self, mask: torch.Tensor | None) -> None:
        self.mask, self._new = mask, None

    def new_valid(self, t: int) -> torch.Tensor | None:
        """(B, t) bool on the host: which of the newest t positions are real tokens; None without a mask."""
        if self.mask is None:
            return None
        if self._new is None or self._new[0] != t:
            self._new = (t, self.mask[:, -t:].to(torch.bool).cpu())
        return self._new[1]


def _watch_padding(model: torch.nn.Module) -> None:
    """Hand each forward's `attention_mask` to the KvcalibCache it runs with (once per model)."""
    base = getattr(model, "base_model", model)
    if getattr(base, "_kvcalib_padding_hook", False):
        return

    def hook(_module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, KvcalibCache):
            mask = kwargs.get("attention_mask")
            cache.padding.set(mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)

    base.register_forward_pre_hook(hook, with_kwargs=True)
    base._kvcalib_padding_hook = True


def decode(layer: CompressedLayer, q: torch.Tensor, opts: AttentionOptions) -> torch.Tensor:
    """Attention of the newest positions over the compressed cache: the layer's format's kernel for one new
    token where it reads the method's blocks (`Format.attend`), otherwise the method's torch reference
    over the dequantized cache."""
    method, fmt = layer.method, layer.format
    gqa = q.shape[1] // layer.k_res.shape[1]
    if (layer.layout is not None and q.shape[-2] == 1
            and fmt.supports(layer.declaration, q.shape[-1], q.device, gqa, opts)):
        return fmt.attend(method, layer.layer, q, layer.layout, opts.scaling, layer.state, softcap=opts.softcap)
    k_held, v_held = layer.held(compute_dtype(q))
    return method.decode(layer.layer, q, k_held, v_held, opts, layer.state)


def register_attention() -> None:
    """Make `kvcalib_runtime` (and `kvcalib_runtime_masked`, with SDPA's masks) attention implementations transformers
    can switch a model to."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionInterface.register(IMPLEMENTATION_MASKED, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION_MASKED, sdpa_mask)
