"""Data-parallel calibration (`kvcalib.parallel`): two CPU processes joined by gloo, as
`torchrun --nproc-per-node 2 -m kvcalib ...` starts them (the same environment variables), give what one
process gives, byte for byte: `collect`'s plan, manifest and every shard; `train-adapters`' and
`fit-codebook`'s artifact; `eval`'s result. Byte identity holds here
because each shard's samples run the same float32 CPU forward in either case (one thread per process in
both runs: a different thread count may split a matrix product's sums differently)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path

import pytest

from kvcalib.parallel import share

TIMEOUT = 240  # seconds for a run of two processes (a hang at a barrier fails the test instead of CI)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(job: str, source: str, text: str, out: str, device: str = "cpu"):
    """The command a process runs, and its module (whose `share` the test watches). `device`: collect's
    (`cuda`: each rank on its own GPU, tests/test_multi_gpu.py)."""
    if job == "collect":
        import kvcalib.collect as module

        return module, lambda: module.collect(out, model=source, dataset=text, num_samples=5, seq_len=32, chunk_size=2,
                                              device=device)
    if job == "eval":
        import kvcalib.evaluate as module

        return module, lambda: module.evaluate(source, dataset=text, num_samples=3, seq_len=40, method="kivi", bits=2,
                                               group_size=8, residual=16, json_path=out, device="cpu")
    if job == "diagnose":
        import kvcalib.diagnose as module

        return module, lambda: module.diagnose(source, out, plot_layers=[0], device="cpu")
    if job == "train-adapters":
        import kvcalib.methods.kvlinc_fit as module

        return module, lambda: module.train_adapters(source, out, rank=16, steps=10, group_size=8, residual=16, tokens=48)
    import faiss

    import kvcalib.methods.vecinfer_fit as module

    faiss.omp_set_num_threads(1)  # one thread in both runs, as torch's
    return module, lambda: module.fit_codebook(source, out, k_config="d4b6", v_config="d2b5", iters=5,
                                               max_points_per_centroid=64)


def as_rank(rank: int | None, size: int, port: int, log: str, work) -> None:
    """A spawned process as torchrun starts one (rank None: the plain one-process run): its environment, then
    `work()` (a JSON-able dict), written to `log` with "ok", or the error and its traceback; the process group,
    if the work made one, is closed after."""
    if rank is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    try:
        result = {"ok": True, **work()}
    except (Exception, SystemExit) as exc:  # (the command line exits on a user's error, after its one line)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(log).write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _child(job: str, rank: int | None, size: int, port: int, source: str, text: str, out: str, log: str,
           device: str = "cpu") -> None:
    """One process of the run (rank None: the one-process run): what torchrun gives a process, then the job."""
    import torch

    torch.set_num_threads(1)

    def work() -> dict:
        module, run = _job(job, source, text, out, device)
        shares = []
        real_share = module.share
        module.share = lambda items, r, n: shares.append(real_share(items, r, n)) or shares[-1]
        run()
        return {"shares": shares}

    as_rank(rank, size, port, log, work)


def run_processes(target, args: list[tuple], logs: list[Path]) -> list[dict]:
    """Start one spawned process per `args` running `target(*args)`, wait for them (`TIMEOUT`: a hang at a barrier
    fails the test), and return the JSON each wrote to its log."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT  # one allowance for the whole run, however many processes
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    where = {log.name: ("running, " if p.is_alive() else "ended, ") + _stages(log) for p, log in zip(procs, logs)}
    for p in alive:
        p.kill()
    assert not alive, (f"{len(alive)} process(es) still running after {TIMEOUT} s (a rank waiting on another); "
                       f"each process and the last stage it noted: {where}")
    return [json.loads(log.read_text()) for log in logs]


def reached(log: str, stage: str) -> None:
    """Note, beside a rank's `log`, that it has reached `stage` (with the time): a run stopped by `TIMEOUT`
    then says where each rank was, slow or waiting."""
    with open(f"{log}.stages", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {stage}\n")


def _stages(log: Path) -> str:
    path = Path(f"{log}.stages")
    lines = path.read_text().strip().splitlines() if path.exists() else []
    return lines[-1] if lines else "none noted"


def _run(size: int, model: Path, text: Path, out: Path, tmp: Path, job: str = "collect", device: str = "cpu") -> list[dict]:
    """Start `size` processes (size 1: the plain one-process run) and return what each reported."""
    port = _free_port()
    logs = [tmp / f"{out.name}-rank{r}.json" for r in range(size)]
    return run_processes(_child, [(job, None if size == 1 else r, size, port, str(model), str(text), str(out),
                                   str(logs[r]), device) for r in range(size)], logs)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_two_gloo_processes_collect_the_directory_one_process_collects(tmp_path, tiny_model_dir, text_file):
    one = _run(1, tiny_model_dir, text_file, tmp_path / "one", tmp_path)
    assert one[0]["ok"], one[0]
    two = _run(2, tiny_model_dir, text_file, tmp_path / "two", tmp_path)
    assert all(r["ok"] for r in two), two
    # the work was split: 3 chunks, rank 0 records chunks 0 and 2, rank 1 chunk 1
    assert [r["shares"] for r in two] == [[[0, 2]], [[1]]]
    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(a) == sorted(b) and len(a) > 3, (sorted(a), sorted(b))
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"files differ between the one-process and two-process runs: {differ}"


@pytest.mark.parametrize("job", ["train-adapters", "fit-codebook", "diagnose"])
def test_layers_fitted_on_two_ranks_make_the_artifact_one_process_makes(job, tmp_path, tiny_model_dir, text_file):
    """KVLinC's adapters, VecInfer's codebooks and diagnose's figures are computed layer by layer: two ranks
    take a share of the layers each and rank 0 writes one artifact (one report), whose manifest and tensors
    (report.json, report.md and the plots, drawn a share a rank) equal the one-process output byte for byte
    (run.json holds wall-clock seconds: apart, as in tests/test_reproducible_artifacts.py)."""
    if job == "fit-codebook":
        pytest.importorskip("faiss", reason="fit-codebook needs faiss (pip install kvcalib[cpu])")
    from kvcalib.artifacts import MANIFEST, TENSORS

    acts = tmp_path / "acts"
    assert _run(1, tiny_model_dir, text_file, acts, tmp_path)[0]["ok"]
    one = _run(1, acts, text_file, tmp_path / "one", tmp_path, job)
    assert one[0]["ok"], one[0]
    two = _run(2, acts, text_file, tmp_path / "two", tmp_path, job)
    assert all(r["ok"] for r in two), two
    layers = json.loads((acts / "plan.json").read_text())["model_fingerprint"]["num_layers"]
    assert sorted(sum((r["shares"][0] for r in two), [])) == list(range(layers)) and all(r["shares"][0] for r in two)
    names = (MANIFEST, TENSORS) if job != "diagnose" else sorted(p.name for p in (tmp_path / "one").iterdir())
    if job == "diagnose":  # the report and its plots, which the two ranks draw a share each of
        assert {"report.json", "report.md", "norms_layer00.png", "error_by_layer.png"} <= set(names), names
        assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_windows_scored_on_two_ranks_give_the_one_process_result(tmp_path, tiny_model_dir, text_file):
    """eval: each rank scores its share of the windows; the NLL, error sums and bits are added in window
    order whichever rank scored each, so the JSON equals the one-process JSON in every number (but the
    wall-clock seconds)."""
    one = _run(1, tiny_model_dir, text_file, tmp_path / "one.json", tmp_path, "eval")
    two = _run(2, tiny_model_dir, text_file, tmp_path / "two.json", tmp_path, "eval")
    assert one[0]["ok"] and all(r["ok"] for r in two), (one, two)
    assert [r["shares"] for r in two] == [[[0, 2]], [[1]]]
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert a.pop("seconds") > 0 and b.pop("seconds") > 0
    assert a == b


def test_an_error_on_rank0_stops_every_rank_with_its_message(tmp_path, tiny_model_dir, text_file):
    """Rank 0 refuses a directory holding another collection's plan; rank 1 must not wait for it at a
    barrier, but stop with rank 0's message."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"kind": "activations", "settings": {"seq_len": 7}}))
    two = _run(2, tiny_model_dir, text_file, out, tmp_path)
    assert not any(r["ok"] for r in two), two
    assert "other settings" in two[0]["error"] and "rank 0 stopped" in two[1]["error"], two
    assert "other settings" in two[1]["error"]


@pytest.mark.parametrize("n,size", [(0, 2), (1, 2), (5, 2), (7, 3)])
def test_shares_cover_every_item_once_and_differ_by_at_most_one(n, size):
    items = list(range(n))
    parts = [share(items, r, size) for r in range(size)]
    assert sorted(x for p in parts for x in p) == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_model_spread_by_device_map_auto_collects_what_one_device_collects(tmp_path, tiny_model_dir, text_file):
    """`--device-map auto` loads the model through accelerate's placement (here, with no GPU, every layer on
    the CPU): the same plan, manifest and shards as `--device cpu`, byte for byte. On several GPUs the
    layers sit on different devices and the hooks record each on its own (run on the GPUs: not here)."""
    from kvcalib import models
    from kvcalib.collect import collect

    args = dict(model=str(tiny_model_dir), dataset=str(text_file), num_samples=3, seq_len=32, chunk_size=2)
    models._load_cached.cache_clear()
    collect(tmp_path / "cpu", device="cpu", **args)
    models._load_cached.cache_clear()
    collect(tmp_path / "auto", device_map="auto", max_memory={"cpu": "8GiB"}, **args)
    models._load_cached.cache_clear()
    assert _files(tmp_path / "cpu") == _files(tmp_path / "auto")


def test_a_command_that_does_not_share_its_work_is_refused_under_torchrun(tmp_path, monkeypatch, capsys):
    """Under torchrun every process would run such a command in full over one output: one line, exit 2."""
    from kvcalib.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        main(["fit-turboquant", "--activations", str(tmp_path), "--out", str(tmp_path / "tq")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcalib: error: fit-turboquant runs in one process") and "\n" not in err


def _threads_child(rank: int, size: int, port: int, log: str, env: dict) -> None:
    """A rank started with `env` on top of torchrun's variables: its torch thread count once in the group."""
    os.environ.update(env)

    def work() -> dict:
        import torch

        from kvcalib.parallel import world

        torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a process
        world()
        return {"threads": torch.get_num_threads()}

    as_rank(rank, size, port, log, work)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU core: a rank's share of it is torchrun's one thread")
def test_a_rank_takes_its_share_of_the_cores_where_torchrun_left_it_one_thread(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 where the caller set none; joining the group, each rank takes the host's
    cores over the ranks on it instead (here LOCAL_WORLD_SIZE=1 says one rank a host, so the share is every core
    and differs from one thread on any machine of 2 cores or more); an OMP_NUM_THREADS of the caller's is kept."""
    from kvcalib.parallel import rank_threads

    cores = len(os.sched_getaffinity(0))
    port = _free_port()
    logs = [tmp_path / f"rank{r}.json" for r in range(2)]
    got = run_processes(_threads_child, [(r, 2, port, str(logs[r]), {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
                                         for r in range(2)], logs)
    assert [g.get("threads") for g in got] == [cores, cores], got
    assert rank_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, 32) == 16
    assert rank_threads({"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}, 2) == 1  # never fewer than one
    assert rank_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "6"}, 32) is None  # the caller's choice
    assert rank_threads({"OMP_NUM_THREADS": "1"}, 32) is None  # not under torchrun
