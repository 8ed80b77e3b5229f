"""The calibration pipeline on one machine: each command as a user runs it (`kvcalib ...` in its
own process), timed, with its peak host memory (the process's maximum resident set, from the kernel) and
peak GPU memory (the process's, sampled from `nvidia-smi` every 0.2 s, CUDA context included).

    python benchmarks/calibrate.py --model DIR [--num-samples 64] [--seq-len 2048] [--max-tokens N] [--nproc 1]
                                   [--device auto | --device-map auto] [--work runs/calibrate] [--steps all] [--keep]
                                   [--train-layers 0-1] [--train-samples 8] [--budget 2.25] [--eval-methods kivi]
                                   [--results FILE]

Steps: collect (`--num-samples` x `--seq-len`), fit-codebook d4b8 and d8b12, train-adapters (`--train-layers`, 0-1 by
default), diagnose, plan (`--budget`, one process: it is not data-parallel), eval (each of `--eval-methods`, KIVI-2
by default, 4 windows of `--seq-len`; vecinfer, kvlinc and plan evaluate the work directory's d4b8 codebooks,
adapters and plan; each eval's perplexity and effective bits are in its row). `--nproc N` runs each
under `torchrun --nproc-per-node N` (data-parallel, `kvcalib.parallel`); `--device-map auto` spreads the
model of collect, plan and eval over the GPUs instead. Build the model first with `kvcalib make-model` (its
time is not counted: a user has a model); on a machine without the embedded GGUF, with `--tokenizer DIR`,
a tokenizer saved where the GGUF is (a few MB to carry). The table gives the pipeline's total (collect, fits, training,
diagnose) beside each step (of those run: `--steps` picks some, e.g. `fit-d8b12`, and `--keep` reuses
the work directory's collection, to spread a pipeline over runs of limited length); host memory is the
largest of the processes of a step. Each step's time is also split around its own progress bars (`phases`): before
(process, CUDA, the model or the collection's index), during (the chunks, layers or windows the ranks share under
torchrun) and after (gathering, rank 0's writing): what data-parallel can shrink and what it cannot. `--max-tokens
N` is collect's own: every window runs through the model whole, N tokens per layer are stored (a seeded sample of
positions in each window); train-adapters trains on whole windows, so with `--max-tokens` the train step first
collects `--train-samples` windows (8 by default) whole, its own row. An 8B model stores 393 kB per token over its
32 layers (Q of 32 heads, K and V of 8, float16): 64 x 2048 tokens whole is 51 GB, more than the GPU machines' disk
holds beside the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from results import RESULTS, publish

GIB = 2**30
# kvcalib's own progress bars, by their units, within one line of tqdm's output (another library's bar counts
# other units; kvcalib turns transformers' loading bars off)
OWN_BAR = re.compile(rb"%\|[^\r\n]*(sample|layer|step|window|forward)")
STEPS = ("collect", "fit-d4b8", "fit-d8b12", "train", "diagnose", "plan", "eval")  # in the order they run
# eval's methods (--eval-methods) and their rows' names: KIVI-2 and OScaR-2 at eval's defaults, TurboQuant at 2 bits
EVAL_METHODS = {"fp16": "fp16", "kivi": "KIVI-2", "oscar": "OScaR-2", "turboquant": "TurboQuant-2",
                "vecinfer": "VecInfer d4b8", "kvlinc": "KVLinC-2", "plan": "plan"}


def gpu_memory(pids: set[int]) -> int:
    """Bytes of GPU memory the processes `pids` hold now (nvidia-smi; 0 without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    total = 0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids and mib.strip().isdigit():
            total += int(mib) * 2**20
    return total


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (torchrun's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def peak_rss(pids: set[int], peaks: dict[int, int]) -> None:
    """Each process's largest resident set so far (VmHWM), kept in `peaks`."""
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[p] = max(peaks.get(p, 0), int(line.split()[1]) * 1024)
        except OSError:
            pass


def run(argv: list[str], env: dict[str, str]) -> dict:
    """Run one command; its wall time, the largest host RSS of its processes, its peak GPU memory. Its stderr
    (progress bars, messages) passes through as it comes, so that a run cut short shows where it was."""
    print(f"started: kvcalib {' '.join(argv[argv.index('kvcalib') + 1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    bars: list[float] = []  # when a progress bar moved: the command's splittable work (`phases`)

    def relay() -> None:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            if OWN_BAR.search(chunk):
                bars.append(time.perf_counter() - start)
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    rss: dict[int, int] = {}
    gpu = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pids = descendants(proc.pid)
            peak_rss(pids, rss)
            gpu[0] = max(gpu[0], gpu_memory(pids))
            done.wait(0.2)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    proc.wait()
    relayer.join()
    done.set()
    watcher.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}; its messages are above)")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss": max(rss.values(), default=0), "gpu": gpu[0], "phases": phases(bars, seconds)}


def phases(bars: list[float], seconds: float) -> tuple[float, float, float]:
    """Seconds (before, during, after) the command's progress bars, `bars` being when one moved (seconds from the
    start) and `seconds` the whole: before the first bar (the process, CUDA, the model or the collection's index),
    from the first bar of any rank to the last bar of any rank (the chunks, layers or windows the ranks share under
    torchrun, with any imbalance between them), and after (gathering, rank 0's writing). No bar: all of it before."""
    if not bars:
        return seconds, 0.0, 0.0
    return bars[0], bars[-1] - bars[0], seconds - bars[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="A model directory (kvcalib make-model) or the embedded name.")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=None, help="collect --max-tokens: stored tokens per layer.")
    parser.add_argument("--train-samples", type=int, default=8,
                        help="With --max-tokens: the windows collected whole for train-adapters (it trains on whole "
                             "windows, which a collection of sampled positions does not hold).")
    parser.add_argument("--train-layers", default="0-1",
                        help="train-adapters --layers (all: every layer, the work data-parallel ranks share).")
    parser.add_argument("--nproc", type=int, default=1, help="Processes per step under torchrun (data-parallel).")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--device-map", default="none",
                        help="auto: collect, plan and eval spread the model over the GPUs.")
    parser.add_argument("--work", default="runs/calibrate", help="Scratch directory (removed first unless --keep).")
    parser.add_argument("--steps", default="all", help="all, or some of: " + ", ".join(STEPS))
    parser.add_argument("--keep", action="store_true", help="Keep the work directory (a collection made earlier).")
    parser.add_argument("--budget", type=float, default=2.25, help="plan --budget.")
    parser.add_argument("--plan-windows", type=int, default=None,
                        help="plan --windows (its default: 4 held-out windows; each runs the model 1 + 2 x layers times)")
    parser.add_argument("--eval-methods", default="kivi", help="eval's methods, comma-separated, of "
                        + ", ".join(EVAL_METHODS))
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    methods = [m for m in args.eval_methods.split(",") if m]
    if not methods or (odd := [m for m in methods if m not in EVAL_METHODS]):
        got = f"; got {', '.join(odd)}" if methods else ""
        parser.error(f"--eval-methods: choose of {', '.join(EVAL_METHODS)}{got}")
    work = Path(args.work)
    chosen = list(STEPS) if args.steps == "all" else args.steps.split(",")
    if unknown := [c for c in chosen if c not in STEPS]:
        parser.error(f"--steps: unknown {', '.join(unknown)}; choose of {', '.join(STEPS)}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    alone = [sys.executable, "-m", "kvcalib"]
    launch = alone if args.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "-m", "kvcalib"]
    place = ["--device-map", "auto"] if args.device_map == "auto" else ["--device", args.device]
    acts = str(work / "acts")
    windows = ["--windows", str(args.plan_windows)] if args.plan_windows is not None else []  # else plan's default
    whole = str(work / "acts-whole")  # training's collection (whole windows) where --max-tokens samples positions

    def collect(samples: int, out: str, stored: int | None) -> list[str]:
        return ["collect", "--model", args.model, "--num-samples", str(samples), "--seq-len", str(args.seq_len), *place,
                "--out", out, *(["--max-tokens", str(stored)] if stored else [])]
    given = {"turboquant": ["--bits", "2"], "vecinfer": ["--artifacts", str(work / "vq-d4b8")],
             "kvlinc": ["--artifacts", str(work / "kvlinc")], "plan": ["--artifacts", str(work / "plan")]}
    steps = {  # key (`STEPS`, --steps): [(the table's name for it, the launcher, the command)]
        "collect": [("collect", launch, collect(args.num_samples, acts, args.max_tokens))],
        "fit-d4b8": [("fit-codebook d4b8", launch, ["fit-codebook", "--activations", acts, "--k-config", "d4b8",
                                                    "--v-config", "d4b8", "--device", args.device, "--out",
                                                    str(work / "vq-d4b8")])],
        "fit-d8b12": [("fit-codebook d8b12", launch, ["fit-codebook", "--activations", acts, "--k-config", "d8b12",
                                                      "--v-config", "d8b12", "--device", args.device, "--out",
                                                      str(work / "vq-d8b12")])],
        "train": [*([(f"collect for training ({args.train_samples} x {args.seq_len}, whole windows)", launch,
                      collect(args.train_samples, whole, None))] if args.max_tokens else []),
                  (f"train-adapters (layers {args.train_layers})", launch,
                   ["train-adapters", "--activations", whole if args.max_tokens else acts, "--layers",
                    args.train_layers, "--device", args.device, "--out", str(work / "kvlinc")])],
        "diagnose": [("diagnose", launch, ["diagnose", "--activations", acts, "--device", args.device, "--out",
                                           str(work / "diagnose")])],
        "plan": [(" ".join(["plan --budget", f"{args.budget:g}", *windows, "(one process)"]), alone,
                  ["plan", "--activations", acts, "--budget", str(args.budget), "--model", args.model, *place,
                   *windows, "--out", str(work / "plan")])],
        "eval": [(f"eval ({EVAL_METHODS[m]}, 4 windows)", launch,
                  ["eval", "--model", args.model, "--method", m, *given.get(m, []), "--num-samples", "4",
                   "--seq-len", str(args.seq_len), *place, "--json", str(work / f"eval-{m}.json")]) for m in methods],
    }
    assert tuple(steps) == STEPS
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rows, pipeline = [], 0.0
    for key, (name, launcher, argv) in ((k, c) for k in STEPS if k in chosen for c in steps[k]):  # the pipeline's order
        res = run(launcher + argv, env)
        if key not in ("plan", "eval"):
            pipeline += res["seconds"]
        before, during, after = res["phases"]
        scored = ""  # an eval's perplexity at its effective bits, from its --json
        if key == "eval":  # run() stops the benchmark where a command fails
            got = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
            scored = f"{got['perplexity']:.3f} at {got['effective_bits']:.3f} bits"
        rows.append(f"| {name} | {res['seconds']:.1f} | {before:.1f} / {during:.1f} / {after:.1f} | "
                    f"{res['rss'] / GIB:.2f} | {res['gpu'] / GIB:.2f} | {scored} |")
        print(rows[-1], flush=True)
    how = f"{args.nproc} process(es)" + (", --device-map auto" if args.device_map == "auto" else f", --device {args.device}")
    stored = f", {args.max_tokens} stored per layer" if args.max_tokens else ""
    some = "" if chosen == list(STEPS) else f"; steps {', '.join(chosen)}"
    lines = [f"model {args.model}; {args.num_samples} x {args.seq_len} tokens{stored}; {how}{some}", "",
             "| step | seconds | before / during / after its progress bars, s | peak host RSS GiB (largest process) "
             "| peak GPU GiB (all processes) | perplexity (eval) |",
             "|---|---:|---:|---:|---:|---|", *rows,
             f"| pipeline: collect + fits + training + diagnose | {pipeline:.1f} | | | | |"]
    import torch

    # the GPUs the run used: all of them where the model is spread or each process takes its own, else one
    used = torch.cuda.device_count() if args.device_map == "auto" else args.nproc
    machine = "CPU" if not torch.cuda.is_available() else (
        f"{used} x {torch.cuda.get_device_name()}" if used > 1 else torch.cuda.get_device_name())
    trained = "" if args.train_layers == "0-1" else f", adapters on layers {args.train_layers}"
    title = (f"Calibration pipeline, {machine}, {Path(args.model).name}, {args.num_samples} x {args.seq_len}, "
             f"{how}{trained}")
    table = "\n".join(lines)
    publish(title, table, sys.argv, path=args.results)


if __name__ == "__main__":
    main()
