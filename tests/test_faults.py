"""Faults: `collect`, `fit-codebook`, `train-adapters` and `diagnose`, each run as a real process and
stopped by SIGINT or SIGKILL at a random point of its work, leave nothing half-written, and a re-run
into the same output resumes or restarts to the very bytes of an uninterrupted run.

The signal is placed by what the command reports, not by a clock, so that it can neither come after
the work on a fast machine nor miss it on a busy one. The command's stderr is a pipe in packet mode
(O_DIRECT) of one page, so of one slot: every write() of the command (a progress-bar refresh is one)
takes the slot, and the next write blocks until the test has read that packet. Once the test stops
reading, the command can write one more packet and then waits at the write after it. Every progress
bar ends with two writes (its last refresh, then the newline of `close()`), and each command finishes
(renames its output into place; collect writes its manifest, its shards are written whole between
samples) only after its last bar has closed; so once the test has read a refresh that shows n < N of
N units done, the command cannot finish until the test reads on. tqdm refreshes at every unit here
(TQDM_MININTERVAL=0, TQDM_MINITERS=1), so every unit is a stopping point. Per seed the test stops
reading at a random unit of the reference's (seed k of n among the k-th n-th of them, so that seeds
spread from early to late; a resumed collect at the same share of the samples it has left), waits a
random part of that unit's time in the reference (up to 1.5 times it: the command works on, and may
have reached its next write and wait there), and signals it.

Each command starts with SIGINT at its default disposition (`_default_sigint`): a test process started
in the background of a non-interactive shell (`make test &`, nohup) has SIGINT ignored, the command
would inherit that and run on through every SIGINT (seen in clean-clone runs until 2026-11-24; each
failure message says how the command and the test process hold SIGINT).

Each command first runs once uninterrupted (the reference: the bytes to compare with, its bars'
units and the time of each). After each seed's signal:
- the command did not finish: no result line on stdout and exit 130 (SIGINT) or -9 (SIGKILL);
- SIGINT: one line on stderr (`kvcalib: interrupted`), no traceback, and neither a temporary of its
  own nor the lock left behind (a SIGKILLed seed before it may have left its own temporary, which
  the next write of that output removes);
- both: every file at the output is complete and byte-identical to the reference's (collect: each
  shard written so far; the others: the whole output or nothing), and no command can take a partial
  output for a finished one.
The re-run at the end, after all the seeds' interruptions, must exit 0 with the reference's bytes
and no temporary or lock file anywhere.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcalib.collect import Activations, collect
from kvcalib.errors import ArtifactError
from test_bad_inputs import messages

REPO = Path(__file__).resolve().parents[1]
# Unbuffered, so that every write reaches the pipe when made; one thread, because torch's threads spin
# against each other (and slow ten-fold) where the machine's cores are shared; a refresh per unit.
ENV = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"} | {
    "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
    "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"}
SEEDS = [(0, signal.SIGINT), (1, signal.SIGKILL), (2, signal.SIGINT)]
DONE = " written to "  # every command names its result on stdout when it has finished
REFRESH = re.compile(r"(?:^|\r)([^\r\n:]+): +\d+%\|[^\r\n]*?\| (\d+)/(\d+) ")  # "desc:  50%|█████     | 1/2 [..."
TIMEOUT = 300  # seconds without a packet from a running command before the test gives up on it


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
        return Command(["collect", "--model", str(model_dir), "--dataset", str(text_file), "--num-samples", "40",
                        "--seq-len", "64"], [])  # 5 chunks of 8 samples: a resumed run has whole chunks left
    if name == "fit-codebook":
        pytest.importorskip("faiss", reason="fit-codebook needs faiss (pip install kvcalib[cpu])")
        return Command(["fit-codebook", "--activations", str(acts), "--k-config", "d2b6", "--v-config", "d2b6",
                        "--iters", "20", "--max-points-per-centroid", "64"], ["manifest.json", "tensors.safetensors"])
    if name == "train-adapters":
        return Command(["train-adapters", "--activations", str(acts), "--rank", "8", "--steps", "4",
                        "--group-size", "8", "--residual", "16", "--tokens", "48"], ["manifest.json", "tensors.safetensors"])
    return Command(["diagnose", "--activations", str(acts), "--bits", "2", "--group-size", "8", "--plot-layers", "0"],
                   ["report.json", "report.md"])


@dataclass
class Run:
    """A command as a real process whose stderr is read one write at a time (see the module's docstring)."""
    proc: subprocess.Popen
    stderr: int  # the read end of its one-packet pipe
    stdout: Path
    packets: list[tuple[float, str]] = field(default_factory=list)  # (time read, text) of each write to stderr

    @classmethod
    def start(cls, args: list[str], out: Path, stdout: Path) -> Run:
        read, write = os.pipe2(os.O_DIRECT | os.O_CLOEXEC)
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 1)  # rounded up to one page: one slot
        try:
            with stdout.open("w") as f:
                proc = subprocess.Popen([sys.executable, "-m", "kvcalib.cli", *args, "--out", str(out)], env=ENV,
                                        stdout=f, stderr=write, cwd=out.parent, preexec_fn=_default_sigint)
        finally:
            os.close(write)
        return cls(proc, read, stdout)

    def read(self) -> str | None:
        """The next write of the command to stderr; None once it has closed stderr (exited)."""
        ready, _, _ = select.select([self.stderr], [], [], TIMEOUT)
        assert ready, f"no output in {TIMEOUT} s: {self.output()}"
        packet = os.read(self.stderr, 1 << 16)  # one packet (a write of at most a page) per read
        if not packet:
            return None
        self.packets.append((time.monotonic(), packet.decode(errors="replace")))
        return self.packets[-1][1]

    def stop_at(self, desc: str, n: int, total: int) -> None:
        """Read up to the refresh of bar `desc` that shows the share n/total of its units done, and no
        further (a resumed collect has fewer samples left than the reference had)."""
        while (packet := self.read()) is not None:
            refresh = REFRESH.search(packet)
            if refresh and refresh[1].strip() == desc and int(refresh[2]) == n * int(refresh[3]) // total:
                assert int(refresh[2]) < int(refresh[3]), packet  # never its last refresh: see the docstring
                return
        pytest.fail(f"the command ended before {desc} showed {n}/{total} done: {self.output()}")

    def finish(self) -> int:
        """Read to the end and wait for the exit; returns the exit code."""
        while self.read() is not None:
            pass
        return self.proc.wait(timeout=TIMEOUT)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a failed check left it waiting at a write
            self.proc.kill()
            self.finish()
        os.close(self.stderr)

    def output(self) -> str:
        return "".join(text for _, text in self.packets) + self.stdout.read_text(errors="replace")

    def signal_state(self) -> str:
        """The process's SIGINT as the kernel holds it: ignored, blocked, caught (a handler), from /proc."""
        return _sigint_state(f"/proc/{self.proc.pid}/status")

    def units(self) -> list[tuple[str, int, int, float]]:
        """(bar, unit, units of the bar, seconds it took) of each unit but a bar's last: the time from the
        refresh that shows it starting to the one that shows it done."""
        first = {}
        for t, text in self.packets:
            for desc, n, total in REFRESH.findall(text):
                first.setdefault((desc.strip(), int(n), int(total)), t)
        return [(desc, n, total, first[desc, n + 1, total] - t) for (desc, n, total), t in first.items() if n < total]


def _default_sigint() -> None:
    """In the child before exec: SIGINT at its default and unblocked, whatever the test process inherited
    or a library in it set (an ignored or blocked signal stays so across exec; the command under test, as
    any program, keeps an ignored SIGINT ignored), so that the child's interpreter installs its handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _sigint_state(status: str) -> str:
    try:
        fields = dict(line.split(":\t", 1) for line in Path(status).read_text().splitlines() if line.startswith("Sig"))
    except OSError as err:
        return f"unreadable: {err}"
    bit = 1 << (signal.SIGINT - 1)
    return ", ".join(f"{name} {'yes' if int(fields[key], 16) & bit else 'no'}"
                     for name, key in (("ignored", "SigIgn"), ("blocked", "SigBlk"), ("caught", "SigCgt")))


def _shards(collection: Path) -> set[str]:
    return {p.name for p in collection.glob("layer*.safetensors")}


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
    # An output is renamed into place whole: there is all of it or none.
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for file in compared:
        assert (out / file).read_bytes() == (reference / file).read_bytes(), file


@pytest.mark.parametrize("name", ["collect", "fit-codebook", "train-adapters", "diagnose"])
def test_interrupted_command_leaves_nothing_partial_and_reruns_to_the_same_bytes(name, acts, tiny_model_dir,
                                                                                 text_file, tmp_path):
    command = _command(name, acts, tiny_model_dir, text_file)
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    reference, out = tmp_path / "ref" / "out", tmp_path / "run" / "out"
    with Run.start(command.args, reference, tmp_path / "reference.log") as first:  # its bytes, units, their times
        assert first.finish() == 0, first.output()
    units = first.units()
    for seed, sig in SEEDS:
        rng = random.Random(seed)
        chosen = units[int((seed + rng.random()) / len(SEEDS) * len(units))]  # seed k: the k-th n-th of the units
        if name == "collect" and _shards(out) == _shards(reference):
            shutil.rmtree(out)  # every shard written (the manifest too, or not): no sample left to interrupt
        desc, n, total, seconds = chosen
        with Run.start(command.args, out, tmp_path / f"seed{seed}.log") as run:
            run.stop_at(desc, n, total)
            # A random point of that unit's work (as long as the reference's), or a little after, when the
            # command may already be waiting at a write.
            time.sleep(rng.uniform(0, 1.5 * seconds))
            state = (f"SIGINT in the command: {run.signal_state()}; in the test process: "
                     f"{_sigint_state('/proc/self/status')}")
            run.proc.send_signal(sig)
            code = run.finish()
        output = run.output()
        assert DONE not in output, (state, output)  # the signal interrupted the work (it cannot finish unread)
        assert "Traceback" not in output, output
        _check_nothing_half_written(name, out, reference, command.compared)
        if sig == signal.SIGINT:
            assert code == 130, output
            lines = messages(output)
            assert lines == ["kvcalib: interrupted"], output
            own = [p for p in _temporaries(tmp_path / "run") if p.name.startswith(f".tmp-{run.proc.pid}-")
                   or p.name == ".lock"]
            assert not own, own
        else:
            assert code == -signal.SIGKILL, output

    rerun = subprocess.run([sys.executable, "-m", "kvcalib.cli", *command.args, "--out", str(out)],
                           env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
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
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen([sys.executable, "-m", "kvcalib.cli", *args, "--out", str(out)], env=ENV,
                                 stdout=log, stderr=log, cwd=tmp_path)
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
