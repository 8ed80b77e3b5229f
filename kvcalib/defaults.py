"""The one set of defaults of the method options, for every command (eval, train-adapters, diagnose,
oscar-artifact), the library functions and the runtime cache; `kvcalib.methods.MethodSettings`
says how a given option, an artifact's setting and these combine. No torch here: the CLI reads it."""

DEFAULTS = {"bits": 2, "group_size": 32, "residual": 128, "scaling": "l2", "rotation": True, "sink_tokens": 0,
            "residual_mode": "blockwise"}
OPTIONS = {"bits": "--bits", "group_size": "--group-size", "residual": "--residual", "scaling": "--scaling",
           "rotation": "--rotation/--no-rotation", "sink_tokens": "--sink-tokens",
           "residual_mode": "--residual-mode"}
RESIDUAL_MODES = ("blockwise", "sliding")  # --residual-mode: `kvcalib.methods` says what each does
