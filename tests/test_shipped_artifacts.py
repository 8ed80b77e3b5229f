"""The artifacts shipped under artifacts/smollm2-135m (which `make demo` evaluates) are what today's defaults make:
`kvcalib collect` with no flag, then `kvcalib plan --budget 2.25` (and `--budget 3`), `kvcalib fit-codebook` and
`kvcalib oscar-artifact` with no other flag. Each manifest's settings are held to the commands' own defaults, read from the
CLI (a default changed without remaking the artifact fails here), and each artifact loads for the embedded model."""

import json
from pathlib import Path

import click
import pytest

from kvcalib import cli
from kvcalib.defaults import DEFAULTS, PLAN_ANCHOR, PLAN_CANDIDATES, PLAN_ITEM, PLAN_SINK_TOKENS, PLAN_VECTOR_KEYS
from kvcalib.methods.plan import parse_scheme

ART = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m"


def _defaults(command) -> dict:
    """A click command's option defaults by parameter name, as the command would take them (a flag's: False)."""
    ctx = click.Context(command)
    return {p.name: p.get_default(ctx) for p in command.params}


def _manifest(name: str) -> dict:
    return json.loads((ART / name / "manifest.json").read_text())


def _calibration_mismatches(calibration: dict) -> list[str]:
    """The collection's settings that differ from `kvcalib collect`'s defaults (the library function's where the
    command leaves an option unset)."""
    import inspect

    from kvcalib.collect import collect

    library = {k: p.default for k, p in inspect.signature(collect).parameters.items()}
    want = {k: v if v is not None else library.get(k) for k, v in _defaults(cli.collect_cmd).items()}
    return [f"calibration {k}: {calibration.get(k)!r}, default {want[k]!r}"
            for k in ("dataset", "num_samples", "seq_len", "seed", "max_tokens", "text_field")
            if calibration.get(k) != want[k]]


def plan_mismatches(manifest: dict, budget: float = 2.25) -> list[str]:
    """What a plan's manifest holds that `collect` + `plan --budget B` with default flags would not write."""
    s, extra, want = manifest["settings"], manifest["extra"], _defaults(cli.plan_cmd)
    expected = {"budget": budget, "items": PLAN_ITEM, "sink_tokens": PLAN_SINK_TOKENS, "residual": DEFAULTS["residual"],
                "residual_mode": DEFAULTS["residual_mode"], "granularity": want["granularity"], "iters": want["iters"],
                "sliding_layers": want["sliding_layers"], "float16_layers": []}  # the embedded Llama: no sliding layer
    out = [f"{k}: {s.get(k)!r}, default {v!r}" for k, v in expected.items() if s.get(k) != v]
    scalar = [c for c in PLAN_CANDIDATES if not parse_scheme(c).dim]
    keys = list(PLAN_CANDIDATES) if PLAN_VECTOR_KEYS else scalar
    extras = {"candidates": list(PLAN_CANDIDATES), "anchor": PLAN_ANCHOR, "windows": want["windows"],
              "seq_len": want["seq_len"], "candidates_per_part": {"k": keys, "v": list(PLAN_CANDIDATES)}}
    out += [f"{k}: {extra.get(k)!r}, default {v!r}" for k, v in extras.items() if extra.get(k) != v]
    return out + _calibration_mismatches(extra.get("calibration", {}))


def vecinfer_mismatches(manifest: dict) -> list[str]:
    """What a VecInfer manifest holds that `fit-codebook` with default flags would not write."""
    s, want = manifest["settings"], _defaults(cli.fit_codebook_cmd)
    out = [f"{k}: {s.get(k)!r}, default {want[k]!r}"
           for k in ("k_config", "v_config", "granularity", "iters", "max_points_per_centroid", "seed", "sink_tokens",
                     "exclude_sinks")
           if s.get(k) != want[k]]
    out += [f"{k}: {s.get(k)!r}, default {want[k]!r}" for k in ("smooth", "hadamard") if s.get(k) is not True]
    return out + _calibration_mismatches(manifest["extra"].get("calibration", {}))


def oscar_mismatches(manifest: dict) -> list[str]:
    """What an OScaR manifest holds that `oscar-artifact` with default flags would not write."""
    s, want = manifest["settings"], _defaults(cli.oscar_artifact_cmd)
    return [f"{k}: {s.get(k)!r}, default {want[k]!r}" for k in ("bits", "group_size", "residual", "scaling", "rotation")
            if s.get(k) != want[k]]


CHECKS = {"plan-2.25": plan_mismatches, "plan-3": lambda m: plan_mismatches(m, 3.0), "vecinfer-d4b8": vecinfer_mismatches,
          "oscar": oscar_mismatches}


def test_every_shipped_artifact_is_checked():
    assert sorted(p.name for p in ART.iterdir() if p.is_dir()) == sorted(CHECKS)


@pytest.mark.parametrize("name", list(CHECKS))
def test_each_shipped_artifact_is_what_the_default_flags_make(name):
    assert CHECKS[name](_manifest(name)) == []


@pytest.mark.parametrize("name,key,value", [("plan-2.25", "sink_tokens", 0), ("plan-3", "sliding_layers", "compress"),
                                            ("vecinfer-d4b8", "k_config", "d8b12"),
                                            ("vecinfer-d4b8", "sink_tokens", 1), ("oscar", "group_size", 128)])
def test_a_manifest_one_setting_off_its_default_is_caught(name, key, value):
    manifest = _manifest(name)
    manifest["settings"][key] = value
    assert any(m.startswith(f"{key}:") for m in CHECKS[name](manifest))


def test_a_plan_whose_keys_could_take_vector_codes_is_not_the_default():
    """The artifact shipped before today's default barred vector codes from keys: its manifest named no per-part lists."""
    manifest = _manifest("plan-2.25")
    manifest["extra"]["candidates_per_part"] = {"k": list(PLAN_CANDIDATES), "v": list(PLAN_CANDIDATES)}
    assert any(m.startswith("candidates_per_part") for m in plan_mismatches(manifest))
