"""`train-adapters`: fit KVLinC's feature maps (`kvcalib.methods.kvlinc`) on collected activations.

Each layer is trained on its own (layers are independent). For a query i that sees f_i flushed
tokens (the one flush rule, `attention.flushed_length`: f_i = floor((i+1)/R)·R), the loss is
the cross-entropy between the full-precision causal attention weights p_i = softmax(q_i Kᵀ/√d) and
the corrected quantized weights the method applies,

    ŵ_ij ∝ exp(q_i·kᵠ_j/√d) + φ_q(q_i)·φ_k(kᵉ_j)   for j < f_i,      exp(q_i·k_j/√d) for f_i ≤ j ≤ i,

computed in logs: log w_ij = logaddexp(sᵠ_ij, log c_ij) (c_ij > 0, softmax features), and
CE_i = logsumexp_j log w_ij − Σ_j p_ij log w_ij. Adam minimizes the mean over queries and heads.

Data: the last max(1, S/8) of the S collected sequences are held out; the held-out loss without
correction and with the trained (float16-rounded) adapters is written to the artifact manifest
(`extra`), with each query head's held-out attention output error ‖o − o_ref‖/‖o_ref‖ (`head_errors`:
the method's own attention, values quantized too) without and with the correction.

Gate (`gate`, the default; our addition): the loss is a proxy, and a small KL gain does not always
lower the output error. A query head keeps its correction only if it lowers that head's held-out
output error; the others get φ_q = 0 (`Adapter.heads`), and a layer with no head left is left out
of the artifact, so it stays uncorrected (and carries no S, P states) rather than made worse.

Each step draws `batch` training sequences and `tokens` query positions among those
that see a flushed block, from a generator seeded by (seed, layer): the result depends only on the
seed, whatever --layers selects. Initial W ~ N(0, 1/d), seeded the same way (zero W would keep the
two halves of φ identical forever).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..artifacts import save_artifact
from ..atomic import ensure_writable_dir
from ..attention import AttentionOptions, flushed_counts, flushed_length, mixed_attention
from ..collect import Activations
from ..defaults import DEFAULTS
from ..errors import SettingsError
from ..devices import resolve_device
from ..models import AttentionShape
from ..parallel import local_device, merged, on_rank0, share, world
from .base import hold
from .kivi import KiviConfig
from .kvlinc import ADAPTER_NAMES, Adapter, Kvlinc, check_keys, features

log = logging.getLogger(__name__)

_EVAL_CHUNK = 128


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 256
    steps: int = 60
    lr: float = 1e-2
    bits: int = DEFAULTS["bits"]
    group_size: int = DEFAULTS["group_size"]
    residual: int = DEFAULTS["residual"]
    tokens: int = 128  # query positions per Adam step
    batch: int = 1  # sequences per Adam step
    seed: int = 0
    keys: str = DEFAULTS["keys"]  # the key coding the correction is trained on top of (kvcalib.methods.kvlinc)

    def __post_init__(self) -> None:
        KiviConfig(self.bits, self.group_size, self.residual)
        check_keys(self.keys)
        if self.rank < 2 or self.rank % 2:
            raise SettingsError(f"--rank must be an even number >= 2, got {self.rank}")
        if self.steps < 0 or self.tokens < 1 or self.batch < 1 or not self.lr > 0:
            raise SettingsError("--steps must be >= 0, --tokens and the batch positive, --lr > 0")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`all`, or comma-separated layer numbers and ranges: `0-9`, `0,4,7-9`."""
    if spec == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SettingsError(f"--layers {spec!r}: give `all`, or numbers and ranges such as 0-9 or 0,4,7-9") from None
    if not layers or min(layers) < 0 or max(layers) >= num_layers:
        raise SettingsError(f"--layers {spec!r}: the model has layers 0-{num_layers - 1}")
    return sorted(layers)


@dataclass
class _LayerData:
    q: torch.Tensor  # (S, Hq, T, d)
    k: torch.Tensor  # (S, Hkv, T, d)
    k_quant: torch.Tensor  # (S, Hkv, F, d): the F flushable tokens as the cache stores them
    k_err: torch.Tensor  # float16 k - k_quant over the same tokens: what φ_k sees (Kvlinc.states)

    def take(self, seqs: torch.Tensor) -> "_LayerData":
        return _LayerData(*(getattr(self, n)[seqs] for n in ("q", "k", "k_quant", "k_err")))


def _layer_data(acts: dict[str, torch.Tensor], config: TrainConfig) -> _LayerData:
    """A collected layer, its flushable keys as the KVLinC cache holds them (`methods.hold`: float16,
    then compressed by the method, the rule eval scores) and their error against the float16 keys."""
    q, k, v = (acts[n].float() for n in "qkv")
    shape = AttentionShape(1, q.shape[1], k.shape[1], k.shape[-1])
    held = hold(kvlinc(config, shape), 0, k, v)
    f = held.flushed
    return _LayerData(q, k, held.k[..., :f, :], held.k16[..., :f, :] - held.k[..., :f, :])


def attention_ce(data: _LayerData, pos: torch.Tensor, residual: int, scaling: float,
                 adapter: Adapter | None) -> torch.Tensor:
    """CE between exact and corrected quantized attention of the queries at `pos`: (S, Hq, n)."""
    s_, hq, _, d = data.q.shape
    hkv, t = data.k.shape[1], data.k.shape[2]
    g = hq // hkv
    pos = pos.to(data.q.device)
    q = data.q[:, :, pos].reshape(s_, hkv, g, len(pos), d)
    scores = scaling * q @ data.k.unsqueeze(2).transpose(-1, -2)
    flushable = data.k_quant.shape[-2]
    j = torch.arange(t, device=data.q.device)
    visible = j[None, :] <= pos[:, None]
    held = j[None, :flushable] < flushed_length(pos + 1, residual)[:, None]
    held_scores = scaling * q @ data.k_quant.unsqueeze(2).transpose(-1, -2)
    if adapter is not None:
        fq = features(data.q[:, :, pos], adapter.q_w1, adapter.q_w2).reshape(s_, hkv, g, len(pos), -1)
        fk = features(data.k_err, adapter.k_w1, adapter.k_w2).unsqueeze(2)
        held_scores = torch.logaddexp(held_scores, torch.log((fq @ fk.transpose(-1, -2)).clamp_min(1e-30)))
    log_w = torch.cat([torch.where(held, held_scores, scores[..., :flushable]), scores[..., flushable:]], -1)
    log_w = log_w.masked_fill(~visible, float("-inf"))
    # CE minus the entropy of p: the KL divergence, same gradient, and 0 for a perfect correction.
    log_p = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), -1)
    p = log_p.exp()
    kl = torch.logsumexp(log_w, -1) - (p * (log_w - log_p).masked_fill(~visible, 0.0)).sum(-1)
    return kl.reshape(s_, hq, len(pos))


def heldout_loss(data: _LayerData, config: TrainConfig, scaling: float, adapter: Adapter | None) -> float:
    eligible = torch.arange(config.residual - 1, data.q.shape[-2])
    with torch.no_grad():
        total = sum(attention_ce(data, chunk, config.residual, scaling, adapter).sum().item()
                    for chunk in eligible.split(_EVAL_CHUNK))
    return total / (data.q.shape[0] * data.q.shape[1] * len(eligible))


def head_errors(method: Kvlinc, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """Per query head, ‖o − o_ref‖/‖o_ref‖ of `method`'s attention against exact attention over the
    queries that see a flushed block: q (S, Hq, T, d), k, v (S, Hkv, T, d) -> (Hq,)."""
    t = q.shape[-2]
    opts = AttentionOptions(scaling=scaling)
    flushed = flushed_counts(t, t, method.block, device=q.device)
    seen = flushed > 0
    with torch.no_grad():
        out = method.attend(layer, q, k, v, hold(method, layer, k, v), flushed, opts)[:, :, seen]
        ref = mixed_attention(q, k, v, opts)[:, :, seen]
    return (((out - ref) ** 2).sum((0, 2, 3)) / (ref**2).sum((0, 2, 3))).sqrt()


def gated(adapter: Adapter, config: TrainConfig, shape: AttentionShape, layer: int,
          held: dict[str, torch.Tensor], scaling: float) -> tuple[Adapter, torch.Tensor, torch.Tensor]:
    """`adapter` with `heads` set to the query heads whose held-out output error it lowers, and the
    per-head errors without and with the correction."""
    q, k, v = (held[n].float() for n in "qkv")
    before, after = (head_errors(kvlinc(config, shape, adapters), layer, q, k, v, scaling)
                     for adapters in ({}, {layer: adapter}))
    heads = (after < before).float()
    return Adapter(*(getattr(adapter, n) for n in ADAPTER_NAMES), heads=heads), before, after


def kvlinc(config: TrainConfig, shape: AttentionShape, adapters: dict[int, Adapter] | None = None) -> Kvlinc:
    """The cache the adapters are trained for: `config`'s quantization and key coding."""
    return Kvlinc(KiviConfig(config.bits, config.group_size, config.residual), shape, adapters, keys=config.keys)


def _init(shape: tuple[int, int, int], config: TrainConfig, gen: torch.Generator) -> Adapter:
    hq, hkv, d = shape
    sizes = {"q": hq, "k": hkv}
    return Adapter(*(torch.randn(sizes[n[0]], d, config.rank // 2, generator=gen) * d**-0.5 for n in ADAPTER_NAMES))


def train_layer(data: _LayerData, config: TrainConfig, scaling: float, layer: int,
                bar: tqdm | None = None) -> Adapter:
    """Adam on the attention cross-entropy over `data` (training sequences only)."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + layer)  # on the CPU: the same draws on any device
    adapter = _init((data.q.shape[1], data.k.shape[1], data.q.shape[-1]), config, gen)
    adapter = Adapter(*(getattr(adapter, n).to(data.q.device) for n in ADAPTER_NAMES))
    params = [getattr(adapter, n).requires_grad_() for n in ADAPTER_NAMES]
    opt = torch.optim.Adam(params, lr=config.lr)
    n_seq, t = data.q.shape[0], data.q.shape[-2]
    batch = min(config.batch, n_seq)
    for _ in range(config.steps):
        seqs = torch.randperm(n_seq, generator=gen)[:batch].to(data.q.device)
        pos = torch.randint(config.residual - 1, t, (config.tokens,), generator=gen).unique()
        loss = attention_ce(data.take(seqs), pos, config.residual, scaling, adapter).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(layer=layer, loss=f"{loss.item():.4f}")
    # The artifact stores float16; train and report with exactly what is stored.
    return Adapter(*(p.detach().half().float() for p in params))


def train_adapters(activations: str | Path, out: str | Path, rank: int = 256, steps: int = 60, lr: float = 1e-2,
                   bits: int = DEFAULTS["bits"], group_size: int = DEFAULTS["group_size"],
                   residual: int = DEFAULTS["residual"], tokens: int = 128,
                   layers: str = "all", seed: int = 0, gate: bool = True, keys: str = DEFAULTS["keys"],
                   device: str | None = None) -> Path:
    """Train φ_q, φ_k per layer and head on `activations` and save a `kvlinc` artifact to `out`.
    `device`: where the layers train (`--device`; under torchrun each rank its own GPU)."""
    config = TrainConfig(rank=rank, steps=steps, lr=lr, bits=bits, group_size=group_size, residual=residual,
                         tokens=tokens, seed=seed, keys=keys)
    out = ensure_writable_dir(out)
    dev = torch.device(local_device(resolve_device(device)))
    acts = Activations(activations)
    settings = acts.manifest["settings"]
    if not acts.full_sequences:
        raise SettingsError(f"{activations} keeps a sub-sample of positions (--max-tokens); training needs whole "
                            "sequences: collect without --max-tokens")
    if settings["seq_len"] <= residual:
        raise SettingsError(f"sequences of {settings['seq_len']} tokens never flush a block of --residual {residual}")
    if settings["num_samples"] < 2:
        raise SettingsError("training needs at least 2 collected sequences (one is held out)")
    chosen = parse_layers(layers, acts.num_layers)
    if layers == "all":  # the layers a cache compresses: a model's sliding ones it keeps as computed (by default)
        chosen = [i for i in chosen if i not in acts.sliding_windows] or chosen
    fp = acts.fingerprint
    shape = AttentionShape(acts.num_layers, fp["num_heads"], fp["num_kv_heads"], fp["head_dim"])
    kvlinc(config, shape)  # refuses settings the cache cannot hold before training
    scaling = shape.head_dim**-0.5
    n_held = max(1, settings["num_samples"] // 8)

    rank, size = world()
    mine = share(chosen, rank, size)  # under torchrun each rank trains its share of the layers (`kvcalib.parallel`)
    trained: dict[int, tuple[Adapter, float, float, torch.Tensor, torch.Tensor]] = {}
    start = time.perf_counter()
    with tqdm(total=len(mine) * config.steps, unit="step", position=rank,
              desc="train-adapters" if size == 1 else f"train-adapters, rank {rank} of {size}") as bar:
        for i, raw in acts.layers(mine, device=dev):  # onto the device, the next layer read while this one trains
            data = _layer_data(raw, config)
            n = data.q.shape[0]
            train, held = data.take(torch.arange(n - n_held)), data.take(torch.arange(n - n_held, n))
            adapter = train_layer(train, config, scaling, i, bar)
            ce = heldout_loss(held, config, scaling, None), heldout_loss(held, config, scaling, adapter)
            adapter, err_before, err_after = gated(adapter, config, shape, i,
                                                   {x: raw[x][n - n_held:] for x in "qkv"}, scaling)
            log.info("layer %d: held-out attention KL %.4f uncorrected, %.4f corrected; output error lowered in "
                     "%d of %d heads", i, *ce, int(adapter.heads.sum()), len(adapter.heads))
            adapter = Adapter(*(getattr(adapter, n).cpu() for n in ADAPTER_NAMES), heads=adapter.heads.cpu())
            trained[i] = (adapter, *ce, err_before.cpu(), err_after.cpu())
    trained = merged(trained, size)
    seconds = time.perf_counter() - start

    tensors, before, after, kept = {}, [], [], []
    errors: dict[str, list] = {"uncorrected": [], "corrected": [], "heads": []}
    for i in chosen:  # in layer order, whichever rank trained each
        adapter, ce_before, ce_after, err_before, err_after = trained[i]
        before.append(ce_before)
        after.append(ce_after)
        errors["uncorrected"].append(err_before.tolist())
        errors["corrected"].append(err_after.tolist())
        errors["heads"].append(int(adapter.heads.sum()))
        if gate and not adapter.heads.any():
            continue
        kept.append(i)
        tensors |= {f"layers.{i}.{n}": getattr(adapter, n).half() for n in ADAPTER_NAMES}
        if gate:
            tensors[f"layers.{i}.heads"] = adapter.heads.half()
    return on_rank0(lambda: save_artifact(
        out, "kvlinc",
        settings=asdict(config) | {"layers": kept, "trained_layers": chosen, "gate": gate, "scaling": scaling, "value_rotation": "hadamard",
                                   "state_dtype": "float32", "activations": settings},
        fingerprint=acts.fingerprint, tensors=tensors,
        run={"train_seconds": seconds},
        extra={"heldout_ce_uncorrected": before, "heldout_ce_corrected": after,
               "heldout_sequences": n_held, "heldout_head_error_uncorrected": errors["uncorrected"],
               "heldout_head_error_corrected": errors["corrected"], "heads_lowered": errors["heads"]},
    ), rank, size) or out
