"""Recipes: pipelines as data. A TOML file lists steps; each step names a kvcalib command and its
arguments, exactly the keyword arguments of the library function behind that command.

    [defaults]              # merged into every step that takes these arguments
    seq_len = 1024
    num_samples = 4

    [[steps]]
    command = "eval"
    label = "KIVI-2 G=32"   # optional, names the row in result tables
    method = "kivi"
    group_size = 32

Relative paths in a recipe are taken relative to the working directory, like on the command line.
"""

from __future__ import annotations

import inspect
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .defaults import DEFAULTS
from .errors import SettingsError


def _commands() -> dict[str, Callable]:
    from .collect import collect
    from .diagnose import diagnose
    from .evaluate import evaluate
    from .methods.kvlinc_fit import train_adapters
    from .methods.oscar_fit import save_oscar_artifact
    from .methods.turboquant_fit import fit_turboquant
    from .methods.plan_fit import make_plan
    from .methods.vecinfer_fit import fit_codebook

    return {"collect": collect, "eval": evaluate, "fit-codebook": fit_codebook, "train-adapters": train_adapters,
            "diagnose": diagnose, "oscar-artifact": save_oscar_artifact, "fit-turboquant": fit_turboquant,
            "plan": make_plan}


@dataclass
class Step:
    command: str
    label: str
    arguments: dict


def _default_applies(key: str, step: dict) -> bool:
    """A recipe default of a method option fills an eval step only where its method reads the option
    and no artifact fixes it: the option would be refused there (`MethodSettings.resolve`)."""
    if key not in DEFAULTS or "method" not in step:
        return True
    from .methods import settings_used

    return "artifacts" not in step and key in settings_used(step["method"])


def load_recipe(path: str | Path) -> list[Step]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SettingsError(f"could not read recipe {path}: {err}") from err
    commands = _commands()
    defaults = data.get("defaults", {})
    steps = []
    for i, raw in enumerate(data.get("steps", [])):
        raw = dict(raw)
        command = raw.pop("command", None)
        if command not in commands:
            raise SettingsError(f"recipe {path} step {i + 1}: command must be one of {', '.join(commands)}")
        label = raw.pop("label", raw.get("method", command))
        accepted = inspect.signature(commands[command]).parameters
        unknown = set(raw) - set(accepted)
        if unknown:
            raise SettingsError(f"recipe {path} step {i + 1}: {command} takes no {', '.join(sorted(unknown))}")
        arguments = {k: v for k, v in defaults.items() if k in accepted and _default_applies(k, raw)} | raw
        steps.append(Step(command, label, arguments))
    if not steps:
        raise SettingsError(f"recipe {path} has no [[steps]]")
    return steps


def run_step(step: Step, **overrides) -> object:
    """Run one step; `overrides` replace its arguments where its command takes them."""
    command = _commands()[step.command]
    accepted = inspect.signature(command).parameters
    return command(**(step.arguments | {k: v for k, v in overrides.items() if k in accepted and v is not None}))


def run_recipe(path: str | Path, model=None, trust_remote_code: bool = False,
               device: str | None = None, dtype: str | None = None) -> list[tuple[Step, object]]:
    """Run every step in order; returns (step, what the command returned). `model` overrides the recipe's;
    `trust_remote_code` turns it on for every step that loads a model (a recipe may also set it per step);
    `device` (auto when None) places every step's model, in `dtype` (auto when None: `models.default_dtype`)."""
    return [(step, run_step(step, model=model, trust_remote_code=trust_remote_code or None,
                            device=None if device == "auto" else device, dtype=None if dtype == "auto" else dtype))
            for step in load_recipe(path)]
