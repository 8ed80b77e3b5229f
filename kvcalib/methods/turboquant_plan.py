"""`plan`: a per-layer bit plan for calibrated TurboQuant under an average bit budget.

Layers differ widely in how much a low-bit cache hurts them, so a single bit width spends bits
where they do not matter. The plan chooses, for every layer and separately for its keys and its
values (an "item"), a bit width b from `--bits` (1-4), to minimise the summed sensitivity of the
items under a budget of average bits per cached element:

1. Codebooks: the calibrated per-coordinate codebooks of `fit-turboquant`
   (`turboquant_fit.fit_codebooks`) for every candidate b, fitted on the collection.
2. Sensitivity, on held-out calibration windows (the calibration text after the collection's
   tokens, never the evaluation text), under `eval`'s decode-exact flush rule (a query reads the
   coded tokens older than its last flush, float16 after). For each item, the KL divergence of the
   model's next-token distributions, float16 cache against the item alone coded at the anchor
   width (the middle candidate, 2 of 1-4 bits), summed over every position: one forward per item
   and window. The other widths scale it by the item's squared attention-output error,
   s(item, b) = KL(item, anchor) · ‖Δo(item, b)‖² / ‖Δo(item, anchor)‖², since a small error in one
   layer's output moves the loss to second order (KL ≈ ½ Δoᵀ F Δo). Measured first: a diagonal
   Fisher estimate, ½ Σ (g ⊙ Δo)² with g the gradient of each window's summed loss (as KVQuant
   weighs its error), ranked items so badly that its plan at 2.25 bits lost to uniform 2 bits
   (perplexity 19.01 against 17.93): one summed gradient per window is a poor Fisher.
3. Choice: a multiple-choice knapsack, solved exactly by dynamic programming over costs in units of
   1/`COST_UNITS` bit per element, each rounded up (so the plan never exceeds the budget).

Cost of an item at b bits, counted as `eval` counts it: the codes and fp16 norm of each vector,
32 ceil(d b / 32) + 16 bits per d elements, plus its codebook (16 bits per centroid) spread over the
item's elements in `eval`'s default run (4 windows of 1024 tokens: `SHARED_BITS_TOKENS`), and with
`--sink-tokens S` the first S tokens of each 1024-token window in float16 as well. Every
item has the same number of elements, so the average over items is the average per element.

The plan is an artifact of method `turboquant` (settings `bits: "plan"`, `k_bits`, `v_bits`,
`budget`; tensors `layers.{i}.{k,v}_codebook` with 2^b centroids each), which `eval --method
turboquant --artifacts` and the runtime load like any other; the manifest's extra holds every
sensitivity and the predicted bits.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..artifacts import save_artifact
from ..atomic import ensure_writable_dir
from ..attention import AttentionOptions, flushed_counts, intercept, mixed_attention
from ..collect import Activations
from ..data import token_windows
from ..errors import SettingsError
from ..models import DEFAULT_MODEL, LoadedModel, attention_shape, check_fingerprint, load_model
from . import DEFAULTS, Held, apply_residual_mode, check_residual_mode, hold
from .turboquant import BITS, ROTATION_SEED, TurboQuant, TurboQuantConfig
from .turboquant_fit import check_fit_settings, fit_codebooks

log = logging.getLogger(__name__)

COST_UNITS = 256  # the knapsack's cost resolution: 1/256 bit per element
SHARED_BITS_TOKENS = 4 * 1024  # eval's default run (--num-samples 4 --seq-len 1024): codebooks amortised over it
SEQUENCE_TOKENS = 1024  # eval's default window: float16 sink tokens amortised over it


def item_cost(head_dim: int, bits: int, groups: int, kv_heads: int, tokens: int = SHARED_BITS_TOKENS,
              sink_tokens: int = 0) -> float:
    """Bits per element of one item (a layer's keys or values) at `bits`: codes and norm, its codebook,
    and its float16 sink tokens (16 bits more per element of each, over a window of `SEQUENCE_TOKENS`)."""
    per_vector = 32 * math.ceil(head_dim * bits / 32) + 16
    codebook = 16 * groups * head_dim * (1 << bits)
    return per_vector / head_dim + codebook / (tokens * kv_heads * head_dim) + 16 * sink_tokens / SEQUENCE_TOKENS


def solve(sensitivity: torch.Tensor, cost: torch.Tensor, budget: float) -> list[int]:
    """The multiple-choice knapsack: for each item i (rows) one option j (columns), minimising
    Σ sensitivity[i, j] under Σ cost[i, j] <= budget · items. Exact over costs rounded up to
    1/COST_UNITS; returns the option of every item. Raises SettingsError when even the cheapest
    options exceed the budget."""
    items, options = sensitivity.shape
    units = torch.ceil(cost.double() * COST_UNITS - 1e-9).long()
    capacity = math.floor(budget * items * COST_UNITS + 1e-9)
    cheapest = int(units.min(1).values.sum())
    if cheapest > capacity:
        least = cheapest / (items * COST_UNITS)
        raise SettingsError(f"--budget {budget} is below the cheapest plan ({least:.4f} bits per element); raise it")
    inf = float("inf")
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)  # best[c]: least sensitivity at total cost c
    best[0] = 0.0
    choice = torch.empty(items, capacity + 1, dtype=torch.long)
    for i in range(items):
        nxt = torch.full_like(best, inf)
        arg = torch.zeros(capacity + 1, dtype=torch.long)
        for j in range(options):
            u = int(units[i, j])
            if u > capacity:
                continue
            cand = torch.full_like(best, inf)
            cand[u:] = best[: capacity + 1 - u] + float(sensitivity[i, j])
            better = cand < nxt
            nxt = torch.where(better, cand, nxt)
            arg = torch.where(better, torch.full_like(arg, j), arg)
        best, choice[i] = nxt, arg
    c = int(best.argmin())
    picks = [0] * items
    for i in reversed(range(items)):
        picks[i] = int(choice[i, c])
        c -= int(units[i, picks[i]])
    return picks


def heldout_windows(lm: LoadedModel, acts: Activations, windows: int, seq_len: int) -> torch.Tensor:
    """`windows` x `seq_len` tokens of the calibration text after the tokens the collection used."""
    cal = acts.manifest["settings"]
    skip = cal["num_samples"] * cal["seq_len"]
    flat = token_windows(lm.tokenizer, cal["dataset"], "calibration", 1, skip + windows * seq_len, cal["text_field"])
    return flat[0, skip:].reshape(windows, seq_len)


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (`model.model.layers` and its kin), or []."""
    try:
        return list(model.get_decoder().layers)
    except AttributeError:
        return []


def measure_sensitivity(lm: LoadedModel, coders: dict[int, TurboQuant], windows: torch.Tensor,
                        anchor: int | None = None) -> torch.Tensor:
    """s (layers, 2, len(coders)): the sensitivity of each layer's keys (0) and values (1) at each
    coder's bits, over `windows` (module docstring): the KL divergence of the next-token
    distributions when only that item is coded at the `anchor` bits (default: the middle candidate),
    scaled to the other bits by the item's squared attention-output error."""
    shape = attention_shape(lm.config)
    bits = sorted(coders)
    a = bits.index(anchor) if anchor is not None else (len(bits) - 1) // 2
    err = torch.zeros(shape.num_layers, 2, len(bits), dtype=torch.float64)
    kl = torch.zeros(shape.num_layers, 2, dtype=torch.float64)
    device = next(lm.model.parameters()).device

    def cache_of(k, v, q, opts):
        """The float16 cache, and when each query's keys were flushed, in `eval`'s arithmetic."""
        k16, v16 = k.half().to(k.dtype), v.half().to(v.dtype)
        c = coders[bits[0]]
        flushed = flushed_counts(q.shape[-2], k.shape[-2], c.block, device=q.device, window=c.window)
        return k16, v16, flushed, mixed_attention(q, k16, v16, opts, k16, v16, flushed)

    layers = _decoder_layers(lm.model)
    outputs: dict[int, object] = {}  # each decoder layer's output in the reference forward

    def log_probs(ids, attend, skip: int = 0) -> torch.Tensor:
        """Next-token log-probabilities; the first `skip` decoder layers replay their reference outputs
        (their inputs are the reference's: the item under test sits in a later layer)."""
        for i in range(skip):
            layers[i].forward = lambda *args, _out=outputs[i], **kwargs: _out
        try:
            with torch.no_grad(), intercept(lm.model, attend):
                return torch.log_softmax(lm.model(ids, use_cache=False).logits[0].double(), -1)
        finally:
            for i in range(skip):
                del layers[i].forward  # the class's forward again

    for window in tqdm(windows, desc="plan: sensitivity", unit="window"):
        ids = window.unsqueeze(0).to(device)

        def reference(layer: int, q, k, v, opts: AttentionOptions):
            k16, v16, flushed, ref = cache_of(k, v, q, opts)
            for j, b in enumerate(bits):
                held: Held = hold(coders[b], layer, k, v)
                err[layer, 0, j] += (mixed_attention(q, k16, v16, opts, held.k, v16, flushed) - ref).double().pow(2).sum().cpu()
                err[layer, 1, j] += (mixed_attention(q, k16, v16, opts, k16, held.v, flushed) - ref).double().pow(2).sum().cpu()
            return ref

        hooks = [layer.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out))
                 for i, layer in enumerate(layers)]
        try:
            ref_logp = log_probs(ids, reference)
        finally:
            for hook in hooks:
                hook.remove()
        for target, which in itertools.product(range(shape.num_layers), (0, 1)):
            def one_item(layer: int, q, k, v, opts: AttentionOptions):
                k16, v16, flushed, ref = cache_of(k, v, q, opts)
                if layer != target:
                    return ref
                held: Held = hold(coders[bits[a]], layer, k, v)
                kh, vh = (held.k, v16) if which == 0 else (k16, held.v)
                return mixed_attention(q, k16, v16, opts, kh, vh, flushed)

            logp = log_probs(ids, one_item, skip=target if len(layers) == shape.num_layers else 0)
            kl[target, which] += (ref_logp.exp() * (ref_logp - logp)).sum().cpu()
    at_anchor = err[..., a : a + 1]
    return torch.where(at_anchor > 0, kl[..., None] * err / at_anchor.clamp_min(1e-300), torch.zeros_like(err))


def plan_path(out: str | Path, budget: float, several: bool) -> Path:
    """Where the plan for `budget` goes: `out` itself, or `out/budget-{budget}` when several budgets share a run."""
    return Path(out) / f"budget-{budget:g}" if several else Path(out)


def make_plan(activations: str | Path, budget: float | Sequence[float], out: str | Path,
              model: str | LoadedModel = DEFAULT_MODEL, bits: tuple[int, ...] = BITS, windows: int = 4,
              seq_len: int = 512, granularity: str = "layer", iters: int = 50,
              residual: int | None = None, sink_tokens: int = 0,
              residual_mode: str = DEFAULTS["residual_mode"]) -> list[Path]:
    """Fit codebooks for every candidate bit width, measure every item's sensitivity, choose the bits
    of every layer's keys and values under each budget, and save each plan as a TurboQuant artifact:
    at `out` for one budget, at `out/budget-{b}` for several (the codebooks and sensitivities, the
    slow part, are shared)."""
    budgets = [float(budget)] if isinstance(budget, (int, float)) else [float(b) for b in budget]
    bits = tuple(sorted(set(bits)))
    if not bits:
        raise SettingsError("--bits must list widths in 1..4, got none")
    if not budgets or any(not b > 0 or not math.isfinite(b) for b in budgets):
        raise SettingsError(f"--budget must be positive numbers of bits per element, got {budgets}")
    if windows < 1 or seq_len < 2:
        raise SettingsError("--windows must be positive and --seq-len at least 2")
    if sink_tokens < 0:
        raise SettingsError(f"--sink-tokens must be 0 or more, got {sink_tokens}")
    check_residual_mode(residual_mode)
    check_fit_settings(bits, granularity, iters)  # before the model loads, not when the fit starts
    residual = DEFAULTS["residual"] if residual is None else residual
    outs = [ensure_writable_dir(plan_path(out, b, len(budgets) > 1)) for b in budgets]
    acts = Activations(activations)
    lm = load_model(model)
    check_fingerprint(acts.fingerprint, lm.model, f"collection {activations}")
    shape = attention_shape(lm.config)
    groups = 1 if granularity == "layer" else shape.num_kv_heads
    cost = torch.tensor([[item_cost(shape.head_dim, b, groups, shape.num_kv_heads, sink_tokens=sink_tokens) for b in bits]]
                        * (2 * shape.num_layers))
    for b in budgets:  # a budget below the cheapest plan is refused before any work
        solve(torch.zeros_like(cost), cost, b)
    tensors, _ = fit_codebooks(acts, bits, granularity, iters, desc="plan: codebooks")
    coders = {}
    for b in bits:
        books = [(tensors[b][f"layers.{i}.k_codebook"], tensors[b][f"layers.{i}.v_codebook"])
                 for i in range(shape.num_layers)]
        coders[b] = TurboQuant(TurboQuantConfig(bits=b, residual=residual), shape, books, granularity)
        coders[b].sink = sink_tokens
        apply_residual_mode(coders[b], residual_mode)
    sens = measure_sensitivity(lm, coders, heldout_windows(lm, acts, windows, seq_len))
    written = []
    for budget, path in zip(budgets, outs):
        picks = solve(sens.reshape(2 * shape.num_layers, len(bits)), cost, budget)
        chosen = [bits[j] for j in picks]  # items in order layer 0 keys, layer 0 values, layer 1 keys, ...
        k_bits, v_bits = chosen[0::2], chosen[1::2]
        plan_tensors = {}
        for i in range(shape.num_layers):
            plan_tensors[f"layers.{i}.k_codebook"] = tensors[k_bits[i]][f"layers.{i}.k_codebook"]
            plan_tensors[f"layers.{i}.v_codebook"] = tensors[v_bits[i]][f"layers.{i}.v_codebook"]
        predicted = sum(float(cost[n, j]) for n, j in enumerate(picks)) / len(picks)
        settings = {"bits": "plan", "k_bits": k_bits, "v_bits": v_bits, "budget": budget, "granularity": granularity,
                    "rotation_seed": ROTATION_SEED, "iters": iters, "sink_tokens": sink_tokens,
                    "residual_mode": residual_mode}
        extra = {"activations": str(activations), "calibration": acts.manifest["settings"],
                 "candidate_bits": list(bits), "residual": residual, "windows": windows, "seq_len": seq_len,
                 "sensitivity": {"k": sens[:, 0].tolist(), "v": sens[:, 1].tolist()},
                 "predicted_bits_per_element": predicted, "shared_bits_tokens": SHARED_BITS_TOKENS}
        log.info("plan at %.4f bits per element (budget %s): keys %s, values %s", predicted, budget, k_bits, v_bits)
        written.append(save_artifact(path, TurboQuant.name, settings, acts.fingerprint, plan_tensors, extra))
    return written
