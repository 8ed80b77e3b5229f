"""`oscar-artifact`: OScaR needs no calibration data; its artifact records the settings, the model's
fingerprint and the rotation, so a deployment reproduces the method (`kvcalib.methods.oscar`)."""

from __future__ import annotations

from ..artifacts import save_artifact
from ..atomic import ensure_writable_dir
from ..defaults import DEFAULTS
from ..hadamard import hadamard
from ..models import DEFAULT_MODEL, LoadedModel, attention_shape, fingerprint, load_model
from .oscar import Oscar, OscarConfig


def save_oscar_artifact(out: str, model: str | LoadedModel = DEFAULT_MODEL, bits: int = DEFAULTS["bits"],
                        group_size: int = DEFAULTS["group_size"], residual: int = DEFAULTS["residual"],
                        scaling: str = DEFAULTS["scaling"], rotation: bool = DEFAULTS["rotation"],
                        trust_remote_code: bool = False, device: str | None = None, dtype: str | None = None) -> str:
    """Write the artifact a deployment reproduces OScaR from: settings, model fingerprint, rotation."""
    config = OscarConfig(bits=bits, group_size=group_size, residual=residual, scaling=scaling, rotation=rotation)
    ensure_writable_dir(out, "--out")
    lm = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    shape = attention_shape(lm.config)
    method = Oscar(config, shape)
    tensors = {"rotation": hadamard(shape.head_dim)} if rotation else {}
    return str(save_artifact(out, "oscar", method.settings(), fingerprint(lm.model), tensors))
