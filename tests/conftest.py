"""Shared fixtures: tiny random-initialised models built from configs, with a small BPE tokenizer
trained on the embedded text, so no test needs a download."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvcalib.data import documents
from kvcalib.models import LoadedModel

VOCAB = 512


def tiny_config(arch: str = "llama", **overrides):
    """A 2-layer decoder of the named family; GQA with 4 query and 2 KV heads of dim 16."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    extra = {
        "llama": {},
        "mistral": {"sliding_window": 24},
        "qwen2": {},
        "qwen3": {},  # q/k RMSNorm before RoPE
        "gemma": {},
        "gemma2": {"attn_logit_softcapping": 5.0, "sliding_window": 24, "query_pre_attn_scalar": 16},
        "gemma3_text": {"sliding_window": 24, "query_pre_attn_scalar": 16},
        "phi3": {"pad_token_id": 0},  # fused qkv and gate-up projections
    }[arch]
    return AutoConfig.for_model(arch, **{**common, **extra, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Random init at std 0.02 gives near-uniform attention and logits, on which no cache error shows;
    # larger weights give peaked attention and confident predictions that quantization visibly moves.
    gains = {"q_proj.weight": 8.0, "k_proj.weight": 8.0, "v_proj.weight": 4.0, "o_proj.weight": 4.0, "lm_head.weight": 6.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, gain in gains.items():
                if name.endswith(suffix):
                    p.mul_(gain)
    return model.eval().requires_grad_(False)


def _rms_norm(module, x):  # Llama, Mistral, Qwen2/3: weight * x / rms(x)
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def _gemma_rms_norm(module, x):  # Gemma 1-3: (1 + weight) * x / rms(x)
    return (1.0 + module.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps))


def float64(model):
    """`model` in float64 end to end. transformers' RMSNorms compute in float32 whatever the model's
    dtype (they cast), which would leave rare float32-sized differences between two float64 paths (a
    value near a float32 rounding midpoint); their forward is replaced by the same formula in float64."""
    import functools

    model = model.double()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            norm = _gemma_rms_norm if name.startswith("Gemma") else _rms_norm
            module.forward = functools.partial(norm, module)
    return model


@pytest.fixture(scope="session")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False)
    text = list(documents("pydoc", "evaluation"))[:40]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny_lm(tokenizer) -> LoadedModel:
    return LoadedModel(model=tiny_model("llama"), tokenizer=tokenizer, spec="tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_lm):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_lm.model.save_pretrained(path)
    tiny_lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n\n".join(list(documents("pydoc", "evaluation"))[:30]))
    return path


def pytest_addoption(parser):
    parser.addoption("--plant", default=None, metavar="NAME",
                     help="switch on a planted runtime-cache error (tests/test_runtime_cache.py PLANTS) in the "
                          "tests that take the `plant` fixture, to see them fail")


@pytest.fixture
def plant(request, monkeypatch):
    """Applies the error named by --plant, if any; a test that takes this fixture must then fail."""
    name = request.config.getoption("--plant")
    if name is not None:
        from test_runtime_cache import PLANTS

        PLANTS[name](monkeypatch)
    return name


@pytest.fixture
def no_faiss(monkeypatch):
    """faiss not installed: its import fails (what a GPU machine without faiss-gpu's wheel gives)."""
    import builtins
    import sys

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "faiss":
            raise ImportError("no faiss here")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "faiss", raising=False)
    monkeypatch.setattr(builtins, "__import__", refuse)
