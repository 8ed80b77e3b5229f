"""KVLinC (Saxena & Roy, 2025): channel-wise keys, Hadamard-rotated values, and a trained linear
correction of the keys' quantization error.

Quantization. Keys per-channel in groups of G tokens (default 128); values rotated by the Hadamard
matrix (`kvcalib.hadamard`) and quantized per token in groups of min(G, head_dim) channels; the
most recent tokens stay float16 and are flushed in blocks of R = 128. Layout: `kvcalib.quant`
(keys axis="tokens", rotated values axis="channels"); `decompress` rotates the values back.
`keys="oscar"` (`--keys oscar`) codes the keys as OScaR does (`kvcalib.methods.oscar`: Hadamard-rotated,
divided by their float16 L2 norm, then per channel), and the correction is trained on that coding's
error instead of the paper's channel-wise keys; the norms are stored and counted as OScaR's (16 bits a
token and KV head), and the fused kernel reads them as it reads OScaR's.

Correction. With the key error kᵉ = k − kᵠ of every flushed token, the attention output of a query q is

    o = (Σ_j exp(q·kᵠ_j/√d) vᵠ_j + Σ_res exp(q·k_j/√d) v_j + φ_q(q) S) /
        (Σ_j exp(q·kᵠ_j/√d)      + Σ_res exp(q·k_j/√d)      + φ_q(q) P),
    S = Σ_j φ_k(kᵉ_j)ᵀ vᵠ_j  (D x d),   P = Σ_j φ_k(kᵉ_j)  (D),

j over the flushed tokens, `res` over the float16 residual (exact, uncorrected). S and P grow as
blocks are flushed: constant memory per head, linear time. The feature map is
φ(x) = [softmax(x W₁), softmax(x W₂)] ∈ R^D with W₁, W₂ ∈ R^{d x D/2}.

Choices made here:
- GQA: φ_q has its own W₁, W₂ per query head, φ_k per KV head, so S and P are per KV head (all
  the query heads of a group read the same states).
- States are float32 and counted in the stored bits: Hkv x (D·d + D) x 32 bits per layer and
  sequence, once a first block is flushed (every KV head of a corrected layer, also one whose query
  heads the gate all switched off: the runtime keeps them). Adapters are stored as float16 and
  counted once as shared bits.
- Numerics: the formula's exp has no max-subtraction. We keep the exact value with one shared
  shift M = max(lse, 0), lse the log-sum-exp of the held scores: both sums are divided by e^M, so
  the correction enters as e^(−M) φ_q(q) S (`combine`).
- "No correction" means the states are absent (S = 0, P = 0): `kvlinc` without an artifact is the
  uncorrected channel-K + Hadamard-V scheme, and a layer the artifact has no adapters for is not
  corrected. Zero adapters are not that: softmax of zeros is uniform, φ_q·φ_k = 4/D, which adds a
  constant weight 4/D to every flushed token before normalization (a test pins both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..artifacts import load_artifact
from ..attention import AttentionOptions, compute_dtype, mixed_attention
from ..defaults import DEFAULTS, KVLINC_KEYS
from ..errors import ArtifactError, SettingsError
from ..hadamard import hadamard, rotate
from ..models import AttentionShape, LoadedModel
from ..quant import dequantize, quantize
from .base import DeviceCopies, Held, MethodSettings
from .kivi import Kivi, KiviConfig, KiviPacked
from .oscar import decode_keys, encode_keys

STATE_BITS = 32
ADAPTER_NAMES = ("q_w1", "q_w2", "k_w1", "k_w2")


@dataclass
class Adapter:
    """One layer's feature maps: q_w* (Hq, d, D/2) for φ_q, k_w* (Hkv, d, D/2) for φ_k.

    `heads` (Hq, 0 or 1), when set, switches the correction off for the query heads marked 0 (the
    per-head gate of `train-adapters`): their φ_q is zero, so φ_q S = φ_q P = 0 and the head reads
    the uncorrected attention exactly.
    """

    q_w1: torch.Tensor
    q_w2: torch.Tensor
    k_w1: torch.Tensor
    k_w2: torch.Tensor
    heads: torch.Tensor | None = None

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        """φ_q(q) per query head, zero for the heads the gate switched off: q (B, Hq, T, d) -> (B, Hq, T, D)."""
        fq = features(q, self.q_w1, self.q_w2)
        return fq if self.heads is None else fq * self.heads.to(fq)[:, None, None]

    @property
    def rank(self) -> int:
        return 2 * self.q_w1.shape[-1]

    def numel(self) -> int:
        return sum(getattr(self, n).numel() for n in ADAPTER_NAMES)

    def to(self, device: torch.device) -> "Adapter":
        return Adapter(*(getattr(self, n).to(device) for n in ADAPTER_NAMES),
                       heads=None if self.heads is None else self.heads.to(device))


def features(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """φ(x) = [softmax(x W₁), softmax(x W₂)] per head: x (B, H, T, d), W (H, d, D/2) -> (B, H, T, D)."""
    dt = compute_dtype(x)
    x = x.to(dt)
    return torch.cat([torch.softmax(torch.einsum("bhtd,hde->bhte", x, w.to(dt)), -1) for w in (w1, w2)], -1)


@dataclass
class States:
    """The correction states of one layer: s (B, Hkv, D, d) and p (B, Hkv, D), float32."""

    s: torch.Tensor
    p: torch.Tensor

    @classmethod
    def empty(cls, batch: int, kv_heads: int, rank: int, head_dim: int, device=None) -> "States":
        return cls(torch.zeros(batch, kv_heads, rank, head_dim, device=device), torch.zeros(batch, kv_heads, rank, device=device))

    def flush(self, adapter: Adapter, k_err: torch.Tensor, v_held: torch.Tensor) -> "States":
        """The states after a block is flushed: S += φ_k(kᵉ)ᵀ vᵠ, P += Σ φ_k(kᵉ) over its tokens."""
        fk = features(k_err, adapter.k_w1, adapter.k_w2)
        return States(self.s + fk.transpose(-1, -2) @ v_held.float(), self.p + fk.sum(-2))


def correction_terms(fq: torch.Tensor, states: States) -> tuple[torch.Tensor, torch.Tensor]:
    """φ_q(q) S (B, Hq, T, d) and φ_q(q) P (B, Hq, T), in exp units; fq (B, Hq, T, D), states per KV head."""
    b, hq, t, _ = fq.shape
    hkv = states.s.shape[1]
    fq = fq.reshape(b, hkv, hq // hkv, t, -1)
    s, p = states.s.to(fq.dtype), states.p.to(fq.dtype)
    num = (fq @ s.unsqueeze(2)).reshape(b, hq, t, -1)
    den = (fq @ p[:, :, None, :, None]).reshape(b, hq, t)
    return num, den


def combine(out: torch.Tensor, lse: torch.Tensor, fq: torch.Tensor, states: States) -> torch.Tensor:
    """Add the correction to attention normalized as `out` with log-sum-exp `lse`.

    out (B, Hq, T, d), lse (B, Hq, T), fq = φ_q(q) (B, Hq, T, D), states per KV head. Both sums of
    the module docstring's formula are divided by e^M, M = max(lse, 0), so nothing overflows:
    o = (out·e^(lse−M) + e^(−M) φ_q S) / (e^(lse−M) + e^(−M) φ_q P).
    """
    num, den = correction_terms(fq, states)
    m = lse.clamp_min(0.0)
    exact, shift = torch.exp(lse - m), torch.exp(-m)
    return (out * exact[..., None] + shift[..., None] * num) / (exact + shift * den)[..., None]


def check_keys(keys: str) -> str:
    """`keys`, the key coding under the correction, refused unless one of `KVLINC_KEYS`."""
    if keys not in KVLINC_KEYS:
        raise SettingsError(f"--keys must be one of {', '.join(KVLINC_KEYS)}, got {keys!r}")
    return keys


@dataclass
class KvlincPacked(KiviPacked):
    corrected: bool  # the layer has an adapter, so the sequence carries S and P for it
    k_scale: torch.Tensor | None = None  # keys="oscar": each token's norm (B, Hkv, T, 1) float16


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions,
                     adapter: Adapter | None = None, states: States | None = None,
                     key_start: torch.Tensor | None = None) -> torch.Tensor:
    """The corrected attention of new queries over a decoder's cache: the reference the runtime matches.

    q (B, Hq, Tq, d) are the last Tq positions; k, v (B, Hkv, Tk, d) the cache as held (flushed
    blocks dequantized, then the float16 residual); `states` the S and P of the flushed blocks,
    kept by `States.flush` as each block is flushed. Without states this is plain attention. `key_start`:
    each row's first real key (`mixed_attention`).
    """
    if states is None:
        return mixed_attention(q, k, v, opts, key_start=key_start)
    out, lse = mixed_attention(q, k, v, opts, return_lse=True, key_start=key_start)
    return combine(out, lse, adapter.query_features(q), states)


class Kvlinc(Kivi):
    name = "kvlinc"
    rotated_values = True

    def __init__(self, config: KiviConfig, shape: AttentionShape, adapters: dict[int, Adapter] | None = None,
                 scaling: float | None = None, keys: str = DEFAULTS["keys"]):
        super().__init__(config, shape)
        hadamard(shape.head_dim)  # values are rotated: refuses an odd head_dim now, not mid-evaluation
        self.shape = shape
        self.adapters = adapters or {}
        self._copies = DeviceCopies()
        self.scaling = scaling  # the attention scaling the adapters were trained for
        self.keys = check_keys(keys)

    def for_kv_heads(self, start: int, stop: int) -> "Kvlinc":
        """Each adapter's feature maps of these KV heads and their query heads alone."""
        g = self.shape.num_heads // self.shape.num_kv_heads
        q = slice(start * g, stop * g)
        return self._heads_part(start, stop, adapters={
            i: Adapter(a.q_w1[q], a.q_w2[q], a.k_w1[start:stop], a.k_w2[start:stop], None if a.heads is None else a.heads[q])
            for i, a in self.adapters.items()})

    def adapter(self, layer: int, device: torch.device) -> Adapter | None:
        """The layer's adapter (None: not corrected) on `device`, its layer's (`DeviceCopies`)."""
        adapter = self.adapters.get(layer)
        if adapter is None or adapter.q_w1.device == device:
            return adapter
        return self._copies.on(layer, adapter, device)

    @property
    def rotated_keys(self) -> bool:
        return self.keys == "oscar"

    @property
    def per_kv_head(self) -> bool:
        return bool(self.adapters)

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KvlincPacked:
        c = self.config
        k, s = encode_keys(k, True, "l2") if self.keys == "oscar" else (k, None)
        return KvlincPacked(k=quantize(k, c.bits, c.group_size, "tokens"),
                            v=quantize(rotate(v.float()), c.bits, self.value_group, "channels"),
                            corrected=layer in self.adapters, k_scale=s)

    def decompress(self, layer: int, packed: KvlincPacked) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize(packed.k)
        return (decode_keys(k, packed.k_scale, True) if self.keys == "oscar" else k), rotate(dequantize(packed.v))

    def codebook_spec(self, layer: int) -> None:
        return None  # its correction terms are the INT2 kernel's alone

    def int2_parts(self, packed: KvlincPacked):
        return packed.k, packed.v, None if packed.k_scale is None else packed.k_scale[..., 0]

    def part_bits(self, packed: KvlincPacked) -> tuple[int, int]:
        k, v = super().part_bits(packed)
        return k + (0 if packed.k_scale is None else 16 * packed.k_scale.numel()), v

    def state_bits(self, batch: int) -> int:
        """Bits of one layer's S and P for `batch` sequences (0 without an adapter)."""
        rank = next(iter(self.adapters.values())).rank if self.adapters else 0
        return STATE_BITS * batch * self.shape.num_kv_heads * rank * (self.shape.head_dim + 1)

    def stored_bits(self, packed: KvlincPacked) -> int:
        states = self.state_bits(packed.k.codes.shape[0]) if packed.corrected else 0
        return super().stored_bits(packed) + states

    def constant_bits(self) -> int:
        return 16 * sum(a.numel() for a in self.adapters.values())

    def settings(self) -> dict:
        extra = {"rank": next(iter(self.adapters.values())).rank, "corrected_layers": len(self.adapters)} \
            if self.adapters else {"correction": "none"}
        return super().settings() | extra | ({"keys": self.keys} if self.keys != DEFAULTS["keys"] else {})

    def states(self, layer: int, k: torch.Tensor, held: Held) -> list[States]:
        """S, P after each flushed block: entry b holds the first b blocks (entry 0 is empty)."""
        adapter = self.adapter(layer, k.device)
        b, hkv, _, d = k.shape
        out = [States.empty(b, hkv, adapter.rank, d, device=k.device)]
        for start in range(0, held.flushed, self.block):
            blk = slice(start, start + self.block)
            k_err = held.k16[..., blk, :].float() - held.k[..., blk, :].float()
            out.append(out[-1].flush(adapter, k_err, held.v[..., blk, :]))
        return out

    def flush_state(self, layer: int, state: States | None, k16: torch.Tensor, k_held: torch.Tensor,
                    v_held: torch.Tensor) -> States | None:
        adapter = self.adapter(layer, k16.device)
        if adapter is None:
            return None
        if state is None:
            b, hkv, _, d = k16.shape
            state = self.empty_state(layer, b, hkv, d, k16.device)
        return state.flush(adapter, k16.float() - k_held.float(), v_held)

    def empty_state(self, layer: int, batch: int, kv_heads: int, head_dim: int, device=None) -> States | None:
        adapter = self.adapters.get(layer)
        return None if adapter is None else States.empty(batch, kv_heads, adapter.rank, head_dim, device=device)

    def correction(self, layer: int, q: torch.Tensor, state: States | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        adapter = self.adapter(layer, q.device)
        return None if adapter is None or state is None else correction_terms(adapter.query_features(q), state)

    def decode(self, layer: int, q: torch.Tensor, k_held: torch.Tensor, v_held: torch.Tensor,
               opts: AttentionOptions, state: States | None, key_start: torch.Tensor | None = None) -> torch.Tensor:
        return decode_attention(q, k_held, v_held, opts, self.adapter(layer, q.device), state, key_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, held: Held,
               flushed: torch.Tensor, opts: AttentionOptions) -> torch.Tensor:
        adapter = self.adapter(layer, q.device)
        if adapter is None or held.flushed == 0:
            return super().attend(layer, q, k, v, held, flushed, opts)
        if opts.sliding_window:
            raise SettingsError("KVLinC's correction states cannot drop tokens that leave a sliding window")
        if self.scaling is not None and abs(opts.scaling - self.scaling) > 1e-6 * self.scaling:
            raise ArtifactError(f"adapters were trained for attention scaling {self.scaling}, the model uses {opts.scaling}")
        out, lse = mixed_attention(q, held.k16, held.v16, opts, held.k, held.v, flushed, return_lse=True)
        fq = adapter.query_features(q)
        states = self.states(layer, k, held)
        # Query i reads the states of the flushed[i] // block blocks it sees, exactly as a decoder would.
        blocks = flushed // self.block
        result = out.clone()
        for n in blocks.unique().tolist():
            if n == 0:
                continue
            i = (blocks == n).nonzero().squeeze(1)
            result[:, :, i] = combine(out[:, :, i], lse[:, :, i], fq[:, :, i], states[n])
        return result


def load_adapters(path: str, shape: AttentionShape, model: LoadedModel | None = None):
    """The artifact's adapters per layer, its settings and its attention scaling, validated."""
    art = load_artifact(path, "kvlinc", model=model.model if model is not None else None)
    layers = art.settings.get("layers", [])
    adapters = {}
    for i in layers:
        try:
            adapters[i] = Adapter(*(art.layer(i, n).float() for n in ADAPTER_NAMES))
        except KeyError as err:
            raise ArtifactError(f"artifact {path} lacks tensor {err.args[0]}") from err
        a = adapters[i]
        if f"layers.{i}.heads" in art.tensors:
            a.heads = art.layer(i, "heads").float()
            if a.heads.shape != (shape.num_heads,) or not ((a.heads == 0) | (a.heads == 1)).all():
                raise ArtifactError(f"artifact {path}: layers.{i}.heads must hold {shape.num_heads} values, each 0 or 1")
        want = {"q": shape.num_heads, "k": shape.num_kv_heads}
        for n in ADAPTER_NAMES:
            w = getattr(a, n)
            if w.shape != (want[n[0]], shape.head_dim, a.rank // 2):
                raise ArtifactError(f"artifact {path}: layers.{i}.{n} has shape {tuple(w.shape)}, "
                                    f"expected {(want[n[0]], shape.head_dim, a.rank // 2)}")
    return adapters, art.settings


SETTINGS = ("bits", "group_size", "residual", "keys")


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Kvlinc:
    """Without an artifact, the uncorrected channel-K + Hadamard-V scheme; with one, the adapters and
    the quantization settings they were trained for."""
    if artifacts is None:
        *quant, keys = settings.resolve("kvlinc", SETTINGS).values()
        return Kvlinc(KiviConfig(*quant), shape, keys=keys)
    adapters, trained = load_adapters(artifacts, shape, model)
    fixed = {k: trained.get(k, DEFAULTS[k]) for k in SETTINGS}  # adapters trained before --keys: kivi keys
    *quant, keys = settings.resolve("kvlinc", SETTINGS, fixed, artifacts).values()
    return Kvlinc(KiviConfig(*quant), shape, adapters, trained.get("scaling"), keys)
