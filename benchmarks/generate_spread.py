"""Decoding a model larger than one GPU through `model.generate`: a random-initialised Llama-3.1-70B shape in
float16, its layers split evenly over every GPU of the machine (accelerate's dispatch, as `device_map="auto"`
places it: the GPUs run one after another), one long prompt at B=1; kvcalib's caches against transformers'
fp16 paths on the same GPUs, in one process.

    python benchmarks/generate_spread.py [--shape llama-3.1-70b] [--context 32768] [--paths all]
    torchrun --nproc-per-node 2 benchmarks/generate_spread.py --engine tp --model DIR [--context 16384,32768]
                                                              [--plan DIR]

`--engine tp`: the other way to spread a model, transformers' tensor parallelism (`from_pretrained(DIR,
distributed_config=DistributedConfig(tp_plan="auto"))` under torchrun, NCCL): every GPU holds a share of every
layer's heads and they run together, each rank's caches holding its own KV heads (the static caches capture each
rank's step). Its weights are read from DIR, written first: `kvcalib make-model --shape llama-3.1-70b --dtype
float16 --device cuda --out DIR` (drawn on the GPU; 138.5 GB with the embedded tokenizer's vocabulary, which the
lent two-GPU machine's 256 GiB /dev/shm holds). Rank 0 times and records; the byte floor is then a rank's share of
the weights and of the cache over one GPU's copy bandwidth (the GPUs run at once).

Paths:
- `fp16-dynamic`: `model.generate` as it comes (DynamicCache, SDPA, eager);
- `fp16-static`: `model.generate(past_key_values=StaticCache(...))`: transformers compiles the decode step
  itself where it can (for a model's layers on several GPUs Inductor does not capture CUDA graphs; under tensor
  parallelism each rank's step is on one GPU, and it may);
- `kivi128-dynamic`, `oscar32-dynamic`: `KvcalibCache` (KIVI-2 G=128, OScaR-2 G=32; R=128);
- `kivi128-static`, `oscar32-static`: `StaticKvcalibCache`; its step runs uncaptured on a model's layers over
  several GPUs (one CUDA graph records one GPU's work), captured on each rank under tensor parallelism;
- `plan-static`: `StaticKvcalibCache(model, "plan", artifacts=--plan DIR)`, the plan `kvcalib plan` wrote for this
  model (`kvcalib collect --model DIR`, then `kvcalib plan --budget 2.25`), as `kvcalib generate --method plan
  --artifacts DIR` serves it: under tensor parallelism each rank holds its own KV heads' schemes.

Per path: `first call` (generate of 1 new token: prefill and first token, no decode step), a call of 5
new tokens untimed (the first decode steps: compilation, the static cache's decoder), then ms/token =
(t(69 new tokens) - t(5)) / 64 from warm calls, and TTFT = t(5) - 4 ms/token. The byte floor of
a step is what it must read, weights and the cache as held, over one GPU's copy bandwidth (the GPUs take
the layers in turn). Weights: normal(0, 0.02), norms 1, drawn on their GPUs (seconds; no disk). The
tokens are random-weight tokens and are not compared: accuracy at these bits is measured on a real model
(RESULTS.md, perplexity tables). Vocabulary 49152 (the embedded tokenizer's, as `kvcalib make-model`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

PATHS = ["fp16-dynamic", "kivi128-dynamic", "oscar32-dynamic", "kivi128-static", "oscar32-static", "fp16-static",
         "plan-static"]
CACHES = {"kivi128": ("kivi", (2, 128, 128)), "oscar32": ("oscar", (2, 32, 128))}


def spread_model(shape: str, context: int):
    """The model of the docstring, layers split evenly over the GPUs (embeddings with the first layers,
    norm and head with the last)."""
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvcalib.random_model import SHAPES

    fields = {k: v for k, v in SHAPES[shape].items() if k != "model_type"}
    config = LlamaConfig(**fields | {"vocab_size": 49152, "max_position_embeddings": max(131072, context + 1024)})
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    n, gpus = config.num_hidden_layers, torch.cuda.device_count()
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1}
    placement |= {f"model.layers.{i}": i * gpus // n for i in range(n)}
    for name, p in model.named_parameters():
        module = max((m for m in placement if name.startswith(m + ".")), key=len)
        device = torch.device("cuda", placement[module])
        value = torch.empty(p.shape, dtype=torch.float16, device=device)
        value.fill_(1.0) if name.endswith("norm.weight") else value.normal_(0.0, 0.02)
        set_module_tensor_to_device(model, name, device, value=value)
    model = dispatch_model(model.eval(), device_map=placement)
    model.generation_config.eos_token_id = None  # every call decodes all its tokens
    return model, config


def tp_model(directory: str):
    """The model of `directory` under transformers' tensor parallelism on this rank's GPU, the current device
    (module docstring)."""
    from kvcalib.models import load_model

    model = load_model(directory, dtype=torch.float16, tensor_parallel=True).model  # the process group joined first
    model.generation_config.eos_token_id = None
    return model, model.config


def floor_bytes(model, config, row: dict, tokens: int, ranks: int = 1) -> float:
    """Bytes a decode step reads on one GPU: its weights (a rank's shards under tensor parallelism), and its
    share of the cache of `tokens` as the path holds it (a plan's: the bytes its static cache holds on this GPU,
    `row["held"]`, sized for the prompt and the tokens decoded, one block of slack: 1% over at 16k)."""
    from generate import fp16_bytes, int2_bytes

    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]  # a DTensor's own shard
    weights = sum(p.numel() * p.element_size() for p in local)
    name = row["path"].rsplit("-", 1)[0]
    if name == "plan":
        return weights + row["held"]
    return weights + (fp16_bytes(tokens, config) if name == "fp16" else int2_bytes(tokens, name, config)) / ranks


def run_path(path: str, model, context: int, gpus: list[int], plan: str | None = None) -> dict:
    from generate import held_tensors
    from transformers import StaticCache

    from kvcalib.methods import MethodSettings
    from kvcalib.runtime.cache import KvcalibCache
    from kvcalib.runtime.static_cache import StaticKvcalibCache

    torch._dynamo.reset()
    ids = torch.randint(1, 49152, (1, context), generator=torch.Generator().manual_seed(0)).cuda()
    name, how = path.rsplit("-", 1)
    room = context + 69 + 8
    static = None
    if name == "fp16":
        model.set_attn_implementation("sdpa")
    elif name == "plan":
        static = StaticKvcalibCache(model, "plan", artifacts=plan, max_batch=1, max_length=room)
    elif how == "static":
        method, settings = CACHES[name]
        static = StaticKvcalibCache(model, method, MethodSettings(*settings), max_batch=1, max_length=room)
    held = 0 if static is None else held_tensors(static)  # this GPU's share (the plan's byte floor)

    def call(new: int) -> float:
        if name == "fp16":
            cache = StaticCache(config=model.config, max_cache_len=room) if how == "static" else None
        elif how == "dynamic":
            method, settings = CACHES[name]
            cache = KvcalibCache(model, method, MethodSettings(*settings))
        else:
            cache = static
        for d in gpus:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        for d in gpus:
            torch.cuda.synchronize(d)
        assert out.shape[1] == context + new, (path, out.shape)
        return time.perf_counter() - t0

    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    try:
        first = call(1)
        call(5)  # warm: the first decode steps (compilation, the static cache's decoder) happen here, untimed
        t5, t69 = call(5), call(69)
    finally:
        if static is not None:
            static.close()  # its captured graphs go before the next path (and before the group is destroyed)
        # and those Inductor captured for fp16-static (generate compiles a StaticCache's step, "reduce-overhead"):
        # under tensor parallelism they hold the all-reduces too
        torch._dynamo.reset()
        gc.collect()
    per = (t69 - t5) / 64
    peak = [torch.cuda.max_memory_allocated(d) / 2**30 for d in gpus]
    del static
    torch.cuda.empty_cache()
    return {"path": path, "first": first, "ttft": t5 - 4 * per, "per": per, "peak": peak, "held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-70b")
    parser.add_argument("--context", default="32768", help="prompt tokens; comma-separated: one table each, "
                        "the model loaded once")
    parser.add_argument("--paths", default="all", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--engine", choices=["map", "tp"], default="map",
                        help="map: layers in sequence over the GPUs (device_map); tp: tensor parallelism (torchrun)")
    parser.add_argument("--model", default=None, help="--engine tp: a model directory with its weights written")
    parser.add_argument("--plan", default=None, help="plan-static: the directory `kvcalib plan` wrote for this model")
    parser.add_argument("--results", default=None, help="record into this file (default RESULTS.md)")
    args = parser.parse_args()
    from generate import copy_bandwidth

    paths = PATHS if args.paths == "all" else args.paths.split(",")
    contexts = [int(c) for c in args.context.split(",")]
    if args.paths == "all" and args.plan is None:
        paths = [p for p in paths if p != "plan-static"]
    tp = args.engine == "tp"
    if "plan-static" in paths and args.plan is None:
        parser.error("plan-static serves a plan: --plan DIR (what `kvcalib plan` wrote for this model)")
    if tp and (args.model is None or "LOCAL_RANK" not in os.environ):
        parser.error("--engine tp runs under torchrun --nproc-per-node N and reads --model DIR (its weights written)")
    if tp:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    bandwidth = copy_bandwidth()  # before the weights take the memory
    model, config = tp_model(args.model) if tp else spread_model(args.shape, max(contexts))
    from kvcalib.runtime.cache import tensor_parallel_rank, tensor_parallel_size

    ranks = tensor_parallel_size(model)
    gpus = [torch.cuda.current_device()] if tp else list(range(torch.cuda.device_count()))
    lead = tensor_parallel_rank(model) == 0  # the rank that reports
    for context in contexts:
        rows = []
        for path in paths:
            try:
                rows.append(run_path(path, model, context, gpus, args.plan))
            except Exception as err:  # a path that fails is reported in its row, the others still run
                rows.append({"path": path, "error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"})
                if tp:  # one rank's failure leaves the others waiting in a collective: stop every rank (torchrun),
                    if lead:  # the rows run so far recorded first
                        report(rows, args, context, model, config, ranks, bandwidth, gpus)
                    raise
                torch.cuda.empty_cache()
            if lead:
                print(f"[{context} {path}] {rows[-1]}", file=sys.stderr, flush=True)
        if lead:  # each context's table as it ends: a run cut short keeps those done
            report(rows, args, context, model, config, ranks, bandwidth, gpus)
    if tp:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def report(rows: list[dict], args, context: int, model, config, ranks: int, bandwidth: float, gpus: list[int]) -> None:
    """Print and record the table of `rows` (a failed path's row says why)."""
    base = next((r for r in rows if r["path"] == "fp16-dynamic" and "per" in r), None)
    fastest_fp16 = min((r["per"] for r in rows if r["path"].startswith("fp16") and "per" in r), default=None)
    lines = ["| path | first call s | TTFT s | ms/token | x fp16-dynamic | x fastest fp16 | byte floor ms | "
             "x floor | peak GiB per GPU |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error']} | | | | | | | |")
            continue
        floor = floor_bytes(model, config, r, context + 37, ranks) / bandwidth
        versus_dynamic = f"{base['per'] / r['per']:.2f}" if base else "-"  # each ratio where its fp16 path ran
        versus_fastest = f"{fastest_fp16 / r['per']:.2f}" if fastest_fp16 else "-"
        lines.append(f"| {r['path']} | {r['first']:.1f} | {r['ttft']:.2f} | {1e3 * r['per']:.2f} | {versus_dynamic} | "
                     f"{versus_fastest} | {1e3 * floor:.2f} | {r['per'] / floor:.2f} | "
                     f"{' / '.join(f'{g:.1f}' for g in r['peak'])} |")
    from results import RESULTS, record

    tp = args.engine == "tp"
    cards = f"{ranks if tp else len(gpus)} x {torch.cuda.get_device_name()}"
    if tp:
        title = (f"Decoding under tensor parallelism over {ranks} GPUs through model.generate, {cards}, "
                 f"the model of {Path(args.model).name}, B=1")
    else:
        title = (f"Decoding a model over {len(gpus)} GPUs through model.generate, {cards}, {args.shape} shape "
                 "(random init), B=1")
    table = "\n".join(lines)
    print(f"\n{title}, {context}-token prompt\n\n{table}")
    record(f"{title}, {context}-token prompt", table, sys.argv, args.results or RESULTS)


if __name__ == "__main__":
    main()
