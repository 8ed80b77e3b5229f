"""kvcalib: offline calibration, artifacts and evaluation for low-bit KV-cache compression."""

__version__ = "0.1.0"

from .errors import KvcalibError  # noqa: E402

__all__ = ["KvcalibError", "__version__", "collect", "evaluate"]


def __getattr__(name: str):
    # The heavy modules (torch, transformers) load only when their function is asked for.
    if name == "collect":
        from .collect import collect

        return collect
    if name == "evaluate":
        from .evaluate import evaluate

        return evaluate
    raise AttributeError(name)
