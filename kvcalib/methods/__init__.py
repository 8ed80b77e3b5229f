"""Cache compression methods: each is data (its settings and fitted tensors) plus two functions,
`compress(layer, k, v) -> packed` and the reference attention over what it reads back.

- `base.py`: the contract every method implements (`Method`: the codec, abstract, and `KernelLayout`,
  what the runtime reads beyond it), the flush rule applied to a sequence (`hold`, `keep_sinks`) and the
  one rule by which options resolve (`MethodSettings`);
- `registry.py`: `METHODS`, each `--method` name and its module, and `build_method`;
- one module per method, `fp16.py`, `kivi.py`, `kvlinc.py`, `oscar.py`, `plan.py`, `turboquant.py`,
  `vecinfer.py` (codec, reference attention, what the runtime reads of it), and `{name}_fit.py` beside the
  ones that fit something (docs/layout.md: each method's codec, fit, layout and kernel in one table).
"""

from ..defaults import DEFAULTS
from .base import (DeviceCopies, Held, KernelLayout, Method, MethodSettings, apply_residual_mode, check_residual_mode,
                   float16_window, hold, keep_sinks, settle_float16_layers)
from .registry import GENERIC, METHOD_NAMES, METHODS, build_method, check_method_name, settings_used

__all__ = ["DEFAULTS", "GENERIC", "METHOD_NAMES", "METHODS", "DeviceCopies", "Held", "KernelLayout", "Method",
           "MethodSettings", "apply_residual_mode", "build_method", "check_method_name", "check_residual_mode",
           "float16_window", "hold", "keep_sinks", "settings_used", "settle_float16_layers"]
