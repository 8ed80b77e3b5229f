"""Faults: `collect`, `fit-codebook`, `train-adapters` and `diagnose`, each run as a real process and
stopped by SIGINT or SIGKILL at a random point of its work, leave nothing half-written, and a re-run
into the same output resumes or restarts to the very bytes of an uninterrupted run.

Each command runs once uninterrupted (the reference, which also times its work: from its first
progress bar on stderr, when the model is loaded and the inputs read, to the line naming its result).
Then, per seed, it is started into one output location, and once its progress bar appears it is
signalled at a random point of that work time: seed k of n within the k-th n-th of it, so that the
seeds spread from early to late (for collect, of the share of the work left; a collection that a
seed finds finished is removed first, so that every seed has work to interrupt). A signal that
comes after the command has printed its result interrupts nothing (a SIGINT during the
interpreter's shutdown ends it with -SIGINT): the seed tries again, signalling four times earlier,
until its signal interrupts the work. After every signal, and for the one that interrupts:
- SIGINT: exit 130 (or 2), one line on stderr (`kvcalib: interrupted`), no traceback, and neither a
  temporary of its own nor the lock left behind (a SIGKILLed seed before it may have left its own
  temporary, which the next write of that output removes);
- both: every file at the output is complete and byte-identical to the reference's (collect: each
  shard written so far; the others: the whole output or nothing), and no command can take a partial
  output for a finished one.
The re-run at the end, after all the seeds' interruptions, must exit 0 with the reference's bytes
and no temporary or lock file anywhere.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcalib.collect import Activations, collect
from kvcalib.errors import ArtifactError
from test_bad_inputs import messages

REPO = Path(__file__).resolve().parents[1]
# Unbuffered, so that the result line is seen when printed; one thread, because torch's threads spin
# against each other (and slow ten-fold) where the machine's cores are shared.
ENV = os.environ | {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SEEDS = [(0, signal.SIGINT), (1, signal.SIGKILL), (2, signal.SIGINT)]
ATTEMPTS = 6  # per seed: the last signal comes 4^5 = 1024 times earlier than the first, right after the progress bar
PROGRESS = "%|"  # a tqdm bar has started: the model is loaded and the inputs read
DONE = " written to "  # every command names its result on stdout when it has finished


@dataclass
class Command:
    args: list[str]  # the command line before --out
    compared: list[str]  # the files of the output compared with the reference's (collect: all of them)


@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_model_dir, text_file):
    return collect(tmp_path_factory.mktemp("faults") / "acts", str(tiny_model_dir), dataset=str(text_file),
                   num_samples=4, seq_len=64)


def _command(name: str, acts: Path, model_dir: Path, text_file: Path) -> Command:
    if name == "collect":
        return Command(["collect", "--model", str(model_dir), "--dataset", str(text_file), "--num-samples", "160",
                        "--seq-len", "64"], [])  # 20 chunks of 8 samples (about a second): a resume has work left
    if name == "fit-codebook":
        pytest.importorskip("faiss", reason="fit-codebook needs faiss (pip install kvcalib[cpu])")
        return Command(["fit-codebook", "--activations", str(acts), "--k-config", "d2b6", "--v-config", "d2b6",
                        "--iters", "200", "--max-points-per-centroid", "64"], ["manifest.json", "tensors.safetensors"])
    if name == "train-adapters":
        return Command(["train-adapters", "--activations", str(acts), "--rank", "8", "--steps", "4",
                        "--group-size", "8", "--residual", "16", "--tokens", "48"], ["manifest.json", "tensors.safetensors"])
    return Command(["diagnose", "--activations", str(acts), "--bits", "2", "--group-size", "8", "--plot-layers", "0"],
                   ["report.json"])


def _start(args: list[str], out: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, "-m", "kvcalib.cli", *args, "--out", str(out)], env=ENV,
                                stdout=f, stderr=f, cwd=out.parent)


def _wait_for(text: str, proc: subprocess.Popen, log: Path) -> float:
    """Wait until `text` is in the process's output (or it has exited); returns the time."""
    while text not in log.read_text(errors="replace") and proc.poll() is None:
        time.sleep(0.01)
    return time.monotonic()


def _reference(args: list[str], out: Path) -> float:
    """Run uninterrupted into `out`; returns the seconds of its work: from its first progress bar to
    the line that names its result (not to its exit: the interpreter's shutdown takes a while)."""
    log = out.with_name("reference.log")
    proc = _start(args, out, log)
    started = _wait_for(PROGRESS, proc, log)
    finished = _wait_for(DONE, proc, log)
    assert proc.wait(timeout=300) == 0, log.read_text()
    return finished - started


def _left(name: str, out: Path, reference: Path) -> float:
    """The share of the work a run into `out` has left: collect skips the shards already written."""
    if name != "collect":
        return 1.0
    done = len(list(out.glob("layer*.safetensors")))
    return 1 - done / len(list(reference.glob("layer*.safetensors")))


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name == ".lock"]


def _check_nothing_half_written(name: str, out: Path, reference: Path, compared: list[str]) -> None:
    if not out.exists():
        return
    if name == "collect":
        finished = (out / "manifest.json").exists()
        for shard in out.glob("layer*.safetensors"):
            assert shard.read_bytes() == (reference / shard.name).read_bytes(), shard
        if finished:
            assert Activations(out).manifest == Activations(reference).manifest
        else:
            with pytest.raises(ArtifactError, match="not a finished activation collection"):
                Activations(out)
        return
    for file in compared:  # an output is renamed into place whole: there is all of it or none
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file


# Known unreliable (issue 20, open): in a full `make test` on a clean clone every signal, even one sent
# right after the progress bar appears, came after the command's result (diagnose's two layers take
# 40 ms); run alone, each case passes. Kept running, not counted as a pass, until the work is made
# long enough to interrupt on every machine.
@pytest.mark.xfail(reason="signals can land after the work on a fast or busy machine (issue 20, open)", strict=False)
@pytest.mark.parametrize("name", ["collect", "fit-codebook", "train-adapters", "diagnose"])
def test_interrupted_command_leaves_nothing_partial_and_reruns_to_the_same_bytes(name, acts, tiny_model_dir,
                                                                                 text_file, tmp_path):
    command = _command(name, acts, tiny_model_dir, text_file)
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    reference, out = tmp_path / "ref" / "out", tmp_path / "run" / "out"
    work = _reference(command.args, reference)
    for seed, sig in SEEDS:
        share = (seed + random.Random(seed).random()) / len(SEEDS)  # seed k: a random point of the k-th third
        for attempt in range(ATTEMPTS):
            if (out / "manifest.json").exists():  # a finished collection: nothing would be left to interrupt
                shutil.rmtree(out)
            log = tmp_path / f"seed{seed}-{attempt}.log"
            proc = _start(command.args, out, log)
            _wait_for(PROGRESS, proc, log)
            # The reference's work time is one measurement on a machine others may share: a signal that
            # comes after the result is tried again, four times earlier each time.
            time.sleep(share * work * _left(name, out, reference) / 4**attempt)
            proc.send_signal(sig)
            code = proc.wait(timeout=300)
            output = log.read_text(errors="replace")
            assert "Traceback" not in output, output
            _check_nothing_half_written(name, out, reference, command.compared)
            if DONE not in output:  # it was interrupted
                break
        else:
            pytest.fail(f"seed {seed}: {ATTEMPTS} signals all came after the command had finished")
        if sig == signal.SIGINT:
            assert code in (130, 2), output
            lines = messages(output)
            assert len(lines) == 1 and lines[0].startswith("kvcalib: "), output
            own = [p for p in _temporaries(tmp_path / "run") if p.name.startswith(f".tmp-{proc.pid}-")
                   or p.name == ".lock"]
            assert not own, own
        else:
            assert code == -signal.SIGKILL

    rerun = subprocess.run([sys.executable, "-m", "kvcalib.cli", *command.args, "--out", str(out)],
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    compared = command.compared or sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in out.iterdir() if p.name in compared) == sorted(compared)
    for file in compared:
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file
    assert not _temporaries(tmp_path / "run"), _temporaries(tmp_path / "run")


def _held(lock: Path) -> bool:
    """Whether a process holds a flock on `lock` (the file exists a moment before it is locked), read
    from /proc/locks so that looking never takes the lock from the process being watched."""
    try:
        inode = os.stat(lock).st_ino
    except FileNotFoundError:
        return False
    held = (line.split() for line in Path("/proc/locks").read_text().splitlines())
    return any(f[1] == "FLOCK" and f[5].split(":")[-1] == str(inode) for f in held if len(f) > 5)


def test_second_collect_into_the_same_directory_is_refused_while_the_first_runs(tiny_model_dir, text_file, tmp_path):
    """Two real processes: the first is paused (SIGSTOP) while it holds the directory, the second is
    refused with one line, and the first then finishes a complete collection."""
    args = ["collect", "--model", str(tiny_model_dir), "--dataset", str(text_file), "--num-samples", "4",
            "--seq-len", "32"]
    out = tmp_path / "acts"
    first = _start(args, out, tmp_path / "first.log")
    try:
        while not _held(out / ".lock"):
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)
        second = subprocess.run([sys.executable, "-m", "kvcalib.cli", *args, "--out", str(out)],
                                env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert messages(second.stderr) == [f"kvcalib: error: another process is writing a collection into {out} "
                                       f"(it holds {out / '.lock'}); wait for it to finish or choose another --out"]
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    assert Activations(out).num_layers == 2 and not (out / ".lock").exists()
