"""Calibrated artifacts: a directory with `tensors.safetensors` and `manifest.json`. Never pickle.

Tensors are named `layers.{i}.{what}` (e.g. `layers.3.k_codebook`). The manifest holds the format
version, the method, its settings, the model fingerprint (`models.fingerprint`), the tool version
and the sha256 of every tensor's bytes. `load_artifact` checks all of it, and the fingerprint
against the model when one is given. The directory is written under a temporary name and renamed.
Figures of the run itself (wall-clock seconds) go to `run.json` beside them, outside the manifest,
so that the same inputs and seed give byte-identical `manifest.json` and tensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .atomic import atomic_path, ensure_writable_dir
from .errors import ArtifactError
from .models import check_fingerprint
from .tensorfile import check_finite, read_tensors, tensor_bytes

FORMAT_VERSION = 1
TENSORS = "tensors.safetensors"
MANIFEST = "manifest.json"
RUN = "run.json"  # wall-clock figures of the fit: not part of the artifact's identity


@dataclass
class Artifact:
    method: str
    settings: dict
    fingerprint: dict
    tensors: dict[str, torch.Tensor]
    extra: dict

    def layer(self, i: int, what: str) -> torch.Tensor:
        return self.tensors[f"layers.{i}.{what}"]


def _checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def save_artifact(path: str | Path, method: str, settings: dict, fingerprint: dict,
                  tensors: dict[str, torch.Tensor], extra: dict | None = None, run: dict | None = None) -> Path:
    path = ensure_writable_dir(path, "--out")
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": "artifact",
        "method": method,
        "settings": settings,
        "model_fingerprint": fingerprint,
        "tool_version": __version__,
        "tensors": {name: {"sha256": _checksum(t), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for name, t in sorted(tensors.items())},
        "extra": extra or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.mkdir()
        (tmp / TENSORS).write_bytes(tensor_bytes(tensors))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if run:
            (tmp / RUN).write_text(json.dumps(run, indent=2, sort_keys=True) + "\n")
    return path


def check_format(manifest, kind: str, version: int, what: str) -> None:
    """Refuse a manifest of another kind or format version; a newer one asks for a newer kvcalib."""
    found = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind or not isinstance(found, int):
        raise ArtifactError(f"{what} has no valid {kind} manifest; make it again with kvcalib")
    if found > version:
        raise ArtifactError(f"{what} has format version {found}, written by a newer kvcalib (this is {__version__}, "
                            f"which reads version {version}); upgrade kvcalib")
    if found != version:
        raise ArtifactError(f"{what} has format version {found}, which this kvcalib no longer reads; make it again")


def load_artifact(path: str | Path, method: str | None = None, model=None) -> Artifact:
    """Load and validate an artifact; `model` (a model or config) is checked against the fingerprint."""
    path = Path(path)
    if not (path / MANIFEST).is_file() or not (path / TENSORS).is_file():
        raise ArtifactError(f"{path} is not a kvcalib artifact (expected {MANIFEST} and {TENSORS} in a directory)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        raw = (path / TENSORS).read_bytes()
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise ArtifactError(f"artifact {path} is corrupted: {str(err).splitlines()[0]}") from err
    check_format(manifest, "artifact", FORMAT_VERSION, f"artifact {path}")
    missing = {"method", "settings", "model_fingerprint", "tensors", "extra"} - set(manifest)
    if missing:
        raise ArtifactError(f"artifact {path} is corrupted: its manifest lacks {', '.join(sorted(missing))}")
    tensors = read_tensors(raw, f"artifact {path}")
    if method is not None and manifest["method"] != method:
        raise ArtifactError(f"artifact {path} is for method {manifest['method']!r}, not {method!r}")
    expected = manifest["tensors"]
    if set(expected) != set(tensors):
        raise ArtifactError(f"artifact {path} is corrupted: its tensors do not match its manifest")
    for name, t in tensors.items():
        if _checksum(t) != expected[name]["sha256"]:
            raise ArtifactError(f"artifact {path} is corrupted: checksum mismatch in tensor {name}")
    check_finite(tensors, f"artifact {path}")
    if model is not None:
        check_fingerprint(manifest["model_fingerprint"], model, f"artifact {path}")
    return Artifact(method=manifest["method"], settings=manifest["settings"],
                    fingerprint=manifest["model_fingerprint"], tensors=tensors, extra=manifest["extra"])
