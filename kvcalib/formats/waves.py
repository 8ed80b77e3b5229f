"""How a decode kernel's launch fills the GPU, shared by the kernels of `formats/`: one wave of resident blocks, the
flushed tokens split so that the splits of every (batch row, KV head) fill it once."""

from __future__ import annotations

import functools

import torch

MAX_GQA = 8  # query heads per KV head: the 8 columns of an mma tile (every kernel's limit)


@functools.lru_cache(maxsize=8)
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(length: int, blocks_per_split: int, unit: int, slots: int, reserved: int = 0) -> tuple[int, int]:
    """(splits, tokens per split) of `length` flushed tokens: at most one wave of `slots` resident blocks,
    `blocks_per_split` of them per split (batch x KV heads), `reserved` of the wave's slots going to the
    float16 rows' blocks; splits of whole `unit`s (int2_decode.cu: 128 tokens and whole key groups;
    vq_decode.cu: whole stages). With device counts a kernel re-splits each row's own length over the same
    number of splits (`packed_partial`, `vq_partial`)."""
    units = max(1, -(-length // unit))
    want = max(1, (slots - reserved) // blocks_per_split)
    per = -(-units // min(units, want))
    split_len = per * unit
    return max(1, -(-length // split_len)) if length else 0, split_len
