"""`collect`: record the Q/K/V activations the KV cache really holds, per layer, as safetensors shards.

Directory layout (all names fixed):

| file                                  | content                                                  |
|---------------------------------------|----------------------------------------------------------|
| `plan.json`                           | the settings and model fingerprint; written first        |
| `layer{i:03d}-chunk{c:04d}.safetensors` | `q` (S, Hq, m, d), `k`/`v` (S, Hkv, m, d) float16, `positions` (S, m) int32 |
| `manifest.json`                       | plan + token counts + sha256 of every shard and of each tensor in it; written last |

S is the number of samples in the chunk and m the number of token positions kept per sample (all
`seq_len` of them unless `max_tokens` caps the tokens stored per layer; then each sample keeps the
same seeded random subset of positions in every layer, in order). Samples run one at a time, each
layer's activations copied from the device straight into its chunk's buffers; a layer's shard is handed
to writer threads as soon as the chunk's last sample has passed that layer (`ShardWriter`: written
straight from those buffers, hashed as it is written), while the forward goes on. Host memory stays
bounded by one chunk (at most 1 GiB of activations, or one sample where a sample is larger:
`chunk_samples`) plus WRITE_AHEAD bytes being written, whatever the number of samples. The manifest holds each
shard's SHA-256 and each of its tensors' (`tensor_sha256`), so a reader of keys and values reads and
checks those bytes alone (`Activations.layer(i, names)`). Every shard is
written under a temporary name and renamed, so a file with a shard name is always complete;
re-running into the same directory with the same settings skips the chunks already written (after
checking each against the manifest of the earlier run, if it finished, so a damaged shard is
recorded again). `OUT/.lock` keeps a second `collect` out of a directory that one is writing.

Data-parallel (`torchrun --nproc-per-node N -m kvcalib collect ...`, `kvcalib.parallel`): rank 0 takes the
lock, checks or writes the plan and clears damaged shards; then each rank records every N-th chunk still
to do, on its own GPU; rank 0 writes the manifest once all have finished. A shard holds the same samples
whichever rank records it, so the directory is byte-identical to a one-process run's wherever one sample's
forward gives the same float16 activations in both (same device kind, same kernels, same thread count;
tests/test_parallel.py checks it with two CPU processes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import __version__
from .artifacts import check_format
from .atomic import atomic_path, ensure_writable_dir, exclusive, write_json
from .attention import AttentionOptions, intercept, mixed_attention
from .data import DEFAULT_DATASET, token_windows
from .errors import ActivationError, ArtifactError, SettingsError
from .models import (DEFAULT_MODEL, LoadedModel, attention_shape, check_seq_len, fingerprint, load_model,
                     sliding_windows)
from .parallel import barrier, on_rank0, placement, share, world
from .tensorfile import HEADER, check_finite, read_header, read_into, read_tensors, write_tensors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CollectConfig:
    dataset: str = DEFAULT_DATASET
    text_field: str = "text"
    num_samples: int = 16
    seq_len: int = 512
    seed: int = 0
    max_tokens: int | None = None  # per layer, over all samples
    chunk_size: int | None = None  # samples per shard; None: `chunk_samples` (host memory bound)

    def kept_per_sample(self) -> int:
        if self.max_tokens is None:
            return self.seq_len
        return min(self.seq_len, math.ceil(self.max_tokens / self.num_samples))


HOST_CHUNK_BYTES = 2**30  # a chunk of activations held in host memory before it is written, at most
MAX_CHUNK = 8


def chunk_samples(shape, kept: int) -> int:
    """Samples per chunk: as many as keep one chunk (every layer's Q, K, V in float16) within
    HOST_CHUNK_BYTES, at most MAX_CHUNK, at least one (a sample larger than the bound is written alone).
    The embedded model at 512 tokens: 8 (29 MiB a sample); an 8B model at 2048 tokens: 1 (768 MiB)."""
    per_sample = shape.num_layers * (shape.num_heads + 2 * shape.num_kv_heads) * kept * shape.head_dim * 2
    return max(1, min(MAX_CHUNK, HOST_CHUNK_BYTES // per_sample))


def shard_name(layer: int, chunk: int) -> str:
    return f"layer{layer:03d}-chunk{chunk:04d}.safetensors"


def _positions(config: CollectConfig, sample: int) -> torch.Tensor:
    keep = config.kept_per_sample()
    if keep == config.seq_len:
        return torch.arange(config.seq_len)
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + sample)
    return torch.randperm(config.seq_len, generator=gen)[:keep].sort().values


def tokens_per_second(bar: tqdm, tokens_per_unit: int) -> None:
    """Show the bar's rate in tokens/s (what calibration speed is counted in) beside its units/s, from the
    next refresh on (no refresh of its own)."""
    done, elapsed = bar.format_dict["n"] + 1, bar.format_dict["elapsed"]
    if elapsed > 0:
        bar.set_postfix_str(f"{done * tokens_per_unit / elapsed:.0f} tokens/s", refresh=False)


def shard_sums(path: Path) -> tuple[str, dict[str, str]]:
    """A shard's SHA-256 and its header's and tensors' (`kvcalib.tensorfile.write_tensors`'s hashes), read
    from the file in one pass."""
    with open(path, "rb") as f:
        entries, start = read_header(f, str(path), os.fstat(f.fileno()).st_size)
        f.seek(0)
        raw = memoryview(f.read())
    sums = {HEADER: hashlib.sha256(raw[:start]).hexdigest()}
    for name, (_dtype, _shape, begin, end) in entries.items():
        sums[name] = hashlib.sha256(raw[start + begin : start + end]).hexdigest()
    return hashlib.sha256(raw).hexdigest(), sums


WRITERS = 4  # threads writing and hashing shards (file writes and SHA-256 run outside the GIL)
WRITE_AHEAD = 2**29  # bytes of shards handed to the writers and not yet written, at most (beyond one shard)
READERS = 4  # threads reading and checking a layer's shards (`Activations.layer`), as many shards in flight


class ShardWriter:
    """Writes shards on threads while the caller goes on recording: `write` hands a shard over and returns,
    waiting first, while more than WRITE_AHEAD bytes are handed over and not yet written, for the oldest
    (so host memory holds at most that much beyond what is being recorded). Each shard goes through
    `atomic_path` (complete or absent); its hashes land in `sums`. An error in a write (a full disk) is
    raised by a later `write` or at exit."""

    def __init__(self, sums: dict[str, tuple[str, dict[str, str]]]):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.sums, self.pending, self.held = sums, deque(), 0
        self.pool = ThreadPoolExecutor(min(WRITERS, os.cpu_count() or 1))

    def _one(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            self.sums[path.name] = write_tensors(f, tensors)

    def _oldest(self) -> None:
        future, size = self.pending.popleft()
        self.held -= size
        future.result()

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        while self.pending and self.pending[0][0].done():
            self._oldest()  # written: raise its error, if any, now
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        while self.pending and self.held + size > WRITE_AHEAD:
            self._oldest()
        self.pending.append((self.pool.submit(self._one, path, tensors), size))
        self.held += size

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            while kind is None and self.pending:
                self._oldest()
        finally:
            for future, _ in self.pending:
                future.cancel()
            self.pool.shutdown(wait=True)


def collect(out: str | Path, model: str | LoadedModel = DEFAULT_MODEL, dataset: str = DEFAULT_DATASET,
            text_field: str = "text", num_samples: int = 16, seq_len: int = 512, seed: int = 0,
            max_tokens: int | None = None, chunk_size: int | None = None, trust_remote_code: bool = False,
            device: str | None = None, device_map: str | None = None,
            max_memory: dict[int | str, str] | None = None, dtype: str | None = None) -> Path:
    """Run calibration text through `model` and save post-RoPE Q/K/V per layer under `out`.

    One process at a time writes `out` (a lock file inside it); a run that fails or is interrupted
    before its first shard removes the directory it created, a later one leaves its shards to resume. Activations
    float16 cannot hold (infinite, NaN, or beyond its range: a collection stores float16) are refused at the layer
    that holds them (`ActivationError`), and the collection is removed whole: the same text would give them again."""
    config = CollectConfig(dataset, text_field, num_samples, seq_len, seed, max_tokens, chunk_size)
    if num_samples < 1 or (chunk_size is not None and chunk_size < 1) or (max_tokens is not None and max_tokens < 1):
        raise SettingsError("--num-samples, --max-tokens and the chunk size must be positive")
    out = ensure_writable_dir(out)
    rank, size = world()
    created = not out.exists()
    unstarted = False
    with contextlib.ExitStack() as lock:  # rank 0 holds the directory's lock for the whole group

        def take() -> None:
            out.mkdir(parents=True, exist_ok=True)
            lock.enter_context(exclusive(out, "a collection into"))

        on_rank0(take, rank, size)
        try:
            return _record(out, config, model, trust_remote_code, device, rank, size, device_map, max_memory, dtype)
        except ActivationError:  # the same text gives the same values again: nothing here is worth resuming
            unstarted = rank == 0 and created
            if rank == 0:
                for name in ("layer*.safetensors", ".tmp-*", ".sums-*.json", "plan.json", "manifest.json"):
                    for path in out.glob(name):
                        path.unlink(missing_ok=True)
            raise
        except BaseException:
            unstarted = rank == 0 and created and not any(out.glob("layer*.safetensors"))
            if unstarted:
                (out / "plan.json").unlink(missing_ok=True)
            raise
        finally:
            lock.close()
            if unstarted:
                with contextlib.suppress(OSError):  # not empty: another process has started in it since
                    out.rmdir()


def _overflow(layer: int, name: str, sample: int, x: torch.Tensor, config) -> str:
    """Why a layer's activations cannot be stored: infinite or NaN in the model's own dtype, or beyond float16's range
    (65504), which a collection stores."""
    part = {"q": "queries", "k": "keys", "v": "values"}[name]
    where = f"layer {layer}'s {part} (sample {sample})"
    if not bool(torch.isfinite(x).all()):
        return (f"{where} are infinite or NaN in the model's {str(x.dtype).removeprefix('torch.')}: the model overflows "
                "its dtype; load it in one with more range (--dtype bfloat16 or float32)")
    return (f"{where} exceed float16's range (largest {float(x.abs().max()):.4g}, float16 holds 65504), and a "
            f"collection stores float16: kvcalib cannot calibrate this {config.model_type} model's cache yet")


def _intact(path: Path, sha256: str | None) -> bool:
    """Whether a shard left by an earlier run is whole: its checksum in that run's manifest when there
    is one, else a valid safetensors file (a shard is renamed into place only once written)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return False
    if sha256 is not None:
        return hashlib.sha256(raw).hexdigest() == sha256
    try:
        read_tensors(raw, str(path))
    except ArtifactError:
        return False
    return True


def _earlier_checksums(out: Path) -> dict[str, str]:
    try:
        return json.loads((out / "manifest.json").read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _record(out: Path, config: CollectConfig, model: str | LoadedModel, trust_remote_code: bool,
            device: str | None, rank: int = 0, size: int = 1, device_map: str | None = None,
            max_memory: dict[int | str, str] | None = None, dtype: str | None = None) -> Path:
    lm = load_model(model, **placement(device, device_map, max_memory, size), dtype=dtype,
                    trust_remote_code=trust_remote_code)
    check_seq_len(lm.config, config.seq_len)
    windows = token_windows(lm.tokenizer, config.dataset, "calibration", config.num_samples, config.seq_len,
                            config.text_field)
    shape = attention_shape(lm.config)
    if config.chunk_size is None:  # recorded in the plan as resolved: a resumed run finds the same chunks
        config = replace(config, chunk_size=chunk_samples(shape, config.kept_per_sample()))
    num_samples, chunk_size = config.num_samples, config.chunk_size
    plan = {
        "format_version": FORMAT_VERSION,
        "kind": "activations",
        "tool_version": __version__,
        "model": lm.spec,
        "model_fingerprint": fingerprint(lm.model),
        "model_dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        "settings": asdict(config),
        "tokens_per_layer": num_samples * config.kept_per_sample(),
    }
    num_chunks = math.ceil(num_samples / chunk_size)

    def prepare() -> None:
        """The plan checked (or written), stale temporaries and damaged shards removed: once, by rank 0."""
        plan_path = out / "plan.json"
        if plan_path.exists():
            if json.loads(plan_path.read_text()) != plan:
                raise SettingsError(f"{out} holds a collection made with other settings or another model; use a new --out")
        else:
            write_json(plan_path, plan)
        for stale in [*out.glob(".tmp-*"), *out.glob(".sums-*.json")]:  # an earlier run's temporaries
            stale.unlink()
        earlier = _earlier_checksums(out)
        for i in range(shape.num_layers):
            for c in range(num_chunks):
                path = out / shard_name(i, c)
                if path.exists() and not _intact(path, earlier.get(path.name)):
                    log.warning("%s is damaged; recording it again", path)
                    path.unlink()

    on_rank0(prepare, rank, size)
    todo = [c for c in range(num_chunks)
            if not all((out / shard_name(i, c)).exists() for i in range(shape.num_layers))]
    todo = share(todo, rank, size)  # data-parallel: each rank its own chunks (`kvcalib.parallel`)
    on = next(lm.model.parameters()).device
    bar = tqdm(total=sum(min(chunk_size, num_samples - c * chunk_size) for c in todo), unit="sample",
               desc="collect" if size == 1 else f"collect, rank {rank} of {size}", position=rank)
    sums: dict[str, tuple[str, dict[str, str]]] = {}  # shard -> its hashes, for the shards this process writes
    try:
        with ShardWriter(sums) as writer:
            for chunk in todo:
                samples = range(chunk * chunk_size, min((chunk + 1) * chunk_size, num_samples))
                positions = [_positions(config, s) for s in samples]
                pos_tensor = torch.stack(positions).to(torch.int32)
                store: dict[int, dict[str, torch.Tensor]] = {}  # a layer's buffers, from its first sample to its write
                for j, (s, pos) in enumerate(zip(samples, positions)):
                    def record(layer: int, q, k, v, opts: AttentionOptions, j=j, pos=pos, last=j == len(samples) - 1):
                        if layer not in store:  # filled in place as each sample runs: the device-to-host copy is the only one
                            store[layer] = {name: torch.empty(len(samples), x.shape[1], len(pos), x.shape[-1],
                                                              dtype=torch.float16) for name, x in (("q", q), ("k", k), ("v", v))}
                        for name, x in (("q", q), ("k", k), ("v", v)):
                            store[layer][name][j].copy_(x[0, :, pos.to(x.device), :].half())
                            if not bool(torch.isfinite(store[layer][name][j]).all()):
                                raise ActivationError(_overflow(layer, name, s, x, lm.config))
                        if last:  # the layer's shard is complete: written while the forward goes on
                            tensors, path = store.pop(layer), out / shard_name(layer, chunk)
                            if not path.exists():
                                writer.write(path, {**tensors, "positions": pos_tensor})
                        return mixed_attention(q, k, v, opts)

                    with torch.no_grad(), intercept(lm.model, record):
                        lm.model(windows[s : s + 1].to(on), use_cache=False)
                    tokens_per_second(bar, config.seq_len)
                    bar.update(1)
    finally:  # the bar ends its line before any error is printed
        bar.close()
    if rank:  # the hashes this rank took, for rank 0's manifest (else it reads these shards back)
        write_json(out / f".sums-{rank}.json", sums)

    def finish() -> None:
        """The manifest over every rank's shards, written by rank 0 once all have written theirs: the hashes
        each rank took while writing (the other ranks' from their `.sums-RANK.json`), an earlier run's shards'
        read from the files."""
        manifest = dict(plan)
        manifest["num_chunks"] = num_chunks
        # the layers that slide over a window, and their windows (`models.sliding_windows`): what diagnose and plan
        # treat as no items unless asked
        manifest["sliding_windows"] = {str(i): w for i, w in sliding_windows(lm.config).items()}
        names = [shard_name(i, c) for i in range(shape.num_layers) for c in range(num_chunks)]
        taken = dict(sums)
        for other in sorted(out.glob(".sums-*.json")):  # the other ranks' (`size` > 1)
            taken.update({name: tuple(pair) for name, pair in json.loads(other.read_text()).items()})
        known = {name: taken[name] if name in taken else shard_sums(out / name) for name in names}
        manifest["shards"] = {name: known[name][0] for name in names}
        manifest["tensor_sha256"] = {name: known[name][1] for name in names}
        write_json(out / "manifest.json", manifest)
        for other in out.glob(".sums-*.json"):
            other.unlink()

    barrier(size)
    on_rank0(finish, rank, size)
    return out


class Activations:
    """A finished collection: `layer(i)` returns {"q", "k", "v", "positions"} over all samples."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / "manifest.json"
        if not path.exists():
            raise ArtifactError(
                f"{self.directory} is not a finished activation collection (no manifest.json); "
                "run `kvcalib collect` into it (it resumes)"
            )
        try:
            self.manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{path} is corrupted ({err}); run `kvcalib collect` into {self.directory} again "
                                "with the same settings (it checks and keeps the intact shards)") from err
        check_format(self.manifest, "activations", FORMAT_VERSION, f"collection {self.directory}")

    @property
    def num_layers(self) -> int:
        return self.manifest["model_fingerprint"]["num_layers"]

    @property
    def fingerprint(self) -> dict:
        return self.manifest["model_fingerprint"]

    @property
    def sliding_windows(self) -> dict[int, int]:
        """The model's layers that slide over a window, with their windows (none recorded by an older collection)."""
        return {int(i): w for i, w in self.manifest.get("sliding_windows", {}).items()}

    @property
    def full_sequences(self) -> bool:
        settings = self.manifest["settings"]
        return settings["max_tokens"] is None or settings["max_tokens"] >= settings["num_samples"] * settings["seq_len"]

    def layers(self, indices: list[int], names: tuple[str, ...] | None = None, device=None,
               samples: int | None = None):
        """Yield (i, `layer(i, ...)`) for each of `indices` in order, the next layer read ahead on a thread
        while the caller works on this one: reading and checking shards (file reads, SHA-256, both outside
        the GIL) overlaps the caller's k-means or training. Two layers are held at a time. An error in a
        layer read ahead is raised when that layer is reached, as if it had been read then."""
        from concurrent.futures import ThreadPoolExecutor

        if not indices:
            return
        with ThreadPoolExecutor(1) as pool:
            read = lambda i: pool.submit(self.layer, i, names, device, samples)  # noqa: E731
            ahead = read(indices[0])
            for position, i in enumerate(indices):
                data = ahead.result()
                ahead = read(indices[position + 1]) if position + 1 < len(indices) else None
                yield i, data
                del data

    def layer(self, i: int, names: tuple[str, ...] | None = None, device=None,
              samples: int | None = None) -> dict[str, torch.Tensor]:
        """Layer i over its first `samples` samples (default all; only the shards holding them are read):
        `names` of q, k, v, positions (default all), on `device` (default the CPU). The first shard is read
        alone (it gives the shapes); the others on READERS threads, each read, checked and copied into the
        result (read straight into it where the result is on the CPU) in order, at most READERS in flight:
        the host holds the result (none of it with a `device` other than the CPU) and at most READERS
        shards (a chunk is at most about 1 GiB over every layer: `chunk_samples`), never every shard and
        their concatenation."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        if not 0 <= i < self.num_layers:
            raise ArtifactError(f"layer {i} is not in {self.directory} ({self.num_layers} layers)")
        settings = self.manifest["settings"]
        total = settings["num_samples"] if samples is None else min(samples, settings["num_samples"])
        per_tensor = self.manifest.get("tensor_sha256", {})
        num_chunks = self.manifest["num_chunks"]
        out: dict[str, torch.Tensor] = {}

        def read(c: int, start: int, chunk: int | None) -> dict[str, torch.Tensor]:
            path = self.directory / shard_name(i, c)
            # every shard but the last holds a whole chunk (the first read says how many: `chunk` None)
            rows = chunk if c < num_chunks - 1 else None
            part = self._read_shard(path, per_tensor.get(path.name), names, out, start, total, rows)
            check_finite(part, f"activation shard {path}")
            if rows is not None and _rows(part) != rows:
                raise ArtifactError(f"activation shard {path} holds {_rows(part)} samples where its chunk holds {rows}; "
                                    f"run `kvcalib collect` into {self.directory} again")
            return part

        done = 0

        def place(part: dict[str, torch.Tensor]) -> None:
            nonlocal done
            n = _rows(part)
            if samples is not None:
                n = min(n, total - done)  # the last shard read may hold samples past the first `samples`
            if done + n > total:
                raise ArtifactError(f"{self.directory}: layer {i}'s shards hold more samples than its manifest says; "
                                    "run `kvcalib collect` into it again")
            for key, t in out.items():
                if part[key].data_ptr() != t[done:].data_ptr():  # not already read in place
                    t[done : done + n].copy_(part[key][:n])
            done += n

        first = read(0, 0, None)
        chunk = _rows(first)  # every shard but the last holds a whole chunk
        out.update({key: torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=device)
                    for key, t in first.items() if names is None or key in names})
        place(first)
        del first
        wanted = num_chunks if samples is None else min(num_chunks, -(-total // chunk))
        with ThreadPoolExecutor(READERS) as pool:
            pending, c = deque(), 1
            while c < wanted or pending:
                while c < wanted and len(pending) < READERS:
                    pending.append(pool.submit(read, c, c * chunk, chunk))
                    c += 1
                place(pending.popleft().result())
        if done != total:
            raise ArtifactError(f"{self.directory}: layer {i}'s shards hold {done} samples, its manifest says "
                                f"{settings['num_samples']}; run `kvcalib collect` into it again")
        return out

    def _read_shard(self, path: Path, sums: dict[str, str] | None, names, out: dict[str, torch.Tensor], done: int,
                    total: int, rows: int | None = None) -> dict[str, torch.Tensor]:
        """One shard's tensors, checked: with per-tensor hashes (`sums`) only those `names` asks for, else the
        whole file (a collection made before per-tensor hashes). Each holds the same number of samples, at
        least one (so a header cannot size the result past what the files hold)."""
        try:
            part = self._read_tensors(path, sums, names, out, done, total, rows) if sums else self._read_whole(path)
        except OSError as err:
            raise ArtifactError(f"activation shard {path} is missing: {err.strerror}") from err
        except ArtifactError as err:
            raise ArtifactError(f"{err}; run `kvcalib collect` into {self.directory} again with the same settings: "
                                "it records that shard anew") from None
        counts = {t.shape[0] if t.dim() else 0 for t in part.values()}
        if len(counts) != 1 or 0 in counts:
            raise ArtifactError(f"activation shard {path} is corrupted: its tensors hold {sorted(counts)} samples; run "
                                f"`kvcalib collect` into {self.directory} again with the same settings")
        return part

    def _read_whole(self, path: Path) -> dict[str, torch.Tensor]:
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != self.manifest["shards"][path.name]:
            raise ArtifactError(f"activation shard {path} is corrupted (checksum mismatch)")  # `_read_shard` adds the remedy
        return read_tensors(raw, f"activation shard {path}")

    def _read_tensors(self, path: Path, sums: dict[str, str], names, out: dict[str, torch.Tensor], done: int,
                      total: int, rows: int | None) -> dict[str, torch.Tensor]:
        """The tensors of one shard that `names` asks for (all by default), each read and checked against its
        own hash and nothing else read: in place into `out` (rows `done` on) where it is a CPU result the whole
        shard fits and the shard holds the `rows` expected (None: any), else into a buffer of its own."""
        what = f"activation shard {path}"
        with open(path, "rb") as f:
            entries, start = read_header(f, what, os.fstat(f.fileno()).st_size, sums.get(HEADER))
            if set(entries) != set(sums) - {HEADER}:
                raise ArtifactError(f"{what} is corrupted: it holds {sorted(entries)}, its manifest {sorted(set(sums) - {HEADER})}")
            part = {}
            for key, entry in entries.items():
                if names is not None and key not in names:
                    continue
                dtype, shape = entry[0], entry[1]
                dest = out.get(key)
                if (dest is not None and dest.device.type == "cpu" and dest.dtype == dtype and len(shape)
                        and tuple(dest.shape[1:]) == shape[1:] and done + shape[0] <= total
                        and (rows is None or shape[0] == rows)):
                    buf = dest[done : done + shape[0]]
                else:
                    buf = torch.empty(shape, dtype=dtype)
                read_into(f, start, entry, buf, what, sums[key])
                part[key] = buf
        if not part:
            raise ArtifactError(f"{what} holds none of {sorted(names) if names else 'its manifest tensors'}")
        return part


def _rows(part: dict[str, torch.Tensor]) -> int:
    """Samples a shard's tensors hold (`Activations._read_shard` has checked they agree)."""
    return next(iter(part.values())).shape[0]
