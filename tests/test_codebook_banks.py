"""benchmarks/codebook_banks.py, the CPU model of the codebook kernel's centroid gathers' bank conflicts: it gives
Nsight Compute's counts for the layout measured (before the copied books: 2.0 wavefronts a gather of TurboQuant-2's
keys, 4.9 of VecInfer d4b6's values), and the conflict-free count (one wavefront a 128 bytes a pass) for the copies
the kernel holds and for the per-position layout it does not yet."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def banks():
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(BENCHMARKS))  # it imports codebook_pairs.py and generate_calls.py beside it
    spec = importlib.util.spec_from_file_location("bench_codebook_banks", BENCHMARKS / "codebook_banks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    mp.undo()


def test_the_model_gives_nsight_computes_counts_for_the_book_held_once(banks):
    """TurboQuant-2's keys (pairs of 2-bit codes, a book of 16 entries of 4 bytes per position, 64 positions) and
    VecInfer d4b6's values (one book of 64 entries of 8 bytes): 2.0 and 4.9 as Nsight Compute counted them. The
    values' count is a mean over random codes: 400 tiles of 64 gathers hold it within 0.1 (its spread over seeds
    here is under 0.03)."""
    rng = random.Random(1)
    assert banks.gathers("held once", "key", 64, 16, 2, 100, rng) == pytest.approx(2.0, abs=0.02)
    assert banks.gathers("held once", "value", 1, 64, 4, 400, rng) == pytest.approx(4.9, abs=0.1)


@pytest.mark.parametrize("dim", [2, 4, 8])
def test_copies_and_lane_rows_read_every_pass_without_a_conflict(banks, dim):
    """A 4-, 8- or 16-byte gather by 32 lanes is served in passes of 32, 16 or 8 lanes, each one wavefront where no
    two lanes of a pass share a bank: 1, 2 or 4 wavefronts. The copies of a shared book (lane L's copy L % (128 /
    bytes), as the kernel reads them) and the lane rows of books per position meet no conflict whatever the codes."""
    rng = random.Random(2)
    ideal = {2: 1, 4: 2, 8: 4}[dim]
    for part in ("key", "value"):
        assert banks.gathers("copies", part, 1, 256, dim, 20, rng) == ideal
        assert banks.gathers("lane rows", part, 128 // dim, 16, dim, 20, rng) == ideal
        assert banks.gathers("held once", part, 1, 256, dim, 20, rng) > ideal  # random entries of one copy conflict
