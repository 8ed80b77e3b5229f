"""`kvcalib report`: several `kvcalib eval --json` results as one Markdown table and a Pareto plot
(perplexity against effective bits, fp16 as a line, one marker per method, the frontier drawn).

Output directory: `report.md` and `pareto.png`, each written atomically after every input has been
read and checked, so a bad input leaves nothing behind. A row's label is its JSON file's stem.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from .atomic import atomic_path, ensure_writable_dir
from .errors import SettingsError
from .evaluate import EvalResult


@dataclass
class Row:
    label: str
    result: EvalResult


def read_results(paths: list[str]) -> list[Row]:
    """Each path an `EvalResult` JSON; one clear error for a file that is not one."""
    if not paths:
        raise SettingsError("give at least one eval JSON (kvcalib eval ... --json FILE)")
    names = {f.name for f in fields(EvalResult)}
    required = {f.name for f in fields(EvalResult) if f.default is MISSING and f.default_factory is MISSING}
    rows = []
    for p in paths:
        path = Path(p)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SettingsError(f"{path}: not a readable eval JSON ({str(err).splitlines()[0]})") from err
        if not isinstance(data, dict) or not names >= set(data) or not required <= set(data):
            raise SettingsError(f"{path}: not an eval JSON (expected the fields of `kvcalib eval --json`)")
        result = EvalResult(**data)
        if not (isinstance(result.perplexity, (int, float)) and isinstance(result.effective_bits, (int, float))
                and result.effective_bits > 0 and math.isfinite(result.effective_bits)):
            raise SettingsError(f"{path}: perplexity and effective_bits must be numbers, bits positive")
        rows.append(Row(path.stem, result))
    datasets = {(r.result.model, r.result.dataset, r.result.num_samples, r.result.seq_len) for r in rows}
    if len(datasets) > 1:
        raise SettingsError("the results were scored on different models, texts or windows: "
                            + "; ".join(" ".join(map(str, d)) for d in sorted(datasets, key=str)))
    return rows


def frontier(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both effective bits and perplexity (ties kept), by bits."""
    keep = [r for r in rows if not any(
        (o.result.effective_bits <= r.result.effective_bits and o.result.perplexity < r.result.perplexity)
        or (o.result.effective_bits < r.result.effective_bits and o.result.perplexity <= r.result.perplexity)
        for o in rows)]
    return sorted(keep, key=lambda r: r.result.effective_bits)


def markdown(rows: list[Row]) -> str:
    fp16 = [r.result.perplexity for r in rows if r.result.method == "fp16"]
    on_frontier = {id(r) for r in frontier(rows)}
    first = rows[0].result
    lines = [f"Model {first.model}, text {first.dataset}, {first.num_samples} x {first.seq_len} tokens.", "",
             "| result | method | effective bits | of which the cache (codes, metadata, fp16 window) | of which shared tensors (once) "
             "| compressed part alone | averaged over the decode (fp16 window included) | perplexity | over fp16 | Pareto |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def bits(b: dict, key: str) -> str:
        return f"{b[key]:.3f}" if b.get(key) is not None else "-"

    for r in sorted(rows, key=lambda r: (r.result.effective_bits, r.result.perplexity)):
        x, b = r.result, r.result.bits_breakdown
        over = f"{100 * (x.perplexity / fp16[0] - 1):+.1f}%" if fp16 else "-"
        lines.append(f"| {r.label} | {x.method} | {x.effective_bits:.3f} | {bits(b, 'cache_bits_per_element')} | "
                     f"{bits(b, 'shared_bits_per_element')} | {bits(b, 'compressed_part_bits_per_element')} | "
                     f"{bits(b, 'decode_averaged_bits_per_element')} | {x.perplexity:.3f} | "
                     f"{over} | {'yes' if id(r) in on_frontier else ''} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), constrained_layout=True)
    markers = "os^DvP*Xh<>p"
    methods = sorted({r.result.method for r in rows if r.result.method != "fp16"})
    for i, method in enumerate(methods):
        mine = [r for r in rows if r.result.method == method]
        ax.scatter([r.result.effective_bits for r in mine], [r.result.perplexity for r in mine],
                   marker=markers[i % len(markers)], s=60, label=method, zorder=3)
        for r in mine:
            ax.annotate(r.label, (r.result.effective_bits, r.result.perplexity), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    for r in rows:
        if r.result.method == "fp16":
            ax.axhline(r.result.perplexity, color="black", linestyle="--", linewidth=1,
                       label=f"fp16 ({r.result.perplexity:.3f})")
    front = [r for r in frontier(rows) if r.result.method != "fp16"]
    if front:
        ax.step([r.result.effective_bits for r in front], [r.result.perplexity for r in front], where="post",
                color="tab:red", linewidth=1, alpha=0.7, label="Pareto frontier", zorder=2)
    ax.set_xlabel("effective bits per cached element (as `kvcalib eval` counts them)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        formatter = ScalarFormatter()
        formatter.set_scientific(False)
        axis(formatter)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    first = rows[0].result
    ax.set_title(f"{first.model}: {first.dataset}, {first.num_samples} x {first.seq_len} tokens", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def write_report(paths: list[str], out: str | Path) -> Path:
    """Read the eval JSONs, then write `report.md` and `pareto.png` under `out`."""
    out = ensure_writable_dir(out)
    rows = read_results(paths)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(rows))
    plot(rows, out / "pareto.png")
    return out
