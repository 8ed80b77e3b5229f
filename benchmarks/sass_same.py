"""Whether a change to the decode kernels' source changes the machine code: each kernel file compiled by nvcc
for sm_90 (and the cp.async loader also for sm_80) under the runtime's configurations, at a git revision and
in the working tree, and every section of the two cubins compared byte for byte (`.text.<kernel>` is the
SASS; `.nv.info` holds the registers and `.nv.info.<kernel>` the parameters; `.nv.shared.<kernel>` its shared
memory). Equal
sections mean an equal kernel from this nvcc: the same speed without a GPU to time it. The runtime compiles
through CuPy's NVRTC; this compares nvcc's output only. Needs nvcc, not a GPU.

    python benchmarks/sass_same.py [--rev HEAD] [--files int2_decode.cu,vq_decode.cu] [--jobs 2]

The configurations are the runtime's define sets (kvcalib/formats/int2/launch.py, formats/vq/launch.py's `plan`):
INT2 at head_dim 64 and 128, key and value groups the methods use, 1 to 8 query heads per KV head, with and
without key norms and rotations; VecInfer at both head dims, three codebook shapes, 1 to 8 query heads,
with and without replicated books, code rows for the bulk copies and for cp.async, bfloat16 queries too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import os
import math
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ["-std=c++17", "--use_fast_math"]  # kernels_cupy/loader.py's


def int2_sets() -> list[tuple[str, dict]]:
    sets = []
    for d in (64, 128):
        for g, gv in ((32, 128), (128, 128), (16, 16), (64, 64), (32, 32)):
            if gv > d:
                continue
            for gq in (1, 3, 4, 8):
                for norm, rk, rv in ((0, 0, 0), (1, 1, 1), (0, 0, 1)):
                    base = dict(D=d, G=g, GV=gv, GQ=gq, HAS_NORM=norm, ROT_K=rk, ROT_V=rv, BLOCKS_PER_SM=4,
                                SPLIT_UNIT=128 * g // math.gcd(128, g), QT="__half")
                    sets.append(("sm_90", {**base, "CP_ASYNC_LOADER": 0}))
                    if gq == 4:
                        sets.append(("sm_90", {**base, "CP_ASYNC_LOADER": 1}))
                        sets.append(("sm_80", {**base, "CP_ASYNC_LOADER": 1}))
    return sets


def vq_sets() -> list[tuple[str, dict]]:
    """Code rows in 16-byte units (`formats.vq.launch._unit`: the bulk-copy rows, BULK_ROWS, and books staged in the
    ring where replicated) and in 4-byte ones (cp.async), float16 and bfloat16 queries."""
    sets = []
    for d in (64, 128):
        for nk, mk, nv, mv in ((4, 8, 4, 8), (8, 12, 4, 8), (2, 8, 8, 12)):
            for gq in (1, 3, 4, 8):
                for krepl, vrepl in ((1, 1), (128 // (2 * nk), 128 // (2 * nv))):
                    for vunit, qt in ((16, "__half"), (4, "__half"), (16, "__nv_bfloat16")):
                        if qt != "__half" and gq != 4:
                            continue
                        rk, rv = -(-d // nk * mk // 8), -(-d // nv * mv // 8)
                        sets.append(("sm_90", dict(D=d, NK=nk, MK=mk, RK=rk, NV=nv, MV=mv, RV=rv, GQ=gq, QT=qt,
                                                   HADAMARD=1, WARPS=8, TILES=4, NSTAGE=3, BLOCKS_PER_SM=1, KUNIT=16,
                                                   VUNIT=vunit, KREPL=krepl, VREPL=vrepl)))
    return sets


SETS = {"int2_decode.cu": int2_sets, "vq_decode.cu": vq_sets}


def source_of(files: dict[str, str], filename: str, seen: set | None = None) -> str:
    """The loader's `source_of` over a {name: text} snapshot of the kernels (`snapshot`)."""
    seen = set() if seen is None else seen
    if filename in seen:
        return ""
    seen.add(filename)
    return "".join(source_of(files, line.split('"')[1], seen) if line.startswith('#include "') else line
                   for line in files[filename].splitlines(keepends=True))


def sections(cubin: bytes) -> dict[str, bytes | int]:
    """An ELF64 file's sections by name: their bytes, or the size of one that holds none (NOBITS)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = cubin[headers[shstrndx][4]:headers[shstrndx][4] + headers[shstrndx][5]]
    out: dict[str, bytes | int] = {}
    for name_at, kind, _, _, offset, size, *_ in headers:
        name = names[name_at:names.index(b"\0", name_at)].decode()
        out[name] = size if kind == 8 else cubin[offset:offset + size]
    return out


CACHE = ROOT / "runs" / "sass-cache"  # cubins by the hash of what nvcc was given: the revision's side compiles once


def compiled(code: str, arch: str) -> dict[str, bytes | int]:
    key = hashlib.sha256("\0".join([code, arch, *OPTIONS, nvcc_version()]).encode()).hexdigest()
    kept = CACHE / f"{key}.cubin"
    if kept.exists():
        return sections(kept.read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.cu")
        src.write_text(code)
        run = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", *OPTIONS, "-o", f"{tmp}/k.cubin", str(src)],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(run.stderr[-2000:])
        cubin = Path(tmp, "k.cubin").read_bytes()
    CACHE.mkdir(parents=True, exist_ok=True)
    part = kept.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
    part.write_bytes(cubin)
    part.replace(kept)  # whole or absent: two runs may share the folder
    return sections(cubin)


@functools.cache
def nvcc_version() -> str:
    return subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout


def snapshot(rev: str | None) -> dict[str, str]:
    """The kernels' .cu and .cuh files by name (kernels_cupy/'s shared ones and each format's own) at `rev` (None: the
    working tree); at a rev, each name where it lay then (the formats' kernels lived in kernels_cupy/ before)."""
    here = {p.name: p for p in [*(ROOT / "kernels_cupy").iterdir(), *(ROOT / "kvcalib" / "formats").glob("*/*.cu")]
            if p.suffix in (".cu", ".cuh")}
    if rev is None:
        return {n: p.read_text() for n, p in here.items()}
    out = {}
    for n, p in here.items():
        for where in (p.relative_to(ROOT).as_posix(), f"kernels_cupy/{n}"):  # where it lies now, or lay then
            if subprocess.run(["git", "cat-file", "-e", f"{rev}:{where}"], cwd=ROOT,
                              stderr=subprocess.DEVNULL).returncode == 0:
                out[n] = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout
                break
    return out


def compare(old: dict, new: dict, filename: str, arch: str, defines: dict) -> list[str]:
    """The names of the sections that differ (notes aside) between the two snapshots' builds of one set."""
    head = "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items()))
    a, b = (compiled(head + source_of(files, filename), arch) for files in (old, new))
    return sorted(n for n in set(a) | set(b) if not n.startswith(".note") and a.get(n) != b.get(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the revision the working tree is compared with")
    parser.add_argument("--files", default=",".join(SETS))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    old, new = snapshot(args.rev), snapshot(None)
    lines = [f"kernels at {args.rev} against the working tree, nvcc {OPTIONS}", "",
             "| file | configurations | identical cubins | differing (sections) |", "|---|---:|---:|---|"]
    failed = False
    for filename in args.files.split(","):
        sets = SETS[filename]()
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            diffs = list(pool.map(lambda s: compare(old, new, filename, *s), sets))
        bad = [(arch, d, diff) for (arch, d), diff in zip(sets, diffs) if diff]
        failed |= bool(bad)
        lines.append(f"| {filename} | {len(sets)} | {len(sets) - len(bad)} | "
                     + ("; ".join(f"{arch} {d}: {', '.join(diff)}" for arch, d, diff in bad[:3]) or "none") + " |")
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
