"""`plan`: every layer's keys and values coded by the scheme, of several method families, that a bit
budget allows best (the format: `methods/plan.py`).

Layers differ widely in how much a low-bit cache hurts them, and families differ in what they keep:
TurboQuant codes each vector's direction against a calibrated per-coordinate codebook, KIVI and OScaR
quantize keys per channel over groups of tokens. The plan chooses, for every layer and separately for
its keys and its values (an "item"), a scheme from `--candidates` (`plan.parse_scheme`), to minimise the
summed sensitivity of the items under a budget of average bits per cached element. With `--items head`
an item is one KV head's keys or values of a layer: heads of a layer may take different schemes.

1. Codebooks: the calibrated per-coordinate codebooks of `fit-turboquant`
   (`turboquant_fit.fit_codebooks`) for every TurboQuant candidate's width, and the vector codebooks
   (`turboquant_fit.fit_vector_codebooks`, faiss k-means) of every `turboquant-dDbB` candidate, and
   VecInfer's λ and codebooks (`vecinfer_fit.fit_plan_codebooks`) of every `vecinfer-dDbB` candidate,
   fitted on the collection.
2. Sensitivity, on held-out calibration windows (the calibration text after the collection's
   tokens, never the evaluation text), under `eval`'s decode-exact flush rule (a query reads the
   coded tokens older than its last flush, float16 after), every candidate under the plan's one rule
   (`plan.common_flush_step`). For each item, the KL divergence of the model's next-token
   distributions, float16 cache against the item alone coded by the `anchor` scheme (default
   TurboQuant at 2 bits), summed over every position: one forward per item and window. The other
   schemes scale it by the item's squared attention-output error,
   s(item, c) = KL(item, anchor) · ‖Δo(item, c)‖² / ‖Δo(item, anchor)‖², since a small error in one
   layer's output moves the loss to second order (KL ≈ ½ Δoᵀ F Δo); across families this takes F as
   weighing the errors' directions alike, which one anchor cannot check (a KL per family would).
   Per KV head: the error of the query heads that read that KV head (one coded forward gives every
   head's, since a query head reads one KV head), over the item's whole error under the anchor, so
   the heads' shares of the anchor sum to the layer's KL.
   Measured first: a diagonal Fisher estimate, ½ Σ (g ⊙ Δo)² with g the gradient of each window's
   summed loss (as KVQuant weighs its error), ranked items so badly that its plan at 2.25 bits lost to
   uniform 2 bits (perplexity 19.01 against 17.93): one summed gradient per window is a poor Fisher.
3. Choice: a multiple-choice knapsack, solved exactly by dynamic programming over costs in units of
   1/`COST_UNITS` bit per element, each rounded up (so the plan never exceeds the budget).

Cost of an item under a scheme, counted as `eval` counts it: the scheme's stored bits for that part of a
flushed block (`Method.part_bits`: codes, scales and zero points, norms), per element; a TurboQuant
item's codebook (16 bits per centroid) spread over the item's elements in `eval`'s default run (4
windows of 1024 tokens: `SHARED_BITS_TOKENS`); and with `--sink-tokens S` the first S tokens of each
1024-token window in float16 as well. Every item has the same number of elements, so the average over
items is the average per element.

The plan is an artifact of method `plan`, which `eval --method plan --artifacts` and the runtime load
like any other; the manifest's extra holds every sensitivity, every cost and the predicted bits.
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
from ..attention import AttentionOptions, flushed_counts, held_in_float16, intercept, mixed_attention
from ..collect import Activations
from ..data import token_windows
from ..errors import SettingsError
from ..models import (DEFAULT_MODEL, AttentionShape, LoadedModel, attention_shape, check_fingerprint, load_model,
                      resolve_device, sliding_windows)
from ..parallel import placement
from ..defaults import (DEFAULTS, PLAN_ANCHOR, PLAN_CANDIDATES, PLAN_ITEM, PLAN_ITEMS, PLAN_SINK_TOKENS,
                        PLAN_VECTOR_KEYS)
from .. import vq
from .base import Held, Method, apply_residual_mode, check_residual_mode, check_sliding_layers, hold
from .plan import PARTS, Plan, Scheme, codebook_name, common_flush_step, parse_scheme, scheme_coder, smooth_name
from .turboquant import ROTATION_SEED
from .turboquant_fit import check_fit_settings, fit_codebooks, fit_vector_codebooks
from .vecinfer_fit import check_kmeans, fit_plan_codebooks, kmeans_library, library_version

log = logging.getLogger(__name__)
COST_UNITS = 256  # the knapsack's cost resolution: 1/256 bit per element
SHARED_BITS_TOKENS = 4 * 1024  # eval's default run (--num-samples 4 --seq-len 1024): codebooks amortised over it
SEQUENCE_TOKENS = 1024  # eval's default window: float16 sink tokens amortised over it
BARRED_COST = 1e6  # bits per element of a candidate a part may not take (--key-candidates, --value-candidates)


def part_costs(coder: Method, shape: AttentionShape, tokens: int) -> tuple[float, float]:
    """Stored bits per element of the keys and of the values of one flushed block of `tokens` tokens, as
    `coder` stores them (`part_bits`; the bits depend on the shapes only, not on the values)."""
    x = torch.randn(1, shape.num_kv_heads, tokens, shape.head_dim, generator=torch.Generator().manual_seed(0))
    k_bits, v_bits = coder.part_bits(coder.compress(0, x, x))
    return k_bits / x.numel(), v_bits / x.numel()


def item_costs(coders: dict[str, Method], shape: AttentionShape, residual: int, groups: int,
               sink_tokens: int = 0, tokens: int = SHARED_BITS_TOKENS, items: str = "layer") -> torch.Tensor:
    """(2, candidates) bits per element of keys (0) and values (1) under each candidate: stored bits of a
    flushed block; a TurboQuant codebook of `groups` x d x 2^b float16 centroids spread over `tokens`
    tokens of the item's KV heads (every head for layer items; one for head items, so a codebook that
    several heads of a layer share is counted once per head: the plan may spend less than it counts,
    never more); and 16 more bits per element of the float16 sinks in each `SEQUENCE_TOKENS`-token window."""
    item_heads = shape.num_kv_heads if items == "layer" else 1
    cost = torch.zeros(2, len(coders), dtype=torch.float64)
    for j, (name, coder) in enumerate(coders.items()):
        scheme = parse_scheme(name)
        book = 16 * math.prod(scheme.book_shape(groups, shape.head_dim)) if scheme.book else 0
        shared = book / (tokens * item_heads * shape.head_dim) + 16 * sink_tokens / SEQUENCE_TOKENS
        cost[:, j] = torch.tensor(part_costs(coder, shape, residual), dtype=torch.float64) + shared
        if scheme.family == "vecinfer":  # λ: 16 bits per channel of each of the item's heads' keys
            cost[0, j] += 16 / tokens
    return cost


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
    # Each item's cheapest option costs it at least that much whatever it picks: the table runs over what the items
    # spend beyond their cheapest options (`room`), the same optimum and the same ties as over the whole budget, and
    # an option's index fits a byte. (Over the whole budget in int64, 1280 items of a 70B shape at 2.25 bits took a
    # 7.5 GB table.)
    extra = units - units.min(1, keepdim=True).values
    room = capacity - cheapest
    inf = float("inf")
    best = torch.full((room + 1,), inf, dtype=torch.float64)  # best[c]: least sensitivity spending c beyond the cheapest
    best[0] = 0.0
    choice = torch.empty(items, room + 1, dtype=torch.uint8 if options <= 256 else torch.int32)
    for i in range(items):
        nxt = torch.full_like(best, inf)
        arg = torch.zeros(room + 1, dtype=choice.dtype)
        for j in range(options):
            u = int(extra[i, j])
            if u > room:
                continue
            cand = torch.full_like(best, inf)
            cand[u:] = best[: room + 1 - u] + float(sensitivity[i, j])
            better = cand < nxt
            nxt = torch.where(better, cand, nxt)
            arg = torch.where(better, torch.full_like(arg, j), arg)
        best, choice[i] = nxt, arg
    c = int(best.argmin())
    picks = [0] * items
    for i in reversed(range(items)):
        picks[i] = int(choice[i, c])
        c -= int(extra[i, picks[i]])
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


# Positions whose float64 log-probabilities are computed at once for an item's KL: what the sensitivity holds beside
# the reference's (T x vocabulary float64 log-probabilities and probabilities, once a window) stays this many rows
# (a 2048-token window over a 49152-word vocabulary held five full-window float64 tensors, 4 GB, before).
KL_ROWS = 256


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax of logits (T, V) in float64, KL_ROWS rows at a time (no full float64 copy of the logits)."""
    out = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    for a in range(0, logits.shape[0], KL_ROWS):
        out[a : a + KL_ROWS] = torch.log_softmax(logits[a : a + KL_ROWS].double(), -1)
    return out


def kl_sum(ref_logp: torch.Tensor, ref_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Σ over positions of KL(reference ‖ item), from the reference's float64 log-probabilities and
    probabilities (its exp, computed once a window) and the item's logits, in float64, KL_ROWS positions at
    a time."""
    total = torch.zeros((), dtype=torch.float64, device=ref_logp.device)
    for a in range(0, logits.shape[0], KL_ROWS):
        rows = slice(a, a + KL_ROWS)
        total += (ref_p[rows] * (ref_logp[rows] - torch.log_softmax(logits[rows].double(), -1))).sum()
    return total


def measure_sensitivity(lm: LoadedModel, coders: dict[str, Method], windows: torch.Tensor, anchor: str,
                        positions: torch.Tensor | None = None, kept: Sequence[int] = ()) -> torch.Tensor:
    """s (layers, 2, KV heads, len(coders)): the sensitivity of each layer's keys (0) and values (1), per
    KV head, under each coder, in the dict's order, over `windows` (module docstring): the KL divergence
    of the next-token distributions when only that layer's keys or values are coded by `anchor`, times
    the squared attention-output error of the query heads that read the KV head under the coder, over
    that of all query heads under `anchor`. (A query head reads one KV head, so coding all heads at once
    gives each head's error exactly.) Summed over heads, the anchor's is the layer's KL. Every coder
    must flush under the same rule. `positions` (windows x tokens, bool), where given, picks the positions
    whose next-token distributions and attention outputs count (e.g. the answer of a retrieval prompt);
    every position otherwise. The whole window still runs: a counted position reads all before it. Layers in
    `kept` (sliding layers kept as the model computes them) are no items: never coded, their sensitivity zero."""
    shape = attention_shape(lm.config)
    names = list(coders)
    a = names.index(anchor)
    rule = {(c.block, c.window) for c in coders.values()}
    if len(rule) != 1:
        raise ValueError(f"the coders flush under different rules {rule}: a plan measures them under one")
    err = torch.zeros(shape.num_layers, 2, shape.num_kv_heads, len(names), dtype=torch.float64)
    kl = torch.zeros(shape.num_layers, 2, dtype=torch.float64)
    device = next(lm.model.parameters()).device
    block, window = rule.pop()

    def cache_of(k, v, q, opts):
        """The float16 cache, and when each query's keys were flushed, in `eval`'s arithmetic."""
        k16, v16 = held_in_float16(k, v)
        flushed = flushed_counts(q.shape[-2], k.shape[-2], block, device=q.device, window=window)
        return k16, v16, flushed, mixed_attention(q, k16, v16, opts, k16, v16, flushed)

    layers = _decoder_layers(lm.model)
    outputs: dict[int, object] = {}  # each decoder layer's output in the reference forward

    def logits(ids, attend, skip: int = 0) -> torch.Tensor:
        """Next-token logits (T, V) as the model gives them; the first `skip` decoder layers replay their
        reference outputs (their inputs are the reference's: the item under test sits in a later layer)."""
        # a layer's own forward, where the instance holds one (accelerate's device hooks of a spread model
        # wrap it there), is put back after; otherwise the class's
        own = {}  # layer index: what its instance held, for the layers swapped so far
        try:
            for i in range(skip):
                own[i] = layers[i].__dict__.get("forward")
                layers[i].forward = lambda *args, _out=outputs[i], **kwargs: _out
            with torch.no_grad(), intercept(lm.model, attend):
                return lm.model(ids, use_cache=False).logits[0]
        finally:
            for i, forward in own.items():
                if forward is None:
                    del layers[i].forward
                else:
                    layers[i].forward = forward

    if positions is not None and positions.shape != windows.shape:
        raise ValueError(f"positions {tuple(positions.shape)} must have the windows' shape {tuple(windows.shape)}")
    # one bar over every forward (per window: the reference, then one per item), not per window: on a deep model a
    # window's 2 x layers forwards take minutes, and its estimate of the time left should show from the first ones
    targets = [i for i in range(shape.num_layers) if i not in set(kept)]
    with tqdm(total=len(windows) * (1 + 2 * len(targets)), desc="plan: sensitivity", unit="forward") as bar:
        for w, window_ids in enumerate(windows):
            ids = window_ids.unsqueeze(0).to(device)
            rows = slice(None) if positions is None else positions[w].nonzero().squeeze(-1).to(device)

            def per_kv_head(diff: torch.Tensor) -> torch.Tensor:
                """Σ diff² over (B, Hq, T, d) per KV head: query heads j * g .. (j + 1) * g - 1 read KV head j."""
                diff = diff[:, :, rows]
                b, hq, t, d = diff.shape
                return diff.double().pow(2).reshape(b, shape.num_kv_heads, -1).sum((0, 2)).cpu()

            def reference(layer: int, q, k, v, opts: AttentionOptions):
                if layer in kept:  # as the model computes it
                    return mixed_attention(q, k, v, opts)
                k16, v16, flushed, ref = cache_of(k, v, q, opts)
                for j, name in enumerate(names):
                    held: Held = hold(coders[name], layer, k, v)
                    err[layer, 0, :, j] += per_kv_head(mixed_attention(q, k16, v16, opts, held.k, v16, flushed) - ref)
                    err[layer, 1, :, j] += per_kv_head(mixed_attention(q, k16, v16, opts, k16, held.v, flushed) - ref)
                return ref

            hooks = [layer.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out))
                     for i, layer in enumerate(layers)]
            try:
                ref_logp = log_softmax64(logits(ids, reference)[rows])
            finally:
                for hook in hooks:
                    hook.remove()
            bar.update()
            ref_p = ref_logp.exp()  # once a window, not once an item
            for target, which in itertools.product(targets, (0, 1)):
                def one_item(layer: int, q, k, v, opts: AttentionOptions):
                    if layer in kept:
                        return mixed_attention(q, k, v, opts)
                    k16, v16, flushed, ref = cache_of(k, v, q, opts)
                    if layer != target:
                        return ref
                    held: Held = hold(coders[anchor], layer, k, v)
                    kh, vh = (held.k, v16) if which == 0 else (k16, held.v)
                    return mixed_attention(q, k16, v16, opts, kh, vh, flushed)

                skip = target if len(layers) == shape.num_layers else 0
                kl[target, which] += kl_sum(ref_logp, ref_p, logits(ids, one_item, skip=skip)[rows]).cpu()
                bar.update()
    at_anchor = err[..., a : a + 1].sum(2, keepdim=True)  # the item's whole error under the anchor
    return torch.where(at_anchor > 0, kl[..., None, None] * err / at_anchor.clamp_min(1e-300), torch.zeros_like(err))


def plan_path(out: str | Path, budget: float, several: bool) -> Path:
    """Where the plan for `budget` goes: `out` itself, or `out/budget-{budget}` when several budgets share a run."""
    return Path(out) / f"budget-{budget:g}" if several else Path(out)


def candidate_coders(schemes: list[Scheme], shape: AttentionShape, residual: int, residual_mode: str, sink_tokens: int,
                     tensors: dict[str, dict[str, torch.Tensor]], granularity: str,
                     smooth: dict[str, torch.Tensor] | None = None) -> dict[str, Method]:
    """A coder per candidate scheme, all under the plan's one flush rule, with the float16 sinks; `tensors`
    holds each codebook's layers by its tag (`Scheme.book`), `smooth` VecInfer's λ (`smooth_name`)."""
    coders = {}
    for scheme in schemes:
        books = None
        if scheme.book:
            t = tensors[scheme.book]
            books = [(t[f"layers.{i}.k_codebook"], t[f"layers.{i}.v_codebook"]) for i in range(shape.num_layers)]
            if scheme.family == "vecinfer":
                books = [pair + (smooth[smooth_name(i)],) for i, pair in enumerate(books)]
        coders[str(scheme)] = scheme_coder(scheme, shape, residual, books, granularity)
    step = common_flush_step(list(coders.values()))  # divides R: each KIVI-like coder refused an R not a multiple of its G
    for coder in coders.values():
        coder.sink = sink_tokens
        apply_residual_mode(coder, residual_mode)
        if residual_mode == "sliding":
            coder.block = step
    return coders


def kmeans_for(vector_schemes: list[Scheme], kmeans: str, device: str) -> tuple[str, bool]:
    """The k-means (library, on a GPU) of the vector candidates (`kmeans_library`), refused before any work
    where it cannot run (faiss chosen and not installed), naming the candidates that need it."""
    try:
        return kmeans_library(kmeans, device)
    except SettingsError as e:
        shown = ", ".join(map(str, vector_schemes))
        raise SettingsError(f"the candidates {shown} fit vector codebooks by k-means: {e} (or drop them)") from None


def _part_candidates(given: Sequence[str] | None, schemes: list[Scheme], option: str, vectors: bool = True) -> set[str]:
    """The names of the schemes one part may take: `given` (each one of the candidates), or else all of them
    (without `vectors`: the scalar ones, where there are any)."""
    names = [str(s) for s in schemes]
    if given is None:
        scalar = [str(s) for s in schemes if not s.dim]
        return set(names if vectors or not scalar else scalar)
    chosen = {str(parse_scheme(c)) for c in given}
    if not chosen:
        raise SettingsError(f"{option} must name at least one scheme")
    if chosen - set(names):
        raise SettingsError(f"{option}: {', '.join(sorted(chosen - set(names)))} not among --candidates "
                            f"({', '.join(names)})")
    return chosen


def make_plan(activations: str | Path, budget: float | Sequence[float], out: str | Path,
              model: str | LoadedModel = DEFAULT_MODEL, candidates: Sequence[str] = PLAN_CANDIDATES,
              windows: int = 4, seq_len: int = 512, granularity: str = "layer", iters: int = 50,
              residual: int | None = None, sink_tokens: int = PLAN_SINK_TOKENS,
              residual_mode: str = DEFAULTS["residual_mode"], anchor: str = PLAN_ANCHOR,
              items: str = PLAN_ITEM, trust_remote_code: bool = False, device: str | None = None, dtype: str | None = None,
              device_map: str | None = None, max_memory: dict[int | str, str] | None = None,
              kmeans: str = "auto", key_candidates: Sequence[str] | None = None,
              value_candidates: Sequence[str] | None = None,
              sliding_layers: str = DEFAULTS["sliding_layers"]) -> list[Path]:
    """Fit codebooks for every TurboQuant candidate, measure every item's sensitivity to every candidate,
    choose each layer's key and value scheme under each budget, and save each plan as a `plan`
    artifact: at `out` for one budget, at `out/budget-{b}` for several (the codebooks and
    sensitivities, the slow part, are shared). `device_map="auto"` (with `max_memory`) spreads the model over
    the GPUs, as `collect` and `eval` do, for a model larger than one GPU. The vector candidates' k-means
    runs as `fit-codebook --kmeans` chooses (`vecinfer_fit.kmeans_library`): `auto` takes faiss on the CPU,
    kvcalib's own in torch on the model's GPU where faiss has no GPU build. `key_candidates` and
    `value_candidates` (each of `candidates`) are the schemes keys and values may take: every candidate is
    measured on both, and the knapsack never gives a part a scheme outside its own list. None: all of them, but
    for the keys only the scalar ones where there are any (`PLAN_VECTOR_KEYS`: vector codes on keys lose copied
    tokens). `sliding_layers`: a model's sliding layers are kept as it computes them (float16: no items; the budget
    is over the other layers' items, and the plan records them, `Method.float16_layers`) or are items as any layer
    (compress)."""
    place = placement(device, device_map, max_memory, 1)  # a placement given wrong is refused before anything runs
    budgets = [float(budget)] if isinstance(budget, (int, float)) else [float(b) for b in budget]
    schemes = list(dict.fromkeys(parse_scheme(c) for c in candidates))
    if not schemes:
        raise SettingsError("--candidates must name at least one scheme")
    allowed = {"k": _part_candidates(key_candidates, schemes, "--key-candidates", vectors=PLAN_VECTOR_KEYS),
               "v": _part_candidates(value_candidates, schemes, "--value-candidates")}
    anchor = str(parse_scheme(anchor))
    if anchor not in map(str, schemes):
        raise SettingsError(f"--anchor {anchor} must be one of the candidates ({', '.join(map(str, schemes))})")
    if not budgets or any(not b > 0 or not math.isfinite(b) for b in budgets):
        raise SettingsError(f"--budget must be positive numbers of bits per element, got {budgets}")
    if windows < 1 or seq_len < 2:
        raise SettingsError("--windows must be positive and --seq-len at least 2")
    if sink_tokens < 0:
        raise SettingsError(f"--sink-tokens must be 0 or more, got {sink_tokens}")
    check_residual_mode(residual_mode)
    check_sliding_layers(sliding_layers)
    if items not in PLAN_ITEMS:
        raise SettingsError(f"--items must be one of {', '.join(PLAN_ITEMS)}, got {items!r}")
    tq_bits = tuple(sorted({s.bits for s in schemes if s.family == "turboquant" and not s.dim}))
    vectors = tuple(dict.fromkeys(vq.VQConfig(s.dim, s.bits) for s in schemes if s.family == "turboquant" and s.dim))
    vecinfer = tuple(dict.fromkeys(vq.VQConfig(s.dim, s.bits) for s in schemes if s.family == "vecinfer"))
    check_fit_settings(tq_bits, granularity, iters)  # before the model loads, not when the fit starts
    check_kmeans(kmeans)
    # where the vector codebooks are fitted: the model's device, or with --device-map auto the first GPU
    fit_on = resolve_device(None) if device_map == "auto" else place["device"]
    vector_schemes = [s for s in schemes if s.family in ("turboquant", "vecinfer") and s.dim]
    library, gpu = kmeans_for(vector_schemes, kmeans, fit_on) if vector_schemes else ("faiss", False)
    residual = DEFAULTS["residual"] if residual is None else residual
    outs = [ensure_writable_dir(plan_path(out, b, len(budgets) > 1)) for b in budgets]
    acts = Activations(activations)
    lm = load_model(model, **place, dtype=dtype, trust_remote_code=trust_remote_code)
    check_fingerprint(acts.fingerprint, lm.model, f"collection {activations}")
    shape = attention_shape(lm.config)
    groups = 1 if granularity == "layer" else shape.num_kv_heads
    heads = shape.num_kv_heads if items == "head" else 1  # items per layer and part
    kept = sorted(sliding_windows(lm.config)) if sliding_layers == "float16" else []
    if len(kept) == shape.num_layers:
        raise SettingsError(f"every layer of the model slides over a window, kept as it computes them: nothing to plan "
                            "(--sliding-layers compress makes them items)")
    coded = [i for i in range(shape.num_layers) if i not in kept]
    # Costs depend on shapes only: measured on stand-in codebooks, so that a budget below the cheapest
    # plan is refused before any fit.
    standin = {s.book: {f"layers.{i}.{p}_codebook": torch.zeros(s.book_shape(groups, shape.head_dim))
                        for i in range(shape.num_layers) for p in PARTS} for s in schemes if s.book}
    ones = {smooth_name(i): torch.ones(shape.num_kv_heads, shape.head_dim) for i in range(shape.num_layers)}
    coders = candidate_coders(schemes, shape, residual, residual_mode, sink_tokens, standin, granularity, ones)
    part_cost = item_costs(coders, shape, residual, groups, sink_tokens, items=items)
    barred = torch.tensor([[str(c) not in allowed[p] for c in schemes] for p in PARTS])  # (part, candidate)
    # items (layer, part, head) in order; a barred option costs more than any budget allows: never taken
    cost = part_cost.masked_fill(barred, BARRED_COST).repeat_interleave(heads, 0).repeat(len(coded), 1)
    for b in budgets:
        solve(torch.zeros_like(cost), cost, b)
    scalar, _ = fit_codebooks(acts, tq_bits, granularity, iters, desc="plan: codebooks") if tq_bits else ({}, {})
    tensors = {f"b{b}": t for b, t in scalar.items()}
    if vectors:
        tensors |= fit_vector_codebooks(acts, vectors, granularity, iters, desc="plan: vector codebooks",
                                        library=library, gpu=gpu, device=fit_on)
    smooth = {}
    if vecinfer:
        books, smooth = fit_plan_codebooks(acts, vecinfer, granularity, iters, desc="plan: VecInfer codebooks",
                                           library=library, gpu=gpu, device=fit_on)
        tensors |= {f"vecinfer_{tag}": t for tag, t in books.items()}
    coders = candidate_coders(schemes, shape, residual, residual_mode, sink_tokens, tensors, granularity, smooth)
    step = common_flush_step(list(coders.values()))
    sens = measure_sensitivity(lm, coders, heldout_windows(lm, acts, windows, seq_len), anchor, kept=kept)
    item_sens = sens if items == "head" else sens.sum(2, keepdim=True)  # (layers, 2, heads, candidates)
    item_sens = item_sens[coded]  # the items: the layers that are coded
    names = list(coders)
    written = []
    for budget, path in zip(budgets, outs):
        picks = solve(item_sens.reshape(-1, len(names)), cost, budget)
        chosen = [schemes[j] for j in picks]
        # per part and layer, a scheme per KV head (layer items: the layer's one scheme for every head); a kept
        # layer, which nothing reads coded, holds the anchor (the plan names a scheme for every layer)
        at = {i: n for n, i in enumerate(coded)}
        plan = {p: [[chosen[(at[i] * 2 + w) * heads + (h if items == "head" else 0)] if i in at else
                     parse_scheme(anchor) for h in range(shape.num_kv_heads)]
                    for i in range(shape.num_layers)] for w, p in enumerate(PARTS)}
        plan_tensors = {codebook_name(i, p, c.book): tensors[c.book][f"layers.{i}.{p}_codebook"]
                        for i in range(shape.num_layers) for p in PARTS for c in plan[p][i] if c.book}
        plan_tensors |= {smooth_name(i): smooth[smooth_name(i)] for i in range(shape.num_layers)
                         if any(c.family == "vecinfer" for c in plan["k"][i])}
        predicted = sum(float(cost[n, j]) for n, j in enumerate(picks)) / len(picks)
        settings = {p: [[str(c) for c in layer] for layer in plan[p]] for p in PARTS} | {
            "budget": budget, "items": items, "residual": residual, "flush_step": step, "granularity": granularity,
            "rotation_seed": ROTATION_SEED, "iters": iters, "sink_tokens": sink_tokens, "residual_mode": residual_mode,
            "sliding_layers": sliding_layers, "float16_layers": kept}
        extra = {"activations": str(activations), "calibration": acts.manifest["settings"], "candidates": names,
                 "candidates_per_part": {p: sorted(allowed[p], key=names.index) for p in PARTS},
                 **({"kmeans": {"library": library_version(library), "gpu": gpu}} if vector_schemes else {}),
                 "anchor": anchor, "windows": windows, "seq_len": seq_len,
                 "sensitivity_per_kv_head": {p: sens[:, w].tolist() for w, p in enumerate(PARTS)},
                 "cost_bits_per_element": {p: part_cost[w].tolist() for w, p in enumerate(PARTS)},
                 "predicted_bits_per_element": predicted, "shared_bits_tokens": SHARED_BITS_TOKENS}
        log.info("plan at %.4f bits per element (budget %s): keys %s, values %s", predicted, budget,
                 settings["k"], settings["v"])
        written.append(save_artifact(path, Plan.name, settings, acts.fingerprint, plan_tensors, extra))
    return written
