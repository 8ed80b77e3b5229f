"""The runtime cache on CUDA: fused kernel path against the torch reference path of the same cache."""

import pytest
import torch

from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import LoadedModel, attention_shape
import kvcalib.runtime.cache as cache_module
from kvcalib.runtime.cache import KvcalibCache
from test_runtime_cache import _kvlinc_with_adapters

pytest.importorskip("cupy", reason="the fused path needs cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the fused path runs only on a GPU", allow_module_level=True)


def _model(head_dim: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=8 * head_dim, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).cuda().half().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["kivi", "kvlinc", "kvlinc+adapters", "oscar"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_steps_match_the_reference_over_the_same_cache(head_dim, name, batch, monkeypatch):
    """Every single-token step of a fused cache, against the method's torch reference (`Method.decode`)
    over the very same held cache: flushed blocks, float16 residual, KVLinC states."""
    model = _model(head_dim)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    shape = attention_shape(model.config)
    settings = MethodSettings(bits=2, group_size=16, residual=32)
    method = _kvlinc_with_adapters(shape, 16, 32, "cuda") if name.endswith("adapters") else build_method(name, shape, settings)
    errors = []
    fused_decode_step = cache_module.decode

    def checked(layer, q, opts):
        out = fused_decode_step(layer, q, opts)
        if layer.fused is not None:
            ref = layer.method.decode(layer.layer, q, *layer.held(torch.float32), opts, layer.state)
            errors.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
        return out

    monkeypatch.setattr(cache_module, "decode", checked)
    cache = KvcalibCache(lm, method)
    ids = torch.randint(0, 1000, (batch, 150), device="cuda")
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, ids.shape[1]):
            logits = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            assert torch.isfinite(logits).all()
    assert cache.layers[0].fused.length == 128
    assert len(errors) == 2 * 110  # every decode step of both layers ran fused
    assert max(errors) < 5e-3, max(errors)
