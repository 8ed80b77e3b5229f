"""The decode step's weight products at a few rows (B = 1..8): cuBLAS (what `nn.Linear` runs) against the
one-row kernel the static cache's step switches in (kernels_cupy/gemv.cu, `kvcalib.runtime.gemv_kernel`) in
several configurations, each over a whole model's weights (every layer's q, k, v, o, gate, up, down, and an
lm_head of the shape's vocabulary, or 128256 rows where the shape names none; by default the Llama-3.1-8B shape,
15.0 GB) captured in one CUDA graph, with the projections separate (as transformers' models run them) or fused
(q|k|v and gate|up as one product each: views of one weight, as serving engines store them). Beside them, the
read floor: one launch reading the same bytes.

    python benchmarks/gemv.py [--rows 1,8] [--configs 1x8x0,1x8x8] [--shape gemma-3-4b --dtype bfloat16] [--results FILE]

Accuracy: every kernel configuration's output is checked, row by row, against a float64 product of the same
inputs (float16 or bfloat16), with the output buffer poisoned (NaN) before the launch; cuBLAS's error is printed
beside it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from decode import copy_bandwidth, read_floor, timed, worst_row
from kvcalib.runtime.gemv_kernel import launch_gemv
from results import record

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 4096, 14336, 4096, 1024, 128256, 32
DTYPE = torch.float16


def take_shape(name: str) -> None:
    """The products of `kvcalib make-model --shape NAME` in place of the Llama-3.1-8B shape above (its vocabulary
    where the shape names one, else 128256 rows of lm_head)."""
    global HIDDEN, INTER, Q, KV, VOCAB, LAYERS
    from kvcalib.random_model import SHAPES

    c = SHAPES[name]
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    HIDDEN, INTER, LAYERS = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    Q, KV, VOCAB = c["num_attention_heads"] * head, c["num_key_value_heads"] * head, c.get("vocab_size", VOCAB)


def check(config, rows: int) -> tuple[float, float]:
    """Worst row ‖y − y64‖/‖y64‖ of the kernel and of cuBLAS over the model's product shapes (and a K that is no
    multiple of 256), the kernel's output poisoned first."""
    worst, worst_blas = 0.0, 0.0
    for n, k in [(Q + 2 * KV, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, Q), (HIDDEN, INTER), (1000, 576), (37, 200)]:
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
        x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
        ref = x.double() @ w.double().T
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=DTYPE)
        launch_gemv(x, w, None, out, config=config)
        worst = max(worst, worst_row(out, ref))
        worst_blas = max(worst_blas, worst_row(torch.nn.functional.linear(x, w), ref))
    return worst, worst_blas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--configs", default="1x8x0,1x8x8,1x4x0,2x4x8,4x4x4",
                        help="kernel configurations: rows a warp x warps a block x words in flight a lane (0: balanced)")
    parser.add_argument("--shape", default=None, help="a kvcalib make-model shape (default: Llama-3.1-8B's)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--results", default=None, help="record the table in this file (default: print only)")
    args = parser.parse_args()
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    if args.shape:
        take_shape(args.shape)
    torch.manual_seed(0)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    gib = lambda t: t.numel() * 2  # noqa: E731
    layers = []
    for _ in range(LAYERS):
        qkv = torch.randn(Q + 2 * KV, HIDDEN, device="cuda", dtype=DTYPE) * 0.02
        gu = torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=DTYPE) * 0.02
        layers.append(dict(qkv=qkv, o=torch.randn(HIDDEN, Q, device="cuda", dtype=DTYPE) * 0.02, gu=gu,
                           down=torch.randn(HIDDEN, INTER, device="cuda", dtype=DTYPE) * 0.02))
    head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=DTYPE) * 0.02
    nbytes = sum(gib(t) for layer in layers for t in layer.values()) + gib(head)
    copy = copy_bandwidth()
    floor_us = read_floor(nbytes)
    lines = [f"{torch.cuda.get_device_name()}; weights {nbytes / 1e9:.2f} GB; device copy {copy:.0f} GB/s; "
             f"read floor (one launch) {floor_us / 1000:.3f} ms = {nbytes / floor_us / 1e3:.0f} GB/s", "",
             "| rows | path | projections | config | ms | GB/s | x read floor | launches | worst row err (cuBLAS) |",
             "|---:|---|---|---|---:|---:|---:|---:|---|"]
    print(lines[0], flush=True)
    for m in [int(r) for r in args.rows.split(",")]:
        xh = torch.randn(m, HIDDEN, device="cuda", dtype=DTYPE)
        xi = torch.randn(m, INTER, device="cuda", dtype=DTYPE)
        xq = torch.randn(m, Q, device="cuda", dtype=DTYPE)  # o's input: the heads' width (Gemma 3's is not HIDDEN)
        outs = {n: torch.empty(m, n, device="cuda", dtype=DTYPE)
                for n in (Q, KV, HIDDEN, INTER, Q + 2 * KV, 2 * INTER, VOCAB)}

        def products(fused: bool):
            for layer in layers:
                qkv, gu = layer["qkv"], layer["gu"]
                if fused:
                    yield xh, qkv, outs[Q + 2 * KV]
                    yield xh, gu, outs[2 * INTER]
                else:
                    yield xh, qkv[:Q], outs[Q]
                    yield xh, qkv[Q:Q + KV], outs[KV]
                    yield xh, qkv[Q + KV:], outs[KV]
                    yield xh, gu[:INTER], outs[INTER]
                    yield xh, gu[INTER:], outs[INTER]
                yield xq, layer["o"], outs[HIDDEN]
                yield xi, layer["down"], outs[HIDDEN]
            yield xh, head, outs[VOCAB]

        for fused in (False, True):
            launches = len(list(products(fused)))
            variants = [("cuBLAS", None)] + [("kernel", c) for c in configs]
            for path, config in variants:
                def run(_i, fused=fused, config=config):
                    for x, w, out in products(fused):
                        if config is None:
                            torch.mm(x, w.t(), out=out)  # what nn.Linear runs
                        else:
                            launch_gemv(x, w, None, out, config=config)

                if config is None:
                    err = ""
                else:
                    worst, worst_blas = check(config, m)
                    err = f"{worst:.1e} ({worst_blas:.1e})"
                us = timed(run, 1, 20)
                name = "x".join(map(str, config)) if config else "-"
                line = (f"| {m} | {path} | {'fused' if fused else 'separate'} | {name} | {us / 1000:.3f} | "
                        f"{nbytes / us / 1e3:.0f} | {us / floor_us:.3f} | {launches} | {err} |")
                print(line, flush=True)
                lines.append(line)
    table = "\n".join(lines)
    if args.results:
        record(f"Weight products of a decode step, {args.shape or 'Llama-3.1-8B'} shape in {DTYPE}: cuBLAS against a "
               "CuPy kernel", table,
               sys.argv, args.results)


if __name__ == "__main__":
    main()
