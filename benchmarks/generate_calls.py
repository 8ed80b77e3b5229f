"""Decoding through `model.generate`, as a user calls it: per-token cost, time to the first token and the
first call's cost, kvcalib's static cache against transformers' fastest fp16 path, in one run on one GPU.
A random-initialised Llama-3.1-8B-shaped model in fp16 (`generate.llama8b_config`), or with `--shape` one of
`kvcalib make-model`'s shapes (`kvcalib.random_model.SHAPES`) in bfloat16, its checkpoints' dtype (Gemma's
sliding layers then kept as the model computes them by the kvcalib caches, `--sliding-layers float16`).

    python benchmarks/generate_calls.py [--contexts 4096,32768,131072] [--batch8 16384] [--paths all]

Paths (each run in a fresh process, so that its first call pays what a user's first call pays:
CUDA context, kernel loading, compilation or capture; on-disk caches of CuPy and Inductor are as
an earlier run on the machine left them, said beside the table):
- `fp16-static`: `model.generate(past_key_values=StaticCache(...))`; transformers compiles the decode
  step itself (`torch.compile`, mode reduce-overhead: CUDA graphs), its documented fast path;
- `kivi128-static`: `model.generate(past_key_values=StaticKvcalibCache(model, "kivi", G=128, R=128))` as made by
  default: the prompt batch into slots, each decode step replayed from the captured CUDA graph, the model's
  decoder layers around their attention, the rotary application and the cache's append compiled before the
  capture (`compile="regions"`: one compiled region serves every layer, seconds of compilation);
- `kivi128-static-cublas`: the same with the step's weight products by cuBLAS, not the one-row kernel the step
  switches in (`kvcalib.runtime.gemv_kernel`; B=1 at 32k only);
- `kivi128-static-uncompiled`: the same captured with nothing compiled (`compile="none"`, B=1 at 32k only);
- `kivi128-static-compiled`: the whole step compiled by torch.compile (Inductor) before its capture
  (`compile="step"`, B=1 at 32k only: its compilation takes minutes in a cold process);
- `kivi128-static-syncfree`: the same as `kivi128-static`, with `torch.multinomial` replaced in its process by a
  draw that reads nothing back to the host (`sync_free_multinomial`; B=1 at 32k only). A measurement, not a
  fix: torch's `multinomial` checks its probabilities with two host reads (`.item()`) each call, which could
  leave the GPU idle while generate's bookkeeping runs after them; this row tells whether those reads cost
  anything;
- `turboquant2-static`, `turboquant3-static`: the static cache as `kivi128-static` holds it, of
  `StaticKvcalibCache(model, "turboquant", MethodSettings(bits=2 or 3, residual=128))`: TurboQuant's oblivious
  codes read by the fused codebook kernel (`kvcalib.formats.codebook`);
- `plan225-static`, `plan3-static`: the static cache holding a plan (`StaticKvcalibCache(model, plan)`, as
  `--method plan` makes it): the embedded model's default plan (`artifacts/smollm2-135m/plan-2.25`, made by
  `kvcalib collect` then `kvcalib plan --budget 2.25`) or its 3-bit plan (`artifacts/smollm2-135m/plan-3`,
  `kvcalib plan --budget 3`)
  mapped onto this model's layers and KV heads (`mapped_plan`: every family and width keeps its share, each head's
  key and value schemes stay paired), random calibrated books; every scheme read by the codebook kernel, one launch
  per group of a layer's KV heads that share a pair of schemes;
- `kivi128-dynamic`: `model.generate(past_key_values=KvcalibCache(...))`, the eager cache (B=1 rows up to 32k, and
  the B=8 row: its padded rows decode in one launch a layer).
A path named again with `-warm` runs after its first run, in a new process that finds the on-disk caches
(Inductor's FX graph cache, CuPy's kernel cache) that run left: a user's second process.

Rows: B=1 at each of `--contexts`, and B=8 left-padded prompts of 8 lengths spread evenly up to `--batch8`
tokens, row i's shortened by `PHASE` i tokens (`batch8_lengths`): each row's residual window then fills at its own
step of every 128, as a user's batch's rows do, and the step that compresses them (the flush) runs 8 times in 128
steps, not once (lengths of whole windows, as before 2026-11-30, filled them all at one step). Per row: `first call`
is the first `generate` of the process at that shape (9 new tokens);
`TTFT` a warm `generate` of one new token (the prefill and the first token); `ms/token` the cost of one more
token, (t(LONG new tokens) - t(9)) / (LONG - 9) from warm calls (LONG = 265: each call's prefill, 6 s at B=8 and
32k, varies by tens of ms, which a difference of 128 tokens carried as ±0.5 ms a token), greedy and with sampling
(`do_sample`, top-p 0.9, top-k 50, temperature 0.8: transformers' own processors), each the faster of two calls;
tokens/s = B / ms
per token; for the static cache, its captured step driven by kvcalib's own loop in the same process (`captured
step`, greedy, each step's tokens to the host) and generate's cost over it. The generated tokens
are checked only for their count: random weights give near-uniform logits, and a 2-bit cache moves greedy
tokens freely; accuracy is measured on a real model (RESULTS.md, perplexity tables).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PATHS = ["fp16-static", "kivi128-static", "kivi128-static-cublas", "kivi128-static-uncompiled", "kivi128-static-compiled",
         "kivi128-static-syncfree", "turboquant2-static", "turboquant3-static", "plan225-static", "plan3-static",
         "kivi128-dynamic"]
PATHS += [f"{p}-warm" for p in PATHS]
COMPILE = {"kivi128-static": "regions", "kivi128-static-cublas": "regions", "kivi128-static-uncompiled": "none",
           "kivi128-static-compiled": "step", "kivi128-static-syncfree": "regions", "turboquant2-static": "regions",
           "turboquant3-static": "regions", "plan225-static": "regions", "plan3-static": "regions"}
PLANS = {"plan225-static": "artifacts/smollm2-135m/plan-2.25", "plan3-static": "artifacts/smollm2-135m/plan-3"}
ROOT = Path(__file__).resolve().parent.parent


def mapped_plan(config, path: str):
    """The plan at `path` (the embedded model's: 30 layers x 3 KV heads) mapped onto `config`'s layers and KV heads:
    item n of the L x H (layer, head) items of the layers it compresses, layer by layer, takes the (key, value)
    schemes of the plan's item floor(n N / (L H)), so that every family and width keeps its share of items (to one
    item in N) and each head's key and value schemes stay paired; its flush rule and sink; random calibrated books
    (TurboQuant's scalar books sorted, every book of the shape the artifact's would have: the kernel's work does not
    depend on their values). A hybrid model's sliding layers, kept in the model's dtype by default, are no items
    (as `kvcalib plan` leaves them): they take the first item's schemes, which nothing reads.
    Also a line saying the mix and the groups of heads per layer, over the compressed layers."""
    import json as json_

    from kvcalib.methods.plan import Plan, codebook_name, parse_scheme, smooth_name
    from kvcalib.models import attention_shape, sliding_windows

    shape = attention_shape(config)
    settings = json_.loads((Path(path) / "manifest.json").read_text())["settings"]
    items = [(k, v) for ks, vs in zip(settings["k"], settings["v"]) for k, v in zip(ks, vs)]
    per = shape.num_kv_heads
    kept = set(sliding_windows(config))
    compressed = [i for i in range(shape.num_layers) if i not in kept] or list(range(shape.num_layers))
    total = len(compressed) * per
    picked = [items[n * len(items) // total] for n in range(total)]
    row = {layer: r for r, layer in enumerate(compressed)}  # a compressed layer's row of items
    schemes = {part: [[parse_scheme(picked[row.get(i, 0) * per + j][w]) for j in range(per)]
                      for i in range(shape.num_layers)] for w, part in enumerate("kv")}
    g = torch.Generator().manual_seed(0)
    d, books = shape.head_dim, {}
    for part in "kv":
        for i, heads in enumerate(schemes[part]):
            for s in heads:
                if s.book and codebook_name(i, part, s.book) not in books:
                    x = torch.randn(*s.book_shape(1, d), generator=g) * (d**-0.5 if s.family == "turboquant" else 1)
                    books[codebook_name(i, part, s.book)] = (x if s.dim else x.sort(-1).values).half().float()
                if s.family == "vecinfer" and part == "k":
                    books[smooth_name(i)] = (torch.rand(per, d, generator=g) + 0.5).half()
    plan = Plan(shape, schemes, settings["residual"], settings["flush_step"], books, settings["granularity"])
    plan.sink = settings.get("sink_tokens", 0)
    plan.fitted_residual_mode = settings.get("residual_mode")
    groups = [len(plan.codebook_groups(i)) for i in compressed]
    held = {part: [x for i in compressed for x in schemes[part][i]] for part in "kv"}
    mix = {part: {str(s): sum(str(x) == str(s) for x in held[part]) for s in dict.fromkeys(held[part])}
           for part in "kv"}
    print(f"[plan {path}] keys {mix['k']}; values {mix['v']}; groups of heads per layer: mean "
          f"{sum(groups) / len(groups):.2f}, max {max(groups)}", file=sys.stderr, flush=True)
    return plan


def static_method(base: str, config=None, plan3: str | None = None):
    """(method, settings) of a static path: KIVI-2 G=128 R=128, TurboQuant of its bits at R=128, or a plan mapped onto
    `config` (`mapped_plan`)."""
    from kvcalib.methods import MethodSettings

    if base in PLANS:
        return mapped_plan(config, str(ROOT / (plan3 if base == "plan3-static" and plan3 else PLANS[base]))), MethodSettings()
    if base.startswith("turboquant"):
        return "turboquant", MethodSettings(bits=int(base[len("turboquant")]), residual=128)
    return "kivi", MethodSettings(2, 128, 128)


LONG = 265  # new tokens of the longer timed call: 256 more than the shorter one's 9
PHASE = 37  # tokens row i of the B=8 row is shortened by, i times: 8 different steps of every 128 fill its windows


def batch8_lengths(longest: int) -> list[int]:
    """The B=8 row's prompt lengths: 8 spread evenly up to `longest`, row i shortened by PHASE i tokens."""
    return [longest * (8 - i) // 8 - PHASE * i for i in range(8)]


def prompts_of(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of random prompts of `lengths`, left-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:], mask[b, width - n:] = torch.randint(1, 128000, (n,), generator=g), 1
    return ids.cuda(), mask.cuda()


def sync_free_multinomial(probs: torch.Tensor, num_samples: int, *args, **kwargs) -> torch.Tensor:
    """One draw per row from `probs`, as torch's single-sample `multinomial` draws it (the largest of p / E, E
    exponential: the Gumbel-max trick), without its checks' host reads. Only `num_samples=1`, what generate asks."""
    assert num_samples == 1 and not args and not kwargs, "sync_free_multinomial draws one sample"
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1, keepdim=True)


def model_config(shape: str, longest: int):
    """(config, dtype) of the benchmark's model: the 8B shape in fp16, or a named `make-model` shape in bfloat16."""
    from transformers import AutoConfig

    from generate import llama8b_config
    from kvcalib.random_model import SHAPES

    if shape == "llama-3.1-8b":
        return llama8b_config(longest), torch.float16
    fields = dict(SHAPES[shape])
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), longest + 1024)
    return AutoConfig.for_model(fields.pop("model_type"), **fields), torch.bfloat16


def one_path(path: str, shapes: list[list[int]], plan3: str | None = None, shape: str = "llama-3.1-8b") -> list[dict]:
    """Every row of `path` (a list of prompt lengths per row), in this process."""
    from transformers import AutoModelForCausalLM, StaticCache

    from kvcalib.methods import MethodSettings
    from kvcalib.runtime.cache import KvcalibCache
    from kvcalib.runtime.static_cache import StaticKvcalibCache

    longest = max(max(s) for s in shapes)
    torch.manual_seed(0)
    with torch.device("cuda"):
        config, dtype = model_config(shape, longest)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every call decodes all its tokens
    base = path.removesuffix("-warm")
    if base == "kivi128-static-cublas":
        from kvcalib.runtime import gemv_kernel

        gemv_kernel.MAX_ROWS = 0  # this process's steps: every product by cuBLAS
    if base == "kivi128-static-syncfree":
        torch.multinomial = sync_free_multinomial  # this process only: transformers' _sample calls torch.multinomial
    rows = []
    for lengths in shapes:
        if base == "kivi128-dynamic" and len(lengths) == 1 and lengths[0] > 32768:
            continue  # eager: B=1 up to 32k tells its cost (longer rows only take device time)
        one_row = ("kivi128-static-compiled", "kivi128-static-uncompiled", "kivi128-static-cublas",
                   "kivi128-static-syncfree")
        if base in one_row and lengths != [32768]:
            continue
        ids, mask = prompts_of(lengths)
        b, room = len(lengths), ids.shape[1] + LONG + 160  # 128 steps past generate's for `captured_step`
        if base == "fp16-static":
            model.set_attn_implementation("sdpa")
            cache = StaticCache(config=model.config, max_cache_len=room)
        elif base in COMPILE:
            cache = StaticKvcalibCache(model, *static_method(base, model.config, plan3), max_batch=b, max_length=room,
                                       compile=COMPILE[base])
        else:
            cache = None

        def call(new: int, sample: bool = False) -> float:
            use = cache if cache is not None else KvcalibCache(model, "kivi", MethodSettings(2, 128, 128))
            if base == "fp16-static":
                use.reset()
            options = dict(do_sample=True, top_p=0.9, top_k=50, temperature=0.8) if sample else dict(do_sample=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, past_key_values=use, max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=0, **options)
            torch.cuda.synchronize()
            assert out.shape[1] == ids.shape[1] + new, (path, lengths, out.shape)
            return time.perf_counter() - t0

        first = call(9)
        ttft = call(1)  # warm: the first call made every shape a timed call meets but the longer one's
        per = {sample: (min(call(LONG, sample) for _ in range(2)) - min(call(9, sample) for _ in range(2))) / (LONG - 9)
               for sample in (False, True)}
        rows.append({"path": path, "batch": b, "context": max(lengths), "first": first, "ttft": ttft,
                     "greedy": per[False], "sample": per[True],
                     "step": captured_step(cache) if base in COMPILE else None,
                     "graphs": dynamo_graphs()})
        print(f"[{path}] B={b} {max(lengths)}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        del cache
        torch.cuda.empty_cache()
    return rows


def dynamo_graphs() -> int:
    """Graphs torch.compile has made in this process so far (a region recompiled per layer would show here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def captured_step(cache, steps: int = 128) -> float:
    """Seconds per step of the cache's captured step driven as kvcalib's own loop drives it (greedy, the
    tokens to the host every step: `kvcalib.runtime.captured.generate`), on the sequences generate left."""
    tokens = torch.zeros(cache.max_batch, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = cache.decoder.step(tokens).argmax(-1)
        tokens.tolist()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--batch8", type=int, default=16384, help="the longest of the B=8 row's prompts (0: no row)")
    parser.add_argument("--paths", default="all", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--one-path", default=None, help=argparse.SUPPRESS)  # a child process: one path, JSON out
    parser.add_argument("--shape", default="llama-3.1-8b",
                        help="llama-3.1-8b (fp16), or another of `kvcalib make-model`'s shapes (bfloat16)")
    parser.add_argument("--rows-dir", default=None,
                        help="keep each path's rows here as JSON, and read (not rerun) a path already there: a run "
                             "split over several calls of a machine that keeps the folder")
    parser.add_argument("--results", default=None, help="record into this file (default RESULTS.md)")
    parser.add_argument("--plan3", default=None, help="another 3-bit plan for `plan3-static` to map (a `kvcalib plan` "
                        "artifact; default: the shipped plan-3)")
    parser.add_argument("--cache-root", default=None,
                        help="each path's on-disk compile caches in a folder of its own under this one (its -warm "
                             "run shares it): a cold first call is cold whatever ran before it")
    args = parser.parse_args()
    shapes = [[int(c)] for c in args.contexts.split(",") if c]
    if args.batch8:
        shapes.append(batch8_lengths(args.batch8))
    if args.one_path:
        print(json.dumps(one_path(args.one_path, shapes, args.plan3, args.shape)))
        return
    paths = PATHS if args.paths == "all" else args.paths.split(",")
    rows = []
    kept = Path(args.rows_dir) if args.rows_dir else None
    for path in paths:  # a fresh process each: first calls as a user meets them
        if kept is not None and (kept / f"{path}.json").exists():
            rows += json.loads((kept / f"{path}.json").read_text())
            continue
        env = dict(os.environ)
        if args.cache_root:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache_root) / path.removesuffix("-warm"))
        child = subprocess.run([sys.executable, __file__, "--one-path", path, "--contexts", args.contexts,
                                "--batch8", str(args.batch8), "--shape", args.shape]
                               + (["--plan3", args.plan3] if args.plan3 else []),
                               capture_output=True, text=True, env=env)
        sys.stderr.write(child.stderr[-3000:])
        if child.returncode:
            print(f"{path}: failed (exit {child.returncode})", file=sys.stderr)
            continue
        got = json.loads(child.stdout.strip().splitlines()[-1])
        if kept is not None:
            kept.mkdir(parents=True, exist_ok=True)
            (kept / f"{path}.json").write_text(json.dumps(got))
        rows += got
    base = {(r["batch"], r["context"]): r for r in rows if r["path"] in ("fp16-static", "fp16-static-warm")}
    lines = ["| B | longest prompt | path | first call s | TTFT s | ms/token greedy | ms/token sampling | "
             "sampling/greedy | tokens/s | x fp16 | captured step ms (generate/step) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["context"], paths.index(r["path"]))):
        fp16 = base.get((r["batch"], r["context"]))
        speed = "-" if fp16 is None else f"{fp16['greedy'] / r['greedy']:.2f}"
        lines.append(f"| {r['batch']} | {r['context']} | {r['path']} | {r['first']:.1f} | {r['ttft']:.2f} | "
                     f"{1e3 * r['greedy']:.2f} | {1e3 * r['sample']:.2f} | {r['sample'] / r['greedy']:.3f} | "
                     f"{r['batch'] / r['greedy']:.1f} | {speed} | " +
                     ("-" if r["step"] is None else f"{1e3 * r['step']:.2f} ({r['greedy'] / r['step']:.3f})") + " |")
    from results import RESULTS, publish

    named = "Llama-3.1-8B" if args.shape == "llama-3.1-8b" else f"{args.shape} in bfloat16"
    title = f"Decoding through model.generate, {torch.cuda.get_device_name()}, {named} shape (random init)"
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results or RESULTS)


if __name__ == "__main__":
    main()
