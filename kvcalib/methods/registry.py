"""The methods by name: `METHODS` maps each `--method` to its module, and `build_method` builds one.

Each module defines its `Method` subclass, `SETTINGS` (the options of `DEFAULTS` it reads) and
`build(shape, settings, artifacts, model) -> Method`; what it fits lives beside it in `{name}_fit.py`
(docs/layout.md has the table of each method's codec, fit, layout and kernel).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from ..errors import SettingsError
from ..models import AttentionShape, LoadedModel
from . import fp16, kivi, kvlinc, oscar, plan, turboquant, vecinfer
from .base import Method, MethodSettings, apply_residual_mode, check_sliding_layers, settle_float16_layers

METHODS: dict[str, ModuleType] = {
    "fp16": fp16,
    "kivi": kivi,
    "kvlinc": kvlinc,
    "oscar": oscar,
    "plan": plan,
    "turboquant": turboquant,
    "vecinfer": vecinfer,
}
METHOD_NAMES = tuple(METHODS)
# options every compressing method takes, applied by `build_method`
GENERIC = ("sink_tokens", "residual_mode", "sliding_layers")


def check_method_name(name: str) -> None:
    if name not in METHODS:
        raise SettingsError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")


def settings_used(name: str) -> tuple[str, ...]:
    """The options of `DEFAULTS` that method `name` reads: its own, and `GENERIC` for every method that
    compresses (`build_method` applies them to any method, outside the method's own settings)."""
    check_method_name(name)
    return METHODS[name].SETTINGS + (GENERIC if name != "fp16" else ())


def build_method(name: str, shape: AttentionShape, settings: MethodSettings = MethodSettings(),
                 artifacts: str | None = None, model: LoadedModel | None = None) -> Method:
    """Build a method by name from the command's settings and, where it needs one, an artifact."""
    check_method_name(name)
    settings.resolve(name, settings_used(name))  # an option the method does not use is refused, artifact or not
    method = METHODS[name].build(shape, dataclasses.replace(settings, sink_tokens=None, residual_mode=None,
                                                            sliding_layers=None), artifacts, model)
    if name == "fp16":
        return method
    # The generic options by the same rule as the method's own: an artifact fitted with float16 sinks or
    # under one flush rule fixes them, a given value that contradicts it is refused.
    fixed = {"sink_tokens": method.sink or None, "residual_mode": method.fitted_residual_mode,
             "sliding_layers": method.fitted_sliding_layers}
    generic = MethodSettings(sink_tokens=settings.sink_tokens, residual_mode=settings.residual_mode,
                             sliding_layers=settings.sliding_layers).resolve(
        name, GENERIC, {k: v for k, v in fixed.items() if v is not None}, artifacts)
    if generic["sink_tokens"] < 0:
        raise SettingsError(f"--sink-tokens must be 0 or more, got {generic['sink_tokens']}")
    method.sink = generic["sink_tokens"]
    apply_residual_mode(method, generic["residual_mode"])
    check_sliding_layers(generic["sliding_layers"])
    method.sliding_layers = generic["sliding_layers"]
    settle_float16_layers(method, None if model is None else model.config)  # sliding layers kept: Method's docstring
    return method
