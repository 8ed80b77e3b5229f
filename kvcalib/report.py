"""Readable tables of evaluation results (terminal and benchmarks/RESULTS.md share this format)."""

from __future__ import annotations

from .evaluate import EvalResult


def _settings(r: EvalResult) -> str:
    return " ".join(f"{k}={v}" for k, v in r.settings.items()) or "-"


def result_table(results: list[EvalResult], labels: list[str] | None = None) -> str:
    """A Markdown table: one row per result."""
    labels = labels or [r.method for r in results]
    rows = ["| method | settings | perplexity | effective bits | tokens | attn err mean | attn err max |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for label, r in zip(labels, results):
        errs = r.per_layer_attention_rel_error
        rows.append(f"| {label} | {_settings(r)} | {r.perplexity:.3f} | {r.effective_bits:.3f} | {r.tokens} | "
                    f"{sum(errs) / len(errs):.4f} | {max(errs):.4f} |")
    return "\n".join(rows)
