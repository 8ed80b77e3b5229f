"""kernel_variants.py's padded batch: the counts a static cache would pass for rows of different lengths."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_a_padded_batch_spans_its_lengths_in_whole_blocks(monkeypatch):
    mod = load_script("kernel_variants", monkeypatch)
    flushed, windows = mod.padded_counts(8, 32768, 100, device="cpu")
    assert flushed.tolist() == [32768, 28672, 24576, 20480, 16384, 12288, 8192, 4096]
    assert windows.tolist() == [100, 63, 26, 89, 52, 15, 78, 41]  # each row's window filled to its own count
    flushed, windows = mod.padded_counts(3, 1000, 7, device="cpu")
    assert flushed.tolist() == [1000, 616, 232]  # down by whole 128-token blocks, to no less than 1000 / 8
    assert all(1 <= w <= 7 for w in windows.tolist())
