"""One fused decode call at B=1, L=128k, 32 q / 8 kv heads, d=128 (KIVI-2 G=128), for profilers:

    ncu --section SpeedOfLight --section Occupancy -k regex:"packed|residual|merge" python benchmarks/profile_decode.py
"""

import torch

from kvcalib.runtime.decode import fused_decode, pack

torch.manual_seed(0)
k, v = torch.randn(1, 8, 131072, 128, device="cuda"), torch.randn(1, 8, 131072, 128, device="cuda")
layer = pack(k, v, torch.randn(1, 8, 100, 128, device="cuda"), torch.randn(1, 8, 100, 128, device="cuda"), 128, 128)
q = torch.randn(1, 32, 128, device="cuda").half()
for _ in range(3):
    fused_decode(q, layer, 128**-0.5)
torch.cuda.synchronize()
