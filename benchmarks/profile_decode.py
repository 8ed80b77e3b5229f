"""Fused decode calls, 32 q / 8 kv heads, d=128, for profilers: KIVI-2 G=128 on the INT2 kernel, or (`--pair KEY+VALUE`)
one pair of a plan's schemes over all 8 KV heads on the codebook kernel (codebook_pairs.py's layer); L=128k and B=1
unless given.

    ncu --section SpeedOfLight --section Occupancy -k regex:"packed|merge" python benchmarks/profile_decode.py [L ...]
    ncu --section InstructionStats --section WarpStateStats --section SourceCounters -k regex:partial -c 1 \
        python benchmarks/profile_decode.py --batch 8 --pair turboquant-2+vecinfer-d4b6 32768
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("lengths", nargs="*", type=int, default=[131072])
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--pair", default="", help="KEY+VALUE schemes of a plan (e.g. turboquant-2+vecinfer-d4b6)")
parser.add_argument("--plan", default=str(Path(__file__).resolve().parent.parent / "artifacts/smollm2-135m/plan-2.25"),
                    help="the plan whose settings (residual, sink) the pair's layer takes")
args = parser.parse_args()

for length in args.lengths:
    torch.manual_seed(0)
    b = args.batch
    res = [torch.randn(b, 8, 100, 128, device="cuda").half() for _ in "kv"]
    q = torch.randn(b, 32, 128, device="cuda").half()
    if args.pair:
        from codebook_pairs import one_pair_plan, plan_settings
        from decode import plan_layer
        from kvcalib.formats.codebook.launch import codebook_decode

        d = one_pair_plan(plan_settings(args.plan), *args.pair.split("+"), Path(tempfile.mkdtemp(prefix="pair")))
        layer = plan_layer(b, length, d, *res)[0]
        call = lambda: codebook_decode(q, layer, 128**-0.5)  # noqa: E731
    else:
        from kvcalib.formats.int2.launch import fused_decode
        from kvcalib.formats.int2.layout import pack

        k, v = torch.randn(b, 8, length, 128, device="cuda"), torch.randn(b, 8, length, 128, device="cuda")
        layer = pack(k, v, *res, 128, 128)
        call = lambda: fused_decode(q, layer, 128**-0.5)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
