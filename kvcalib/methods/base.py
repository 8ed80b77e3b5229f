"""The contract every method implements (`Method`), and what the methods and their callers share.

A method compresses whole flushed blocks of the cache, `compress(layer, k, v) -> packed`, and
reads them back, `decompress(layer, packed) -> (k, v)`; k and v are (B, Hkv, T, d) with T a
multiple of `block`. Tokens not yet flushed stay in the float16 residual window; when a block is
flushed is the one rule `kvcalib.attention.flushed_length(n, block, window)`:
- blockwise (`--residual-mode blockwise`, the default): `block` = R (`--residual`), `window` = 0, so a
  block of R tokens is flushed as soon as it fills and 0..R-1 tokens wait in float16;
- sliding (`--residual-mode sliding`, the window of TurboQuant's and KIVI's reference code): `window`
  = R and `block` = the method's `flush_step()` (1 for formats that code each vector alone, the key
  group G for formats that quantize keys per channel over G tokens), so the newest R tokens are always
  float16 and R..R+step-1 wait (`apply_residual_mode`).
`hold` applies that rule to a whole sequence: it returns the cache exactly as a decoder holding
these tokens would hold it, and what it costs in stored bits.

A method may keep the first `sink` tokens of every sequence (attention sinks) in float16 beside
their compressed form (`keep_sinks`); they are counted at 16 bits on top of their codes.

`Method` is two parts: the codec, whose members every method must define (abstract here), and
`KernelLayout`, what the runtime reads of a method beyond its codec (the basis its blocks are stored in, a
decoding state), whose defaults declare none of them. A fused kernel's layout a method declares by taking the
declaration class of that format (`KernelLayout`'s docstring).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..attention import AttentionOptions, flushed_length, held_in_float16, mixed_attention
from ..defaults import DEFAULTS, OPTIONS, RESIDUAL_MODES, SLIDING_LAYERS
from ..errors import SettingsError
from ..streams import settled


def kv_head_part(shape, start: int, stop: int):
    """`shape` (an `AttentionShape`) as a rank holding KV heads start..stop-1 sees it: those heads and their
    query heads (transformers' tensor parallelism splits both in contiguous equal parts)."""
    import dataclasses

    group = shape.num_heads // shape.num_kv_heads
    return dataclasses.replace(shape, num_heads=(stop - start) * group, num_kv_heads=stop - start)


class DeviceCopies:
    """A method's per-layer tensors copied to the devices their layers run on, once per (layer, device): an
    artifact loads on the CPU, a model spread over GPUs runs each layer on its own, and a captured step may
    not copy from the host. A layer's source replaced since its copy (a new object) is copied again."""

    def __init__(self):
        self._held: dict[tuple[int, torch.device], tuple[Any, Any]] = {}  # (layer, device) -> (source, copy)

    def on(self, layer: int, source, device: torch.device):
        """`source` (anything with `.to(device)`) on `device`."""
        held = self._held.get((layer, device))
        if held is None or held[0] is not source:
            held = self._held[layer, device] = (source, settled(source.to(device)))  # `streams.side_by_side`
        return held[1]


class KernelLayout:
    """What the runtime reads of a method beyond its codec and the kernel layouts its class declares. The defaults
    mean "no basis, no decoding state". Which fused kernel reads a method's flushed blocks its class says by taking a
    format's declaration class, each beside its format under `kvcalib/formats/`: `int2/coded.py`'s `Int2Coded`
    (KIVI, OScaR, KVLinC), `vq/coded.py`'s `VQCoded` (VecInfer), `codebook/coded.py`'s `CodebookCoded` (TurboQuant,
    VecInfer, KIVI and OScaR, a plan). A method taking none is decoded by the torch reference (`Method.decode` over
    the dequantized blocks), which every method has. The caches try the formats in the registry's order
    (`formats/registry.py`): INT2, VecInfer, then the codebook layout.
    - `rotated_keys`, `rotated_values`: INT2 blocks stored in the Hadamard basis (OScaR; KVLinC's values, and
      its keys with `keys="oscar"`): both caches write them into `PackedLayer`, whose kernel rotates the
      query for them and their partial outputs back.
    - `empty_state`, `flush_state`: a decoding state beside the blocks (KVLinC's S and P): `runtime/cache.py`
      updates it at each flush, `runtime/static_cache.py` allocates it once and updates it in place; the
      torch path hands it to `Method.decode`.
    - `correction`: terms that state adds to attention's sums (KVLinC's), read on the INT2 path of both
      caches (``kvcalib.formats.int2.format`'s `attend`); on the torch path the method's own `decode` adds them.
    """

    rotated_keys = False  # flushed keys are stored in the Hadamard basis: the fused kernel rotates queries for them
    rotated_values = False  # flushed values are stored in the Hadamard basis: the kernel rotates their sums back

    # ---- decoding: a state kept beside the compressed blocks, None at first ----
    def empty_state(self, layer: int, batch: int, kv_heads: int, head_dim: int, device=None) -> Any:
        """The state of sequences that flushed nothing yet, as a dataclass of tensors with the batch first
        (a static cache allocates it once and updates it in place, `kvcalib.runtime.static_cache`), or
        None where the method keeps no state for this layer."""
        return None

    def flush_state(self, layer: int, state: Any, k16: torch.Tensor, k_held: torch.Tensor, v_held: torch.Tensor) -> Any:
        """The state after one block is flushed: its float16 keys, and its keys and values as held."""
        return state

    def correction(self, layer: int, q: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Terms added to attention's unnormalised sums (numerator (B, Hq, T, d) in the model's basis
        (values as held), denominator (B, Hq, T), exp units), or None: KVLinC's φ_q(q)·S and φ_q(q)·P."""
        return None


class Method(KernelLayout, ABC):
    """Base of every method: a subclass sets `name` and `block` and defines the codec (`compress`,
    `decompress`, `part_bits`, `settings`); the rest has defaults that fit most methods, and what the
    runtime reads beyond the codec is `KernelLayout`'s."""

    name: str
    block: int  # tokens per flush
    window: int = 0  # tokens always kept float16 after the flushed blocks: R when sliding, 0 when blockwise
    sink: int = 0  # leading tokens of a sequence also kept in float16 (attention sinks)
    fitted_residual_mode: str | None = None  # the flush rule an artifact was made under (a plan's), None: any
    # The layers kept as the model computes them, each with its window (its sliding layers, `models.sliding_windows`,
    # unless --sliding-layers compress): never compressed, attended over their window as transformers' own caches
    # hold it, counted at 16 bits a value for the window's tokens. None: not yet settled for a model (a method built
    # without one); a cache settles it from its model's config (`settle_float16_layers`).
    float16_layers: dict[int, int] | None = None
    sliding_layers: str | None = None  # --sliding-layers as resolved (`build_method`), None: the default
    fitted_sliding_layers: str | None = None  # what an artifact was made under (a plan's items), None: any

    # ---- the codec: every method defines these ----
    @abstractmethod
    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        """Flushed float16 blocks k, v (B, Hkv, T, d), T a multiple of `block`, as the method stores them."""

    @abstractmethod
    def decompress(self, layer: int, packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks `compress` packed, read back as (k, v) in the model's basis."""

    @abstractmethod
    def part_bits(self, packed: Any) -> tuple[int, int]:
        """Stored bits of a flushed block's keys and of its values, apart (a plan codes them by different
        methods, `kvcalib.methods.plan`)."""

    @abstractmethod
    def settings(self) -> dict:
        """What the method was built with, as eval's results and the artifacts record it."""

    # ---- defaults a method overrides where it differs ----
    def stored_bits(self, packed: Any) -> int:
        """Stored bits of a flushed block: its keys' and values' (`part_bits`), plus anything a sequence
        stores per block beside them (KVLinC's states)."""
        return sum(self.part_bits(packed))

    def flush_step(self) -> int:
        """The fewest tokens one flush may compress (the block of a sliding residual): 1 for formats that
        code each vector on its own; formats that group keys over tokens return their group."""
        return 1

    def constant_bits(self) -> int:
        """Bits of the method's shared tensors (codebooks, adapters), stored once for all sequences."""
        return 0

    @property
    def per_kv_head(self) -> bool:
        """Whether the method holds tensors or choices per KV head (codebooks, smoothing, adapters, a plan's
        schemes): under tensor parallelism a rank sees only its own heads, and takes the method for them
        (`for_kv_heads`, `kvcalib.runtime.cache.KvcalibCache`)."""
        return False

    def for_kv_heads(self, start: int, stop: int) -> "Method":
        """The method as a tensor-parallel rank that holds KV heads start..stop-1 (and their query heads) sees it:
        this method where it holds nothing per head; a method that does (`per_kv_head`) returns a copy with its
        own heads' part of its data, and must override this."""
        if self.per_kv_head:
            raise SettingsError(f"--method {self.name} holds data per KV head and cannot yet give a rank its own heads' "
                                "part: spread the model with device_map='auto' instead")
        return self

    def _heads_part(self, start: int, stop: int, **own) -> "Method":
        """A shallow copy (the flush rule and sinks as set on this one) holding `own` (its heads' part of its
        data), its `shape` that of KV heads start..stop-1 where it keeps one, and its device copies made anew."""
        import copy

        out = copy.copy(self)
        for name, value in own.items():
            setattr(out, name, value)
        if hasattr(self, "shape"):
            out.shape = kv_head_part(self.shape, start, stop)
        if hasattr(self, "_copies"):
            out._copies = DeviceCopies()
        return out

    # ---- the reference attention (eval, and the runtime's torch path) ----
    def decode(self, layer: int, q: torch.Tensor, k_held: torch.Tensor, v_held: torch.Tensor,
               opts: AttentionOptions, state: Any, key_start: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the last q.shape[-2] positions over a decoder's cache as held (reference path);
        `key_start` (B,): each row's first real key, its earlier ones padding (`mixed_attention`)."""
        return mixed_attention(q, k_held, v_held, opts, key_start=key_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, held: Held,
               flushed: torch.Tensor, opts: AttentionOptions) -> torch.Tensor:
        """Attention of every query over the cache as held; methods with correction terms override it."""
        return mixed_attention(q, held.k16, held.v16, opts, held.k, held.v, flushed)


@dataclass
class Held:
    k: torch.Tensor  # every token as stored: compressed part decompressed, the rest float16
    v: torch.Tensor
    k16: torch.Tensor  # every token as the float16 cache received it (a query's residual reads these)
    v16: torch.Tensor
    flushed: int  # tokens in compressed storage
    stored_bits: int  # compressed blocks plus the float16 residual


def hold(method: Method, layer: int, k: torch.Tensor, v: torch.Tensor) -> Held:
    """The cache a decoder holds after these T tokens: floor(T/block)*block compressed, rest float16; a layer the
    method keeps uncompressed (`float16_layers`) holds its window's last tokens as they came.

    The cache receives float16 keys and values (`held_in_float16`); blocks are compressed from those.
    """
    t = k.shape[-2]
    window = float16_window(method, layer)
    if window is not None:  # a layer kept as the model computes it: its window's tokens, never compressed
        held = min(t, window)
        bits = 16 * (k[..., t - held :, :].numel() + v[..., t - held :, :].numel())
        return Held(k=k, v=v, k16=k, v16=v, flushed=0, stored_bits=bits)
    flushed = flushed_length(t, method.block, method.window)
    k16, v16 = held_in_float16(k, v)
    bits = 16 * (k16[..., flushed:, :].numel() + v16[..., flushed:, :].numel())
    k_held, v_held = k16, v16
    if flushed:
        packed = method.compress(layer, k16[..., :flushed, :], v16[..., :flushed, :])
        kq, vq = method.decompress(layer, packed)
        kq, vq, sink_bits = keep_sinks(method, 0, k16, v16, kq, vq)
        bits += method.stored_bits(packed) + sink_bits
        k_held = torch.cat([kq.to(k.dtype), k16[..., flushed:, :]], dim=-2)
        v_held = torch.cat([vq.to(v.dtype), v16[..., flushed:, :]], dim=-2)
    return Held(k=k_held, v=v_held, k16=k16, v16=v16, flushed=flushed, stored_bits=bits)


def keep_sinks(method: Method, start: int, k16: torch.Tensor, v16: torch.Tensor, kq: torch.Tensor,
               vq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Blocks read back (kq, vq) starting at sequence position `start`, with the method's sink tokens
    restored to their float16 originals (k16, v16 from the same position); and their extra bits."""
    count = min(max(method.sink - start, 0), kq.shape[-2])
    if not count:
        return kq, vq, 0
    kq, vq = kq.clone(), vq.clone()
    kq[..., :count, :] = k16[..., :count, :].to(kq.dtype)
    vq[..., :count, :] = v16[..., :count, :].to(vq.dtype)
    return kq, vq, 16 * (kq[..., :count, :].numel() + vq[..., :count, :].numel())


@dataclass(frozen=True)
class MethodSettings:
    """A method's options as the user gave them; None = not given.

    One rule for every method (`resolve`): an option the method does not use is refused; an
    artifact fixes what it was fitted for, and a given option that contradicts it is refused with
    both values named; anything else not given takes `DEFAULTS`.
    """

    bits: int | None = None
    group_size: int | None = None
    residual: int | None = None
    scaling: str | None = None  # OScaR: per-token key coefficient, or "none"
    rotation: bool | None = None  # OScaR: Hadamard rotation of keys and values
    sink_tokens: int | None = None  # every method that compresses: the first N tokens also kept in float16
    residual_mode: str | None = None  # every method that compresses: "blockwise" or "sliding" (module docstring)
    keys: str | None = None  # KVLinC: the key coding its correction is trained on top of, "kivi" or "oscar"
    sliding_layers: str | None = None  # every method that compresses: "float16" or "compress" (`float16_layers`)

    def given(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def resolve(self, method: str, uses: tuple[str, ...], fixed: dict | None = None,
                source: str | None = None) -> dict:
        """The values of the options `uses` lists: given, else fixed by the artifact at `source`, else default."""
        given, fixed = self.given(), fixed or {}
        unused = [k for k in given if k not in uses]
        if unused:
            raise SettingsError(f"{OPTIONS[unused[0]]} is not an option of --method {method}; drop it")
        for key, value in given.items():
            if key in fixed and fixed[key] != value:
                raise SettingsError(f"{OPTIONS[key]} {value} contradicts the artifact {source}, made with "
                                    f"{key}={fixed[key]}: drop {OPTIONS[key]} or pass {fixed[key]}")
        return {k: given.get(k, fixed.get(k, DEFAULTS[k])) for k in uses}


def float16_window(method: "Method", layer: int) -> int | None:
    """The window of a layer the method keeps uncompressed (`Method.float16_layers`), None for a compressed one."""
    return (method.float16_layers or {}).get(layer)


def settle_float16_layers(method: "Method", config) -> None:
    """Settle which layers `method` keeps uncompressed for a model of `config` (once: a method settled keeps its
    layers): its sliding layers under --sliding-layers float16 (the default), none under compress."""
    from ..models import sliding_windows

    if method.float16_layers is not None or config is None:
        return
    mode = method.sliding_layers or method.fitted_sliding_layers or DEFAULTS["sliding_layers"]
    check_sliding_layers(mode)
    method.float16_layers = sliding_windows(config) if mode == "float16" and method.name != "fp16" else {}


def check_sliding_layers(mode: str) -> None:
    if mode not in SLIDING_LAYERS:
        raise SettingsError(f"--sliding-layers must be one of {', '.join(SLIDING_LAYERS)}, got {mode!r}")


def check_residual_mode(mode: str) -> None:
    if mode not in RESIDUAL_MODES:
        raise SettingsError(f"--residual-mode must be one of {', '.join(RESIDUAL_MODES)}, got {mode!r}")


def apply_residual_mode(method: Method, mode: str) -> None:
    """Set `method`'s flush rule (module docstring): sliding keeps R (its block until now) as the window
    and flushes `flush_step()` tokens at a time; blockwise leaves it as built."""
    check_residual_mode(mode)
    if mode == "sliding":
        method.window, method.block = method.block, method.flush_step()
