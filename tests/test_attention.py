import pytest
import torch
from transformers import DynamicCache

from kvcalib.attention import AttentionOptions, flushed_counts, intercept, mixed_attention
from conftest import tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"]


def _reference(q, k, v, opts, k_held=None, v_held=None, flushed=None):
    """Float64, one query at a time, straight from the definition."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(tq):
            pos = tk - tq + i
            keys = k[:, kv].double().clone()
            vals = v[:, kv].double().clone()
            if k_held is not None:
                n = int(flushed[i])
                keys[:, :n] = k_held[:, kv, :n].double()
                vals[:, :n] = v_held[:, kv, :n].double()
            s = (q[:, h, i].double().unsqueeze(1) * keys).sum(-1) * opts.scaling
            if opts.softcap:
                s = opts.softcap * torch.tanh(s / opts.softcap)
            j = torch.arange(tk)
            visible = j <= pos
            if opts.sliding_window:
                visible &= j > pos - opts.sliding_window
            s = s.masked_fill(~visible, float("-inf"))
            out[:, h, i] = (torch.softmax(s, -1).unsqueeze(-1) * vals).sum(1)
    return out


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("tq,tk", [(37, 37), (1, 45), (5, 50)])
@pytest.mark.parametrize("softcap,window", [(None, None), (3.0, 16)])
def test_mixed_attention_matches_float64_reference(groups, tq, tk, softcap, window):
    hkv, d = 2, 16
    q = torch.randn(2, hkv * groups, tq, d)
    k, v = torch.randn(2, hkv, tk, d), torch.randn(2, hkv, tk, d)
    k_held, v_held = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    opts = AttentionOptions(scaling=d**-0.5, softcap=softcap, sliding_window=window)
    flushed = flushed_counts(tq, tk, block=8)
    out = mixed_attention(q, k, v, opts, k_held, v_held, flushed)
    ref = _reference(q, k, v, opts, k_held, v_held, flushed)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    plain = mixed_attention(q, k, v, opts)
    ref_plain = _reference(q, k, v, opts)
    assert ((plain.double() - ref_plain).norm() / ref_plain.norm()).item() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_keys_and_values_equal_what_the_kv_cache_holds(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 512, (1, 40))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        native = model(ids, past_key_values=cache, use_cache=True).logits
    recorded = {}

    def record(layer, q, k, v, opts):
        recorded[layer] = (q, k, v)
        return mixed_attention(q, k, v, opts)

    with torch.no_grad(), intercept(model, record):
        ours = model(ids, use_cache=False).logits
    for layer, (q, k, v) in recorded.items():
        assert q.shape[1] == model.config.num_attention_heads
        # Sliding-window layers keep only their last tokens; those must match.
        n = cache.layers[layer].keys.shape[-2]
        assert n >= 23
        assert torch.allclose(k[..., -n:, :], cache.layers[layer].keys, atol=1e-6)
        assert torch.allclose(v[..., -n:, :], cache.layers[layer].values, atol=1e-6)
    assert len(recorded) == model.config.num_hidden_layers
    # Our attention (mask, GQA, softcap, sliding window) reproduces the model's own.
    assert torch.allclose(ours, native, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == "eager"  # restored after the block
