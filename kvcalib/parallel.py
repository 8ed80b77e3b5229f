"""Data-parallel runs of the calibration commands: one process per GPU (or per CPU share) under
`torchrun`, each taking its share of the work, rank 0 alone deciding and writing what is shared.

    torchrun --nproc-per-node 2 -m kvcalib collect --model DIR --out runs/acts ...

What splits how: `collect` records each rank's share of the calibration chunks (shards are per layer and
chunk); `train-adapters` and `fit-codebook` fit each rank's share of the layers (a layer's fit reads only
that layer), gather the results, and rank 0 writes the one artifact; `eval` scores each rank's share of
the windows and adds them up in window order. Each gives, byte for byte, what one process gives where a
sample's (or layer's) computation does on both (tests/test_parallel.py).

A command finds itself in such a group from the variables `torchrun` sets (`WORLD_SIZE`, `RANK`,
`LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and joins it on first use: NCCL where the process has a
GPU, gloo otherwise. Outside `torchrun` every function here is the one-process case (rank 0 of 1) and
touches nothing of `torch.distributed`. Under torchrun each rank takes its share of the host's CPU cores
(`rank_threads`) unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from .errors import SettingsError
from .devices import check_spread, resolve_device

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, size) of the group this process runs in, joining it on first use; (0, 1) alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        if threads := rank_threads(os.environ, len(os.sched_getaffinity(0))):
            torch.set_num_threads(threads)
        # before the communicator exists: NCCL's support for mixing captured and eager collectives slows both, and
        # here they never run at once (a tensor-parallel decode step's captured all-reduces; transformers' advice)
        os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
        if torch.cuda.is_available():  # NCCL's collectives run on the process's own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl")
        else:
            dist.init_process_group(backend="gloo")
        atexit.register(_leave)
    return dist.get_rank(), dist.get_world_size()


def rank_threads(env, cores: int) -> int | None:
    """The CPU threads a rank takes where torchrun chose them: torchrun gives every rank one thread
    (OMP_NUM_THREADS=1, set where the caller set none), which starves the ranks' host-side work (reading
    shards, the statistics diagnose computes beside the GPU's: on two H200s, diagnose of an 8B collection
    took 40.1 s with one thread a rank, 32.0 s with a share of the cores each); a rank takes its share of
    the cores instead. None (torch's choice stands) outside torchrun or where OMP_NUM_THREADS is other
    than 1 (a caller's own 1 reads as torchrun's)."""
    if "LOCAL_WORLD_SIZE" not in env or env.get("OMP_NUM_THREADS") != "1":
        return None
    return max(1, cores // max(1, int(env["LOCAL_WORLD_SIZE"])))


def _leave() -> None:
    """Leave the group before the interpreter ends (a group left to the exit handlers can abort it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: str) -> str:
    """The device of this process: under torchrun a CUDA `device` (`cuda`, `auto` on a GPU machine)
    becomes the process's own GPU, `cuda:LOCAL_RANK`; an explicit `cuda:N` is refused there (every
    rank would share GPU N)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not device.startswith("cuda"):
        return device
    if device != "cuda":
        raise SettingsError(f"--device {device} under torchrun: each process takes its own GPU (cuda:LOCAL_RANK); "
                            "give --device cuda or auto")
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def placement(device: str | None, device_map: str | None, max_memory: dict | None, size: int) -> dict:
    """`load_model`'s placement arguments for this process: its own GPU under torchrun (`local_device`),
    or the model spread over every GPU with `--device-map auto` (one process: not under torchrun). A placement
    given twice is refused here, before the command reads or writes anything."""
    check_spread(device, device_map)
    if device_map == "auto":
        if size > 1:
            raise SettingsError("--device-map auto spreads one model over every GPU of one process; under torchrun each "
                                "process takes its own GPU: give one or the other")
        return {"device": device, "device_map": "auto", "max_memory": max_memory}
    if max_memory is not None:
        raise SettingsError("--max-memory applies to --device-map auto only")
    return {"device": local_device(resolve_device(device))}


def share(items: list[T], rank: int, size: int) -> list[T]:
    """Rank `rank`'s items: every `size`-th from its own index, so the shares differ by at most one."""
    return items[rank::size]


def on_rank0(step: Callable[[], T], rank: int, size: int) -> T | None:
    """Run `step` on rank 0 alone and let every rank go on only once it has ended. An error on rank 0
    reaches every rank: each raises it as a SettingsError with rank 0's message (rather than waiting at
    the next barrier for a rank that has stopped)."""
    if size == 1:
        return step()
    import torch.distributed as dist

    result, error = None, None
    if rank == 0:
        try:
            result = step()
        except Exception as exc:  # sent to the other ranks, then raised here as it was
            error = exc
    box = [None if error is None else str(error)]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise SettingsError(f"rank 0 stopped: {box[0]}")
    return result


def merged(part: dict, size: int) -> dict:
    """Every rank's `part` (a dict of picklable results, e.g. per layer) merged into one, on every rank."""
    if size == 1:
        return part
    import torch.distributed as dist

    parts: list[dict | None] = [None] * size
    dist.all_gather_object(parts, part)
    whole: dict = {}
    for p in parts:
        whole |= p
    return whole


def barrier(size: int) -> None:
    """Wait for every rank (nothing alone)."""
    if size > 1:
        import torch.distributed as dist

        dist.barrier()
