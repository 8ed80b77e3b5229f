import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvcalib.attention import flushed_counts, intercept
from kvcalib.data import token_windows
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.models import attention_shape


def _plain_perplexity(lm, windows):
    nll = 0.0
    with torch.no_grad():
        for w in windows:
            logits = lm.model(w[None], use_cache=False).logits[0]
            nll += torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
    return math.exp(nll / (windows.numel() - len(windows)))


def _decoded_perplexity(lm, windows, method):
    """Token-by-token decoding; at every step the cache is re-held from scratch by the method."""
    nll, count = 0.0, 0

    def attend(layer, q, k, v, opts):
        held = hold(method, layer, k, v)
        flushed = flushed_counts(q.shape[-2], k.shape[-2], method.block)
        return method.attend(layer, q, k, v, held, flushed, opts)

    with torch.no_grad(), intercept(lm.model, attend):
        for w in windows:
            cache = DynamicCache(config=lm.model.config)
            for t in range(len(w) - 1):
                logits = lm.model(w[None, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                nll += torch.nn.functional.cross_entropy(logits[None], w[t + 1 : t + 2]).item()
                count += 1
    return math.exp(nll / count)


def test_fp16_eval_equals_the_plain_model_perplexity(tiny_lm, text_file):
    windows = token_windows(tiny_lm.tokenizer, str(text_file), "evaluation", 2, 64)
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=2, seq_len=64, method="fp16")
    # Only the float16 rounding of the cached keys and values separates the two.
    assert result.perplexity == pytest.approx(_plain_perplexity(tiny_lm, windows), rel=1e-3)
    assert result.effective_bits == 16.0
    assert max(result.per_layer_attention_rel_error) < 1e-3


@pytest.mark.parametrize("bits,group,residual,seq_len", [(2, 4, 8, 37), (3, 8, 16, 41), (1, 4, 4, 30)])
def test_eval_is_exact_with_respect_to_token_by_token_decoding(tiny_lm, text_file, bits, group, residual, seq_len):
    windows = token_windows(tiny_lm.tokenizer, str(text_file), "evaluation", 2, seq_len)
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=2, seq_len=seq_len, method="kivi",
                      bits=bits, group_size=group, residual=residual)
    method = build_method("kivi", attention_shape(tiny_lm.config), MethodSettings(bits, group, residual))
    assert result.perplexity == pytest.approx(_decoded_perplexity(tiny_lm, windows, method), rel=1e-5)
    # The quantized cache really took part (a random model's perplexity may move either way).
    assert result.perplexity != pytest.approx(_plain_perplexity(tiny_lm, windows), rel=1e-3)


def test_effective_bits_count_metadata_and_the_float16_residual(tiny_lm, text_file):
    # seq_len 40 with R=16: 32 tokens in 2-bit blocks (+32/G bits of fp16 scale and zero), 8 in fp16.
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=40, method="kivi",
                      bits=2, group_size=8, residual=16)
    expected = (32 * (2 + 32 / 8) + 8 * 16) / 40
    assert result.effective_bits == pytest.approx(expected)


def test_attention_error_grows_as_bits_shrink(tiny_lm, text_file):
    errs = [sum(evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=64, method="kivi", bits=b,
                         group_size=8, residual=16).per_layer_attention_rel_error) for b in (4, 2, 1)]
    assert errs[0] < errs[1] < errs[2]


def test_eval_json_holds_the_contract_fields(tiny_lm, text_file, tmp_path):
    path = tmp_path / "r.json"
    evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=32, method="kivi", group_size=8,
             residual=16, json_path=str(path))
    data = json.loads(path.read_text())
    for key in ("method", "perplexity", "effective_bits", "tokens", "per_layer_attention_rel_error"):
        assert key in data
    assert data["tokens"] == 31
    assert len(data["per_layer_attention_rel_error"]) == tiny_lm.config.num_hidden_layers
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
