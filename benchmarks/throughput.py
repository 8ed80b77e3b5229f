"""Decode throughput at a fixed memory budget: in `--budget-gib` of GPU memory, weights included,
the largest batch each cache holds at a given context, and decode tokens/s at that batch, for the
random-initialised Llama-3.1-8B-shaped model of benchmarks/generate.py (fp16).

    python benchmarks/throughput.py [--budget-gib 70] [--contexts 32768,131072] [--steps 64] [--caches all]
                                    [--start-batch CACHE=B,...]
    torchrun --nproc-per-node 2 benchmarks/throughput.py --model DIR [--budget-gib 70] [--contexts 32768] ...

Under torchrun (`--model DIR`, its weights written: `kvcalib make-model --shape llama-3.1-70b --dtype float16
--device cuda --out DIR`) the model is DIR's under transformers' tensor parallelism (generate_spread.py's
`tp_model`): every GPU holds a share of every layer's heads, each rank's cache its own KV heads. The budget
is then a GPU's (`--budget-gib` on each, its share of the weights included); the ranks probe and measure the
same batch (the smallest any rank fits, the largest peak any rank saw), and rank 0 times and records; the byte
floor is a rank's share of the weights and of the cache. kvcalib's `-static-compiled` step is captured with its
regions compiled there (`compile="regions"`, what `model.generate` runs), not the whole step.

Caches, each at its fastest path in generate.py:
- `fp16-static-compile`: transformers' StaticCache, the forward under `torch.compile(mode="reduce-overhead")`;
- `{cache}-static-compiled`, a cache of generate.py's `CACHES` (`kivi128`, `kivi32`, `oscar32`, `kvlinc128`)
  or `VECINFER` (`vecinfer_d4b8`, `vecinfer_d8b12`):
  StaticKvcalibCache, the step compiled and captured (`CapturedDecoder(compile=True)`);
- `{vecinfer cache}-captured`: the same step captured without `torch.compile` (a VecInfer flush encodes every
  slot's window by nearest centroid, a chunked torch loop that Inductor would unroll into thousands of ops at
  large batches);
- `plan-static-compiled`: StaticKvcalibCache holding the plan `kvcalib plan` wrote for this model (`--plan DIR`),
  as `kvcalib generate --method plan --artifacts DIR` serves it; its byte floor counts the bytes a slot's cache
  holds as measured (`held_tensors`, sized for the context, the steps and one block of slack: about 1% over).

Memory. Weights: allocated once the model is built. Cache: the bytes of the tensors it holds
(`held_tensors`; `max_length` = context + the steps run; every buffer is allocated at creation), at batch
1 and 2. Workspace: the peak allocated during an eager decode step over what was allocated before it (the
activations, logits, the flush's intermediates, the attention's partials, and for fp16 the key and value
copies that transformers' SDPA path makes to repeat KV heads under a mask), at batch 1 and 2; for kvcalib
the step that appends and the step that flushes, summed (the decoder keeps a graph pool for each). Both
are linear in the batch, so the largest batch is the largest B with weights + cache(B) + workspace(B) <=
budget. Where the compiled step still peaks over the budget (Inductor's buffers are not the eager step's),
the run spreads the overshoot over the slots, takes the batch that fits, and measures again (at most twice).
At that batch the run reports the peak memory allocated, and the peak torch reserved (CUDA graph pools
and allocator slack included), from the compile to the last timed step.

Filling the slots: a step's time depends on the bytes it reads, not on their values. kvcalib: one prompt
of `context` random token ids is prefilled into a one-slot cache (compressed as it goes) and its state
(codes, scales, zeros, residual, counts) copied into every slot of the batch, where prefilling each slot
would cost minutes of device time for the same bytes; every slot then flushes at the same step (the
masked flush runs at every step anyway). fp16: StaticCache's buffers are filled with normal noise and its
position set to the context; its SDPA step reads the whole `max_cache_len` under a mask at any position.

Timed: `--steps` steps after the warm-up (compile and capture), each synchronised from the host as
generate.py times them; tokens/s = batch / median step time. Byte floor: weights + batch x the cache one
sequence holds at the context (`generate.int2_bytes`; fp16 keys and values), over the copy bandwidth. Two
ratios against fp16: to fp16's measured tokens/s, and to the tokens/s fp16 would reach at its own byte floor
with its batch (what a paged fp16 engine comes close to).
The tokens of random weights say nothing about accuracy: the caches' accuracy is in RESULTS.md's
perplexity tables and generate.py's B=1 runs compare them with fp16.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM, StaticCache

from generate import CACHES as INT2_CACHES
from generate import VECINFER
from generate import (copy_bandwidth, fp16_bytes, held_tensors, int2_bytes, kvcalib_method, llama8b_config, median_p99,
                      spoken, timed_steps)
from kvcalib.models import LoadedModel
from kvcalib.runtime.cache import tensor_parallel_rank, tensor_parallel_size
from kvcalib.runtime.captured import CapturedDecoder, Decoder
from kvcalib.runtime.static_cache import StaticKvcalibCache
from results import RESULTS, record

CACHES = ["fp16-static-compile"] + [f"{name}-static-compiled" for name in [*INT2_CACHES, *VECINFER]] \
    + [f"{name}-captured" for name in VECINFER] + ["plan-static-compiled"]
GIB = 2**30
PLAN: list = []  # the plan of `--plan DIR`, loaded once


def build(name: str, lm: LoadedModel, batch: int, length: int):
    """The cache `name` with `batch` slots of `length` tokens, every buffer allocated (under tensor parallelism,
    this rank's KV heads)."""
    if name == "fp16-static-compile":
        c = lm.model.config
        lm.model.set_attn_implementation("sdpa")
        cache = StaticCache(config=c, max_cache_len=length)
        heads = c.num_key_value_heads // tensor_parallel_size(lm.model)
        cache.early_initialization(batch, heads, c.head_dim, torch.float16, torch.device("cuda"))
        return cache
    if name == "plan-static-compiled":
        return StaticKvcalibCache(lm, PLAN[0], max_batch=batch, max_length=length)
    return StaticKvcalibCache(lm, kvcalib_method(name.split("-")[0], lm), max_batch=batch, max_length=length)


def fp16_step(model, cache, batch: int, at: int, compiled: bool):
    """step(tokens (B,)) -> next tokens (B,) over a StaticCache holding `at` tokens per sequence."""
    forward = torch.compile(model.forward, mode="reduce-overhead") if compiled else model.forward
    for layer in cache.layers:
        layer.cumulative_length.fill_(at)
    pos = [at]

    def step(tokens):
        p = torch.full((batch, 1), pos[0], device="cuda")
        pos[0] += 1
        out = forward(tokens.view(-1, 1), past_key_values=cache, cache_position=p[0], position_ids=p, use_cache=True)
        return out.logits[:, -1].argmax(-1)

    return step


def probe(name: str, lm: LoadedModel, batch: int, length: int, ctx: int) -> tuple[int, int]:
    """(cache bytes, workspace bytes) at `batch`: the tensors the cache holds (`held_tensors`), and the
    peak of an eager step over what was allocated before it. A kvcalib decoder captures a step of each kind, each
    in its own graph pool (`CapturedDecoder`): the step that appends only, the one that also flushes every slot and,
    at B > 1, the one that flushes the one slot whose window alone fills; every pool stays allocated, so every
    workspace counts."""
    release()
    cache = build(name, lm, batch, length)
    cache_bytes = held_tensors(cache)
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
    if name == "fp16-static-compile":
        step = fp16_step(lm.model, cache, batch, ctx, compiled=False)
        kinds = [None]
    else:
        decoder = Decoder(lm.model, cache)
        step = lambda t: decoder.step(t).argmax(-1)  # noqa: E731
        r = cache.method.block  # host residual counts before the step: append only; flush every slot; one slot
        kinds = [[0] * batch, [r - 1] * batch] + [[r - 1] + [0] * (batch - 1)] * (batch > 1)
    workspace = 0
    with torch.no_grad():  # (with autograd on, a step keeps every layer's activations: 64 GiB of fp16 at 128k)
        step(tokens)  # the first step loads the kernels
        for count in kinds:
            if count is not None:
                cache.residual_counts = list(count)  # `advance` picks the step's kind from these
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(tokens)
            torch.cuda.synchronize()
            workspace += torch.cuda.max_memory_allocated() - before
    del cache, step
    return cache_bytes, workspace


def release() -> None:
    """Drop compiled graphs (and their CUDA graph pools) and cached blocks from the last run."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def prefilled(name: str, lm: LoadedModel, length: int, prompt: torch.Tensor):
    """A one-slot cache holding `prompt` (kvcalib), made before the batch's cache: the prefill's activations
    (a few GiB at 128k) then fit beside the weights; None for fp16 (filled with noise)."""
    if name == "fp16-static-compile":
        return None
    one = build(name, lm, 1, length)
    one.prefill(lm.model, 0, prompt)
    return one


def prompt_ids(vocab: int, count: int, seed: int) -> torch.Tensor:
    """`count` random token ids on the GPU, the same on every rank (tensor parallelism feeds each rank the same
    tokens)."""
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).cuda()


def agree(value: float, most: bool) -> float:
    """Under tensor parallelism, the largest (`most`) or smallest `value` over the ranks, so that every rank
    takes the same batch and the same decisions (a rank alone would wait in a collective); else `value`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if most else dist.ReduceOp.MIN)
    return t.item()


def paired_tensors(a, b):
    """(tensor of `a`, the tensor at the same place in `b`), walking two layouts of one format alike (dataclasses,
    lists, tuples, dicts) as `held_tensors` walks one."""
    if isinstance(a, torch.Tensor):
        yield a, b
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            yield from paired_tensors(x, y)
    elif isinstance(a, dict):
        for k in a:
            yield from paired_tensors(a[k], b[k])
    elif hasattr(a, "__dict__") and not isinstance(a, (torch.nn.Module, type)):
        for k, x in vars(a).items():
            if k not in ("method", "model"):
                yield from paired_tensors(x, getattr(b, k))


def fill(cache, one, batch: int, ctx: int) -> None:
    """Slots holding the prompt of `one` (module docstring: one prefill copied), or fp16 noise (`one` None).
    Every tensor of a layer's layout and of its counts and state (`StaticLayer.mutable`: KVLinC's S and P) is
    copied: one slot's rows into each of the batch's (dim 0), a tensor without slots (codebooks, bases) as it is."""
    if one is None:
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
        return
    for src, dst in zip(one.layers, cache.layers):
        # a compressed layer's layout, or a kept sliding layer's rings (`StaticWindowLayer`), and the counts
        held = (src.layout, dst.layout) if hasattr(src, "layout") else ((src.kwin, src.vwin), (dst.kwin, dst.vwin))
        pairs = list(paired_tensors(*held)) + list(zip(src.mutable(), dst.mutable()))
        for a, b in pairs:
            if a is None or a.data_ptr() == b.data_ptr():
                continue
            if a.shape == b.shape:
                b.copy_(a)
            elif a.shape[0] == 1 and a.shape[1:] == b.shape[1:]:
                b.copy_(a.expand_as(b))
            else:
                raise ValueError(f"fill: a one-slot tensor {tuple(a.shape)} against the batch's {tuple(b.shape)}")
    cache.lengths = [ctx] * batch


def measure(name: str, lm: LoadedModel, batch: int, ctx: int, steps: int, profile: int = 0) -> dict:
    """Median and p99 step seconds at `batch` slots filled to `ctx`, and the peak memory allocated and reserved;
    with `profile`, that many more steps under torch.profiler, their GPU time by kind printed (`profile_kinds`)."""
    release()
    length = ctx + steps + 16
    with torch.no_grad():
        one = prefilled(name, lm, length, prompt_ids(lm.model.config.vocab_size, ctx, ctx)[None])
        cache = build(name, lm, batch, length)
        fill(cache, one, batch, ctx)
    del one
    release()
    torch.cuda.reset_peak_memory_stats()
    if name == "fp16-static-compile":
        step, warm = fp16_step(lm.model, cache, batch, ctx, compiled=True), 6
    else:
        # (compiled and) captured here; under tensor parallelism its regions compiled, as `model.generate` serves it
        # there (the whole step's compile has not run with the ranks' collectives)
        compiled = ("regions" if tensor_parallel_size(lm.model) > 1 else True) if name.endswith("-static-compiled") else False
        decoder = CapturedDecoder(lm.model, cache, compile=compiled)
        step, warm = (lambda t: decoder.step(t).argmax(-1)), 3
    tokens = prompt_ids(lm.model.config.vocab_size, batch, 1)
    with torch.no_grad():
        _, warmed = timed_steps(step, tokens, warm)  # compile and capture happen here
        seconds, _ = timed_steps(step, warmed[-1], steps)
    peak = agree(torch.cuda.max_memory_allocated(), True), agree(torch.cuda.max_memory_reserved(), True)
    if profile:
        profile_kinds(step, warmed[-1], profile, f"{ctx} {name} B={batch}", statistics.median(seconds))
    if name != "fp16-static-compile":
        decoder.close()  # its graphs now (under tensor parallelism they hold NCCL collectives)
    del cache, step
    median, p99 = median_p99(seconds)
    return {"median": median, "p99": p99, "peak": peak}


def profile_kinds(step, tokens, steps: int, label: str, step_s: float) -> None:
    """GPU kernel time per step by kind (profile_step.py's kinds: matmul, attention, append+flush, other) and the
    largest kernels, over `steps` steps under torch.profiler: where a large batch's step goes."""
    from profile_step import kernel_profile, kind

    _, per_name_us, _ = kernel_profile(step, tokens, steps)
    per_name = collections.Counter({name: us / 1e3 for name, us in per_name_us.items()})
    by_kind = collections.Counter()
    for kernel_name, ms in per_name.items():
        by_kind[kind(kernel_name)] += ms
    print(f"{label}: step {1e3 * step_s:.2f} ms; kernels " +
          ", ".join(f"{k} {ms:.2f} ms" for k, ms in by_kind.most_common()), flush=True)
    for kernel_name, ms in per_name.most_common(12):
        print(f"    {ms:8.3f} ms  {kernel_name[:100]}", flush=True)


def held_bytes(name: str, ctx: int, config) -> float:
    """Bytes one sequence's cache holds at `ctx` tokens (what a step must read of it)."""
    if name == "fp16-static-compile":
        return fp16_bytes(ctx, config)
    return int2_bytes(ctx, name.split("-")[0], config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=70.0)
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--caches", default="all", help=f"comma-separated, of {', '.join(CACHES)}")
    parser.add_argument("--start-batch", default=None, metavar="CACHE=B,...",
                        help="measure CACHE first at batch B instead of the probes' batch (a batch an earlier run "
                             "found: each measure is a compile); the budget check and re-measure still apply")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after timing, profile this many steps of each measured batch (GPU time by kind)")
    parser.add_argument("--model", default=None,
                        help="under torchrun: a model directory with its weights written, run under tensor parallelism")
    parser.add_argument("--plan", default=None, help="plan-static-compiled: the directory `kvcalib plan` wrote for "
                        "this model")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    tp = "LOCAL_RANK" in os.environ
    if tp != (args.model is not None):
        parser.error("--model DIR runs under torchrun --nproc-per-node N (tensor parallelism), and torchrun needs it")
    caches = CACHES if args.caches == "all" else args.caches.split(",")
    start = {}
    for item in (args.start_batch.split(",") if args.start_batch else []):
        name, _, value = item.partition("=")
        if name not in CACHES or not value.isdigit() or int(value) < 1:
            parser.error(f"--start-batch takes CACHE=B pairs, CACHE of {', '.join(CACHES)}; got {item!r}")
        start[name] = int(value)
    if args.caches == "all" and args.plan is None:
        caches = [c for c in caches if c != "plan-static-compiled"]
    if ("plan-static-compiled" in caches) != (args.plan is not None):
        parser.error("plan-static-compiled serves the plan of --plan DIR, and --plan needs it among --caches")
    contexts = [int(c) for c in args.contexts.split(",")]
    budget = args.budget_gib * GIB
    if tp:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    bandwidth = copy_bandwidth()
    torch.manual_seed(0)
    if tp:
        from generate_spread import tp_model

        model, _ = tp_model(args.model)
    else:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(llama8b_config(max(contexts)), dtype=torch.float16).eval()
    lm = LoadedModel(model=model, tokenizer=None, spec=args.model or "llama-3.1-8b-shaped (random)")
    if args.plan is not None:
        from kvcalib.methods import MethodSettings, build_method
        from kvcalib.models import attention_shape

        PLAN.append(build_method("plan", attention_shape(model.config), MethodSettings(), args.plan, lm))
    ranks, lead = tensor_parallel_size(model), tensor_parallel_rank(model) == 0
    say = print if lead else (lambda *args, **kwargs: None)  # under tensor parallelism rank 0 reports
    weights = torch.cuda.memory_allocated()  # this rank's share under tensor parallelism
    each = " a GPU" if tp else ""
    lines = [f"budget {args.budget_gib:g} GiB{each}; weights {weights / GIB:.2f} GiB allocated{each}; copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s; {args.steps} timed steps after the warm-up", "",
             "| context | cache | GiB per slot: cache + workspace | largest batch | peak GiB allocated / reserved | ms/step median "
             "| p99 | tokens/s | byte-floor tokens/s | median/floor | x fp16 tokens/s | x fp16's byte floor |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ctx in contexts:
        length = ctx + args.steps + 16
        rows = {}
        for name in caches:
            (c1, w1), (c2, w2) = (probe(name, lm, b, length, ctx) for b in (1, 2))
            per_slot = (c2 - c1) + (w2 - w1)
            fixed = (2 * c1 - c2) + (2 * w1 - w2)
            batch = int(agree((budget - weights - fixed) // per_slot, False))
            say(f"{ctx} {name}: cache {c1 / GIB:.3f}/{c2 / GIB:.3f} GiB, workspace {w1 / GIB:.3f}/{w2 / GIB:.3f} GiB "
                  f"at B=1/2 -> batch {batch}", flush=True)
            if name in start:
                batch = start[name]
                say(f"{ctx} {name}: starting at B={batch} (--start-batch)", flush=True)
            res = measure(name, lm, batch, ctx, args.steps, args.profile) if batch >= 1 else None
            for _ in range(2):  # the compiled step may hold more than the eager probe saw: fit it in the budget
                if res is None:
                    break
                over = res["peak"][0] - budget
                if over <= 0:
                    break
                say(f"{ctx} {name}: B={batch} median {1e3 * res['median']:.2f} ms, {batch / res['median']:.0f} tokens/s, "
                      f"peak allocated {res['peak'][0] / GIB:.2f} GiB (over the budget)", flush=True)  # kept if cut
                surplus = over / batch  # spread over the slots, as the probe's workspace is
                smaller = min(batch - 1, int(agree((budget - weights - fixed) // (per_slot + surplus), False)))
                say(f"{ctx} {name}: B={batch} peaks {over / GIB:.2f} GiB over the budget; measuring B={smaller}",
                      flush=True)
                batch, res = smaller, measure(name, lm, smaller, ctx, args.steps) if smaller >= 1 else None
            if res is None:  # not one sequence of this context fits beside the weights (the 70B's fp16 at 32k, say)
                rows[name] = (per_slot, c2 - c1, 0, None, None)
                say(f"{ctx} {name}: holds no sequence of {ctx} tokens in the budget", flush=True)
                continue
            held = c1 if name == "plan-static-compiled" else held_bytes(name, ctx, model.config) / ranks  # a GPU's share
            floor = (weights + batch * held) / bandwidth
            rows[name] = (per_slot, c2 - c1, batch, res, floor)
            say(f"{ctx} {name}: B={batch} median {1e3 * res['median']:.2f} ms, {batch / res['median']:.0f} tokens/s, "
                  f"peak allocated {res['peak'][0] / GIB:.2f}, reserved {res['peak'][1] / GIB:.2f} GiB", flush=True)
        base = rows.get("fp16-static-compile")
        if base is not None and base[3] is None:
            base = None  # fp16 holds no sequence: no ratio to it
        for name, (per_slot, cache_slot, batch, res, floor) in rows.items():
            if res is None:
                lines.append(f"| {ctx} | {name} | {cache_slot / GIB:.3f} + {(per_slot - cache_slot) / GIB:.3f} | 0: holds "
                             "no sequence in the budget | | | | 0 | | | | |")
                continue
            rate = batch / res["median"]
            versus = "-" if base is None else f"{rate / (base[2] / base[3]['median']):.1f}"
            # against the tokens/s fp16 would reach at its own byte floor with its slots (a paged fp16 engine
            # comes close to it): the ratio that says what compression buys beyond fp16's launch overheads
            floor_versus = "-" if base is None else f"{rate / (base[2] / base[4]):.1f}"
            lines.append(f"| {ctx} | {name} | {cache_slot / GIB:.3f} + {(per_slot - cache_slot) / GIB:.3f} | {batch} | "
                         f"{res['peak'][0] / GIB:.1f} / {res['peak'][1] / GIB:.1f} | {1e3 * res['median']:.2f} | {1e3 * res['p99']:.2f} | {rate:.0f} | "
                         f"{batch / floor:.0f} | {res['median'] / floor:.2f} | {versus} | {floor_versus} |")
        say("\n".join(lines), flush=True)  # so far: a run cut short still shows its finished contexts
    if tp:
        import torch.distributed as dist

        release()  # Inductor's graphs of a compiled fp16 step hold the all-reduces too: freed before the group goes
        dist.destroy_process_group()  # (every kvcalib decoder is closed in `measure`)
        if not lead:
            return
        title = (f"Decode throughput in a fixed memory budget per GPU under tensor parallelism at {spoken(contexts)}, "
                 f"{ranks} x {torch.cuda.get_device_name()}, the model of {os.path.basename(args.model.rstrip('/'))}")
    else:
        title = (f"Decode throughput in a fixed memory budget, every method at {spoken(contexts)}, "
                 f"{torch.cuda.get_device_name()}, Llama-3.1-8B shape (random init)")
    table = "\n".join(lines)
    say(f"\n{title}\n\n{table}")
    record(title, table, sys.argv, args.results)


if __name__ == "__main__":
    main()
