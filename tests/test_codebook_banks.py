"""benchmarks/codebook_banks.py, the CPU model of the codebook kernel's centroid gathers' bank conflicts: it gives
Nsight Compute's counts for the layout measured (before the copied books: 2.0 wavefronts a gather of TurboQuant-2's
keys, 4.9 of VecInfer d4b6's values), and the conflict-free count (one wavefront a 128 bytes a pass) for the copies
and lane rows the kernel holds and for books per position of single levels skewed by lane share; and
benchmarks/codebook_pairs.py's pairs named on the command line."""

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


def test_skewed_books_per_position_read_a_keys_shares_without_a_conflict(banks):
    """TurboQuant-4's books per position (16 entries of 2 bytes: single levels), held once as the kernel holds them
    now (`skewed`, launch.py `_skew_words`): a key's gather, four shares of 8 lanes, one wavefront whatever the codes
    (3.85 held once side by side, its shares in the same 8 banks); a value's, eight shares two to a bank, at most 2.
    Books of wider entries span the banks anyway: the skew leaves them as they were (TurboQuant-2's keys, 2.0)."""
    rng = random.Random(3)
    assert banks.gathers("skewed", "key", 128, 16, 1, 50, rng) == 1
    assert banks.gathers("held once", "key", 128, 16, 1, 50, rng) > 3.5
    assert 1 < banks.gathers("skewed", "value", 128, 16, 1, 50, rng) <= 2
    assert banks.gathers("skewed", "key", 64, 16, 2, 100, rng) == pytest.approx(2.0, abs=0.02)


def test_codebook_pairs_names_each_candidate_as_keys_and_values(tmp_path):
    """`codebook_pairs.py --pairs candidates`: each of `kvcalib plan`'s default candidates as a layer's keys and values,
    with the items of the plan holding that pair; KEY+VALUE,... names pairs; a pair without its `+` is refused."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(BENCHMARKS))
    try:
        import codebook_pairs

        from kvcalib.defaults import PLAN_CANDIDATES

        settings = {"k": [["kivi-2-g128", "turboquant-2"]], "v": [["turboquant-1", "turboquant-2"]], "residual": 128}
        pairs = codebook_pairs.named_pairs(settings, "candidates", tmp_path)
        assert [(k, v) for k, v, _, _ in pairs] == [(c, c) for c in PLAN_CANDIDATES]
        assert {k: n for k, _, n, _ in pairs}["turboquant-2"] == 1 and {k: n for k, _, n, _ in pairs}["kivi-2-g128"] == 0
        named = codebook_pairs.named_pairs(settings, "kivi-2-g128+turboquant-1", tmp_path)
        assert [(k, v, n) for k, v, n, _ in named] == [("kivi-2-g128", "turboquant-1", 1)]
        with pytest.raises(SystemExit):
            codebook_pairs.named_pairs(settings, "kivi-2-g128", tmp_path)
    finally:
        mp.undo()
