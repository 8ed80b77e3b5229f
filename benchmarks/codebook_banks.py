"""Shared-memory wavefronts of the codebook kernel's centroid gathers (kvcalib/formats/codebook/codebook_decode.cu
`gather`), a model of the loads each lane makes for random codes, per book layout, for each scheme of the shipped
plans: which books still meet bank conflicts, and what a conflict-free layout of them would cost in shared memory.

Model (benchmarks/vq_code_banks.py's): a warp's S-byte load is served in passes of 128 / S lanes (32 for 2 and 4
bytes); a pass takes as many wavefronts as the most distinct 4-byte words any one bank is asked for. Codes are
uniform over a book's entries (each lane's token has its own), averaged over `--tiles` random tiles. Before the
copied books (b147c2d), Nsight Compute measured turboquant-2 + vecinfer-d4b6 at B=8: 2.0 wavefronts a key gather and
4.9 a value gather; the model's `held once` rows for those schemes are the check.

Layouts:
- `held once`: the book as the kernel held it before the copies, positions STRIDE halves apart (`KSTRIDE`);
- `skewed`: held once, each lane share's positions `_skew_words` words after the last share's (the launch's own
  rule, called here), as the kernel holds a book per position of at most 8 words a position (single levels of up to
  4 bits; others as `held once`);
- `copies` (the kernel's, `book_copies`): a book shared by every position, entry e's 128 / S copies side by side in
  the 128 bytes at 128 e, lane L reading copy L % (128 / S);
- `lane rows`: a book per position, entry e of code j of every lane in one 128-byte row per (j, pass, e), lane L's
  entry in slot L % (128 / slot) of it (slots of max(4, S) bytes): each pass's lanes read distinct banks; costs (codes
  a share) x (slot / 4) x entries x 128 bytes. The kernel holds them (XROWS, where a block reads long splits:
  launch.py `book_layout`) for books of single levels only (S 2: one pass), where they pay.

    cd benchmarks && python codebook_banks.py [--plans ../artifacts/smollm2-135m/plan-2.25,...] [--tiles 200]
                                              [--also turboquant-4]
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
from pathlib import Path

from codebook_pairs import one_pair_plan, plan_settings
from generate import llama8b_config
from generate_calls import mapped_plan
import torch

from kvcalib.formats.codebook.launch import CH, KernelBook, _copies, _shares, _skew_words, kernel_book

D = 128  # the 8B shape's head_dim, as codebook_pairs.py times the pairs
ROOT = Path(__file__).resolve().parent.parent


def wavefronts(addresses: list[int], size: int) -> int:
    """One warp's load of `size` bytes at each lane's byte address: its shared-memory wavefronts."""
    per = 128 // size if size >= 4 else 32
    total = 0
    for p in range(0, 32, per):
        banks: dict[int, set[int]] = collections.defaultdict(set)
        for a in addresses[p : p + per]:
            for word in range(a // 4, (a + max(size, 1) - 1) // 4 + 1):
                banks[word % 32].add(word)
        total += max(len(v) for v in banks.values())
    return total


def lane_position(lane: int, j: int, codes: int, part: str) -> int:
    """The book position lane (g, t) reads with its j-th code: a key's share starts at channel t D/4, a value's at
    g D/8 (the kernel's `gather` calls)."""
    g, t = lane // 4, lane % 4
    return (t if part == "key" else g) * codes + j


def address(layout: str, lane: int, j: int, codes: int, part: str, code: int, positions: int, entries: int,
            size: int, skew: int = 0) -> int:
    """Lane's byte address for its j-th code's entry `code`; `skew`: words each share's positions start after the last
    share's (`skewed`)."""
    if layout == "copies":
        return code * 128 + lane % (128 // size) * size
    if layout == "lane rows":  # slots of 4 bytes at least (2-byte entries: two lanes would share a word's bank)
        slot = max(4, size)
        per = 128 // slot
        return ((j * (32 // per) + lane // per) * entries + code) * 128 + lane % per * slot
    pos = lane_position(lane, j, codes, part) if positions > 1 else 0
    dim = size // 2
    stride = entries * dim + (max(2, dim) if positions > 1 else 0)  # the kernel's KSTRIDE, in halves
    return 2 * pos * stride + 4 * (pos // codes) * skew + code * size


def gathers(layout: str, part: str, positions: int, entries: int, dim: int, tiles: int, rng: random.Random) -> float:
    """Mean wavefronts of one gather instruction (one code of every lane's share) over `tiles` random tiles."""
    size = 2 * dim
    codes = D // _shares(part == "key") // dim  # a lane's share: D / 4 channels of a key, D / 8 of a value
    skew = 0
    if layout == "skewed":  # the launch's rule, of a book of this shape
        book = KernelBook(torch.zeros(1, positions, entries, dim, dtype=torch.float16), entries.bit_length() - 1, dim)
        skew = _skew_words(book, part == "key")
    total = n = 0
    for _ in range(tiles):
        for j in range(codes):
            addresses = [address(layout, lane, j, codes, part, rng.randrange(entries), positions, entries, size,
                                 skew) for lane in range(32)]
            total += wavefronts(addresses, size)
            n += 1
    return total / n


def lane_rows_bytes(part: str, entries: int, dim: int) -> int:
    slot = max(4, 2 * dim)
    codes = D // _shares(part == "key") // dim
    return codes * (slot // 4) * entries * 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shipped = ",".join(str(ROOT / "artifacts/smollm2-135m" / p) for p in ("plan-2.25", "plan-3"))
    parser.add_argument("--plans", default=shipped)
    parser.add_argument("--tiles", type=int, default=200)
    parser.add_argument("--also", default="turboquant-4", help="schemes modelled as keys and values beside the plans' "
                        "(comma-separated; items 0 where no plan holds them)")
    args = parser.parse_args()
    rng = random.Random(0)
    items: dict[tuple[str, str], int] = collections.Counter()
    for plan in args.plans.split(","):
        s = plan_settings(plan)
        for part, names in (("key", s["k"]), ("value", s["v"])):
            for row in names:
                for name in row:
                    items[(part, name)] += 1
    for name in filter(None, args.also.split(",")):
        for part in ("key", "value"):
            items[(part, name)] += 0
    root = Path(tempfile.mkdtemp(prefix="banks"))
    settings = plan_settings(args.plans.split(",")[0])
    print(f"Gathers of the codebook kernel, D={D}, CH={CH}: wavefronts a gather instruction (random codes; 1 a 4-byte "
          "load, 2 an 8-byte one, 4 a 16-byte one: conflict-free)\n")
    print("| part | scheme | items (plans) | book (positions x entries x bytes) | held once | skewed | copies | "
          "lane rows | lane rows KiB |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for (part, name), n in sorted(items.items(), key=lambda x: (x[0][0], -x[1])):
        key, value = (name, "turboquant-1") if part == "key" else ("turboquant-1", name)
        plan = mapped_plan(llama8b_config(0), one_pair_plan(settings, key, value, root))
        spec = plan.codebook_groups(0)[0].spec
        book = kernel_book(spec.key if part == "key" else spec.value)
        positions, entries, dim = book.book.shape[1:]
        once = gathers("held once", part, positions, entries, dim, args.tiles, rng)
        skewed = gathers("skewed", part, positions, entries, dim, args.tiles, rng) if positions > 1 else None
        copies = gathers("copies", part, positions, entries, dim, args.tiles, rng) if _copies(book) > 1 else None
        rows = gathers("lane rows", part, positions, entries, dim, args.tiles, rng) if positions > 1 else None
        kib = f"{lane_rows_bytes(part, entries, dim) / 1024:.0f}" if rows is not None else ""
        print(f"| {part} | {name} | {n} | {positions} x {entries} x {2 * dim} | {once:.2f} | "
              f"{'' if skewed is None else f'{skewed:.2f}'} | "
              f"{'' if copies is None else f'{copies:.2f}'} | {'' if rows is None else f'{rows:.2f}'} | {kib} |")


if __name__ == "__main__":
    main()
