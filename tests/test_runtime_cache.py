"""`model.generate` with a KvcalibCache against an independent recomputation of the same cache."""

import pytest
import torch

from kvcalib.attention import flushed_counts, intercept
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.models import LoadedModel, attention_shape
from kvcalib.runtime.cache import KvcalibCache
from conftest import tiny_model


def _reference_greedy(model, method, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Each new token from a full forward: prompt queries attend in float16, later queries over the
    cache as held at their position (eval's rule); no incremental state at all."""
    ids = prompt.clone()
    tokens, logits = [], []
    p = prompt.shape[1]

    def attend(layer, q, k, v, opts):
        held = hold(method, layer, k, v)
        flushed = flushed_counts(q.shape[-2], k.shape[-2], method.block)
        flushed[:p] = 0
        return method.attend(layer, q, k, v, held, flushed, opts)

    with torch.no_grad(), intercept(model, attend):
        for _ in range(steps):
            out = model(ids, use_cache=False).logits[0, -1]
            logits.append(out)
            nxt = int(out.argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokens, logits


def _kvlinc_with_adapters(shape, group: int = 8, residual: int = 16, device: str = "cpu"):
    """KVLinC with random adapters in every layer, so the S, P states take part."""
    from kvcalib.methods.kivi import KiviConfig
    from kvcalib.methods.kvlinc import Adapter, Kvlinc

    gen = torch.Generator().manual_seed(0)
    heads = {"q": shape.num_heads, "k": shape.num_kv_heads}
    adapters = {i: Adapter(*(torch.randn(heads[n], shape.head_dim, 16, generator=gen).to(device) for n in "qqkk"))
                for i in range(shape.num_layers)}
    return Kvlinc(KiviConfig(2, group, residual), shape, adapters)


def _vecinfer_with_sinks(shape, sink: int = 3, residual: int = 16):
    """VecInfer with random codebooks whose first `sink` tokens stay float16."""
    from kvcalib.methods.vecinfer import LayerCodebooks, VecInfer, VecInferConfig

    gen = torch.Generator().manual_seed(0)
    config = VecInferConfig("d4b6", "d4b6", sink_tokens=sink)
    books = [LayerCodebooks(k=torch.randn(1, 64, 4, generator=gen).half(), v=torch.randn(1, 64, 4, generator=gen).half(),
                            smooth=(torch.rand(shape.num_kv_heads, shape.head_dim, generator=gen) + 0.5).half())
             for _ in range(shape.num_layers)]
    return VecInfer(config, books, shape, residual)


@pytest.mark.parametrize("name,settings", [
    ("fp16", MethodSettings()),
    ("vecinfer+sinks", None),
    ("kivi", MethodSettings(bits=2, group_size=8, residual=16)),
    ("kvlinc", MethodSettings(bits=2, group_size=8, residual=16)),
    ("kvlinc+adapters", None),
    ("oscar", MethodSettings(bits=2, group_size=8, residual=16)),
])
def test_generate_with_compressed_cache_matches_the_reference_recomputation(name, settings):
    model = tiny_model("llama", seed=1)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (1, 21))
    shape = attention_shape(model.config)
    builders = {"kvlinc+adapters": _kvlinc_with_adapters, "vecinfer+sinks": _vecinfer_with_sinks}
    method = builders[name](shape) if settings is None else build_method(name, shape, settings)
    cache = KvcalibCache(lm, method)
    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=30, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, prompt.shape[1]:].tolist()
    ref_tokens, ref_logits = _reference_greedy(model, method, prompt, 30)
    assert generated == ref_tokens
    for got, want in zip(out.logits, ref_logits):
        torch.testing.assert_close(got[0].float(), want.float(), rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == prompt.shape[1] + 29  # the last token is sampled, never cached


def test_compressed_cache_stores_fewer_bits_than_float16():
    model = tiny_model("llama", seed=2)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    prompt = torch.randint(0, 512, (1, 64))
    bits = {}
    for name in ("fp16", "kivi"):
        cache = KvcalibCache(lm, name, MethodSettings(bits=2, group_size=16, residual=16))
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
        bits[name] = cache.stored_bits()
    assert bits["fp16"] == 16 * 2 * 2 * 64 * 2 * 16  # layers x (k, v) x kv heads x tokens x head_dim
    assert bits["kivi"] == pytest.approx(bits["fp16"] * (2 + 32 / 16) / 16)


def test_flushing_keeps_no_view_of_the_prompt_buffer():
    # A view, even an empty one, of the pre-flush float16 buffer would keep the whole prompt alive.
    model = tiny_model("llama", seed=3)
    cache = KvcalibCache(LoadedModel(model=model, tokenizer=None, spec="tiny"), "kivi",
                         MethodSettings(bits=2, group_size=16, residual=32))
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 96)), past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        assert layer.k_res.shape[-2] == 0
        assert layer.k_res.untyped_storage().nbytes() == 0 and layer.v_res.untyped_storage().nbytes() == 0


def test_an_artifact_for_another_model_is_refused_before_anything_runs():
    from kvcalib.errors import KvcalibError

    model = tiny_model("llama", seed=4)
    before = model.config._attn_implementation
    with pytest.raises(KvcalibError, match="another model"):
        KvcalibCache.from_artifacts("artifacts/smollm2-135m/oscar", LoadedModel(model=model, tokenizer=None, spec="tiny"))
    assert model.config._attn_implementation == before
