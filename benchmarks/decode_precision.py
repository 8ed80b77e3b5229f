"""Accuracy of the fused INT2 decode kernel against float64, in the regimes users run, beside the
error torch SDPA makes in the query dtype over the same dequantized cache.

    python benchmarks/decode_precision.py [--dtype float16] [--results FILE]

For each (B, L, G, inputs): the relative error ‖o − o_ref‖/‖o_ref‖ over all rows and the worst row
(a row = one batch entry and query head), where o_ref is `reference_decode` in float64 of the same
`PackedLayer`; "SDPA" is torch SDPA in the query dtype over the dequantized cache. The bound is
flash-attention's rule, per row: fused ≤ 2 × SDPA + 1e-4; "rows over" counts the rows that break it.
Inputs: "diffuse" = unit randn keys, values and queries (near-uniform attention, what many heads of
a long context do); "peaked" = keys with 8 outlier channels at 5x and a sink token whose key is
aligned with every query (attention concentrates). The unpack schemes this table once compared are in
NOTES-decode.md ("Precision"); the kernel keeps the one it measured best for keys and for values.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvcalib.formats.int2.layout import pack, reference_decode
from kvcalib.formats.int2.launch import fused_decode
from results import RESULTS, record

HQ, HKV, D, RESIDUAL = 32, 8, 128, 100
REGIMES = [(1, 32768, 128), (8, 32768, 128), (1, 131072, 128), (4, 131072, 32), (8, 131072, 128),
           (8, 131072, 32), (16, 32768, 256)]
PEAKED = [(8, 131072, 128), (8, 131072, 32)]


def inputs(b: int, length: int, peaked: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = length + RESIDUAL
    k = torch.randn(b, HKV, total, D, device="cuda", generator=gen)
    v = torch.randn(b, HKV, total, D, device="cuda", generator=gen)
    q = torch.randn(b, HQ, D, device="cuda", generator=gen)
    if peaked:
        k[..., :8] *= 5.0  # outlier channels
        sink = q.reshape(b, HKV, HQ // HKV, D).mean(2)  # a key every query of its KV head aligns with
        k[:, :, 0] = 4.0 * sink / sink.norm(dim=-1, keepdim=True) * D**0.5
    return q.to(dtype), k.half(), v.half()


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    """‖got − ref‖/‖ref‖ over the whole tensor, and per row."""
    diff = got.double() - ref
    return (diff.norm() / ref.norm()).item(), diff.norm(dim=-1).flatten() / ref.norm(dim=-1).flatten()


def measure(b: int, length: int, group: int, peaked: bool, dtype: torch.dtype, norms: bool = False) -> dict:
    q, k, v = inputs(b, length, peaked, dtype, seed=b * 7 + length + group)
    kf, vf = k[:, :, :length].float(), v[:, :, :length].float()
    kn = kf.norm(dim=-1) if norms else None
    if norms:
        kf = kf / kn[..., None]
    layer = pack(kf, vf, k[:, :, length:], v[:, :, length:], group, min(group, D), kn)
    del kf, vf, k, v
    scale = D**-0.5
    ref = reference_decode(q, layer, scale)
    fused = errors(fused_decode(q, layer, scale, checked=True), ref)
    kd, vd = layer.flushed_kv()
    kd = torch.cat([kd.to(dtype), layer.kres[:, :, : layer.residual].to(dtype)], 2)
    vd = torch.cat([vd.to(dtype), layer.vres[:, :, : layer.residual].to(dtype)], 2)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True)
    sdpa = errors(sdpa_out[:, :, 0], ref)
    del kd, vd, ref
    torch.cuda.empty_cache()
    return {"fused": fused, "sdpa": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--regimes", default=None, help="B:L:G[:peaked][:norms],... (default: the table's)")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.regimes:
        regimes = []
        for spec in args.regimes.split(","):
            b, n, g, *flags = spec.split(":")
            regimes.append((int(b), int(n), int(g), "peaked" in flags, "norms" in flags))
    else:
        regimes = [(b, n, g, False, False) for b, n, g in REGIMES] + [(b, n, g, True, False) for b, n, g in PEAKED] \
            + [(8, 131072, 32, False, True)]
    lines = ["| B | L (flushed) | G | inputs | fused vs float64 | worst row | SDPA vs float64 | SDPA worst row | "
             "worst fused / (2 SDPA + 1e-4) | rows over |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b, n, g, peaked, norms in regimes:
        e = measure(b, n, g, peaked, dtype, norms)
        (fg, f), (sg, s) = e["fused"], e["sdpa"]
        bound = 2 * s + 1e-4
        kind = ("peaked" if peaked else "diffuse") + (", OScaR norms" if norms else "")
        lines.append(f"| {b} | {n} | {g} | {kind} | {fg:.2e} | {f.max():.2e} | {sg:.2e} | {s.max():.2e} | "
                     f"{(f / bound).max():.2f} | {int((f > bound).sum())} |")
        print(lines[-1], flush=True)
    title = (f"Decode precision, {torch.cuda.get_device_name()}, {HQ} q / {HKV} kv heads, d={D}, residual {RESIDUAL}, "
             f"{args.dtype} queries")
    table = "\n".join(lines)
    print(f"\n{title}\n\n{table}")
    if not args.no_record:
        record(title, table, sys.argv, args.results)


if __name__ == "__main__":
    main()
