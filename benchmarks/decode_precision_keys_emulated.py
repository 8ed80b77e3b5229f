"""CPU emulation of where the fused decode kernel's scores lose precision, against SDPA over the
dequantized cache: the key side of kvcalib/formats/int2/int2_decode.cu's schemes, without a GPU.

    python benchmarks/decode_precision_keys_emulated.py [--trials 40] [--length 128]

One KIVI-2 key group of `--length` tokens, keys randn with a per-channel spread of 1..5x (outlier
channels, fairly peaked attention: the GPU tests' short regime), values unit randn, 16 fp16 query
heads. Every sum is float64: only the fp16 roundings each scheme makes are modelled. Values use
scheme 3 (centred codes, p rounded to fp16, p~ = fp16(p16 s)) in every kernel row. Rows:
  SDPA-like: scores over fp16(z + s x), P in fp16, fp16 values (the peer);
  keys 0-3: q~ = fp16(q o s) multiplies the codes (schemes 0-3 differ only in offsets, exact);
  keys 4: the codes x - 1 times s (exact in fp16), q unscaled, zero points fp16(z + s);
  exact scores: float64 scores, the value side alone.
Prints the mean row error ‖o − o_ref‖/‖o_ref‖ and the rows that break flash-attention's rule
(fused <= 2 x SDPA + 1e-4 per row).
"""

from __future__ import annotations

import argparse

import torch


def half(x: torch.Tensor) -> torch.Tensor:
    return x.half().double()


def trial(seed: int, length: int, d: int = 128, heads: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    spread = 1 + 4 * torch.rand(d, generator=g, dtype=torch.float64)
    k = torch.randn(length, d, generator=g, dtype=torch.float64) * spread
    v = torch.randn(length, d, generator=g, dtype=torch.float64)
    q = half(torch.randn(heads, d, generator=g, dtype=torch.float64))
    ks, kz = half((k.amax(0) - k.amin(0)) / 3), half(k.amin(0))  # per channel over the group
    kx = torch.clamp(torch.round((k - kz) / ks), 0, 3)
    kheld = ks * kx + kz
    vs, vz = half((v.amax(1) - v.amin(1)) / 3), half(v.amin(1))  # per token over the channels
    vx = torch.clamp(torch.round((v - vz[:, None]) / vs[:, None]), 0, 3)
    vheld = vs[:, None] * vx + vz[:, None]
    scale = d**-0.5

    def softmax_out(scores: torch.Tensor, sdpa: bool) -> torch.Tensor:
        p = torch.exp(scores - scores.amax(1, keepdim=True))
        p16 = half(p)
        if sdpa:
            o = p16 @ half(vheld)
        else:
            pt = half(p16 * vs)  # p~ = p16 o s, as the kernel's hmul2
            o = pt @ (vx - 1.5) + p16 @ half(vz + 1.5 * vs)[:, None].expand(length, d)
        return half(o / p.sum(1, keepdim=True))

    ref_scores = q @ kheld.T * scale
    p = torch.exp(ref_scores - ref_scores.amax(1, keepdim=True))
    ref = p @ vheld / p.sum(1, keepdim=True)
    qt = half(q[:, None, :] * ks)  # (heads, 1, d): q~ = fp16(q o s)
    outs = {
        "SDPA-like": softmax_out(q @ half(kheld).T * scale, True),
        "keys 0-3 (q~ = fp16(q o s))": softmax_out(((kx - 1.5) * qt).sum(-1) * scale + (q @ half(kz + 1.5 * ks))[:, None] * scale, False),
        "keys 4 (s (x - 1), q as is)": softmax_out((q @ ((kx - 1) * ks).T + (q @ half(kz + ks))[:, None]) * scale, False),
        "exact scores": softmax_out(ref_scores, False),
    }
    return {name: (o - ref).norm(dim=1) / ref.norm(dim=1) for name, o in outs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    rows: dict[str, list[torch.Tensor]] = {}
    for seed in range(args.trials):
        for name, err in trial(seed, args.length).items():
            rows.setdefault(name, []).append(err)
    errors = {name: torch.cat(e) for name, e in rows.items()}
    bound = 2 * errors["SDPA-like"] + 1e-4
    print(f"{args.trials} key groups of {args.length} tokens, 16 heads each; row error against float64:")
    print("| scores | mean row error | rows over 2 SDPA + 1e-4 | worst row / bound |\n|---|---:|---:|---:|")
    for name, e in errors.items():
        print(f"| {name} | {e.mean():.2e} | {int((e > bound).sum())}/{e.numel()} | {(e / bound).max():.2f} |")


if __name__ == "__main__":
    main()
