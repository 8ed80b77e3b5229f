"""`kvcalib.streams.side_by_side` off a GPU: the calls run in turn, in order, and their results come back in order (a
plan's flush packs its groups through it on every device; tests/test_streams_gpu.py: on CUDA)."""

import torch

from kvcalib.streams import side_by_side


def test_off_a_gpu_the_calls_run_in_turn_and_their_results_come_back_in_order():
    ran = []
    calls = [lambda i=i: ran.append(i) or i * 10 for i in range(4)]
    assert side_by_side(torch.device("cpu"), calls) == [0, 10, 20, 30]
    assert ran == [0, 1, 2, 3]
    assert side_by_side(torch.device("cpu"), []) == []
