"""How near its read floor a fused decode over 1- and 2-bit codes can come: decode_skeleton.cu, a kernel that does
only what every such format must (codes to tensor-core fragments, scores, online softmax, values, split-KV merge),
beside torch SDPA fp16 and the INT2 kernel's KIVI-2 G=128 over the same tokens. 32 query / 8 KV heads, d=128.

    python benchmarks/decode_skeleton.py [--bits 1,2] [--lengths 32768,131072] [--batches 1,8] [--results FILE]

The skeleton is the least such a kernel does, not a format: one affine map a channel for every token (TurboQuant's two
levels a coordinate are one; KIVI's maps move every G tokens), a norm a token, each level taken from its bits as an
fp16 subnormal by one AND (never gathered from a book), whole 16-token tiles, no float16 window or sinks, no
rotation. So its time is a lower bound on what the runtime's kernels can reach at these widths with this tile plan
(mma.m16n8k16, 16 tokens a warp's tile), and "x floor" says how near the floor that is. Each cell is the fastest of
the launch configurations swept (`CONFIGS`); the table names it. "worst row err": max over (batch, query head) of
‖o − o_ref‖/‖o_ref‖ against the float64 attention over the same codes (`reference`); SDPA's: SDPA fp16 over the
same cache dequantized to fp16, against the same reference. Timing, floor and copies: decode.py's.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

HQ, HKV, D, GQ = 32, 8, 128, 4
SOURCE = str(Path(__file__).with_name("decode_skeleton.cu"))
LOG2E = 1.4426950408889634
# (DEPTH tiles in flight a warp, MINBLOCKS resident blocks an SM asked of the register allocator, WARPS a block,
# WAVES: the grid's blocks over MINBLOCKS an SM, TILES a softmax step): at most 8 bytes a thread spill (nvcc -Xptxas
# -v, sm_90). Two and four waves were slower in every cell at 3125b91 (up to 2x at B=1); 8 warps a block at DEPTH 4
# spilled.
CONFIGS = ((2, 2, 8, 1, 1), (2, 4, 4, 1, 2), (4, 2, 4, 1, 4), (4, 3, 4, 1, 4), (8, 2, 4, 1, 4), (8, 2, 4, 1, 8))


def geometry(bits: int) -> dict:
    """The kernel's constants for `bits` (decode_skeleton.cu's defines of the same names)."""
    return {"WORDS": 2 * bits, "PER": 16 // bits, "DIRECT": 10 // bits, "EMAX": 8 if bits == 2 else 9,
            "PART": 512 * bits // 2, "RECORD": 1024 * bits // 2 + 64}


@functools.lru_cache(maxsize=None)
def slots(bits: int, part: str) -> torch.Tensor:
    """(32 lanes, 32 slots, 2 halves, 4) int64: each half2 half's token in the tile, channel, word of the part (lane
    L's WORDS words from L WORDS on) and bit position, by decode_skeleton.cu's rule; the `e` of its subnormal is its
    bit position less 16 for the high half and less 10 for the shifted slots."""
    geo = geometry(bits)
    out = torch.empty(32, 32, 2, 4, dtype=torch.int64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for s in range(32):
            word, j = divmod(s, geo["PER"])
            pos = bits * j if j < geo["DIRECT"] else 10 + bits * (j - geo["DIRECT"])
            hi, f = divmod(s, 16)
            if part == "k":  # s = 16 nt + 2 ks + hb: token g + 8 nt, channels 16 ks + 2t + 8 hb + {0, 1}
                ks, hb = divmod(f, 2)
                cells = [(g + 8 * hi, 16 * ks + 2 * t + 8 * hb + x) for x in (0, 1)]
            else:  # s = 16 tp + 2 mt + r: channel 16 mt + g + 8 r, tokens 2t + 8 tp + {0, 1}
                mt, r = divmod(f, 2)
                cells = [(2 * t + 8 * hi + x, 16 * mt + g + 8 * r) for x in (0, 1)]
            for x, (tok, ch) in enumerate(cells):
                out[lane, s, x] = torch.tensor([tok, ch, lane * geo["WORDS"] + word, pos + 16 * x])
    return out


def channel_shift(bits: int, part: str) -> torch.Tensor:
    """(D,) int64: the power of two e each channel's levels carry in the fragments (one per channel: the kernel folds
    2^-e into q for keys and 2^(24 - e) into merge's scale for values). Raises if a channel's slots disagree."""
    cells = slots(bits, part).reshape(-1, 4)
    pos = cells[:, 3] % 16
    e = torch.where(pos >= 10, pos - 10, pos)  # the shifted slots' bits sit at 10 and up in the word
    shift = torch.full((D,), -1, dtype=torch.int64)
    for ch in range(D):
        es = e[cells[:, 1] == ch].unique()
        if len(es) != 1:
            raise ValueError(f"channel {ch} carries shifts {es.tolist()}")
        shift[ch] = es[0]
    return shift


def levels(records: torch.Tensor, bits: int, part: str) -> torch.Tensor:
    """(B, H, tiles, 16, D) uint8 levels of one part from records (B, H, tiles, RECORD) uint8, by the slot table."""
    geo, cells = geometry(bits), slots(bits, part).reshape(-1, 4).to(records.device)
    offset = 0 if part == "k" else geo["PART"]
    words = records[..., offset:offset + geo["PART"]].contiguous().view(torch.int32).long() & 0xFFFFFFFF
    vals = (words[..., cells[:, 2]] >> cells[:, 3]) & ((1 << bits) - 1)
    out = torch.empty(*records.shape[:3], 16, D, dtype=torch.uint8, device=records.device)
    out[..., cells[:, 0], cells[:, 1]] = vals.to(torch.uint8)
    return out


def norms(records: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value norms (B, H, tiles, 16) float32: 16 bytes at 16 t hold tokens 2t, 2t+1, 2t+8, 2t+9, keys first."""
    off = geometry(bits)["PART"] * 2
    raw = records[..., off:off + 64].contiguous().view(torch.float16).float().reshape(*records.shape[:3], 4, 2, 4)
    order = torch.tensor([2 * t + x for t in range(4) for x in (0, 1, 8, 9)], device=records.device)
    k = torch.empty(*records.shape[:3], 16, device=records.device)
    v = torch.empty_like(k)
    k[..., order] = raw[..., 0, :].reshape(*records.shape[:3], 16)
    v[..., order] = raw[..., 1, :].reshape(*records.shape[:3], 16)
    return k, v


def make_cache(b: int, length: int, bits: int, generator: torch.Generator, device: str) -> dict:
    """Random codes and norms (the kernel's time does not depend on their values) and an affine map a channel of the
    scale of unit-normal keys and values."""
    geo = geometry(bits)
    tiles = length // 16
    records = torch.randint(0, 256, (b, HKV, tiles, geo["RECORD"]), dtype=torch.uint8, generator=generator)
    n = torch.rand(b, HKV, tiles, 32, generator=generator) + 0.5
    records[..., 2 * geo["PART"]:] = n.half().view(torch.uint8).reshape(b, HKV, tiles, 64)
    span = 1 + torch.rand(2, D, generator=generator)  # each channel's range, -span .. span
    scale = 2 * span / ((1 << bits) - 1)
    return {"records": records.to(device), "kzero": -span[0].to(device), "kscale": scale[0].to(device),
            "vzero": -span[1].to(device), "vscale": scale[1].to(device)}


def dequantized(cache: dict, bits: int, part: str, b: int) -> torch.Tensor:
    """Batch b's part as (HKV, T, D) float64, norm (zero + scale level)."""
    rec = cache["records"][b:b + 1]
    lv = levels(rec, bits, part)[0].double()
    n = norms(rec, bits)[0 if part == "k" else 1][0].double()
    y = cache[f"{part}zero"].double() + cache[f"{part}scale"].double() * lv
    return (n[..., None] * y).reshape(HKV, -1, D)


def reference(q: torch.Tensor, cache: dict, bits: int) -> torch.Tensor:
    """(B, HQ, D) float64 softmax(q K^T / sqrt(D)) V over the cache's codes, one batch row at a time."""
    out = []
    for b in range(q.shape[0]):
        k, v = dequantized(cache, bits, "k", b), dequantized(cache, bits, "v", b)
        qb = q[b].double().reshape(HKV, GQ, D)
        p = torch.softmax(qb @ k.transpose(1, 2) * D**-0.5, dim=-1)
        out.append((p @ v).reshape(HQ, D))
        del k, v, p
    return torch.stack(out)


def sdpa_same_cache(q: torch.Tensor, cache: dict, bits: int) -> torch.Tensor:
    """SDPA fp16 over the cache dequantized to fp16: the peer's error on the same codes."""
    out = []
    for b in range(q.shape[0]):
        k = dequantized(cache, bits, "k", b).half()[None]
        v = dequantized(cache, bits, "v", b).half()[None]
        out.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out).double()


class Skeleton:
    """decode_skeleton.cu's two launches over one cache, in one launch configuration."""

    def __init__(self, cache: dict, bits: int, config: tuple[int, int, int, int, int], sms: int):
        from kernels_cupy.loader import kernel

        self.cache, self.bits = cache, bits
        self.depth, self.minblocks, self.warps, waves, tiles_a_step = config
        geo = geometry(bits)
        self.emax = geo["EMAX"]
        b, _, tiles, _ = cache["records"].shape
        self.tiles = tiles
        defines = {"BITS": bits, "D": D, "GQ": GQ, "WARPS": self.warps, "DEPTH": self.depth,
                   "MINBLOCKS": self.minblocks, "TILES": tiles_a_step}
        self.partial = kernel(SOURCE, defines, "partial")
        self.merge = kernel(SOURCE, defines, "merge")
        # WAVES waves of MINBLOCKS blocks an SM, the (batch, KV head) pairs' tiles split evenly over them
        self.splits = max(1, min(tiles, round(waves * sms * self.minblocks / (b * HKV))))
        self.per_split = -(-tiles // self.splits)
        self.splits = -(-tiles // self.per_split)
        if self.splits * self.warps > 4096:  # merge's MAX_PARTS
            raise ValueError(f"{self.splits * self.warps} parts a KV head: at most 4096")
        parts = b * HKV * self.splits * self.warps
        dev = cache["records"].device
        self.part_acc = torch.empty(parts, GQ, D, device=dev)
        self.part_mlz = torch.empty(parts, 3, GQ, device=dev)
        k_e, v_e = channel_shift(bits, "k").to(dev), channel_shift(bits, "v").to(dev)
        self.kfold = cache["kscale"] * torch.exp2((self.emax - k_e).float()) * (D**-0.5 * LOG2E)
        self.vscale = (cache["vscale"] * torch.exp2((24 - v_e).float())).contiguous()
        self.vzero = cache["vzero"].float().contiguous()

    def fold(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores' query q~ scale 2^(EMAX - e) and bias q~ . zero (q~ = q log2(e) / sqrt(D)): a runtime folds them
        in a small launch per step (as `rotate`); the timings leave it out, as a lower bound should."""
        qf = q.float().reshape(q.shape[0], HKV, GQ, D)
        return (qf * self.kfold).contiguous(), (qf * (self.cache["kzero"] * (D**-0.5 * LOG2E))).sum(-1).contiguous()

    def __call__(self, folded: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, checked: bool = False) -> torch.Tensor:
        import cupy

        from kernels_cupy.loader import launch, torch_stream

        qk, bias = folded
        b = qk.shape[0]
        ptr = lambda x: cupy.uint64(x.data_ptr())  # noqa: E731
        with torch_stream(qk.device):
            launch(self.partial, (self.splits, HKV, b), (32 * self.warps,),
                   (ptr(qk), ptr(bias), ptr(self.cache["records"]), cupy.int64(self.tiles), cupy.int32(self.per_split),
                    cupy.float32(2.0 ** (24 - self.emax)), ptr(self.part_acc), ptr(self.part_mlz)), checked)
            launch(self.merge, (HQ, b), (D,), (ptr(self.part_acc), ptr(self.part_mlz),
                                                 cupy.int32(self.splits * self.warps), ptr(self.vzero),
                                                 ptr(self.vscale), ptr(out)), checked)
        return out


def main() -> None:
    from decode import RESIDUAL, kivi2_us, read_floor, sdpa_us, timed, worst_row
    from results import RESULTS, publish

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="1,2")
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--plant", action="store_true",
                        help="read the keys' levels by a slot table with two channels swapped: the error must show it")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    for bits in map(int, args.bits.split(",") if args.plant else ()):
        table = slots(bits, "k")  # tokens g and g + 8 of channels 2t, 2t + 1 trade places (same shift e)
        table[:, 0, :, 0], table[:, 16, :, 0] = table[:, 16, :, 0].clone(), table[:, 0, :, 0].clone()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            gen = torch.Generator().manual_seed(0)
            q = [torch.randn(b, HQ, D, generator=gen).half().cuda() for _ in range(8)]
            us, nbytes = sdpa_us(q, length, gen)
            rows.append((b, length, "SDPA fp16", "", us, read_floor(nbytes), None, None))
            res = [tuple(torch.randn(b, HKV, RESIDUAL, D, device="cuda", dtype=torch.float16) for _ in "kv")
                   for _ in range(max(1, min(8, -(-400 * 2**20 // (b * HKV * length * D // 2)))))]
            us, nbytes = kivi2_us(q, res, length)
            rows.append((b, length, "KIVI-2 G=128, the INT2 kernel (100 float16 tokens)", "", us, read_floor(nbytes),
                         None, None))
            del res
            for bits in map(int, args.bits.split(",")):
                nbytes = b * HKV * (length // 16) * geometry(bits)["RECORD"]
                copies = max(1, min(8, -(-400 * 2**20 // nbytes)))
                caches = [make_cache(b, length, bits, gen, "cuda") for _ in range(copies)]
                out = torch.empty(b, HQ, D, device="cuda")
                ref = reference(q[0], caches[0], bits)
                err_sdpa = worst_row(sdpa_same_cache(q[0], caches[0], bits), ref)
                best = None
                for config in CONFIGS:
                    kernels = [Skeleton(c, bits, config, sms) for c in caches]
                    folded = [k.fold(q[i]) for i, k in enumerate(kernels)]
                    err = worst_row(kernels[0](folded[0], out, checked=True), ref)
                    us = timed(lambda i: kernels[i](folded[i], out), copies)
                    print(f"B={b} L={length} {bits}-bit DEPTH, MINBLOCKS, WARPS, WAVES, TILES={config}: {us:.1f} µs, err {err:.1e}")
                    if best is None or us < best[0]:
                        best = (us, config, err)
                    del kernels, folded
                floor = read_floor(nbytes + b * HQ * D * 8 + b * HKV * GQ * 4)
                rows.append((b, length, f"skeleton, {bits}-bit keys and values", "DEPTH {}, MINBLOCKS {}, WARPS {}, WAVES {}, TILES {}".format(
                    *best[1]), best[0], floor, best[2], err_sdpa))
                del caches, ref
                torch.cuda.empty_cache()
    sdpa = {(r[0], r[1]): r[4] for r in rows if r[2] == "SDPA fp16"}
    lines = ["| B | L | kernel | launch | µs | read floor µs | x floor | x SDPA's speed | worst row err | SDPA's err, same "
             "cache |", "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for b, length, name, config, us, floor, err, err_sdpa in rows:
        e = f"{err:.1e}" if err is not None else ""
        es = f"{err_sdpa:.1e}" if err_sdpa is not None else ""
        lines.append(f"| {b} | {length} | {name} | {config} | {us:.1f} | {floor:.1f} | {us / floor:.2f}x | "
                     f"{sdpa[(b, length)] / us:.2f}x | {e} | {es} |")
    title = (f"The least a fused decode of 1- and 2-bit codes costs: decode_skeleton.cu, "
             f"{torch.cuda.get_device_name(0)}, 32 q / 8 kv heads, d=128")
    publish(title, "\n".join(lines), sys.argv,
            record_it=not args.no_record and not args.plant, path=args.results)


if __name__ == "__main__":
    main()
