"""Activation shards in and out of host memory: collect's write path and the readers', without a model.

The calibration pipeline moves every activation through the host twice or more: `collect` writes 393 kB a token
for an 8B model (Q of 32 heads, K and V of 8, float16, 32 layers), and fit-codebook, train-adapters and
diagnose each read them back, checked. On the H100 collect took 214 s for 51.5 GB with the work directory
in memory (RESULTS.md): the host's copies and hashes, not the GPU nor the disk. This times those paths
alone, on synthetic shards of an 8B layer's shape (one sample of 2048 tokens a shard, as `chunk_samples`
gives there), in a directory in memory (/dev/shm where there is one):

- write, before: each shard stacked, serialized (`safetensors.save`), written, then read again and hashed
  for the manifest (collect before the per-tensor hashes);
- write, now: `collect.ShardWriter` (threads; `tensorfile.write_tensors` from the buffers, hashing the
  file and each tensor while writing);
- read, before: a layer as `Activations.layer` read it before (each file whole, hashed, parsed by
  safetensors, isfinite on every float, copied into the result; one shard at a time);
- read, now: `Activations.layer(i)` (shards on `READERS` threads, the finiteness test on the floats' bits),
  of a collection with only files' hashes (every byte read and hashed, parsed by safetensors) and with
  per-tensor hashes (read in place, each tensor hashed), all tensors and keys and values only (what
  fit-codebook reads).

    python benchmarks/shard_io.py [--layers 4] [--samples 8] [--dir /dev/shm/kvcalib-shard-io]

MB/s counts the bytes of the tensors a path hands over (a reader of keys and values: theirs only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save

from kvcalib.atomic import atomic_path
from kvcalib.collect import Activations, ShardWriter, shard_name
from results import publish

HEADS = {"q": 32, "k": 8, "v": 8}  # Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim 128
TOKENS, HEAD_DIM = 2048, 128


def shards(layers: int, samples: int) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    pos = torch.arange(TOKENS, dtype=torch.int32)[None]
    return {shard_name(i, c): {**{n: torch.randn(1, h, TOKENS, HEAD_DIM).half() for n, h in HEADS.items()},
                               "positions": pos} for i in range(layers) for c in range(samples)}


def write_before(directory: Path, data) -> dict[str, str]:
    for name, tensors in data.items():
        stacked = {k: torch.stack([t[0]]) for k, t in tensors.items()}  # collect stacked each chunk's samples
        with atomic_path(directory / name) as tmp:
            tmp.write_bytes(save(stacked))
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in data}


def write_now(directory: Path, data) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    sums: dict = {}
    with ShardWriter(sums) as writer:
        for name, tensors in data.items():
            writer.write(directory / name, tensors)
    return {n: s[0] for n, s in sums.items()}, {n: s[1] for n, s in sums.items()}


def read_before(directory: Path, layer: int, samples: int) -> dict[str, torch.Tensor]:
    """A layer as `Activations.layer` read it before per-tensor hashes: each file whole, hashed, parsed by
    safetensors (a copy), every float checked by isfinite, copied into the result, one shard at a time."""
    from kvcalib.tensorfile import read_tensors

    out: dict[str, torch.Tensor] = {}
    for c in range(samples):
        raw = (directory / shard_name(layer, c)).read_bytes()
        hashlib.sha256(raw).hexdigest()
        part = read_tensors(raw, "shard")
        del raw
        assert all(torch.isfinite(t).all() for t in part.values() if t.is_floating_point())
        if not out:
            out = {k: torch.empty((samples, *t.shape[1:]), dtype=t.dtype) for k, t in part.items()}
        for k, t in out.items():
            t[c : c + 1].copy_(part[k])
    return out


def manifest(directory: Path, layers: int, samples: int, files: dict, tensors: dict | None) -> None:
    m = {"format_version": 1, "kind": "activations", "model": "synthetic", "num_chunks": samples, "shards": files,
         "settings": {"num_samples": samples, "seq_len": TOKENS, "max_tokens": None, "chunk_size": 1},
         "model_fingerprint": {"num_layers": layers}}
    if tensors is not None:
        m["tensor_sha256"] = tensors
    (directory / "manifest.json").write_text(json.dumps(m))


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--dir", default="/dev/shm/kvcalib-shard-io" if Path("/dev/shm").is_dir() else "runs/shard-io")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        data = shards(args.layers, args.samples)
        total = sum(t.numel() * t.element_size() for ts in data.values() for t in ts.values())
        kv = sum(ts[n].numel() * 2 + (ts["positions"].numel() * 4 if n == "k" else 0)
                 for ts in data.values() for n in ("k", "v"))
        rows = []

        def row(path: str, seconds: float, nbytes: int) -> None:
            rows.append(f"| {path} | {nbytes / 1e6:.0f} | {seconds:.2f} | {nbytes / 1e6 / seconds:.0f} |")

        row("write, before (stack, save, write; re-read and hash for the manifest)",
            timed(lambda: write_before(directory, data)), total)
        hashes = []
        row("write, now (ShardWriter: threads, from the buffers, hashed while written)",
            timed(lambda: hashes.append(write_now(directory, data))), total)
        files, tensors = hashes[-1]
        layer_total = total // args.layers
        layer_kv = kv // args.layers
        row("read a layer, before (whole files, safetensors' parse, isfinite, one shard at a time)",
            timed(lambda: read_before(directory, 0, args.samples)), layer_total)
        manifest(directory, args.layers, args.samples, files, None)
        row("read a layer, now, whole files (a collection with only files' hashes)",
            timed(lambda: Activations(directory).layer(0)), layer_total)
        manifest(directory, args.layers, args.samples, files, tensors)
        row("read a layer, now, per tensor: q, k, v, positions", timed(lambda: Activations(directory).layer(0)), layer_total)
        row("read a layer, now, per tensor: k, v, positions (fit-codebook)",
            timed(lambda: Activations(directory).layer(0, ("k", "v", "positions"))), layer_kv)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    table = "\n".join(["| path | MB | seconds (best of 3) | MB/s |",
                       "|---|---:|---:|---:|", *rows])
    title = (f"Activation shard I/O, {os.cpu_count()} CPU cores, {args.layers} layers x {args.samples} shards of "
             f"an 8B layer's sample ({TOKENS} tokens), in {directory.parent}")
    publish(title, table, sys.argv, not args.no_record)


if __name__ == "__main__":
    main()
