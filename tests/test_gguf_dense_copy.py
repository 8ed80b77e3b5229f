"""A GGUF checkpoint loads from its dense copy (`kvcalib.models.dense_copy`), made at its first load: the same
weights, config fingerprint and tokenizer as transformers' own load of the GGUF, so that every artifact of the model
still matches it; made once and then read; and where the cache cannot be written, the GGUF loads directly."""

import logging

import pytest
import torch

from kvcalib import models
from kvcalib.models import dense_copy, fingerprint


@pytest.fixture(scope="module")
def gguf():
    directory, kwargs = models._resolve("smollm2-135m")
    return models.Path(directory) / kwargs["gguf_file"]


@pytest.mark.slow
def test_the_dense_copy_holds_what_the_gguf_loads(gguf, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    path = dense_copy(gguf)
    assert path is not None and (path / "complete").exists() and path.parent.parent == tmp_path
    made = (path / "model.safetensors").stat().st_mtime_ns
    assert dense_copy(gguf) == path and (path / "model.safetensors").stat().st_mtime_ns == made  # read, not remade

    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    copy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs, ours = direct.state_dict(), copy.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    assert fingerprint(copy) == fingerprint(direct)  # the shipped artifacts' fingerprint holds for both
    text = "def f(x):\n    return [x, 'é', 42]  # a comment"
    tok_direct = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok_copy = AutoTokenizer.from_pretrained(path)
    assert tok_copy(text)["input_ids"] == tok_direct(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tok_copy.apply_chat_template(chat, tokenize=False) == tok_direct.apply_chat_template(chat, tokenize=False)


def test_a_cache_that_cannot_be_written_leaves_the_gguf_to_load_directly(gguf, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(models.CACHE_ENV, str(blocked))
    with caplog.at_level(logging.WARNING, logger="kvcalib.models"):
        assert dense_copy(gguf) is None
    assert "loads directly" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing half-written left
