"""How much of the captured decode step to compile, measured on one cache state: the 8B-shaped random
model of generate.py, B=1, a 2-bit cache (`--cache`) in a StaticKvcalibCache at `--context` tokens.

Each variant captures its own step (`CapturedDecoder`) from the same prefilled state and reports the time to
build it (its compiles and the capture), the step's median over `--replays` replays (CUDA events), the GPU
kernels per step (torch.profiler over the graph's replays), the graphs Dynamo compiled, and the first
step's logits against the uncompiled step's (max |difference| over max |logit|):

- `none`, `regions` (the cache's default: each decoder layer but its attention module, the final norm, the
  rotary application, the cache's append of the step's token), `step` (the whole step);
- `norms-mlps`: the regions as they were, each layer's norms and MLP, the final norm and the rotary
  application; the residual adds and the cache's append eager;
- `norms-mlps+append`: the same and the cache's append;
- any of them with `+cublas`: the weight products by cuBLAS rather than the one-row kernel the step switches
  in on a GPU (`kvcalib.runtime.gemv_kernel`).

    python benchmarks/compile_regions.py [--context 32768] [--variants none,regions,...] [--replays 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from generate import event_steps, prefilled_8b
from profile_step import kernel_profile
from kvcalib.runtime import captured, gemv_kernel
from kvcalib.runtime.captured import CapturedDecoder, compile_options

VARIANTS = ["none", "norms-mlps", "norms-mlps+append", "regions", "step"]


class NormsMlps(captured._Regions):
    """The regions as they were: each layer's children but its attention, the final norm, the rotary
    application, and the cache's append where `append`."""

    append = False

    def __init__(self, model):
        super().__init__(model)
        layers, attention = captured._decoder_layers(model)
        self.modules = [child for layer in layers for child in layer.children()
                        if not any(m is child for m in attention)] + [model.model.norm]
        self.compiled = [torch.compile(m._call_impl, dynamic=False, options=compile_options()) for m in self.modules]
        self.attention = []
        self.swaps = [s for s in self.swaps if self.append or s[1] != "write_token"]


class NormsMlpsAppend(NormsMlps):
    append = True


def build(variant: str, model, cache) -> CapturedDecoder:
    """The variant's captured decoder."""
    if variant.endswith("+cublas"):  # the kernel takes no rows while the step is traced and captured
        rows, gemv_kernel.MAX_ROWS = gemv_kernel.MAX_ROWS, 0
        try:
            return build(variant.removesuffix("+cublas"), model, cache)
        finally:
            gemv_kernel.MAX_ROWS = rows
    kind = {"norms-mlps": NormsMlps, "norms-mlps+append": NormsMlpsAppend}.get(variant)
    if kind is None:
        return CapturedDecoder(model, cache, compile=variant)
    regions = captured._Regions
    captured._Regions = kind
    try:
        return CapturedDecoder(model, cache, compile="regions")
    finally:
        captured._Regions = regions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--cache", default="kivi128", help="one of generate.py's CACHES")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "step"))
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    model, cache, first = prefilled_8b(args.context, args.cache, 4 * args.replays + 512)
    saved = [[t.clone() for t in layer.mutable()] for layer in cache.layers]
    lengths, residuals = list(cache.lengths), list(cache.residual_counts)
    reference = None
    lines = [f"{args.cache}, {args.context} tokens, B=1, {torch.cuda.get_device_name()}", "",
             "| variant | build s | step ms (median) | kernels per step | Dynamo graphs | max abs dlogit / max abs logit |",
             "|---|---:|---:|---:|---:|---:|"]
    for variant in args.variants.split(","):
        for layer, tensors in zip(cache.layers, saved):
            for t, old in zip(layer.mutable(), tensors):
                t.copy_(old)
        cache.lengths, cache.residual_counts = list(lengths), list(residuals)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder = build(variant, model, cache)
        logits = decoder.step(first).float().clone()
        torch.cuda.synchronize()
        built = time.perf_counter() - start
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        reference = logits if reference is None else reference
        drift = float((logits - reference).abs().max() / reference.abs().max())
        token, times = event_steps(decoder, logits.argmax(-1), args.replays)
        _, _, calls = kernel_profile(lambda t: decoder.step(t).argmax(-1), token, 10)
        lines.append(f"| {variant} | {built:.1f} | {statistics.median(times):.3f} | {sum(calls.values()):.0f} "
                     f"| {graphs} | {drift:.2e} |")
        print(lines[-1], file=sys.stderr, flush=True)
        del decoder
    print("\n".join(lines))


if __name__ == "__main__":
    main()
