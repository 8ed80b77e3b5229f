"""CPU emulation of how the fused decode kernel accumulates values, to predict its error against
float64 for each code-unpack scheme of kvcalib/formats/int2/int2_decode.cu without a GPU.

    python benchmarks/decode_precision_emulated.py [--tokens 4704] [--bits 24] [--heads 4]

One warp accumulates, per query head and channel, sum_n p_n v_n over `--tokens` tokens (4704 is a
warp's share at B=8, L=131072, G=128 on an H100: 7 splits of 18816 tokens, four warps each) with
mma.m16n8k16: fp16 operands, products exact, and, per mma, the 16 products and the accumulator
aligned to the largest exponent, truncated to `--bits` bits and summed, the result truncated to
float32 (the tensor cores' accumulation as Fasi et al., "Numerical behavior of NVIDIA tensor cores",
PeerJ CS 2021, measured it). Values: unit randn, KIVI-2 per token over 128 channels; scores unit
randn (diffuse attention). Schemes (int2_decode.cu): 0 offsets 64/16 in the codes, subtracted by
an mma; 2 codes alone; 3 centred codes and zero points; "SDPA-like": fp16 values, one chain.
Prints the worst head's ‖o − o_ref‖/‖o_ref‖ against float64.
"""

from __future__ import annotations

import argparse

import torch


def truncate_to_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 next toward zero (as float64)."""
    t = x.float()
    over = t.double().abs() > x.abs()
    return torch.where(over, torch.nextafter(t, torch.zeros_like(t)), t).double()


def mma_chain(a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """sum_n a[n] b[n] (a (N, D), b (N,)) in 16-token mma steps with aligned, truncated addends."""
    acc = torch.zeros(a.shape[1], dtype=torch.float64)
    for i in range(0, a.shape[0], 16):
        addends = torch.cat([acc[None], a[i : i + 16] * b[i : i + 16, None]], 0)
        top = torch.floor(torch.log2(addends.abs().amax(0).clamp_min(1e-300)))
        quantum = torch.pow(2.0, top - bits + 1)
        acc = truncate_to_float32((torch.trunc(addends / quantum) * quantum).sum(0))
    return acc


def worst_errors(tokens: int, bits: int, heads: int, d: int = 128) -> dict[str, float]:
    torch.manual_seed(0)
    half = lambda x: x.half().double()  # noqa: E731
    errors: dict[str, list[float]] = {"0": [], "2": [], "3": [], "SDPA-like": []}
    for _ in range(heads):
        v = half(torch.randn(tokens, d, dtype=torch.float64))
        low, high = v.min(1).values, v.max(1).values
        s, z = half((high - low) / 3), half(low)
        x = torch.clamp(torch.round((v - z[:, None]) / s[:, None]), 0, 3)
        score = torch.randn(tokens, dtype=torch.float64)
        p = torch.exp(score - score.max())
        held = s[:, None] * x + z[:, None]
        ref = (p[:, None] * held).sum(0)
        p16 = half(p)
        pt = half(p16 * s)  # p~ = p o s, fp16 as the kernel's hmul2
        off = torch.tensor([64.0, 16.0], dtype=torch.float64).repeat(d // 2)
        zeros = z[:, None].expand(tokens, d)
        got = {
            "0": mma_chain(off + x, pt, bits) + mma_chain(-off.expand(tokens, d), pt, bits) + mma_chain(zeros, p16, bits),
            "2": mma_chain(x, pt, bits) + mma_chain(zeros, p16, bits),
            "3": mma_chain(x - 1.5, pt, bits) + mma_chain(half(z + 1.5 * s)[:, None].expand(tokens, d), p16, bits),
            "SDPA-like": mma_chain(half(held), p16, bits),
        }
        for name, out in got.items():
            errors[name].append(((out - ref).norm() / ref.norm()).item())
    return {name: max(e) for name, e in errors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4704)
    parser.add_argument("--bits", type=int, default=24)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    errors = worst_errors(args.tokens, args.bits, args.heads)
    print(f"{args.tokens} tokens per warp, addends truncated to {args.bits} bits; worst head vs float64:")
    print("| scheme | error |\n|---|---:|")
    for name, e in errors.items():
        print(f"| {name} | {e:.1e} |")


if __name__ == "__main__":
    main()
