"""Shared-memory wavefronts of the VecInfer kernel's code loads (kvcalib/formats/vq/vq_decode.cu) under an order of a
tile's tokens in the mma's slots (`slot_token`): a model of the loads each lane makes, for the configurations
`fit-codebook` produces. Prints the wavefronts per tile of the orders named below; `--search` tries all 8!
orders of a half tile (one minute) and prints the best, the one vq_decode.cu uses.

Model: a warp's S-byte load is served in passes of 128 / S lanes (32 for 4 bytes); a pass takes as many
wavefronts as the most distinct 4-byte words any one bank is asked for. On the H100 it reproduced ncu's
per-instruction counts for d4b8 (slots as tokens: the value loads 2 wavefronts where 1 would do;
`t + 4i + 8h`: the key loads 4 where 2 would do).

    python benchmarks/vq_code_banks.py [--search]
"""

from __future__ import annotations

import argparse
import itertools

CONFIGS = [(128, 4, 8, 4, 8), (128, 2, 8, 2, 8), (128, 8, 12, 8, 12), (64, 4, 8, 4, 8), (128, 8, 10, 8, 10),
           (128, 4, 6, 4, 6), (64, 8, 12, 8, 12)]  # (D, NK, MK, NV, MV): d4b8, d2b8, d8b12, ...


def wavefronts(starts: list[int], size: int) -> int:
    per = 128 // size
    total = 0
    for p in range(0, 32, per):
        banks: dict[int, set[int]] = {}
        for a in starts[p:p + per]:
            for word in range(a // 4, (a + size) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(v) for v in banks.values())
    return total


def _load(bits: int, count: int, row: int, starts_bits: list[int]) -> int:
    """`codes_at`'s loads for one warp: whole words, 8-byte pairs where aligned, one word more where not."""
    w = (bits * count + 31) // 32
    aligned = (row % 8 == 0 and (count * bits) % 64 == 0) or (row % 4 == 0 and (count * bits) % 32 == 0 and w % 2)
    starts = [b // 32 * 4 for b in starts_bits]
    if aligned and w % 2 == 0:
        return sum(wavefronts([s + 8 * i for s in starts], 8) for i in range(w // 2))
    return sum(wavefronts([s + 4 * i for s in starts], 4) for i in range(w if aligned else w + 1))


def tile_wavefronts(token, d: int, nk: int, mk: int, nv: int, mv: int) -> int:
    """A warp's code-load wavefronts for one 16-token tile: keys of slots g + 8rr at lane (g, t), values of
    slots 2t + i + 8h at lane (g, t)."""
    rk, rv = (d // nk * mk + 7) // 8, (d // nv * mv + 7) // 8
    ck, cv = d // (4 * nk), d // (8 * nv)
    keys = sum(_load(mk, ck, rk, [token(lane // 4 + 8 * rr) * rk * 8 + lane % 4 * ck * mk for lane in range(32)])
               for rr in range(2))
    values = sum(_load(mv, cv, rv, [token(2 * (lane % 4) + (k4 & 1) + 8 * (k4 >> 1)) * rv * 8 + lane // 4 * cv * mv
                                    for lane in range(32)]) for k4 in range(4))
    return keys + values


def order(perm) -> callable:
    return lambda s: (s & 8) + perm[s & 7]


ORDERS = {"slots as tokens": (0, 1, 2, 3, 4, 5, 6, 7), "t + 4i + 8h": (0, 4, 1, 5, 2, 6, 3, 7),
          "vq_decode.cu (searched)": (0, 5, 2, 7, 1, 4, 3, 6)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--search", action="store_true")
    args = parser.parse_args()
    names = ["d{}b{} / d{}b{}, D={}".format(nk, mk, nv, mv, d) for d, nk, mk, nv, mv in CONFIGS]
    print("| order | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(CONFIGS))
    for name, perm in ORDERS.items():
        print(f"| {name} {perm} | " + " | ".join(str(tile_wavefronts(order(perm), *c)) for c in CONFIGS) + " |")
    if args.search:
        best = min(itertools.permutations(range(8)),
                   key=lambda p: [tile_wavefronts(order(p), *c) for c in CONFIGS[:1]] + [sum(tile_wavefronts(order(p), *c) for c in CONFIGS)])
        print(f"| best of 8! {best} | " + " | ".join(str(tile_wavefronts(order(best), *c)) for c in CONFIGS) + " |")


if __name__ == "__main__":
    main()
