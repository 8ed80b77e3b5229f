import json

import pytest
import torch

from kvcalib.artifacts import load_artifact, save_artifact
from kvcalib.errors import KvcalibError
from kvcalib.models import fingerprint
from conftest import tiny_config


@pytest.fixture
def saved(tmp_path):
    tensors = {"layers.0.k_smooth": torch.rand(64), "layers.1.k_codebook": torch.randn(256, 4).half()}
    return save_artifact(tmp_path / "art", "test", {"a": 1}, fingerprint(tiny_config()), tensors), tensors


def test_artifact_round_trips_tensors_settings_and_fingerprint(saved):
    path, tensors = saved
    art = load_artifact(path, "test", tiny_config())
    assert art.settings == {"a": 1}
    for name, t in tensors.items():
        assert torch.equal(art.tensors[name], t)
    assert torch.equal(art.layer(1, "k_codebook"), tensors["layers.1.k_codebook"])
    assert [p.name for p in path.parent.iterdir()] == ["art"]


def test_artifact_for_another_model_is_refused(saved):
    with pytest.raises(KvcalibError, match="another model"):
        load_artifact(saved[0], model=tiny_config(num_key_value_heads=4))


def test_artifact_with_a_flipped_byte_is_refused(saved):
    path = saved[0] / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(KvcalibError, match="corrupted"):
        load_artifact(saved[0])


def test_artifact_of_another_method_or_format_is_refused(saved):
    with pytest.raises(KvcalibError, match="for method"):
        load_artifact(saved[0], "vecinfer")
    manifest = saved[0] / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(KvcalibError, match="written by a newer kvcalib"):
        load_artifact(saved[0])


def test_missing_artifact_is_refused(tmp_path):
    with pytest.raises(KvcalibError, match="not a kvcalib artifact"):
        load_artifact(tmp_path / "nothing")
