"""The same inputs and seed give byte-identical artifacts: every fitting command, run twice, writes
the same `manifest.json` and `tensors.safetensors`; wall-clock figures go to `run.json` apart."""

import json

import pytest

from kvcalib.artifacts import MANIFEST, RUN, TENSORS
from kvcalib.collect import collect


@pytest.fixture(scope="module")
def acts(tmp_path_factory, tiny_lm, text_file):
    return collect(tmp_path_factory.mktemp("acts") / "acts", tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


def _fit_codebook(acts, out, lm):
    pytest.importorskip("faiss", reason="fit-codebook needs faiss (pip install kvcalib[cpu])")
    from kvcalib.methods.vecinfer_fit import fit_codebook

    return fit_codebook(acts, out, k_config="d4b6", v_config="d2b5", iters=5, max_points_per_centroid=64)


def _train_adapters(acts, out, lm):
    from kvcalib.methods.kvlinc_fit import train_adapters

    return train_adapters(acts, out, rank=16, steps=10, group_size=8, residual=16, tokens=48)


def _fit_turboquant(acts, out, lm):
    from kvcalib.methods.turboquant_fit import fit_turboquant

    return fit_turboquant(acts, out, bits=2, iters=5)


def _plan(acts, out, lm):
    from kvcalib.methods.plan_fit import make_plan

    pytest.importorskip("faiss", reason="vector codebooks need faiss (pip install kvcalib[cpu])")
    # Budget 2.0 at head_dim 16: the vector schemes (1 bit + a 1-bit norm share, 1 bit) are chosen, so
    # their k-means codebooks and λ are among the bytes compared (keys may take them too: not the default).
    candidates = ("turboquant-1", "turboquant-2", "turboquant-3", "kivi-4-g16", "oscar-2-g8", "turboquant-d4b4",
                  "vecinfer-d4b4")
    path = make_plan(acts, 2.0, out, model=lm, candidates=candidates, key_candidates=candidates, windows=1, seq_len=32,
                     iters=3, residual=16)[0]
    names = json.loads((path / "manifest.json").read_text())["settings"]
    assert "vecinfer-d4b4" in str(names["k"]) + str(names["v"])
    return path


def _oscar_artifact(acts, out, lm):
    from kvcalib.methods.oscar_fit import save_oscar_artifact

    return save_oscar_artifact(str(out), model=lm, group_size=8, residual=16)


FITS = {"fit-codebook": _fit_codebook, "train-adapters": _train_adapters, "fit-turboquant": _fit_turboquant,
        "plan": _plan, "oscar-artifact": _oscar_artifact}


@pytest.mark.parametrize("command", sorted(FITS))
def test_fitting_twice_writes_byte_identical_artifacts(command, acts, tmp_path, tiny_lm):
    first = FITS[command](acts, tmp_path / "first", tiny_lm)
    second = FITS[command](acts, tmp_path / "second", tiny_lm)
    for name in (MANIFEST, TENSORS):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    assert str(first).endswith("first") and str(second).endswith("second")
    manifest = (tmp_path / "first" / MANIFEST).read_text()
    assert "seconds" not in manifest  # run-time figures live in run.json only
    run = tmp_path / "first" / RUN
    if run.exists():
        assert all("seconds" in key for key in json.loads(run.read_text()))
