"""The PNG plots of `kvcalib diagnose` (matplotlib, Agg backend)."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import BinaryIO

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from .quant import round_trip  # noqa: E402
from .token_norms import TENSORS, TRANSFORMS, OutlierRule, find_outliers  # noqa: E402
from .methods.oscar import decode_keys, encode_keys  # noqa: E402

_SHOWN = 128  # token positions drawn in the per-position panels
_COLORS = {"none": "tab:gray", "scaling": "tab:orange", "rotation": "tab:blue", "oscar": "tab:green"}


def _norm_figure(layer: int, kept: dict, file: BinaryIO) -> None:
    """Box plots of per-token norms per head (top) and norms along the first positions (bottom)."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for col, name in enumerate(TENSORS):
        norms = kept["norms"][name]  # (S, H, T)
        heads = norms.shape[1]
        ax = axes[0, col]
        ax.boxplot([norms[:, h].flatten().numpy() for h in range(heads)], whis=(1, 99), flierprops={"markersize": 2})
        ax.set_xticks(range(1, heads + 1), [str(h) for h in range(heads)])
        ax.set_yscale("log")
        ax.set_title(f"layer {layer} {name.upper()}: per-token L2 norm per head (whiskers 1-99%)")
        ax.set_xlabel("head")
        ax.set_ylabel("norm (log)")
        ax = axes[1, col]
        shown = min(_SHOWN, norms.shape[2])
        for h in range(heads):
            ax.plot(kept["positions"][:shown].numpy(), norms[:, h, :shown].median(0).values.numpy(), lw=1, label=f"head {h}")
        ax.set_yscale("log")
        ax.set_title(f"{name.upper()} norm by position (median over samples)")
        ax.set_xlabel("token position")
        if heads <= 9:
            ax.legend(fontsize=7, ncol=3)
    fig.savefig(file, dpi=90, format="png")
    plt.close(fig)


def _oscar_figure(layer: int, kept: dict, bits: int, group: int, rule: OutlierRule, file: BinaryIO) -> None:
    """One key head of the first sample: what gets quantized under each transform, and the error."""
    k = kept["k0"]  # (H, T, d)
    norms_k = kept["norms"]["k"]  # (S, H, T)
    low = torch.stack([find_outliers(norms_k[:, h], rule)[0] for h in range(norms_k.shape[1])], dim=1)
    head = int(low.sum((0, 2)).argmax())
    x = k[head : head + 1]
    shown = min(64, x.shape[1])
    fig = plt.figure(figsize=(16, 8), constrained_layout=True)
    grid = fig.add_gridspec(2, 4)
    errors = {}
    for col, (name, (rotation, scaling)) in enumerate(TRANSFORMS.items()):
        xt, s = encode_keys(x, rotation, scaling)
        xr = decode_keys(round_trip(xt, bits, group, "tokens"), s, rotation)
        errors[name] = ((xr - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[0]
        ax = fig.add_subplot(grid[0, col])
        im = ax.imshow(xt[0, :shown].abs().numpy(), aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(f"{name}: |quantized input|")
        ax.set_xlabel("channel")
        ax.set_ylabel("token position")
        fig.colorbar(im, ax=ax, shrink=0.8)
    positions = kept["positions"].numpy()
    ax = fig.add_subplot(grid[1, :2])
    norms = x[0].norm(dim=-1)
    ax.plot(positions, norms.numpy(), lw=0.8, color="tab:gray", label="before: ||k|| per token")
    ax.plot(positions, torch.ones_like(norms).numpy(), lw=1.5, color="tab:green", label="after OScaR scaling (stored as codes)")
    marked = low[0, head]
    ax.scatter(positions[marked.numpy()], norms[marked].numpy(), color="red", zorder=3, s=18, label="low-norm outliers")
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_title(f"layer {layer}, KV head {head}, sample 0: key norms before / after OScaR")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[1, 2:])
    for name, err in errors.items():
        ax.plot(positions, err.numpy(), lw=0.8, color=_COLORS[name], label=f"{name} (mean {err.mean():.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_title(f"{bits}-bit per-channel key error per token, ||k̂−k||/||k||")
    ax.legend(fontsize=8)
    fig.savefig(file, dpi=90, format="png")
    plt.close(fig)


def _error_figure(report: dict, file: BinaryIO) -> None:
    """Relative quantization error per layer under each transform, keys and values, lowest bit width."""
    b = str(report["bits"][0])
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), constrained_layout=True)
    for ax, name in zip(axes, ("k", "v")):
        for t in TRANSFORMS:
            ax.plot([l["quant"][name][b][t]["rel_err"] for l in report["layers"]], marker="o", ms=3,
                    color=_COLORS[t], label=t)
        ax.set_title(f"{'keys' if name == 'k' else 'values'}: {b}-bit relative error per layer")
        ax.set_xlabel("layer")
        ax.set_ylabel("||x̂−x|| / ||x||")
        ax.legend()
    fig.savefig(file, dpi=90, format="png")
    plt.close(fig)


def figures(report: dict, kept: dict[int, dict]) -> dict[str, Callable[[BinaryIO], None]]:
    """Every plot of the report by its file name, each a function drawing it as PNG into a file: two for each
    layer of `kept` (the plotted layers' norms and first keys), one over all layers."""
    rule = OutlierRule(**report["outlier_rule"])
    draws = {}
    for layer, data in kept.items():
        draws[f"norms_layer{layer:02d}.png"] = functools.partial(_norm_figure, layer, data)
        draws[f"oscar_keys_layer{layer:02d}.png"] = functools.partial(
            _oscar_figure, layer, data, report["bits"][0], report["group_size"], rule)
    draws["error_by_layer.png"] = functools.partial(_error_figure, report)
    return draws


def render(draws: dict[str, Callable[[BinaryIO], None]], names: list[str]) -> dict[str, bytes]:
    """The PNG bytes of the plots `names` (of `figures`). A bar counts them: the 7 figures of a 30-layer model
    take about 7 s on one core, so under torchrun each rank draws its share."""
    pngs = {}
    for name in tqdm(names, desc="diagnose plots", unit="plot"):
        with io.BytesIO() as file:
            draws[name](file)
            pngs[name] = file.getvalue()
    return pngs
