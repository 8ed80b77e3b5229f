"""`diagnose`: Token Norm Imbalance (TNI) in collected Q/K/V, and what it costs low-bit quantization.

For every layer, tensor (q, k, v) and head: the distribution of per-token L2 norms (taken per head,
as in the OScaR paper), imbalance figures (max/min, max/median, coefficient of variation) and the
outlier tokens with their sample and position. A token is an outlier when its log-norm lies more
than `z` robust standard deviations (1.4826 x MAD) from the median AND its norm is more than `ratio`
times below (low-norm, attention sinks) or above (high-norm) the median of its head.

Quantization error of keys (per channel, groups of G tokens) and values (per token, groups of
min(G, d) channels), round-to-nearest at each bit width, measured in the original space after each
transform of `kvcalib.methods.oscar` is undone: none, token scaling alone (l2), Hadamard rotation
alone, and both (OScaR). For keys, the groups that hold an outlier token are scored twice: as
stored, and with the outliers left out of the group's range, so the error the outliers inflict on
their neighbours is a number. A per-token value group holds one token, so no outlier changes another
token's value error; for values the outliers' own relative error is set against the others'.
Scaling values is a no-op for per-token groups (the error scales with the token), which is why OScaR
scales only keys; the value figures under "scaling" show exactly that.

Writes `report.json`, `report.md` and PNG plots into `out` (atomically, as one directory).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .atomic import atomic_path, ensure_writable_dir, write_json
from .collect import Activations, tokens_per_second
from .errors import SettingsError
from .methods import DEFAULTS
from .methods.base import check_sliding_layers
from .methods.oscar import decode_keys, encode_keys
from .devices import resolve_device
from .parallel import merged, on_rank0, share, world
from .quant import round_trip
from .token_norms import TENSORS, TRANSFORMS, OutlierRule, find_outliers, norm_stats

log = logging.getLogger(__name__)

_LISTED = 256  # outlier tokens listed per head in report.json (the counts are always complete)


def _outlier_tokens(mask: torch.Tensor, positions: torch.Tensor) -> list[list[int]]:
    """[sample, position] of every True token of mask (S, T), at most _LISTED."""
    s, t = mask.nonzero(as_tuple=True)
    return [[int(a), int(positions[a, b])] for a, b in zip(s[:_LISTED], t[:_LISTED])]


def _position_counts(mask: torch.Tensor, positions: torch.Tensor) -> dict[str, int]:
    """How often each position holds an outlier (over samples and heads), most frequent first."""
    pos = positions.unsqueeze(1).expand_as(mask)[mask]
    values, counts = pos.unique(return_counts=True)
    order = counts.argsort(descending=True)[:20]
    return {str(int(values[i])): int(counts[i]) for i in order}


def _norm_report(x: torch.Tensor, positions: torch.Tensor, rule: OutlierRule) -> tuple[dict, torch.Tensor]:
    """Per-head norm figures and outliers of x (S, H, T, d); returns them and the outlier mask (S, H, T)."""
    norms = x.norm(dim=-1)
    low, high = torch.zeros_like(norms, dtype=torch.bool), torch.zeros_like(norms, dtype=torch.bool)
    heads = []
    for h in range(x.shape[1]):
        low[:, h], high[:, h] = find_outliers(norms[:, h], rule)
        heads.append(norm_stats(norms[:, h]) | {
            "low_count": int(low[:, h].sum()), "high_count": int(high[:, h].sum()),
            "low_tokens": _outlier_tokens(low[:, h], positions), "high_tokens": _outlier_tokens(high[:, h], positions),
        })
    summary = {
        "heads": heads,
        "low_positions": _position_counts(low, positions),
        "high_positions": _position_counts(high, positions),
    }
    return summary, low | high


def _channel_peak(x: torch.Tensor) -> float:
    """Mean over sequences, heads and channels of max_t |x| / rms_t(x): how spiky channels are."""
    rms = x.pow(2).mean(-2).sqrt().clamp_min(1e-30)
    return (x.abs().amax(-2) / rms).mean().item()


def _quant_report(x: torch.Tensor, outliers: torch.Tensor, bits: int, group: int, axis: str) -> dict:
    """Error figures of one tensor (S, H, T, d) at one bit width under every transform."""
    norm2 = x.pow(2).sum(-1)
    d = x.shape[-1]
    groups = outliers.reshape(*outliers.shape[:-1], -1, group).any(-1).repeat_interleave(group, -1)
    others = groups & ~outliers
    out = {}
    for name, (rotation, scaling) in TRANSFORMS.items():
        xt, s = encode_keys(x, rotation, scaling)

        def token_err2(keep=None):
            return (decode_keys(round_trip(xt, bits, group, axis, keep), s, rotation) - x).pow(2).sum(-1)

        err2 = token_err2()
        tnorm = xt.norm(dim=-1)
        rel = (err2 / norm2.clamp_min(1e-30)).sqrt()
        fig = {
            "mse": err2.sum().item() / x.numel(),
            "rel_err": math.sqrt(err2.sum().item() / norm2.sum().item()),
            "rel_err_outlier_tokens": rel[outliers].mean().item() if outliers.any() else None,
            "rel_err_other_tokens": rel[~outliers].mean().item(),
            "channel_peak": _channel_peak(xt),
            "norm_max_over_median": (tnorm.amax() / tnorm.median()).item(),
            "norm_cv": (tnorm.std() / tnorm.mean()).item(),
        }
        if axis == "tokens" and others.any():
            fig |= {
                "mse_outlier_groups": err2[groups].sum().item() / (int(groups.sum()) * d),
                "mse_others_with_outliers": err2[others].sum().item() / (int(others.sum()) * d),
                "mse_others_without_outliers": token_err2(~outliers)[others].sum().item() / (int(others.sum()) * d),
            }
        out[name] = fig
    return out


def _layer(data: dict[str, torch.Tensor], bits: list[int], group: int, rule: OutlierRule) -> dict:
    positions = data["positions"].long()
    report: dict = {"norms": {}, "quant": {}}
    masks = {}
    for name in TENSORS:
        report["norms"][name], masks[name] = _norm_report(data[name].float(), positions, rule)
    d = data["k"].shape[-1]
    for name, axis, g in (("k", "tokens", group), ("v", "channels", min(group, d))):
        x = data[name].float()
        report["quant"][name] = {str(b): _quant_report(x, masks[name], b, g, axis) for b in bits}
    return report


def _check(bits: list[int], group_size: int, acts: Activations, max_samples: int | None,
           plot_layers: list[int] | None) -> None:
    if not bits or any(not 1 <= b <= 8 for b in bits):
        raise SettingsError(f"--bits must list widths in 1..8, got {bits}")
    if group_size < 1:
        raise SettingsError("--group-size must be positive")
    if max_samples is not None and max_samples < 1:
        raise SettingsError("--max-samples must be positive")
    if plot_layers is not None and any(not 0 <= i < acts.num_layers for i in plot_layers):
        raise SettingsError(f"--plot-layers must be in 0..{acts.num_layers - 1}, got {plot_layers}")
    d = acts.fingerprint["head_dim"]
    if d % min(group_size, d):
        raise SettingsError(f"--group-size {group_size} must divide head_dim {d} for values")


def diagnose(activations: str | Path, out: str | Path, bits: tuple[int, ...] | list[int] = (2, 3, 4),
             group_size: int = DEFAULTS["group_size"], max_samples: int | None = None, plot_layers: list[int] | None = None,
             outlier_z: float = 3.5, outlier_ratio: float = 2.0, device: str | None = None,
             sliding_layers: str = DEFAULTS["sliding_layers"]) -> Path:
    """Measure TNI in a collection and its cost to RTN quantization; write report.json, report.md, PNGs.
    `device`: where the statistics are computed (`--device`). `sliding_layers`: the model's sliding layers (as the
    collection records them) are measured and reported, but under float16, which keeps them uncompressed, they
    count in no summary figure and are no default plot's strongest imbalance; under compress they are as any."""
    from .diagnose_plots import figures, render  # matplotlib is imported only here

    acts = Activations(activations)
    check_sliding_layers(sliding_layers)
    float16 = sorted(acts.sliding_windows) if sliding_layers == "float16" else []
    bits = sorted(set(bits))
    _check(bits, group_size, acts, max_samples, plot_layers)
    out = ensure_writable_dir(out, "--out")
    rule = OutlierRule(outlier_z, outlier_ratio)
    dev = torch.device(resolve_device(device))
    rank, size = world()
    measured: dict[int, tuple[dict, int, int]] = {}  # layer -> its report, samples, tokens
    # What a layer's plots need grows with the samples and tokens: it is kept only for the layers that can be
    # plotted (`_plottable`), at most three, so memory and what the ranks gather stay flat in the collection's size.
    kept: dict[int, dict] = {}
    # under torchrun each rank measures its share of the layers (`kvcalib.parallel`); rank 0 writes the report
    mine = share(list(range(acts.num_layers)), rank, size)
    # shard by shard onto the device, only the shards used, the next layer read while this one is measured
    bar = tqdm(acts.layers(mine, device=dev, samples=max_samples), total=len(mine), unit="layer", position=rank,
               desc="diagnose" if size == 1 else f"diagnose, rank {rank} of {size}")
    for i, data in bar:
        samples = data["q"].shape[0]  # at most max_samples: `layers` read no more
        tokens = data["q"].shape[2] // group_size * group_size
        if tokens == 0:
            raise SettingsError(f"the collection keeps {data['q'].shape[2]} tokens per sample, fewer than --group-size {group_size}")
        data = {k: t[..., :tokens, :] if t.dim() == 4 else t[:, :tokens] for k, t in data.items()}  # already on dev
        measured[i] = (_layer(data, bits, group_size, rule), samples, tokens)
        plottable = _plottable(measured, acts.num_layers, plot_layers, float16)
        if i in plottable:
            kept[i] = {"norms": {name: data[name].float().norm(dim=-1).cpu() for name in TENSORS},
                       "k0": data["k"][0].float().cpu(), "positions": data["positions"][0].long().cpu()}
        kept = {j: plots for j, plots in kept.items() if j in plottable}
        tokens_per_second(bar, samples * tokens)
    measured, kept = merged(measured, size), merged(kept, size)
    layers = [measured[i][0] for i in range(acts.num_layers)]
    samples, tokens = measured[acts.num_layers - 1][1:]
    chosen = plot_layers if plot_layers is not None else _default_plot_layers(layers, float16)
    report = {
        "activations": str(acts.directory),
        "model": acts.manifest["model"],
        "model_fingerprint": acts.fingerprint,
        "full_sequences": acts.full_sequences,
        "samples": samples,
        "tokens_per_sample": tokens,
        "bits": bits,
        "group_size": group_size,
        "outlier_rule": {"z": rule.z, "ratio": rule.ratio},
        "plot_layers": chosen,
        "float16_layers": float16,  # sliding layers kept uncompressed: in no summary figure
        "layers": layers,
    }
    report["summary"] = summarize(report)
    # the plots take seconds each: under torchrun every rank draws its share, rank 0 writes them all
    draws = figures(report, {i: kept[i] for i in chosen})
    pngs = merged(render(draws, share(list(draws), rank, size)), size)

    def write() -> Path:
        """The report over every layer, written once (by rank 0 under torchrun)."""
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            tmp.mkdir()
            write_json(tmp / "report.json", report)
            for name in draws:
                (tmp / name).write_bytes(pngs[name])
            (tmp / "report.md").write_text(markdown(report, list(draws)))
        return out

    return on_rank0(write, rank, size) or out


def _imbalance(layer: dict) -> float:
    """A layer's strongest key-norm imbalance: the largest max/min over its KV heads."""
    return max(h["max_over_min"] for h in layer["norms"]["k"]["heads"])


def _worst(reports: dict[int, dict], float16: list[int] = ()) -> int:
    """The layer (of `reports`: layer -> its report) with the strongest key-norm imbalance, the first of equals;
    layers kept uncompressed (`float16`) only where no other layer is there."""
    coded = [i for i in reports if i not in float16] or list(reports)
    return max(coded, key=lambda i: (_imbalance(reports[i]), -i))


def _default_plot_layers(layers: list[dict], float16: list[int] = ()) -> list[int]:
    """The first layer, the layer with the strongest key-norm imbalance (`_worst`), and the last layer."""
    return sorted({0, _worst(dict(enumerate(layers)), float16), len(layers) - 1})


def _plottable(measured: dict[int, tuple], num_layers: int, plot_layers: list[int] | None,
               float16: list[int] = ()) -> set[int]:
    """The layers measured so far (`measured`: layer -> (report, ...), in increasing order) that may still be
    plotted: those asked for, or else the first, the last and the strongest imbalance so far (`_worst`, the
    rule `_default_plot_layers` applies to all of them). The layer it picks over all layers is the first of
    equals among each rank's own, so each rank keeping its own is enough."""
    if plot_layers is not None:
        return set(plot_layers)
    return {0, num_layers - 1, _worst({i: m[0] for i, m in measured.items()}, float16)}


def summarize(report: dict) -> dict:
    """Headline figures over the layers that are compressed (all but `float16_layers`) at the lowest bit width;
    the layer lists name layers by their index in the model."""
    b = str(report["bits"][0])
    kept = set(report.get("float16_layers", []))
    layers = {i: l for i, l in enumerate(report["layers"]) if i not in kept} or dict(enumerate(report["layers"]))
    key = {t: {i: l["quant"]["k"][b][t]["rel_err"] for i, l in layers.items()} for t in TRANSFORMS}
    val = {t: {i: l["quant"]["v"][b][t]["rel_err"] for i, l in layers.items()} for t in TRANSFORMS}
    return {
        "bits": int(b),
        "key_rel_err_mean": {t: sum(e.values()) / len(e) for t, e in key.items()},
        "value_rel_err_mean": {t: sum(e.values()) / len(e) for t, e in val.items()},
        "layers_with_low_norm_key_tokens": [i for i, l in layers.items()
                                            if any(h["low_count"] for h in l["norms"]["k"]["heads"])],
        # The scaling-induced outlier artifact: scaling alone makes keys worse than doing nothing.
        "layers_where_scaling_alone_hurts_keys": [i for i in layers if key["scaling"][i] > key["none"][i]],
        "layers_where_oscar_beats_rotation_on_keys": [i for i in layers if key["oscar"][i] < key["rotation"][i]],
    }


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def markdown(report: dict, plots: list[str]) -> str:
    """The readable report."""
    s = report["summary"]
    b = str(s["bits"])
    lines = [
        "# Token Norm Imbalance diagnosis",
        "",
        f"Activations: `{report['activations']}` ({report['model']}). Used {report['samples']} samples x "
        f"{report['tokens_per_sample']} tokens of every one of the {len(report['layers'])} layers"
        + ("" if report["full_sequences"] else " (the collection itself holds sub-sampled token positions)")
        + ". Norms are per token and head (L2 over head_dim); quantization is round-to-nearest, "
        f"groups of {report['group_size']} (keys per channel over tokens, values per token over channels), "
        f"bits {', '.join(map(str, report['bits']))}; errors are measured in the original space.",
        "",
        f"Outlier tokens: |robust z| of the log-norm > {report['outlier_rule']['z']} and norm more than "
        f"{report['outlier_rule']['ratio']}x away from the head's median.",
        "",
        f"## Summary at {b} bits",
        "",
        *([f"Sliding layers {report['float16_layers']} are kept uncompressed (--sliding-layers float16): measured "
           "below, in no summary figure.", ""] if report.get("float16_layers") else []),
        "| transform | key rel. error (mean over layers) | value rel. error (mean over layers) |",
        "|---|---:|---:|",
    ]
    for t in TRANSFORMS:
        lines.append(f"| {t} | {s['key_rel_err_mean'][t]:.4f} | {s['value_rel_err_mean'][t]:.4f} |")
    lines += [
        "",
        f"- Layers with low-norm key tokens: {s['layers_with_low_norm_key_tokens'] or 'none'}",
        f"- Scaling-induced outlier artifact (token scaling alone raises key error above no transform): "
        f"layers {s['layers_where_scaling_alone_hurts_keys'] or 'none'}",
        f"- OScaR (rotation + scaling) beats rotation alone on keys in "
        f"{len(s['layers_where_oscar_beats_rotation_on_keys'])} of "
        f"{len(report['layers']) - len(report.get('float16_layers', []))} layers",
        "",
        "## Key norms and outliers per layer",
        "",
        "Worst head of each layer; positions are the most frequent outlier positions (position: count over samples and heads).",
        "",
        "| layer | max/min | max/median | CV | low-norm tokens | low positions | high-norm tokens | high positions |",
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for i, l in enumerate(report["layers"]):
        k = l["norms"]["k"]
        worst = max(k["heads"], key=lambda h: h["max_over_median"])
        low = sum(h["low_count"] for h in k["heads"])
        high = sum(h["high_count"] for h in k["heads"])
        top = lambda p: ", ".join(f"{pos}: {n}" for pos, n in list(p.items())[:4]) or "-"  # noqa: E731
        lines.append(f"| {i} | {_fmt(worst['max_over_min'])} | {_fmt(worst['max_over_median'])} | {_fmt(worst['cv'])} | "
                     f"{low} | {top(k['low_positions'])} | {high} | {top(k['high_positions'])} |")
    lines += [
        "",
        f"## Key quantization at {b} bits per layer",
        "",
        "Relative error ||k̂ − k|| / ||k|| under each transform; then, for groups holding an outlier token, "
        "the MSE of the other tokens with the outliers in the group's range against without them (none transform), "
        "and the channel peak (max/rms per channel) of what is quantized.",
        "",
        "| layer | none | scaling | rotation | oscar | outlier tokens (none / oscar) | others with / without outliers | channel peak none / scaling / rotation / oscar |",
        "|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for i, l in enumerate(report["layers"]):
        q = l["quant"]["k"][b]
        wo = q["none"].get("mse_others_without_outliers")
        inflation = f"{_fmt(q['none']['mse_others_with_outliers'])} / {_fmt(wo)}" if wo is not None else "-"
        lines.append(f"| {i} | " + " | ".join(f"{q[t]['rel_err']:.4f}" for t in TRANSFORMS)
                     + f" | {_fmt(q['none']['rel_err_outlier_tokens'])} / {_fmt(q['oscar']['rel_err_outlier_tokens'])}"
                     + f" | {inflation} | " + " / ".join(f"{q[t]['channel_peak']:.2f}" for t in TRANSFORMS) + " |")
    lines += ["", f"## Value quantization at {b} bits per layer", "",
              "| layer | none | scaling | rotation | oscar | outlier tokens (none / oscar) | other tokens (none / oscar) |",
              "|---:|---:|---:|---:|---:|---|---|"]
    for i, l in enumerate(report["layers"]):
        q = l["quant"]["v"][b]
        lines.append(f"| {i} | " + " | ".join(f"{q[t]['rel_err']:.4f}" for t in TRANSFORMS)
                     + f" | {_fmt(q['none']['rel_err_outlier_tokens'])} / {_fmt(q['oscar']['rel_err_outlier_tokens'])}"
                     + f" | {_fmt(q['none']['rel_err_other_tokens'])} / {_fmt(q['oscar']['rel_err_other_tokens'])} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "Every figure for every bit width, head and tensor (q too) is in `report.json`.", ""]
    return "\n".join(lines)
