"""Where the compiled, captured decode step's time goes: the 8B-shaped random model of
generate.py, B=1 (or `--batch` slots of prompts from `--context` tokens down, as generate_calls.py's B=8 row), a 2-bit cache of generate.py's `CACHES` (`--cache`), or TurboQuant or a mapped plan of
generate_calls.py's static paths (`turboquant2`, `turboquant3`, `plan225`, `plan3`), in a StaticKvcalibCache at
`--context` tokens; torch.profiler over `--replays`
graph replays, GPU kernel time per step by kind:

- rings: SDPA's kernels over a hybrid model's kept sliding layers (`StaticWindowLayer`, `--shape gemma-3-4b`);
- matmul: cuBLAS/cuBLASLt kernels (the fp16 weights' matrix-vector products, lm_head included);
- attention: the fused decode kernels (INT2's `packed_partial`, the codebook kernel's `rotate` and `partial`, `merge`);
- append+flush: Inductor kernels of the cache's append and masked flush (their fused names hold
  scatter/gather, the quantizer's min/max and rounding, or the packing's shifts);
- other: the rest of the model's fused elementwise ops and reductions (RMSNorm, rotary, SiLU, adds).

Then each layer's attention as the GPU ran it (`attention_windows`): its kernels' window from the first to start to
the last to end, split into the phase before any `partial` starts (`rotate`, launch gaps), the partials' span, and
the phase after the last one ends (`merge`), with the idle gaps before and after it; medians over the layers. A plan
runs its groups of heads side by side: a phase is the layer's, over every group.

    python benchmarks/profile_step.py [--context 32768] [--batch 1] [--cache kivi128] [--replays 20] [--out DIR]
                                      [--compile step]
                                      [--shape llama-3.1-8b | another make-model shape, in bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import re
import statistics
from pathlib import Path

import torch

from generate import CACHES, event_steps, prefilled_8b
from kvcalib.runtime.captured import CapturedDecoder

KINDS = [("attention", re.compile(r"packed_partial|partial|merge|rotate")),
         ("rings", re.compile(r"fmha|flash|efficient_attention|sdpa", re.I)),
         ("matmul", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK|cublas", re.I)),
         ("append+flush", re.compile(r"scatter|gather|amax|amin|round|clamp|bitwise|lshift|rshift|where")),
         ("other", re.compile(r"."))]


def kind(name: str) -> str:
    return next(k for k, pattern in KINDS if pattern.search(name))


def kernel_profile(step, token, steps: int) -> tuple[torch.Tensor, collections.Counter, collections.Counter, list]:
    """`steps` calls of `step(token) -> next token` under torch.profiler: (the last token, GPU microseconds per
    step by kernel name, launches per step by kernel name, every kernel as (name, start us, end us))."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(token)
        torch.cuda.synchronize()
    us, calls, spans = collections.Counter(), collections.Counter(), []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[event.name] += event.device_time_total / steps
            calls[event.name] += 1 / steps
            spans.append((event.name, event.time_range.start, event.time_range.end))
    return token, us, calls, spans


PHASES = ("idle before", "before the partials", "partials", "after the partials", "window", "idle after")


def attention_windows(spans: list) -> list[dict]:
    """Each run of attention kernels (in start order, nothing else starting among them: a layer's attention, its
    groups' side streams included) as the `PHASES` in microseconds: the idle time since the kernel before it ended,
    the time from its first start to the first `partial`'s, the partials' span, from the last partial's end to the
    window's, the window, and the idle time until the next kernel starts."""
    spans = sorted(spans, key=lambda x: x[1])
    ended = list(itertools.accumulate((x[2] for x in spans), max))  # the latest end of the kernels up to each
    out, i = [], 0
    for attention, run in itertools.groupby(spans, key=lambda x: kind(x[0]) == "attention"):
        run = list(run)
        j = i + len(run)
        if attention and 0 < i and j < len(spans):  # not a window cut by the profile's edges
            start, end = run[0][1], max(x[2] for x in run)
            partials = [x for x in run if "partial" in x[0]]
            if partials:
                p0, p1 = min(x[1] for x in partials), max(x[2] for x in partials)
                out.append(dict(zip(PHASES, (start - ended[i - 1], p0 - start, p1 - p0, end - p1, end - start,
                                             spans[j][1] - end))))
        i = j
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--cache", default="kivi128", help="one of generate.py's CACHES")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=20, help="steps timed and profiled; at least a flush block "
                        "(the cache's `block`) to count the flushes' share")
    parser.add_argument("--compile", default="regions", help="the captured step's compile mode: regions (what "
                        "model.generate's static cache compiles, the default: the flush eager in the captured step), or "
                        "step (the whole step by torch.compile: at B=8 its compile did not end within 170 s)")
    parser.add_argument("--out", default=".")
    parser.add_argument("--shape", default="llama-3.1-8b", help="llama-3.1-8b (fp16), or another of `kvcalib "
                        "make-model`'s shapes (bfloat16, generate_calls.py's `model_config`)")
    args = parser.parse_args()
    from generate_calls import model_config, static_method

    method = None
    if args.cache not in CACHES:
        method = lambda config: static_method(f"{args.cache}-static", config)  # noqa: E731
    room = 2 * args.replays + 64
    config, dtype = model_config(args.shape, args.context + room)
    model, cache, token = prefilled_8b(args.context, args.cache, room, method, config, dtype, args.batch)
    decoder = CapturedDecoder(model, cache, compile=args.compile)
    for _ in range(5):
        token = decoder.step(token).argmax(-1)
    token, times = event_steps(decoder, token, args.replays)
    token, per_name, calls, spans = kernel_profile(lambda t: decoder.step(t).argmax(-1), token, args.replays)
    by_kind = collections.Counter()
    for name, us in per_name.items():
        by_kind[kind(name)] += us
    step_ms = statistics.median(times)
    total = sum(by_kind.values())
    lines = [f"{args.shape}, {args.cache}, {args.context} tokens, B={args.batch}, compiled {args.compile}: step {step_ms:.2f} ms (median of {args.replays} "
             f"replays, events), GPU kernels {total / 1e3:.2f} ms, {sum(calls.values()):.0f} kernels per step", "",
             "| kind | ms per step | share of the step |", "|---|---:|---:|"]
    lines += [f"| {k} | {us / 1e3:.3f} | {us / 1e3 / step_ms:.0%} |" for k, us in by_kind.most_common()]
    lines += [f"| idle between kernels | {step_ms - total / 1e3:.3f} | {1 - total / 1e3 / step_ms:.0%} |", "",
              "| kernel | kind | calls per step | ms per step |", "|---|---|---:|---:|"]
    lines += [f"| {name[:90]} | {kind(name)} | {calls[name]:.0f} | {us / 1e3:.3f} |" for name, us in per_name.most_common(40)]
    lines += ["", "Kernels on side streams overlap: the kinds' sum may pass the step."]
    windows = attention_windows(spans)
    if windows:
        lines += ["", f"A layer's attention, µs ({len(windows) / args.replays:.1f} windows a step; median, and the "
                  "sum a step in ms):", "", "| phase | median µs | ms a step |", "|---|---:|---:|"]
        lines += [f"| {p} | {statistics.median(w[p] for w in windows):.2f} | "
                  f"{sum(w[p] for w in windows) / args.replays / 1e3:.3f} |" for p in PHASES]
    text = "\n".join(lines)
    print(text)
    Path(args.out, f"profile_{args.shape}_{args.cache}_{args.context}_b{args.batch}_{args.compile}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
