"""Fused decode calls at B=1, 32 q / 8 kv heads, d=128 (KIVI-2 G=128; L=128k unless given), for profilers:

    ncu --section SpeedOfLight --section Occupancy -k regex:"packed|merge" python benchmarks/profile_decode.py [L ...]
"""

import sys

import torch

from kvcalib.formats.int2.layout import pack
from kvcalib.formats.int2.launch import fused_decode

for length in map(int, sys.argv[1:] or ["131072"]):
    torch.manual_seed(0)
    k, v = torch.randn(1, 8, length, 128, device="cuda"), torch.randn(1, 8, length, 128, device="cuda")
    layer = pack(k, v, torch.randn(1, 8, 100, 128, device="cuda"), torch.randn(1, 8, 100, 128, device="cuda"), 128, 128)
    q = torch.randn(1, 32, 128, device="cuda").half()
    for _ in range(3):
        fused_decode(q, layer, 128**-0.5)
    torch.cuda.synchronize()
