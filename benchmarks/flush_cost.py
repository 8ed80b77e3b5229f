"""What a flushing step costs a static cache, layer by layer: the cache layer's own `append` of one token per row at
B rows whose windows are full, the flush included (`StaticLayer.append`), run as `model.generate`'s default compile
(`regions`) runs it: eagerly, inside the captured step. Counted on any device (the ops that launch a kernel: every
aten op but views and allocations), and on a GPU captured in a CUDA graph of its own and replayed (µs a layer).

A step where any row's window fills flushes every layer (`StaticKvcalibCache.advance`), so a flushing step costs the
layers' sum more than a step that appends only; a user's batch, whose windows fill at different steps, pays it at up to
B steps of every R (`generate_calls.py`'s B=8 prompts: 8 of 128). Paths: generate_calls.py's KIVI-2 G=128, TurboQuant,
and the shipped plans mapped onto the 8B shape (a plan's layers differ in their groups of heads: `--layers`).

    cd benchmarks && python flush_cost.py [--paths kivi128-static,plan225-static,plan3-static] [--batch 8]
                                          [--layers 0,1,2,3] [--one] [--compiled] [--results FILE]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decode import timed
from generate_calls import model_config, static_method

# aten ops that launch no kernel: views, allocations, metadata
NO_KERNEL = {"view", "slice", "select", "unsqueeze", "squeeze", "permute", "alias", "_unsafe_view", "empty",
             "empty_strided", "expand", "t", "transpose", "split", "split_with_sizes", "unbind", "detach", "lift_fresh",
             "as_strided", "_reshape_alias", "reshape", "unflatten", "flatten", "narrow", "chunk", "movedim",
             "view_as", "expand_as", "is_nonzero", "item", "_local_scalar_dense", "sym_size", "sym_stride", "dim",
             "is_same_size"}


class LaunchCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (on an empty tensor none does: not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).removeprefix("aten.")
        results = out if isinstance(out, (tuple, list)) else [out]
        if name not in NO_KERNEL and not all(isinstance(r, torch.Tensor) and r.numel() == 0 for r in results):
            self.ops[name] += 1
        return out


def full_layer(method, layer: int, batch: int, config, device: torch.device, one: bool = False):
    """A static layer of `method` whose every row holds R - 1 tokens in its window (the next append flushes); `one`:
    row 0 alone, the others R - 2 (the step `append_one` takes: one window fills)."""
    from kvcalib.models import attention_shape
    from kvcalib.runtime.static_cache import StaticLayer

    shape = attention_shape(config)
    r = method.block
    gqa = shape.num_heads // shape.num_kv_heads
    static = StaticLayer(method, layer, batch, 4 * r, shape.num_kv_heads, shape.head_dim, device, gqa)
    g = torch.Generator(device="cpu").manual_seed(layer)
    for buf in (static.layout.kres, static.layout.vres):
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    static.flushed.fill_(r)  # past the first block: sinks already held
    static.residual.fill_(r - 2 if one else r - 1)
    static.residual[0] = r - 1
    k = torch.randn(batch, shape.num_kv_heads, 1, shape.head_dim, generator=g).half().to(device)
    return static, k, k.clone()


def flush_of(static, one: bool):
    """The layer's append with its flush: of every slot (masked), or of slot 0 alone (`append_one`). The one-slot
    flush puts the counts back after it (two copies of B numbers, in the figure): the other slots' windows, which it
    does not flush, would otherwise pass their end within the calls `timed` makes."""
    if one:
        counts = [static.flushed.clone(), static.residual.clone()]

        def flush(k, v):
            static.append_one(k, v, static.slot)
            static.flushed.copy_(counts[0])
            static.residual.copy_(counts[1])
        return flush
    return lambda k, v: static.append(k, v, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="kivi128-static,plan225-static,plan3-static")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", default="0,1,2,3", help="the layers measured (their mean stands for every layer)")
    parser.add_argument("--phases", type=int, default=8, help="flushing steps of every R a batch pays (its rows' "
                        "windows filling at that many different steps)")
    parser.add_argument("--compiled", action="store_true", help="an experiment: each layer's append and flush "
                        "compiled by torch.compile (what fusing the flush would take off): Inductor's kernels a layer, "
                        "its compile seconds, its µs")
    parser.add_argument("--one", action="store_true", help="the flush of one slot's window (`append_one`, a step "
                        "where one slot's window alone fills) rather than the masked flush of every slot")
    parser.add_argument("--results", default=None, help="record into this file (default: print only)")
    args = parser.parse_args()
    from kvcalib.methods.registry import build_method
    from kvcalib.models import attention_shape

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, _ = model_config("llama-3.1-8b", 4096)
    layers = [int(x) for x in args.layers.split(",")]
    how = "compiled, Inductor's" if args.compiled else "eager"
    lines = [f"| path | kernels a layer ({how}, layers {args.layers}) | µs a layer | a flushing step, "
             f"{config.num_hidden_layers} layers, ms | ms a token at {args.phases} flushing steps of R |"
             + (" compile s a layer |" if args.compiled else ""),
             "|---|---|---:|---:|---:|" + ("---:|" if args.compiled else "")]
    for path in args.paths.split(","):
        method, settings = static_method(path, config)
        if isinstance(method, str):
            method = build_method(method, attention_shape(config), settings)
        counts, times, compile_s = [], [], []
        for layer in layers:
            static, k, v = full_layer(method, layer, args.batch, config, device, args.one)
            flush_of(static, args.one)(k, v)  # a warm-up, as the captured step's: what is made once is made here
            static, k, v = full_layer(method, layer, args.batch, config, device, args.one)
            flush = flush_of(static, args.one)
            if args.compiled:
                import torch._inductor.metrics as metrics

                torch._dynamo.reset()
                metrics.reset()
                flush = torch.compile(flush, dynamic=False)
                start = time.perf_counter()
                flush(k, v)
                compile_s.append(time.perf_counter() - start)
                counts.append(metrics.generated_kernel_count)
            else:
                with LaunchCount() as c:
                    flush(k, v)
                counts.append(sum(c.ops.values()))
            if device.type == "cuda":  # captured in a CUDA graph and replayed: the kernels, not the data, set the time
                times.append(timed(lambda i, run=flush: run(k, v), 1))
        us = statistics.mean(times) if times else float("nan")
        step_ms = us * config.num_hidden_layers / 1e3
        lines.append(f"| {path} | {', '.join(map(str, counts))} | {us:.0f} | {step_ms:.1f} | "
                     f"{step_ms * args.phases / method.block:.2f} |"
                     + (f" {statistics.mean(compile_s):.1f} |" if args.compiled else ""))
        print(lines[-1], file=sys.stderr)
    table = "\n".join(lines)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (kernels counted only)"
    whose = "one slot's window (append_one)" if args.one else "every slot's window (masked)"
    title = f"A flushing step's cost, layer by layer, B={args.batch}, {whose}, {where}, Llama-3.1-8B shape"
    print(f"\n{title}\n\n{table}")
    if args.results:
        from results import record

        record(title, table, sys.argv, args.results)


if __name__ == "__main__":
    main()
