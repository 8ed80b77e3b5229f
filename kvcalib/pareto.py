"""`kvcalib report`: several `kvcalib eval --json` results as one Markdown table and a Pareto plot
(perplexity against effective bits, fp16 as a line, one marker per method, the frontier drawn).

With `--tasks`, results of `kvcalib lm-eval --output-path` too (long-context task scores, RULER's):
each is paired with the eval result of the same method and settings, and read beside it in a second
table (every task at every length, their average with a 95% interval) and a second plot, `tasks.png`
(average task score against effective bits).

Output directory: `report.md`, `pareto.png` (and `tasks.png`), each written atomically after every
input has been read and checked, so a bad input leaves nothing behind. A row's label is its JSON file's stem.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from .atomic import atomic_path, ensure_writable_dir
from .errors import SettingsError
from .evaluate import EvalResult


@dataclass
class Row:
    label: str
    result: EvalResult


def _read_json(path: Path, what: str):
    """The JSON at `path`; one clear error for a file that cannot be read as one."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SettingsError(f"{path}: not a readable {what} JSON ({str(err).splitlines()[0]})") from err


def read_results(paths: list[str]) -> list[Row]:
    """Each path an `EvalResult` JSON; one clear error for a file that is not one."""
    if not paths:
        raise SettingsError("give at least one eval JSON (kvcalib eval ... --json FILE)")
    names = {f.name for f in fields(EvalResult)}
    required = {f.name for f in fields(EvalResult) if f.default is MISSING and f.default_factory is MISSING}
    rows = []
    for p in paths:
        path = Path(p)
        data = _read_json(path, "eval")
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


@dataclass
class TaskRow:
    """One `kvcalib lm-eval` result: its scores per (task, length) in [0, 1], samples per task, and the eval row
    of the same method and settings (its bits and perplexity)."""
    label: str
    row: Row
    scores: dict[tuple[str, int], float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def average(self) -> tuple[float, float]:
        """The mean score over every (task, length), and the half-width of its 95% interval: each score taken as
        a binomial proportion over its task's samples (RULER scores a sample 0 or 1, or by the share of its
        words found: then the interval is an upper bound), the tasks independent."""
        n = len(self.scores)
        mean = sum(self.scores.values()) / n
        var = sum(p * (1 - p) / max(self.samples.get(t, 1), 1) for (t, _), p in self.scores.items()) / n**2
        return mean, 1.96 * math.sqrt(var)


_LENGTH = re.compile(r"^(\d+),none$")


def read_task_results(paths: list[str], rows: list[Row]) -> list[TaskRow]:
    """Each path a `kvcalib lm-eval --output-path` JSON, paired with the eval row of its method and settings."""
    out = []
    for p in paths:
        path = Path(p)
        data = _read_json(path, "lm-eval")
        meta = data.get("kvcalib") if isinstance(data, dict) else None
        if not isinstance(meta, dict) or not isinstance(data.get("results"), dict):
            raise SettingsError(f"{path}: not a `kvcalib lm-eval --output-path` JSON (no kvcalib and results entries)")
        same = [r for r in rows if r.result.method == meta.get("method") and r.result.settings == meta.get("settings")]
        if not same:
            raise SettingsError(f"{path}: no eval JSON of method {meta.get('method')} with settings "
                                f"{meta.get('settings')} among the results to read it beside")
        task = TaskRow(path.stem, same[0])
        for name, metrics in data["results"].items():
            for key, value in metrics.items():
                m = _LENGTH.match(key)
                # lm-eval's RULER reports -1 at a length of its metric list it made no sample of (a run of
                # `--max-lengths 8192` alone still lists 4096): no score there
                if m and isinstance(value, (int, float)) and value >= 0:
                    task.scores[name, int(m.group(1))] = float(value)
            task.samples[name] = int(metrics.get("sample_len", 0) or 0)
        if not task.scores:
            raise SettingsError(f"{path}: no task scores at a length (RULER's `4096,none` metrics)")
        out.append(task)
    return out


def task_markdown(tasks: list[TaskRow]) -> str:
    columns = sorted({k for t in tasks for k in t.scores}, key=lambda k: (k[1], k[0]))
    samples = sorted({n for t in tasks for n in t.samples.values()})
    lines = ["", f"Task scores (lm-eval; {', '.join(map(str, samples))} samples per task; the interval is 95%, binomial).", "",
             "| result | method | effective bits | perplexity | " + " | ".join(f"{t} @ {n}" for t, n in columns) +
             " | average |", "|---|---|---:|---:|" + "---:|" * len(columns) + "---:|"]
    for t in sorted(tasks, key=lambda t: t.row.result.effective_bits):
        mean, half = t.average()
        cells = " | ".join("-" if k not in t.scores else f"{100 * t.scores[k]:.1f}" for k in columns)
        lines.append(f"| {t.label} | {t.row.result.method} | {t.row.result.effective_bits:.3f} | "
                     f"{t.row.result.perplexity:.3f} | {cells} | {100 * mean:.1f} ± {100 * half:.1f} |")
    return "\n".join(lines) + "\n"


def task_plot(tasks: list[TaskRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), constrained_layout=True)
    for t in tasks:
        mean, half = t.average()
        x = t.row.result
        if x.method == "fp16":
            ax.axhline(100 * mean, color="black", linestyle="--", linewidth=1, label=f"fp16 ({100 * mean:.1f})")
            continue
        ax.errorbar(x.effective_bits, 100 * mean, yerr=100 * half, fmt="o", capsize=3, zorder=3)
        ax.annotate(t.label, (x.effective_bits, 100 * mean), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("effective bits per cached element (as `kvcalib eval` counts them)")
    ax.set_ylabel("average task score, % (95% interval)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{tasks[0].row.result.model}: lm-eval task scores against bits", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


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


def write_report(paths: list[str], out: str | Path, task_paths: list[str] = ()) -> Path:
    """Read the eval JSONs (and the lm-eval JSONs of `task_paths`), then write `report.md`, `pareto.png`
    (and `tasks.png`) under `out`."""
    out = ensure_writable_dir(out)
    rows = read_results(paths)
    tasks = read_task_results(list(task_paths), rows)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(rows) + (task_markdown(tasks) if tasks else ""))
    plot(rows, out / "pareto.png")
    if tasks:
        task_plot(tasks, out / "tasks.png")
    return out
