"""A static-capacity compressed cache: one CUDA graph serves every decode step.

    cache = StaticKvcalibCache(model, "kivi", MethodSettings(group_size=128), max_batch=8, max_length=32768)
    model.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), past_key_values=cache,
                   do_sample=True, top_p=0.9, max_new_tokens=256, streamer=TextStreamer(tokenizer))

Through `model.generate` (greedy or sampling, logits processors, EOS and stopping criteria, streamers:
all of it transformers' own), the cache takes the model's forwards itself (`route_forward`, installed on
the model when the cache is made): the prompt batch goes row by row into slots 0..B-1, each row's real
tokens alone (a left-padded row without its padding, compressed at its own length), and every decode
step replays the step captured in one CUDA graph (`kvcalib.runtime.captured.CapturedDecoder`, captured
at the first step and kept with the cache for the next `generate` call of the same batch). A new
`generate` call starts from empty slots; the cache is sized for the longest prompt plus
`max_new_tokens` (`max_length`) and for the batch (`max_batch`). By default (`compile="regions"`) the
model's decoder layers around their attention, the rotary application and the cache's append are compiled
before the capture (seconds, once: one compiled region serves every layer); `compile="step"` compiles the
whole step (faster steps, minutes of compilation before the first token of a process whose on-disk caches
are cold); `compile="none"` compiles nothing (`kvcalib.runtime.captured`).

The same cache serves kvcalib's own loop, which refills a finished sequence's slot with the next prompt:

    cache.prefill(model, slot, input_ids)        # one sequence into its slot, alone, compressed at once
    decoder = CapturedDecoder(model, cache)      # kvcalib.runtime.captured: the step captured once
    logits = decoder.step(tokens)                # (B,) each slot's newest token -> (B, vocab)

Like transformers' StaticCache, every buffer is allocated once, for `max_batch` sequences of up to
`max_length` tokens. Unlike it, what each sequence holds is counted in device memory: `flushed` (B,)
tokens packed in INT2 blocks (the layout of `kvcalib.formats.int2.layout`, which the fused kernel reads) and
`residual` (B,) float16 tokens waiting, R at most. The kernel reads both counts itself
(`fused_decode(..., counts=...)`), so its launch is the same at every step.

A decode step appends each sequence's new token at its own residual position. A sequence whose
residual is then full is flushed inside the same step, without a branch on the device: a flushing
step compresses every sequence's residual window (or the one slot's, below) with the method's own `compress` and
writes the codes at its `flushed` offset where the window is full, into a slack block past the capacity where it is
not.
Which steps flush the host knows without asking the device: every slot's residual count advances by one
a step (a free slot's too), so `advance` keeps a copy of the counts and sets each layer's `flush` for
the step; a step where no window fills appends only, and a step where one slot's window alone fills (a batch
whose prompts differ in length fills its windows at different steps) compresses that slot's window only
(`append_one`: a flush runs eagerly inside the captured step, and at B = 8 the masked flush of every slot took
twice one slot's). A decoder therefore runs (or captures) three steps, two at B = 1: at B = 1 and R = 128 one
step in 128 pays for compressing the window. Every write is an `index_put_`, which `torch.compile` keeps in
place (a `scatter_` there copies the whole buffer at every step). The flush rule is the blockwise one `kvcalib eval` scores
(`kvcalib.attention.flushed_length`): the stored codes are those `KvcalibCache` stores, bit for bit.

Under transformers' tensor parallelism (`tp_plan="auto"` under torchrun) each rank's cache holds its own KV
heads (transformers splits the key and value projections into equal contiguous parts), and a method with data
per KV head gives the rank its heads' part (`kvcalib.runtime.cache.for_this_rank`); each rank captures its
own step, the collectives of the row-split projections in it. Close the cache (`close`, or a `with` block) before
`torch.distributed.destroy_process_group()`: while a graph holding NCCL collectives lives, the communicator cannot
be destroyed and that call waits forever.

Sequences of different lengths share the batch; a slot is freed (`release`) and refilled (`prefill`)
while the others keep their state. A prompt is prefilled into its slot on its own, attends in float16
(as in `KvcalibCache`) and is compressed at once, so the float16 cache of one prompt exists at a time,
never the whole batch's.

Methods: those whose flushed blocks a fused kernel reads (`Int2Coded.int2_spec`: KIVI, OScaR and KVLinC
at 2 bits with power-of-two key groups of >= 16 tokens; `VQCoded.vq_books`: VecInfer; `CodebookCoded.codebook_groups`:
TurboQuant, KIVI and OScaR at other widths, and a plan, one group of KV heads per pair of schemes, with float16
sink tokens, written beside the codes at a sequence's first flush); others are refused with the reason. A sliding
layer the method keeps uncompressed (`Method.float16_layers`: Gemma 3's, by default) is a ring of each slot's last
`window` tokens in the model's dtype (`StaticWindowLayer`), beside the compressed full-attention layers. What a
method declares of itself is served as `KvcalibCache` serves it (`kvcalib.runtime.cache.decode`):
- a rotated basis (OScaR's keys and values, KVLinC's values): the flushed blocks are stored rotated
  (`PackedLayer.rotated_keys`/`rotated_values`) and the kernel rotates the query for them and their
  partial outputs back; the residual is held as it came in, which is what the flush compresses;
- per-token key norms (OScaR): a norm buffer beside the codes, written by the same masked flush;
- a decoding state (KVLinC's S and P, `Method.empty_state`): allocated once per slot, updated at the
  flush in place where a window filled (`torch.where`), read for the correction terms every step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..attention import AttentionOptions, as_float16, capped_attention, held_in_float16
from ..errors import SettingsError
from ..formats.base import Format
from ..formats.registry import FORMATS
from ..hadamard import hadamard
from ..methods import Method, MethodSettings, build_method, settle_float16_layers
from ..models import LoadedModel, attention_shape, layer_devices
from .cache import (IMPLEMENTATION, check_static, for_this_rank, hand_to_attention, kernel_format, model_softcap,
                    register_attention, tensor_parallel_size)
from . import slots
from .captured import CapturedDecoder, Decoder, compile_mode

log = logging.getLogger(__name__)


def _tensors(state) -> list[torch.Tensor]:
    """A method's decoding state (a dataclass of tensors, `Method.empty_state`) as its tensors; none for None."""
    return [] if state is None else [getattr(state, f.name) for f in dataclasses.fields(state)]


class SlotLayer(CacheLayerMixin):
    """What every layer of a static cache shares: buffers allocated at creation for `batch` slots of `capacity`
    tokens, counts on the device (`mutable`), a prompt taken into one slot (`prefill`, while `prefill_slot` is set)
    and one token for every slot per step (`step`), then the attention call that follows handed this layer
    (`attend`); the model's masks are never read (a prompt attends over itself, a step by its counts)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layer: int, batch: int, capacity: int):
        super().__init__()
        self.layer, self.batch, self.capacity = layer, batch, capacity
        self.is_initialized = True
        self.prefill_slot: int | None = None  # set by StaticKvcalibCache.prefill for the forward it runs
        self.flush = True  # whether a step may fill a window (StaticKvcalibCache.advance): else it appends only
        self.one = False  # whether only one slot's window may fill, the cache's `slot` (StaticKvcalibCache.advance)

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated at creation
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prefill_slot is not None:
            self.prefill(self.prefill_slot, key_states, value_states)
        elif key_states.shape[2] == 1 and key_states.shape[0] == self.batch:
            self.step(key_states, value_states)
        else:
            raise SettingsError("a static cache takes a prompt through `prefill(model, slot, ids)` and then one "
                                f"token for each of its {self.batch} slots per step")
        hand_to_attention(self, self.prefill_slot is not None)
        return key_states, value_states

    def get_seq_length(self, *args) -> int:
        return 0

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        n = query_length if isinstance(query_length, int) else query_length.shape[0]
        return n, 0  # the mask is not read: a prompt attends causally over itself, a step by its counts

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def reset(self) -> None:
        for t in self.mutable():
            t.zero_()


class StaticLayer(SlotLayer):
    """One layer's buffers (its format's layout, sized for the capacity plus one block of slack, where the
    masked flush writes the rows it does not take), its per-sequence counts and decoding state."""

    def __init__(self, method: Method, layer: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 device: torch.device, gqa: int = 1, softcap: float | None = None):
        """`softcap`: the model's cap on its scores (Gemma 2), which the layer's kernel must apply."""
        super().__init__(layer, batch, capacity)
        # the format whose kernel reads the layer (`check_static` has held every layer to one); where none reads these
        # shapes (the host side alone, on the CPU), the first the method declares
        fmt, declaration = kernel_format(method, layer, head_dim, torch.device("cuda"), gqa, softcap)
        if fmt is None:
            fmt, declaration = next(((f, d) for f in FORMATS if (d := f.declaration(method, layer)) is not None),
                                    (None, None))
        if fmt is None:
            raise SettingsError(f"a static cache cannot hold --method {method.name}: it declares no fused layout")
        declaration = fmt.on(declaration, device)
        r = method.block
        self.method = method
        self.format: Format = fmt
        self.layout = fmt.allocate(method, layer, declaration, batch, capacity + r, capacity, r, kv_heads, head_dim,
                                   device)
        self.state = method.empty_state(layer, batch, kv_heads, head_dim, device)
        self.flushed = torch.zeros(batch, dtype=torch.int32, device=device)
        self.residual = torch.zeros(batch, dtype=torch.int32, device=device)
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)  # the slot `append_one` flushes (`step`)
        if method.rotated_keys or method.rotated_values:  # made now, read by a compiled flush as an input
            hadamard(head_dim, torch.float32, self.flushed.device)

    def mutable(self) -> list[torch.Tensor]:
        """What a decode step changes besides the buffers' rows past the counts: the counts and the state
        (a captured decoder's warm-up puts them back)."""
        return [self.flushed, self.residual, *_tensors(self.state)]

    def tokens(self) -> torch.Tensor:
        """(B,) int32: the tokens each slot holds."""
        return self.flushed + self.residual

    def _flush(self, k16: torch.Tensor, v16: torch.Tensor, start):
        """Compress float16 blocks k16, v16 (B, H, T, D), T a multiple of R, as they came in: their packed
        buffers' contents in `_buffers`' order, and the decoding state after them from `start` (None: the
        empty state, a prompt's; the method's own rule, `Method.flush_state`)."""
        m = self.method
        packed = m.compress(self.layer, k16.float(), v16.float())
        parts = self.format.flush_parts(m, packed)
        state = None
        if self.state is not None:
            kd, vd = m.decompress(self.layer, packed)
            state = m.flush_state(self.layer, start, k16, kd, vd)
        return parts, state

    def _buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The packed buffers with the tokens each row along dim 2 stands for, in `_flush`'s order."""
        return self.format.buffers(self.layout)

    def _state_fields(self, state) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this layer's state tensor, the same field of `state`), field by field."""
        return list(zip(_tensors(self.state), _tensors(state)))

    def prefill(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A whole prompt (1, H, T, D) into `slot`: its full blocks packed, the rest in the residual."""
        t, r = k.shape[2], self.layout.residual
        n = t // r * r
        k16, v16 = as_float16(k), as_float16(v)
        for mine in _tensors(self.state):
            mine[slot] = 0
        if n:
            parts, state = self._flush(k16[:, :, :n], v16[:, :, :n], None)
            for (buf, unit), part in zip(self._buffers(), parts):
                buf[slot, :, : n // unit] = part[0]
            if state is not None:
                for mine, new in self._state_fields(state):
                    mine[slot] = new[0]
            if self.format.holds_sinks and self.layout.sinks:  # the first tokens in float16 as well
                s = self.layout.sinks
                self.layout.ksink[slot, :, :s], self.layout.vsink[slot, :, :s] = k16[0, :, :s], v16[0, :, :s]
        self.layout.kres[slot, :, : t - n], self.layout.vres[slot, :, : t - n] = k16[0, :, n:], v16[0, :, n:]
        self.flushed[slot], self.residual[slot] = n, t - n

    def append(self, k: torch.Tensor, v: torch.Tensor, flush: bool = True, slot: torch.Tensor | None = None) -> None:
        """One new token per sequence (B, H, 1, D), then the masked flush of every full residual;
        `flush=False` where the caller knows no residual fills at this step (it appends only). `slot` (1,) int64 on
        the device: the caller knows that this slot's window alone may fill, and only its window is flushed, its rows
        taken out and put back (`append_one`)."""
        r = self.layout.residual
        slots.write_token(self.layout.kres, self.layout.vres, self.residual, k, v)
        if not flush:
            return
        # The flushed rows: every slot's tensors themselves (updated in place), or copies of the one slot's.
        rows = (lambda t: t) if slot is None else (lambda t: t.index_select(0, slot))  # noqa: E731

        def put(held: torch.Tensor, new: torch.Tensor) -> None:  # the flushed rows' new values into the layer's own
            if slot is not None:
                held.index_copy_(0, slot, new)
            elif new is not held:
                held.copy_(new)

        kres, vres = rows(self.layout.kres), rows(self.layout.vres)
        mine = None if self.state is None else dataclasses.replace(
            self.state, **{f.name: rows(getattr(self.state, f.name)) for f in dataclasses.fields(self.state)})
        flushed, residual = rows(self.flushed), rows(self.residual)
        full = residual == r  # the host's word checked on the device: a window not full writes into the slack
        parts, state = self._flush(kres, vres, mine)
        slots.flush_writes([(buf, part, unit) for (buf, unit), part in zip(self._buffers(), parts)], flushed, full,
                           slot)
        if state is not None:
            for (held, old), (_, new) in zip(self._state_fields(mine), self._state_fields(state)):
                put(held, torch.where(full.view(-1, *[1] * (old.dim() - 1)), new, old))
        if self.format.holds_sinks and self.layout.sinks:  # a sequence's first flush holds its sink tokens
            c, first = self.layout, full & (flushed == 0)
            for buf, res in ((c.ksink, kres), (c.vsink, vres)):
                slots.masked_write(buf, res[:, :, : c.sinks], torch.zeros_like(flushed), first, slot)
        # An idle slot (no sequence) keeps counting; at capacity it flushes into the slack block instead of
        # running past the buffers. A live sequence never gets there: the cache refuses it first.
        put(self.flushed, flushed.add_(full.int() * r).clamp_(max=self.capacity))
        put(self.residual, residual.masked_fill_(full, 0))

    def append_one(self, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        """`append` where the caller knows that the window of one slot alone, `slot` (1,) int64 on the device, may
        fill at this step: the masked flush of that slot's window only, the others appending. The same bits as
        `append`'s (rows are compressed independently, and on CUDA with CuPy the rotation gives a row the same bits
        whatever rows come with it: `hadamard.rotate`), for a batch's fraction of its work: a batch whose windows
        fill at different steps (prompts of different lengths) flushes one slot at a time, and the flush runs
        eagerly inside the captured step, where at B = 8 a plan's masked flush of every slot took twice a lone
        slot's time (benchmarks/flush_cost.py, --batch 8 against --batch 1)."""
        self.append(k, v, True, slot)

    def step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.flush and self.one:
            self.append_one(k, v, self.slot)
        else:
            self.append(k, v, self.flush)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, opts: AttentionOptions,
               prefill: bool) -> torch.Tensor:
        """A prompt attends in float16 over itself; a step through the fused kernel, counts on the device; the scores
        soft-capped where the model caps them (Gemma 2)."""
        if opts.sliding_window:  # `check_static` refuses such models before a cache is made
            raise SettingsError("a static cache attends over every token of a compressed layer: this layer slides")
        if prefill:
            k16, v16 = held_in_float16(key, value)
            if opts.softcap:
                return chunked_prefill_attention(query, k16, v16, opts.scaling, softcap=opts.softcap)
            return torch.nn.functional.scaled_dot_product_attention(
                query, k16, v16, is_causal=True, scale=opts.scaling, enable_gqa=True)
        return self.format.attend(self.method, self.layer, query, self.layout, opts.scaling, self.state,
                                  counts=(self.flushed, self.residual), softcap=opts.softcap)


def flush_step(counts: list[int], r: int) -> tuple[bool, int | None]:
    """What a step does, from every slot's residual count after its append (`StaticKvcalibCache.advance`): whether a
    window fills (the flush), and the slot whose window alone fills where one does in a batch of several (a masked
    flush of that slot only, `StaticLayer.append_one`; None: every slot's masked flush, or none)."""
    filling = [i for i, n in enumerate(counts) if n == r]
    return bool(filling), filling[0] if len(filling) == 1 and len(counts) > 1 else None


def chunked_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                              window: int | None = None, softcap: float | None = None,
                              chunk: int | None = None) -> torch.Tensor:
    """A prompt's causal attention, queries (1, Hq, T, D) over keys and values (1, H, T, D): query i over keys j with
    0 <= i - j < window (transformers' sliding mask; every j <= i without a window), the scores soft-capped as
    softcap tanh(s / softcap) where given (Gemma 2, which SDPA does not do: then products in float32, softmax as
    the model's eager attention takes it). Chunks of `chunk` queries, each over its own keys, so that no T x T mask
    or score matrix is made (1 GiB of mask at 32k)."""
    t = query.shape[2]
    chunk = chunk or (512 if softcap else 2048)
    if softcap:
        key = key.float()  # once, not per chunk (`capped_attention` takes its products in float32)
    outs = []
    for a in range(0, t, chunk):
        e = min(a + chunk, t)
        lo = max(0, a - window + 1) if window else 0
        i = torch.arange(a, e, device=query.device).view(-1, 1)
        j = torch.arange(lo, e, device=query.device).view(1, -1)
        mask = (i >= j) & (i - j < window) if window else i >= j
        q, k, v = query[:, :, a:e], key[:, :, lo:e], value[:, :, lo:e]
        if softcap:
            outs.append(capped_attention(q, k, v, mask, scale, softcap))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                         enable_gqa=True))
    return torch.cat(outs, dim=2)


class StaticWindowLayer(SlotLayer):
    """A sliding layer the method keeps as the model computes it (`Method.float16_layers`, Gemma 2 and 3's sliding
    layers by default): each slot's last `window` tokens in a ring in the model's dtype, uncompressed, the count of
    tokens it has seen on the device. A prompt attends over itself through the window's mask
    (`chunked_prefill_attention`); a step writes its token into the ring (`slots.write_token`'s sibling
    `slots.write_ring`) and attends over the min(count, window) tokens the ring holds: the tokens transformers'
    sliding mask lets it see, in another order. Its `capacity` is the ring's length."""

    def __init__(self, layer: int, batch: int, window: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, longest: int | None = None):
        """`longest`: the most tokens a slot holds, where fewer than the window: the ring is then that long (it never
        wraps, and holds the same tokens)."""
        super().__init__(layer, batch, min(window, longest or window))
        self.window = window
        self.kvwin = torch.zeros(2, batch, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.kwin, self.vwin = self.kvwin[0], self.kvwin[1]  # keys and values: one buffer, one write a step
        self.count = torch.zeros(batch, dtype=torch.int32, device=device)

    def mutable(self) -> list[torch.Tensor]:
        return [self.count]

    def tokens(self) -> torch.Tensor:
        """(B,) int32: the tokens each slot has seen."""
        return self.count

    def prefill(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A whole prompt (1, H, T, D) into `slot`: its last min(T, ring) tokens, token t at ring position t mod ring."""
        t = k.shape[2]
        n = min(t, self.capacity)
        at = torch.arange(t - n, t, device=k.device) % self.capacity
        self.kwin[slot, :, at] = k[0, :, t - n:].to(self.kwin.dtype)
        self.vwin[slot, :, at] = v[0, :, t - n:].to(self.vwin.dtype)
        self.count[slot] = t

    def step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        slots.write_ring(self.kvwin, self.count, k, v)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, opts: AttentionOptions,
               prefill: bool) -> torch.Tensor:
        """A prompt over itself within the window; a step over the ring's valid tokens (SDPA, the model's dtype)."""
        if prefill:
            return chunked_prefill_attention(query, key, value, opts.scaling, window=self.window, softcap=opts.softcap)
        return slots.ring_attention(query, self.kwin, self.vwin, self.count, opts.scaling, opts.softcap)


class StaticKvcalibCache(Cache):
    """The cache of the module docstring: `max_batch` slots of up to `max_length` tokens each."""

    def __init__(self, model, method: str | Method = "kivi", settings: MethodSettings = MethodSettings(),
                 artifacts: str | None = None, max_batch: int = 1, max_length: int = 4096,
                 compile: bool | str = "regions"):
        """`compile`: how much of the step `model.generate` replays torch.compile compiles before its capture
        (`kvcalib.runtime.captured.COMPILE_MODES`)."""
        mode = compile_mode(compile)
        lm = model if isinstance(model, LoadedModel) else LoadedModel(model=model, tokenizer=None, spec="")
        shape = attention_shape(lm.config)
        method = build_method(method, shape, settings, artifacts, lm) if isinstance(method, str) else method
        settle_float16_layers(method, lm.config)  # the sliding layers it keeps as the model computes them
        ranks = tensor_parallel_size(lm.model)  # under tensor parallelism each rank holds its own KV heads' slots
        if shape.num_kv_heads % ranks:
            raise SettingsError(f"tensor parallelism over {ranks} ranks splits {shape.num_kv_heads} KV heads "
                                "unevenly: use a rank count dividing them")
        method = for_this_rank(lm.model, method, shape)
        devices = layer_devices(lm.model, shape.num_layers)  # each layer's buffers on its layer's GPU
        for device in dict.fromkeys(devices):
            check_static(method, shape.head_dim, device, shape.num_heads // shape.num_kv_heads, shape.num_layers,
                         lm.config)
        if max_batch < 1 or max_length < 1:
            raise SettingsError(f"max_batch and max_length must be positive, got {max_batch} and {max_length}")
        r = method.block
        self.method, self.max_batch, self.max_length = method, max_batch, max_length
        capacity = -(-max_length // r) * r
        kept = method.float16_layers or {}
        dtype = next(lm.model.parameters()).dtype
        heads = shape.num_kv_heads // ranks
        super().__init__(layers=[StaticWindowLayer(i, max_batch, kept[i], heads, shape.head_dim, dtype, devices[i],
                                                   longest=capacity)
                                 if i in kept else
                                 StaticLayer(method, i, max_batch, capacity, heads, shape.head_dim, devices[i],
                                             shape.num_heads // shape.num_kv_heads, model_softcap(lm.config))
                                 for i in range(shape.num_layers)])
        self.device = devices[0]  # where the decode step's inputs go (its first layer's GPU)
        # the layer whose residual counts say which steps flush: the first compressed one
        self.counting = next(layer for layer in self.layers if isinstance(layer, StaticLayer))
        self.spread = len(set(devices)) > 1  # over several GPUs: the step runs uncaptured (`_step`)
        self.lengths = [0] * max_batch  # tokens each slot holds (0: free), mirrored on the host for the limits
        self.residual_counts = [0] * max_batch  # the layers' residual counts, mirrored: which steps flush
        self.flush_slot: dict[torch.device, torch.Tensor] = {}  # the slot a one-slot flush takes, one per GPU
        for layer in self.layers:
            if isinstance(layer, StaticLayer):
                layer.slot = self.flush_slot.setdefault(layer.slot.device, layer.slot)
        self.compile = mode
        self.decoder: Decoder | None = None  # the step model.generate replays, captured at its first step
        self.direct = False  # a forward of the cache's own (prefill, the decoder's step): not routed (`route_forward`)
        register_attention()
        lm.model.set_attn_implementation(IMPLEMENTATION)
        route_forward(lm.model)

    def positions(self) -> torch.Tensor:
        """(B, 1) int64 on the device: the position of each slot's next token (tokens it holds)."""
        return self.layers[0].tokens().long().view(-1, 1)

    def release(self, slot: int) -> None:
        """Free a slot: its counts go to zero (its buffers are overwritten by the next prompt)."""
        self._check_slot(slot)
        for layer in self.layers:
            for t in layer.mutable():  # counts and state (KVLinC's S and P start from zero)
                t[slot] = 0
        self.lengths[slot] = 0
        self.residual_counts[slot] = 0

    def prefill(self, model, slot: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Run a prompt (1, T) into `slot` (freed first); returns the logits of its last position (vocab,)."""
        self._check_slot(slot)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or not 0 < input_ids.shape[1] <= self.max_length:
            raise SettingsError(f"prefill takes one prompt (1, T) with 0 < T <= max_length {self.max_length}, "
                                f"got shape {tuple(input_ids.shape)}")
        self.release(slot)
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        for layer in self.layers:
            layer.prefill_slot = slot
        try:
            with torch.no_grad():
                out = self.run_direct(lambda: model(input_ids, position_ids=pos[None], cache_position=pos,
                                                    past_key_values=self, use_cache=True, logits_to_keep=1))
        finally:
            for layer in self.layers:
                layer.prefill_slot = None
        self.lengths[slot] = t
        self.residual_counts[slot] = t % self.method.block
        return out.logits[0, -1]

    def advance(self) -> None:
        """Count one decode step on the host for every slot holding a sequence, refusing one that would
        pass `max_length` (a free slot's step is computed and thrown away: it counts nothing)."""
        full = [i for i, n in enumerate(self.lengths) if n >= self.max_length]
        if full:
            raise SettingsError(f"slot {full[0]} holds max_length {self.max_length} tokens: release it or make the "
                                "cache with a larger max_length")
        self.lengths = [n + 1 if n else 0 for n in self.lengths]
        r = self.method.block
        counts = [n + 1 for n in self.residual_counts]  # every slot's, a free one's too (as the device counts)
        flush, one = flush_step(counts, r)
        if one is not None:
            for slot in self.flush_slot.values():
                slot.fill_(one)
        self.residual_counts = [n % r for n in counts]
        for layer in self.layers:
            layer.flush, layer.one = flush, one is not None

    def read_counts(self) -> None:
        """Take the host's copy of the residual counts from the device (one transfer): for counts written
        other than by `prefill` and `release` (a benchmark filling slots by copying)."""
        self.residual_counts = self.counting.residual.tolist()

    def run_direct(self, forward):
        """`forward()`, a model call of the cache's own, run as the model's forward (`route_forward` steps aside)."""
        was, self.direct = self.direct, True
        try:
            return forward()
        finally:
            self.direct = was

    def serve(self, model, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
              **kwargs) -> CausalLMOutputWithPast:
        """A forward of `model.generate` (module docstring): a prompt batch (B, T) into slots 0..B-1, or a
        decode step (B, 1) replayed from the captured graph. Returns the newest position's logits (B, 1, vocab)."""
        if input_ids is None:
            raise SettingsError("a static cache takes input_ids through model.generate, not inputs_embeds")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise SettingsError("a static cache returns logits only: generate without output_attentions and "
                                "output_hidden_states")
        b, t = input_ids.shape
        if b > self.max_batch:
            raise SettingsError(f"a batch of {b} prompts needs a cache of max_batch >= {b}; this one has {self.max_batch}")
        step = t == 1 and (attention_mask.shape[1] > 1 if attention_mask is not None else any(self.lengths[:b]))
        if step:
            logits = self._step(model, input_ids[:, 0])
        else:
            logits = self._prefill_batch(model, input_ids, attention_mask)
        return CausalLMOutputWithPast(logits=logits[:b, None], past_key_values=self)

    def _prefill_batch(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Every slot freed, then row b's real tokens (where `attention_mask` is 1) prefilled into slot b alone;
        the logits of each row's last token (B, vocab)."""
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not bool(valid[:, -1].all()):
            raise SettingsError("a prompt ends in padding: pad the batch on the left (tokenizer.padding_side = 'left')")
        for slot in range(self.max_batch):
            self.release(slot)
        return torch.stack([self.prefill(model, b, input_ids[b][valid[b]][None]) for b in range(input_ids.shape[0])])

    def _step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of every slot, rows 0..len(tokens)-1 taking `tokens` (the rest, free, a stand-in 0)."""
        if self.decoder is None:
            if self.spread:  # one CUDA graph captures one GPU's work
                log.warning("StaticKvcalibCache: the model's layers lie on several GPUs, so each decode step runs "
                            "uncaptured; tensor parallelism (tp_plan='auto' under torchrun) keeps one captured step "
                            "per GPU")
                self.decoder = Decoder(model, self, compile=self.compile)
            else:
                self.decoder = CapturedDecoder(model, self, compile=self.compile)
        if tokens.shape[0] < self.max_batch:
            tokens = torch.cat([tokens, tokens.new_zeros(self.max_batch - tokens.shape[0])])
        return self.decoder.step(tokens)

    def close(self) -> None:
        """Free the step `model.generate` captured (its CUDA graphs); the next `generate` call captures anew.
        Under torchrun with tensor parallelism, close every such cache before `destroy_process_group`: a live
        graph holding NCCL collectives keeps the communicator from being destroyed, and the call never returns
        (`CapturedDecoder.close`). `with StaticKvcalibCache(...) as cache:` closes it at the block's end."""
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None

    def __enter__(self) -> StaticKvcalibCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise SettingsError(f"slot must be in 0..{self.max_batch - 1}, got {slot}")


def route_forward(model: torch.nn.Module) -> None:
    """Hand `model`'s forwards that carry a `StaticKvcalibCache` to the cache (`StaticKvcalibCache.serve`), once
    per model: `model.generate` then prefills into slots and replays the captured step. Other forwards, and
    the cache's own (`run_direct`), run the model's forward as it was."""
    if getattr(model, "_kvcalib_routed", False):
        return
    forward = model.forward

    @functools.wraps(forward)
    def routed(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, StaticKvcalibCache) and not cache.direct:
            return cache.serve(model, *args, **kwargs)
        return forward(*args, **kwargs)

    model.forward = routed
    model._kvcalib_routed = True
