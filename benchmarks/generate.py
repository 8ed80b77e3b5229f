"""Decode latency end to end: a random-initialised Llama-3.1-8B-shaped model (built from its
config, fp16) with a long prompt at B=1, each decode step timed on its own, for transformers' fp16 paths
and kvcalib's caches.

    python benchmarks/generate.py [--contexts 4096,32768] [--steps 256] [--paths all] [--results FILE]

Paths:
- `fp16-eager`: fp16 DynamicCache, SDPA, eager (transformers' default);
- `fp16-static-compile`: fp16 StaticCache with the forward under `torch.compile(mode="reduce-overhead")`,
  the fast path transformers documents (prefill eager, decode steps compiled and graph-replayed);
- `{cache}-dynamic`: KvcalibCache, eager; `{cache}-static`: StaticKvcalibCache, the same step eager;
  `{cache}-captured`: StaticKvcalibCache, the step replayed from one CUDA graph; `{cache}-static-compiled`:
  the same, the step compiled by `torch.compile` (Inductor fusing the model's non-attention ops and the
  cache's flush) before it is captured. Caches (`CACHES`), all 2-bit with R = 128: `kivi128`, `kivi32`
  (KIVI, key groups of 128 / 32 tokens), `oscar32` (OScaR, G = 32: Hadamard-rotated keys and values,
  per-token key norms), `kvlinc128` (KVLinC, G = 128, random adapters of the default rank 256 on every
  layer: the correction's cost, not its accuracy), `vecinfer_d4b8` and `vecinfer_d8b12` (VecInfer,
  per-layer random codebooks and smoothing, R = 128, the fused VecInfer kernel).

Each kvcalib static path makes one cache for the longest context and prefills each context's prompt
into its slot, its step compiled and captured once (as a server holds one cache for the longest context
it serves; the kernel spreads each sequence's own length over the launch, so a short prompt in a long
cache is not slowed by the capacity). fp16's StaticCache is sized per context, as transformers' docs do.

Eager paths (`fp16-eager` and every `-dynamic`) named together are measured side by side: per prompt,
every one is prefilled, then their steps alternate (`run_eager_together`), as host-bound steps drift.
Each step is timed from the host (synchronised before and after), as a user calling the path sees it:
the median and the 99th percentile over `--steps` steps, flush steps included (at R = 128, 256 steps
hold two flushes per layer of the dynamic cache). The byte floor is what the step must read, the
weights (all of them, as the issue counts) and the cache as held at the middle step, over the copy
bandwidth measured at the start of the run (read + write of a 2 GiB buffer, median of 20).
Tokens: greedy, compared with the fp16 eager path's (random weights give near-uniform logits, so a
2-bit cache changes greedy tokens freely; the accuracy of these caches is measured on a real model:
RESULTS.md, perplexity tables).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, StaticCache

from kvcalib.methods import MethodSettings, build_method
from kvcalib.methods.kvlinc import Adapter
from kvcalib.models import LoadedModel, attention_shape
from kvcalib.runtime.cache import KvcalibCache
from kvcalib.runtime.captured import CapturedDecoder, Decoder
from kvcalib.runtime.static_cache import StaticKvcalibCache
from results import RESULTS, publish

CACHES = {"kivi128": ("kivi", MethodSettings(2, 128, 128)), "kivi32": ("kivi", MethodSettings(2, 32, 128)),
          "oscar32": ("oscar", MethodSettings(2, 32, 128)), "kvlinc128": ("kvlinc", MethodSettings(2, 128, 128))}
KVLINC_RANK = 256  # kvcalib train-adapters' default
VECINFER = {"vecinfer_d4b8": "d4b8", "vecinfer_d8b12": "d8b12"}  # random per-layer codebooks, R = 128
PATHS = ["fp16-eager", "fp16-static-compile"] + [f"{k}-{how}" for k in [*CACHES, *VECINFER]
                                                  for how in ("dynamic", "static", "captured", "static-compiled")]
EAGER = ["fp16-eager"] + [f"{k}-dynamic" for k in [*CACHES, *VECINFER]]  # measured side by side (`run_eager_together`)


def llama8b_config(context: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=max(131072, context + 1024), rope_theta=500000.0)


def kvcalib_method(name: str, lm: LoadedModel):
    """The method of cache `name` (`CACHES`, `VECINFER`) for the model; KVLinC with seeded random adapters,
    VecInfer with seeded random codebooks and smoothing (the kernel's work does not depend on their values)."""
    if name in VECINFER:
        from kvcalib.methods.vecinfer import LayerCodebooks, VecInfer, VecInferConfig

        shape, g, config = attention_shape(lm.config), torch.Generator().manual_seed(0), VecInferConfig(VECINFER[name], VECINFER[name])
        book = lambda c: torch.randn(1, c.centroids, c.dim, generator=g).half().cuda()  # noqa: E731
        layers = [LayerCodebooks(book(config.k), book(config.v),
                                 (0.5 + torch.rand(shape.num_kv_heads, shape.head_dim, generator=g)).half().cuda())
                  for _ in range(shape.num_layers)]
        return VecInfer(config, layers, shape, residual=128)
    method_name, settings = CACHES[name]
    method = build_method(method_name, attention_shape(lm.config), settings)
    if method_name == "kvlinc":
        shape, g = attention_shape(lm.config), torch.Generator().manual_seed(0)
        w = lambda h: (torch.randn(h, shape.head_dim, KVLINC_RANK // 2, generator=g) * shape.head_dim**-0.5).half().cuda()  # noqa: E731
        method.adapters = {i: Adapter(w(shape.num_heads), w(shape.num_heads), w(shape.num_kv_heads), w(shape.num_kv_heads))
                           for i in range(shape.num_layers)}
    return method


def prefilled_8b(context: int, cache: str, room: int, method=None, config=None,
                 dtype: torch.dtype = torch.float16, batch: int = 1) -> tuple[torch.nn.Module, StaticKvcalibCache, torch.Tensor]:
    """The 8B-shaped random model on the GPU (seed 0; or one of `config` in `dtype`), a StaticKvcalibCache of `batch`
    slots of cache `cache` (`CACHES`, `VECINFER`; or `method(config) -> (method, settings)` where one is given) with
    `room` tokens past `context`, and random prompts prefilled into its slots, slot i's of context (B - i) / B tokens
    (generate_calls.py's B=8 row's lengths; one of `context` at B=1): (model, cache, the first decoded tokens (B,))."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config or llama8b_config(context), dtype=dtype).eval()
    lm = LoadedModel(model=model, tokenizer=None, spec="llama-3.1-8b-shaped (random)")
    if method is None:
        static = StaticKvcalibCache(lm, kvcalib_method(cache, lm), max_batch=batch, max_length=context + room)
    else:
        built, settings = method(model.config)
        static = StaticKvcalibCache(lm, built, settings, max_batch=batch, max_length=context + room)
    firsts = []
    for i in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (1, context * (batch - i) // batch), device="cuda")
        firsts.append(static.prefill(model, i, prompt).argmax().view(1))
    return model, static, torch.cat(firsts)


def event_steps(decoder, token: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """`steps` greedy steps of a captured decoder from `token`, each timed by CUDA events around the step and its
    argmax, the host waiting on each: (the last token, milliseconds per step)."""
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        token = decoder.step(token).argmax(-1)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return token, times


def int2_bytes(tokens: int, name: str, config: LlamaConfig) -> float:
    """Bytes a cache of `CACHES` or `VECINFER` holds for `tokens`. VecInfer: code rows and the float16 residual.
    The 2-bit caches: flushed blocks (2-bit codes of keys and values,
    fp16 scale and zero per key group of G tokens and channel, and per value group of min(G, d) channels
    and token; OScaR's fp16 norm per token), the float16 residual keys and values (held as they came in:
    the kernel rotates for the blocks stored rotated), and KVLinC's float32 S and P (rank x (d + 1) per KV head)."""
    rows = config.num_hidden_layers * config.num_key_value_heads
    if name in VECINFER:  # code rows of keys and values (ceil(codes x bits / 8) bytes each), float16 residual
        from kvcalib import vq

        c, d, r = vq.VQConfig.parse(VECINFER[name]), config.head_dim, 128
        flushed = tokens // r * r
        return rows * (flushed * 2 * c.row_bytes(d) + (tokens - flushed) * 2 * d * 2)
    method, settings = CACHES[name]
    d, g, r = config.head_dim, settings.group_size, settings.residual
    flushed = tokens // r * r
    per_token_bits = d * (2 + 32 / g) + d * 2 + (d // min(g, d)) * 32 + (16 if method == "oscar" else 0)
    state = KVLINC_RANK * (d + 1) * 4 if method == "kvlinc" else 0
    return rows * (flushed * per_token_bits / 8 + (tokens - flushed) * 2 * d * 2 + state)


def held_tensors(cache) -> int:
    """Bytes of every tensor the cache holds (its buffers, counts and state), each storage once: the
    cache's own size, free of the allocator's rounding and of whatever else allocates meanwhile."""
    seen, total = set(), 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            for k, y in vars(x).items():
                if k not in ("method", "model"):
                    walk(y)

    for layer in cache.layers:
        walk(layer)
    return total


def fp16_bytes(tokens: int, config: LlamaConfig) -> float:
    """Bytes an fp16 cache holds for `tokens`: keys and values of every layer and KV head."""
    return 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * tokens


def median_p99(seconds: list[float]) -> tuple[float, float]:
    """The median and the 99th percentile (the largest below 1% of the steps) of step times."""
    s = sorted(seconds)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 20."""
    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    return 2 * 2**31 / statistics.median(times[3:])


def timed_steps(step, first: int, steps: int) -> tuple[list[float], list[int]]:
    """Run `step(token) -> next token` `steps` times from `first`, each synchronised: seconds, tokens."""
    seconds, tokens = [], [first]
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens.append(step(tokens[-1]))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return seconds, tokens


def one_token(t: int) -> torch.Tensor:
    """A decode step's input: token `t` as a (1, 1) batch on the GPU."""
    return torch.tensor([[t]], device="cuda")


def run_path(path: str, model, lm: LoadedModel, prompts: list[torch.Tensor], steps: int):
    """Yield (context, path, {"seconds", "tokens", "cache_bytes"}) for each prompt, on one path. A kvcalib static
    cache is made once, for the longest prompt, and each prompt is prefilled into its slot, as a server
    holds one cache for the longest context it serves: its step is compiled and captured once. fp16's
    StaticCache is made (and its forward compiled) per prompt with `max_cache_len` = prompt + steps, the
    size transformers' docs set: its step reads the whole `max_cache_len`, so one sized for the longest
    prompt would slow its shorter rows."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()  # each path compiles afresh (no shapes marked dynamic by an earlier path)
    warm = 3 if path != "fp16-static-compile" else 6  # compile and capture happen in the warm-up
    name, how = path.split("-", 1)
    static = name != "fp16" and how != "dynamic"
    if static:
        longest = max(p.shape[1] for p in prompts)
        cache = StaticKvcalibCache(lm, kvcalib_method(name, lm), max_batch=1, max_length=longest + warm + steps + 8)
        decoder = (Decoder(model, cache) if how == "static"
                   else CapturedDecoder(model, cache, compile=how == "static-compiled"))
        step = lambda t: int(decoder.step(torch.tensor([t], device="cuda"))[0].argmax())  # noqa: E731
        cache_bytes = lambda: int2_bytes(cache.lengths[0], name, model.config)  # noqa: E731
        progress(f"{path}: cache made, step captured")
    for prompt in prompts:
        ctx = prompt.shape[1]
        with torch.no_grad():
            if path == "fp16-static-compile":
                torch._dynamo.reset()
                model.set_attn_implementation("sdpa")
                cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 8)
                pos = torch.arange(ctx, device="cuda")
                first = int(model(prompt, past_key_values=cache, cache_position=pos, use_cache=True,
                                  logits_to_keep=1).logits[0, -1].argmax())
                forward = torch.compile(model.forward, mode="reduce-overhead")
                at = [ctx]

                def step(t):
                    p = torch.tensor([at[0]], device="cuda")
                    at[0] += 1
                    return int(forward(one_token(t), past_key_values=cache, cache_position=p, position_ids=p[None],
                                       use_cache=True).logits[0, -1].argmax())

                cache_bytes = lambda: fp16_bytes(at[0], model.config)  # noqa: E731  (held, not allocated)
            elif not static:
                cache, first, step, cache_bytes, _ = eager(path, model, lm, prompt)
            else:
                first = int(cache.prefill(model, 0, prompt).argmax())
            progress(f"{path} {ctx}: prefilled")
            _, warm_tokens = timed_steps(step, first, warm)
            seconds, tokens = timed_steps(step, warm_tokens[-1], steps)
            progress(f"{path} {ctx}: timed")
            held = cache_bytes()
        if not static:
            del cache
            gc.collect()
            torch.cuda.empty_cache()
        yield ctx, path, {"seconds": seconds, "tokens": [first] + warm_tokens[1:] + tokens[1:], "cache_bytes": held}


def eager(path: str, model, lm: LoadedModel, prompt: torch.Tensor):
    """An eager path (`EAGER`) with `prompt` prefilled: (cache, first token, step(token) -> token, bytes held(),
    the attention implementation its steps run under: SDPA for fp16, `kvcalib_runtime` for a KvcalibCache)."""
    if path == "fp16-eager":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        cache_bytes = lambda: sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)  # noqa: E731
    else:
        cache = KvcalibCache(lm, kvcalib_method(path.split("-")[0], lm))  # switches the model to kvcalib_runtime
        cache_bytes = lambda: cache.stored_bits() / 8  # noqa: E731
    implementation = model.config._attn_implementation
    first = int(model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
    step = lambda t: int(model(one_token(t), past_key_values=cache, use_cache=True).logits[0, -1].argmax())  # noqa: E731
    return cache, first, step, cache_bytes, implementation


def run_eager_together(paths: list[str], model, lm: LoadedModel, prompts: list[torch.Tensor], steps: int):
    """Yield (context, path, result) as `run_path` does, for eager paths (`EAGER`) measured side by side:
    per prompt, every path's cache is prefilled, then their steps alternate (one step of each path in
    turn), so that the host's drift over a run (clocks, other processes, the allocator) falls on every
    path alike. An eager step is bound by the host's launches; measured one path after another, such
    drift moved medians by over 20% between paths doing the same work (RESULTS.md, history 2026-11-24)."""
    for prompt in prompts:
        ctx = prompt.shape[1]
        gc.collect()
        torch.cuda.empty_cache()
        runs = {}
        with torch.no_grad():
            for path in paths:
                cache, first, step, cache_bytes, implementation = eager(path, model, lm, prompt)
                _, warm = timed_steps(step, first, 3)
                runs[path] = {"cache": cache, "step": step, "bytes": cache_bytes, "attn": implementation,
                              "seconds": [], "tokens": [first] + warm[1:]}
            progress(f"{', '.join(paths)} {ctx}: prefilled")
            for _ in range(steps):
                for run in runs.values():
                    model.set_attn_implementation(run["attn"])  # untimed: each path under its own attention
                    seconds, tokens = timed_steps(run["step"], run["tokens"][-1], 1)
                    run["seconds"] += seconds
                    run["tokens"].append(tokens[-1])
            progress(f"{', '.join(paths)} {ctx}: timed")
        for path, run in runs.items():
            yield ctx, path, {"seconds": run["seconds"], "tokens": run["tokens"], "cache_bytes": run["bytes"]()}
        del runs, cache, step


def spoken(contexts: list[int]) -> str:
    """Contexts as a title says them: [4096, 32768, 131072] -> '4k, 32k and 128k'."""
    words = [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


START = time.perf_counter()


def progress(what: str) -> None:
    """Where the run is, on stderr, with the seconds since it started (device time is scarce: this says
    what a run's minutes went to)."""
    print(f"[{time.perf_counter() - START:7.1f} s] {what}", file=sys.stderr, flush=True)


def row(ctx: int, path: str, res: dict, base: list[int] | None, weight_bytes: int, bandwidth: float) -> str:
    """One table row: median, p99, the byte floor (weights + cache held, over the copy bandwidth)."""
    med, p99 = median_p99(res["seconds"])
    floor = (weight_bytes + res["cache_bytes"]) / bandwidth
    same = "-" if base is None else f"{sum(a == b for a, b in zip(res['tokens'], base))}/{len(base)}"
    return (f"| {ctx} | {path} | {1e3 * med:.2f} | {1e3 * p99:.2f} | {p99 / med:.2f} | {1e3 * floor:.2f} | "
            f"{med / floor:.2f} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--paths", default="all", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    paths = PATHS if args.paths == "all" else args.paths.split(",")
    bandwidth = copy_bandwidth()
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama8b_config(max(contexts)), dtype=torch.float16).eval()
    lm = LoadedModel(model=model, tokenizer=None, spec="llama-3.1-8b-shaped (random)")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.2f} GB; {args.steps} timed steps "
             "after the warm-up; B=1", "",
             "| context | path | ms/token median | p99 | p99/median | byte floor ms | median/floor | tokens = fp16 eager |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    prompts = [torch.randint(0, 128256, (1, ctx), device="cuda") for ctx in contexts]
    results: dict[tuple[int, str], dict] = {}
    together = [p for p in paths if p in EAGER]
    runs = ([run_eager_together(together, model, lm, prompts, args.steps)] if together else []) + [
        run_path(p, model, lm, prompts, args.steps) for p in paths if p not in EAGER]
    for run in runs:
        for ctx, path, res in run:
            results[ctx, path] = res
            base = results.get((ctx, "fp16-eager"), {}).get("tokens")
            print(row(ctx, path, res, base, weight_bytes, bandwidth), flush=True)  # kept if the run is cut short
    for ctx in contexts:
        base = results.get((ctx, "fp16-eager"), {}).get("tokens")
        lines += [row(ctx, path, results[ctx, path], base, weight_bytes, bandwidth) for path in paths]
    title = (f"Decode latency end to end, every method at {spoken(contexts)}, {torch.cuda.get_device_name()}, "
             "Llama-3.1-8B shape (random init)")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
