"""benchmarks/decode_skeleton.py's slot table against decode_skeleton.cu's rule, on the CPU: the kernel's AND of each
slot's mask, its choice of registers for each mma, and PTX's fragment layout of mma.m16n8k16 (written here from the
ISA's tables, not from the table under test) rebuild each tile's levels as `levels` reads them, times 2^e of the
channel (`channel_shift`). Exact: levels and subnormals are integers times powers of two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmark_scripts import load_script


def kernel_half2(words: np.ndarray, lane: int, bits: int) -> np.ndarray:
    """(32, 2) float64: the lane's 32 half2 as `unpack` makes them (each half an fp16 subnormal), times 2^24."""
    words_a_lane, per, direct = 2 * bits, 16 // bits, 10 // bits
    out = np.empty((32, 2))
    for k in range(words_a_lane):
        w = int(words[lane * words_a_lane + k]) & 0xFFFFFFFF
        for j in range(per):
            src = w if j < direct else w >> 10
            mask = (((1 << bits) - 1) << (bits * (j if j < direct else j - direct))) * 0x10001
            h = src & mask
            halves = np.array([h & 0xFFFF, h >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)
            out[k * per + j] = halves * 2.0**24
    return out


def tiles_from_fragments(h: np.ndarray, part: str) -> np.ndarray:
    """(16 tokens, 128 channels) from every lane's half2 h (32 lanes, 32, 2), placed as the kernel hands them to the
    mma and PTX's m16n8k16 layout reads them (groupID g = lane / 4, threadID_in_group t = lane % 4)."""
    tile = np.full((16, 128), np.nan)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for x in range(16):
            if part == "k":  # B (k16 x n8, col): b0 = rows 2t, 2t+1 of column g; b1 = rows 2t+8, 2t+9
                nt, ks = divmod(x, 8)
                for reg, rows in ((16 * nt + 2 * ks, (2 * t, 2 * t + 1)), (16 * nt + 2 * ks + 1, (2 * t + 8, 2 * t + 9))):
                    for i, r in enumerate(rows):  # B = K^T: row = channel 16 ks + r, column = token 8 nt + g
                        tile[8 * nt + g, 16 * ks + r] = h[lane, reg, i]
            elif x < 8:  # A (m16 x k16, row) of O^T's m-tile mt = V^T: a0 (g; 2t, 2t+1), a1 (g+8; ..), a2 (g; 2t+8, ..)
                mt = x
                regs = (2 * mt, 2 * mt + 1, 16 + 2 * mt, 16 + 2 * mt + 1)
                places = ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))
                for reg, (row, col) in zip(regs, places):
                    for i in range(2):  # row = channel 16 mt + row, column = token col + i
                        tile[col + i, 16 * mt + row] = h[lane, reg, i]
    return tile


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("part", ["k", "v"])
def test_each_tile_read_from_the_kernels_fragments_is_the_slot_tables_levels_times_its_channels_shift(bits, part, monkeypatch):
    sk = load_script("decode_skeleton", monkeypatch)
    geo = sk.geometry(bits)
    gen = torch.Generator().manual_seed(bits)
    records = torch.randint(0, 256, (1, 1, 3, geo["RECORD"]), dtype=torch.uint8, generator=gen)
    lv = sk.levels(records, bits, part)[0, 0].double().numpy()
    shift = sk.channel_shift(bits, part).numpy()
    offset = 0 if part == "k" else geo["PART"]
    for tile in range(3):
        words = records[0, 0, tile, offset:offset + geo["PART"]].contiguous().view(torch.int32).numpy()
        h = np.stack([kernel_half2(words, lane, bits) for lane in range(32)])
        got = tiles_from_fragments(h, part)
        assert not np.isnan(got).any()  # every (token, channel) of the tile reaches an mma
        np.testing.assert_array_equal(got, lv[tile] * 2.0**shift)
    assert lv.max() == (1 << bits) - 1 and lv.min() == 0


@pytest.mark.parametrize("bits", [1, 2])
def test_the_slot_table_uses_every_bit_of_a_part_once_and_every_cell_of_the_tile_once(bits, monkeypatch):
    sk = load_script("decode_skeleton", monkeypatch)
    for part in "kv":
        cells = sk.slots(bits, part).reshape(-1, 4)
        assert len({(int(tok), int(ch)) for tok, ch, _, _ in cells}) == 16 * 128
        used = {(int(w), int(p) + i) for _, _, w, p in cells for i in range(bits)}
        assert len(used) == 16 * 128 * bits == 32 * 2 * bits * 32


def test_a_lanes_norms_are_those_of_its_tokens(monkeypatch):
    """Lane (g, t) reads 16 bytes at 16 t: key norms of tokens 2t, 2t+1, 2t+8, 2t+9, then their value norms."""
    sk = load_script("decode_skeleton", monkeypatch)
    for bits in (1, 2):
        off = 2 * sk.geometry(bits)["PART"]
        records = torch.zeros(1, 1, 1, sk.geometry(bits)["RECORD"], dtype=torch.uint8)
        raw = torch.arange(32, dtype=torch.float16)  # value = its half's index in the 64 bytes
        records[0, 0, 0, off:] = raw.view(torch.uint8)
        k, v = sk.norms(records, bits)
        for t in range(4):
            for i, tok in enumerate((2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)):
                assert k[0, 0, 0, tok] == 8 * t + i and v[0, 0, 0, tok] == 8 * t + 4 + i
