"""The runtime cache on CUDA: fused kernel path against the torch reference path of the same cache."""

import pytest
import torch

from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import LoadedModel, attention_shape
from kvcalib.runtime.cache import KvcalibCache
from test_runtime_cache import _kvlinc_with_adapters

pytest.importorskip("cupy", reason="the fused path needs cupy (pip install kvcalib[gpu])")
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


def _logits(model, cache, ids):
    """Teacher-forced: the prompt, then one token at a time; logits of every single-token step."""
    out = []
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1].float())
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["kivi", "kvlinc", "kvlinc+adapters"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_cache_path_matches_the_reference_path(head_dim, name, batch):
    model = _model(head_dim)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    shape = attention_shape(model.config)
    settings = MethodSettings(bits=2, group_size=16, residual=32)
    method = _kvlinc_with_adapters(shape, 16, 32, "cuda") if name.endswith("adapters") else build_method(name, shape, settings)
    ids = torch.randint(0, 1000, (batch, 150), device="cuda")
    fused_cache = KvcalibCache(lm, method)
    fused = _logits(model, fused_cache, ids)
    assert fused_cache.layers[0].fused is not None and fused_cache.layers[0].fused.length == 128
    reference = _logits(model, KvcalibCache(lm, method, fused=False), ids)
    assert torch.isfinite(fused).all()
    err = ((fused - reference).norm() / reference.norm()).item()
    assert err < 1e-2, err
