"""CPU emulation of the lookup-table VecInfer decode kernel (not written yet), to choose its
arithmetic without a GPU: each candidate's worst row error against the float64 reference of the same
codes (`kvcalib.formats.vq.layout.reference_decode`'s computation), beside the peer's, SDPA fp16 over the
dequantized cache, on the same rows. The runtime's accuracy rule: a kernel's row error at most 2x the
peer's on that row.

    python benchmarks/vq_lut_emulated.py [--tokens 8192] [--configs d4b8,d8b12] [--results FILE]

Rows: B=1, 8 KV heads x GQA 4 (32 query heads), d=128, `--tokens` flushed tokens whose codes are uniform
over a random normal codebook (keys in the codec basis, values as they are), no residual. Queries q̃ are
unit normal ("diffuse": attention spread over thousands of tokens) or scaled so the top score stands ~10
above the rest ("peaked").

Candidates (what the kernel would hold and add):
- scores: the table q̃_i · C_k[e] in float32 or rounded to float16, its c entries per token summed in
  float32 (`lut32`, `lut16`) or in float16 (`lut16-hadd`, half2 additions);
- probabilities: float32 exp2 of the score over the running maximum; values: float32 sums of p times the
  value centroid, one centroid read per sub-vector (`direct`, or the same sums gathered per code first,
  a histogram over centroids, `hist`, the same arithmetic in another order), or p rounded to float16 for
  a tensor-core P·V over rebuilt fp16 value tiles (`p16`).
The peer: SDPA fp16 with q̃ rounded to float16, keys and values the dequantized fp16 centroids, scores in
float32, P rounded to float16, float32 sums, the output rounded to float16.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvcalib import vq
from results import RESULTS, publish

HKV, GQA, D = 8, 4, 128


def half(x: torch.Tensor) -> torch.Tensor:
    return x.half().double()


def single(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def rows(config: vq.VQConfig, tokens: int, peaked: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's rows: q̃ (Hq, D), key and value codebooks (2^M, N) fp16, codes (Hkv, T, c)."""
    g = torch.Generator().manual_seed(seed)
    c = D // config.dim
    kbook = half(torch.randn(config.centroids, config.dim, generator=g, dtype=torch.float64))
    vbook = half(torch.randn(config.centroids, config.dim, generator=g, dtype=torch.float64))
    kc = torch.randint(0, config.centroids, (HKV, tokens, c), generator=g)
    vc = torch.randint(0, config.centroids, (HKV, tokens, c), generator=g)
    q = torch.randn(HKV * GQA, D, generator=g, dtype=torch.float64)
    if peaked:  # one token per KV head whose key is the query's direction: its score ~10 above the rest
        keys = kbook[kc].reshape(HKV, tokens, D)
        top = keys[:, 0]  # (Hkv, D)
        q = top.repeat_interleave(GQA, 0) * (10 / top.norm(dim=-1, keepdim=True) ** 2).repeat_interleave(GQA, 0) * D**0.5 \
            + 0.1 * q
    return {"q": q, "kbook": kbook, "vbook": vbook, "kc": kc, "vc": vc}


def attend(scores: torch.Tensor, values: torch.Tensor, p_round=lambda p: p, acc=lambda x: x) -> torch.Tensor:
    """softmax(scores) · values per row: scores (Hq, T), values (Hkv, T, D) -> (Hq, D)."""
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = p_round(single(p))
    v = values.repeat_interleave(GQA, 0)
    return acc(torch.einsum("ht,htd->hd", p, v)) / acc(p.sum(-1, keepdim=True))


def errors(config: vq.VQConfig, tokens: int, peaked: bool) -> dict[str, float]:
    """Worst over rows of each candidate's error over the peer's (and the peer's own worst error)."""
    r = rows(config, tokens, peaked)
    q, kbook, vbook, kc, vc = r["q"], r["kbook"], r["vbook"], r["kc"], r["vc"]
    c, n = kc.shape[-1], config.dim
    scale = D**-0.5
    keys = kbook[kc].reshape(HKV, tokens, D)
    values = vbook[vc].reshape(HKV, tokens, D)
    kc_q = kc.repeat_interleave(GQA, 0)  # (Hq, T, c)

    def lut_scores(entry_round, add_round) -> torch.Tensor:
        lut = torch.einsum("hcn,en->hce", q.reshape(-1, c, n), kbook)  # (Hq, c, 2^M) exact in float64
        lut = entry_round(single(lut) if entry_round is not single else lut)  # products of fp32 q̃ and fp16 C
        picked = lut.gather(-1, kc_q.permute(0, 2, 1)).permute(0, 2, 1)  # (Hq, T, c)
        total = picked[..., 0]
        for i in range(1, c):
            total = add_round(total + picked[..., i])
        return total

    ref = attend(torch.einsum("hd,htd->ht", q, keys.repeat_interleave(GQA, 0)) * scale, values)
    peer_scores = single(torch.einsum("hd,htd->ht", half(q), keys.repeat_interleave(GQA, 0))) * scale
    peer = half(attend(peer_scores, values, p_round=half, acc=single))
    row_error = lambda out: (out - ref).norm(dim=-1) / ref.norm(dim=-1)  # noqa: E731
    base = row_error(peer)
    candidates = {
        "lut32 + direct": attend(single(lut_scores(single, single)) * scale, values, acc=single),
        "lut16 + direct": attend(single(lut_scores(half, single)) * scale, values, acc=single),
        "lut16-hadd + direct": attend(single(lut_scores(half, half)) * scale, values, acc=single),
        "lut32 + p16": attend(single(lut_scores(single, single)) * scale, values, p_round=half, acc=single),
        "lut16 + p16": attend(single(lut_scores(half, single)) * scale, values, p_round=half, acc=single),
    }
    out = {"SDPA fp16 (peer) worst row error": base.max().item()}
    for name, got in candidates.items():
        e = row_error(got)
        out[f"{name}: worst row error"] = e.max().item()
        out[f"{name}: worst error / peer's"] = (e / base).max().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--configs", default="d4b8,d8b12")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    configs = [vq.VQConfig.parse(x) for x in args.configs.split(",")]
    lines = [f"{args.tokens} flushed tokens, {HKV} KV heads x GQA {GQA}, d={D}; codes uniform over random normal "
             "codebooks (fp16); rule: a kernel's row error <= 2x the peer's on the same row", "",
             "| config | inputs | candidate | worst row error | worst (error / peer's) |", "|---|---|---|---:|---:|"]
    for config in configs:
        for peaked in (False, True):
            res = errors(config, args.tokens, peaked)
            inputs = "peaked" if peaked else "diffuse"
            lines.append(f"| {config} | {inputs} | SDPA fp16 (peer) | {res['SDPA fp16 (peer) worst row error']:.1e} | 1 |")
            for name in ("lut32 + direct", "lut16 + direct", "lut16-hadd + direct", "lut32 + p16", "lut16 + p16"):
                lines.append(f"| {config} | {inputs} | {name} | {res[f'{name}: worst row error']:.1e} | "
                             f"{res[f'{name}: worst error / peer' + chr(39) + 's']:.2f} |")
            print("\n".join(lines[-6:]), flush=True)
    title = "VecInfer lookup-table kernel arithmetic, CPU emulation against float64"
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
