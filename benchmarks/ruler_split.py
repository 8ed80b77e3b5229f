"""Offline RULER through `kvcalib lm-eval`'s model, split over two machines: the requests are made and
scored where lm-eval is installed with its dependencies (this machine), and generated on a GPU machine
that has only torch, transformers and lm-eval itself (`pip install --no-deps lm_eval`: its Hugging Face
model imports nothing else).

    python benchmarks/ruler_split.py requests --limit 40 --max-lengths 4096,8192 --out runs/ruler/requests.json
    python benchmarks/ruler_split.py generate --requests runs/ruler/requests.json --rows rows.json \
        --model PATH.gguf --out runs/ruler/responses [--per-gpu 2]   # on the GPU machine
    # or one row over several processes, each with its own --out, then merged:
    #   generate ... --only ROW --shard I/N --out responses-I   (I = 0..N-1, at once)
    #   merge --responses responses-0 ... responses-N-1 --out runs/ruler/responses
    python benchmarks/ruler_split.py score --requests runs/ruler/requests.json \
        --responses runs/ruler/responses --out runs/ruler/lmeval

The generation is `kvcalib.harness.KvcalibLM.generate_until`, the same call `kvcalib lm-eval` makes
(lm-eval's `HFLM` batching, stop strings and truncation; `model.generate` with the runtime cache). The
requests come from `simple_evaluate` with a model that records them, and the scores from
`simple_evaluate` with a model that answers from the generated texts: the tasks, the samples, their
order and the metrics are lm-eval's own, as in a single `kvcalib lm-eval` run with the same seed.

`rows.json`: a list of {"name", "method", "settings": {MethodSettings fields}, "artifacts"}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcalib.harness import OFFLINE_RULER, evaluate_tasks  # noqa: E402
from kvcalib.methods import MethodSettings, build_method  # noqa: E402
from kvcalib.models import DEFAULT_MODEL, attention_shape, load_model  # noqa: E402


def _key(args) -> str:
    context, gen_kwargs = args
    return json.dumps([context, gen_kwargs], sort_keys=True, default=str)


def _answering_lm(answer):
    """An lm-eval `LM` whose generations come from `answer(requests) -> texts`; loglikelihoods are refused
    (RULER's tasks only generate)."""
    from lm_eval.api.model import LM

    class Answering(LM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            return answer([r.args for r in requests])

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("RULER's tasks only generate")

        loglikelihood_rolling = loglikelihood

    return Answering()


def requests(args) -> None:
    tasks, lengths = args.tasks.split(","), [int(n) for n in args.max_lengths.split(",")]
    seen: list = []

    def record(batch):
        seen.extend(batch)
        return [""] * len(batch)

    evaluate_tasks(_answering_lm(record), load_model(DEFAULT_MODEL, "cpu").tokenizer, tasks, args.limit, lengths,
                   args.seed)
    Path(args.out).write_text(json.dumps({"tasks": tasks, "limit": args.limit, "max_lengths": lengths,
                                          "seed": args.seed, "requests": [list(a) for a in seen]}))
    print(f"{len(seen)} requests -> {args.out}")


def file_name(name: str) -> str:
    """A row's files' name: its name with every run of characters other than letters, digits, '.', '_' and '-' as
    one '-' (a machine that hands files back may leave out names with spaces, commas or parentheses)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "row"


def _rows(path: str) -> list[dict]:
    rows = json.loads(Path(path).read_text())
    names = [file_name(r["name"]) for r in rows]
    shared = sorted({n for n in names if names.count(n) > 1})
    if shared:
        raise SystemExit(f"{path}: two rows' names give one file name ({', '.join(shared)})")
    return rows


def _method(row: dict, lm):
    return build_method(row["method"], attention_shape(lm.config), MethodSettings(**row.get("settings", {})),
                        row.get("artifacts"), lm)


def generate(args) -> None:
    """Each row's answers into `--out`/FILE.json (FILE: the row's `file_name`), `--chunk` requests at a time,
    resuming where a file left off (a run spread over calls of limited length). `--per-gpu N` runs every row at once,
    one process each, N a GPU (the embedded model leaves most of a GPU idle: on 2026-11-28 four rows ran at once on
    two H200s)."""
    if args.per_gpu:
        return _generate_at_once(args)
    import torch
    from lm_eval.api.instance import Instance

    from kvcalib.harness import kvcalib_lm

    spec = json.loads(Path(args.requests).read_text())
    keys = [_key(a) for a in spec["requests"]]
    shard, shards = _shard(args.shard)
    lm = load_model(args.model, args.device)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for row in _rows(args.rows):
        if args.only and row["name"] not in args.only.split(","):
            continue
        target = out / f"{file_name(row['name'])}.json"
        got = json.loads(target.read_text()) if target.exists() else {"row": row, "seconds": 0.0, "answers": {}}
        todo = [i for i, k in enumerate(keys) if k not in got["answers"] and i % shards == shard]
        model = kvcalib_lm(lm, _method(row, lm), batch_size=args.batch_size) if todo else None
        for start in range(0, len(todo), args.chunk):
            part = [Instance("generate_until", {}, tuple(spec["requests"][i]), i) for i in todo[start:start + args.chunk]]
            t0 = time.perf_counter()
            texts = model.generate_until(part, disable_tqdm=True)
            got["seconds"] += time.perf_counter() - t0
            got["answers"].update({keys[r.idx]: t for r, t in zip(part, texts)})
            got["device"] = device
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(got))
            tmp.replace(target)
            print(f"{row['name']}: {len(got['answers'])}/{len(keys)} requests, {got['seconds']:.1f} s on {device}",
                  flush=True)


def _shard(text: str) -> tuple[int, int]:
    """`--shard I/N`: this process answers requests I, I + N, I + 2N, ... (N processes share one row)."""
    i, n = (int(x) for x in text.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard I/N needs 0 <= I < N, got {text}")
    return i, n


def _generate_at_once(args) -> None:
    """Every row (of `--only`, or all) in its own `generate` process, `--per-gpu` of them on each visible GPU
    (CUDA_VISIBLE_DEVICES set per process); each process's output in `--out`/NAME.log."""
    import os

    import torch

    names = [r["name"] for r in _rows(args.rows) if not args.only or r["name"] in args.only.split(",")]
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("--per-gpu needs a GPU")
    if len(names) > gpus * args.per_gpu:
        raise SystemExit(f"{len(names)} rows, room for {gpus * args.per_gpu} ({gpus} GPUs x --per-gpu {args.per_gpu})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, __file__, "generate", "--requests", args.requests, "--rows", args.rows, "--model",
              args.model, "--batch-size", str(args.batch_size), "--chunk", str(args.chunk), "--out", args.out]
    procs = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
    for i, name in enumerate(names):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible[i % gpus])  # the i-th GPU this process sees
        with open(out / f"{file_name(name)}.log", "w") as log:
            procs.append((name, subprocess.Popen(common + ["--only", name], env=env, stdout=log, stderr=subprocess.STDOUT)))
    failed = [name for name, p in procs if p.wait() != 0]
    if failed:
        raise SystemExit(f"rows {', '.join(failed)} stopped: see their logs in {out}")


def merge(args) -> None:
    """One response file a row from the `--shard` runs' directories: their answers together, their seconds summed
    (generating seconds, not wall-clock: the shards ran at once)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for directory in args.responses:
        for path in sorted(Path(directory).glob("*.json")):
            got = json.loads(path.read_text())
            row = rows.setdefault(path.stem, {"row": got["row"], "seconds": 0.0, "answers": {}, "device": got["device"]})
            if row["row"] != got["row"]:
                raise SystemExit(f"{path}: another row under the name {path.stem}")
            row["seconds"] += got["seconds"]
            row["answers"].update(got["answers"])
    for name, row in rows.items():
        (out / f"{name}.json").write_text(json.dumps(row))
        print(f"{name}: {len(row['answers'])} answers, {row['seconds']:.1f} s generating, the shards' summed -> {out / name}.json")


def score(args) -> None:
    from kvcalib.evaluate import settings_of

    spec = json.loads(Path(args.requests).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted(p for p in Path(args.responses).glob("*.json") if args.only in (None, p.stem))
    if args.only is None and len(paths) > 1:  # one process each: a second evaluation in a process makes other
        for path in paths:                      # word lists (ruler_cwe), the first the same as the requests' run
            subprocess.run([sys.executable, __file__, "score", "--requests", args.requests, "--responses",
                            args.responses, "--out", args.out, "--only", path.stem], check=True)
        return
    lm = load_model(DEFAULT_MODEL, "cpu")  # its tokenizer sizes the prompts; its shape builds each row's method
    for path in paths:
        got = json.loads(path.read_text())
        answers, row = got["answers"], got["row"]
        if len(answers) < len({_key(a) for a in spec["requests"]}):
            print(f"{row['name']}: {len(answers)} of {len(spec['requests'])} requests answered, not scored")
            continue
        def answer(batch):
            missing = [a for a in batch if _key(a) not in answers]
            if missing:
                raise SystemExit(f"{row['name']}: {len(missing)} prompts the requests file does not hold (lm-eval "
                                 f"made other samples than in the requests' run)")
            return [answers[_key(a)] for a in batch]

        results = evaluate_tasks(_answering_lm(answer), lm.tokenizer, spec["tasks"], spec["limit"],
                                 spec["max_lengths"], spec["seed"])
        method = _method(row, lm)
        results["kvcalib"] = {"model": DEFAULT_MODEL, "method": method.name, "settings": settings_of(method),
                              "artifacts": row.get("artifacts"), "max_lengths": spec["max_lengths"],
                              "limit": spec["limit"], "generated_on": got["device"], "seconds": got["seconds"]}
        from lm_eval.utils import handle_non_serializable

        (out / path.name).write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
        print(f"{row['name']}: scored -> {out / path.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    r = sub.add_parser("requests")
    r.add_argument("--tasks", default=",".join(OFFLINE_RULER))
    r.add_argument("--limit", type=int, default=40)
    r.add_argument("--max-lengths", default="4096,8192")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--requests", required=True)
    g.add_argument("--rows", required=True)
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--device", default=None)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--only", default=None, help="comma-separated row names")
    g.add_argument("--chunk", type=int, default=64, help="requests between saves")
    g.add_argument("--shard", default="0/1", help="I/N: answer only requests I, I+N, ... (their own --out each)")
    g.add_argument("--per-gpu", type=int, default=0, help="run the rows at once, this many a GPU (0: one by one)")
    g.add_argument("--out", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--responses", nargs="+", required=True, help="the shards' --out directories")
    m.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("--requests", required=True)
    s.add_argument("--responses", required=True)
    s.add_argument("--only", default=None, help="one row's name")
    s.add_argument("--out", required=True)
    args = parser.parse_args()
    {"requests": requests, "generate": generate, "merge": merge, "score": score}[args.step](args)


if __name__ == "__main__":
    main()
