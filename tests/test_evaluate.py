import contextlib
import copy
import json
import math

import pytest
import torch
from transformers import DynamicCache

import kvcalib.evaluate as evaluate_module
from kvcalib.attention import flushed_counts, flushed_length, intercept, mixed_attention
from kvcalib.data import token_windows
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.models import LoadedModel, attention_shape
from conftest import float64
from tolerances import U16, U32, gamma, perplexity_tolerance


@pytest.fixture(scope="module")
def tiny_lm64(tiny_lm):
    """The tiny model in float64 (same weights, inputs unchanged). The one-pass and token-by-token paths
    compute keys and values with different matmul shapes; in float32 a value within an ulp of a float16
    rounding boundary can then reach the float16 cache as two different values, a difference far beyond
    round-off. In float64 both paths agree to ~1e-16, attention runs in float64 (`compute_dtype`), and
    quantizing identical float16 values is deterministic."""
    return LoadedModel(model=float64(copy.deepcopy(tiny_lm.model)), tokenizer=tiny_lm.tokenizer, spec="tiny-llama-f64")


def _plain_perplexity(lm, windows, float16_cache=False):
    """Perplexity of the model itself (float64 cross-entropy), and its largest |logit|; with `float16_cache`
    every key and value is rounded to float16 first, as the cache holds them."""
    nll, top = 0.0, 0.0

    def attend(layer, q, k, v, opts):
        return mixed_attention(q, k.half().to(k.dtype), v.half().to(v.dtype), opts)

    with torch.no_grad(), intercept(lm.model, attend) if float16_cache else contextlib.nullcontext():
        for w in windows:
            logits = lm.model(w[None], use_cache=False).logits[0]
            nll += torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
            top = max(top, logits.abs().max().item())
    return math.exp(nll / (windows.numel() - len(windows))), top


def _decoded_perplexity(lm, windows, method):
    """Token-by-token decoding; at every step the cache is re-held from scratch by the method. Returns the
    perplexity and the largest |logit|."""
    nll, count, top = 0.0, 0, 0.0

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
                top = max(top, logits.abs().max().item())
                count += 1
    return math.exp(nll / count), top


_DECODED: dict = {}


def _check_kivi_matches_decoding(lm, text_file, bits, group, residual, seq_len):
    """eval's kivi perplexity on two windows equals token-by-token decoding's within `perplexity_tolerance`;
    returns it. The decoding, the slow part, is computed once per setting."""
    result = evaluate(lm, dataset=str(text_file), num_samples=2, seq_len=seq_len, method="kivi",
                      bits=bits, group_size=group, residual=residual)
    key = (bits, group, residual, seq_len)
    if key not in _DECODED:
        windows = token_windows(lm.tokenizer, str(text_file), "evaluation", 2, seq_len)
        method = build_method("kivi", attention_shape(lm.config), MethodSettings(bits, group, residual))
        _DECODED[key] = _decoded_perplexity(lm, windows, method)
    decoded, top = _DECODED[key]
    tol = perplexity_tolerance(lm.config.vocab_size, seq_len - 1, decoded, top)
    assert result.perplexity == pytest.approx(decoded, rel=tol)
    return result.perplexity


def _check_float16_attention_error(errors):
    """Approximate by design: rounding to float16 moves each key and value by <= u16 = 2^-11 relative, and the
    attention output inherits about that (the independent roundings average out: measured 2-3e-4 per layer).
    2 u16 ~ 1e-3 holds it to float16's own scale; a bfloat16 cache (u = 2^-8 = 8 u16) exceeds it. (The
    rigorous worst case, every rounding aligned, is ~1e-2 with this model's score magnitudes: too weak to
    tell float16 from bfloat16.)"""
    assert max(errors) < 2 * U16


def test_fp16_eval_equals_the_plain_model_perplexity(tiny_lm64, text_file):
    windows = token_windows(tiny_lm64.tokenizer, str(text_file), "evaluation", 2, 64)
    result = evaluate(tiny_lm64, dataset=str(text_file), num_samples=2, seq_len=64, method="fp16")
    # Only the float16 rounding of the cached keys and values separates the two: with it applied to the plain
    # model, they agree to eval's float32 cross-entropy (`perplexity_tolerance`).
    rounded, top = _plain_perplexity(tiny_lm64, windows, float16_cache=True)
    assert result.perplexity == pytest.approx(rounded, rel=perplexity_tolerance(tiny_lm64.config.vocab_size, 63, rounded, top))
    # Approximate by design: the rounding itself (<= u16 = 2^-11 ~ 4.9e-4 relative per key and value) moves the
    # perplexity by 1.1e-5 here; 1e-3 (2 u16) holds it to float16's own scale.
    assert result.perplexity == pytest.approx(_plain_perplexity(tiny_lm64, windows)[0], rel=1e-3)
    assert result.effective_bits == 16.0
    _check_float16_attention_error(result.per_layer_attention_rel_error)


def test_the_float16_attention_error_check_catches_a_bfloat16_cache(tiny_lm64, text_file, monkeypatch):
    def hold_in_bfloat16(method, layer, k, v):
        held = hold(method, layer, k, v)
        held.k, held.v = held.k.bfloat16().to(k.dtype), held.v.bfloat16().to(v.dtype)
        return held

    monkeypatch.setattr(evaluate_module, "hold", hold_in_bfloat16)
    result = evaluate(tiny_lm64, dataset=str(text_file), num_samples=1, seq_len=64, method="fp16")
    with pytest.raises(AssertionError):  # measured 1.6e-3 and 2.5e-3 for the two layers
        _check_float16_attention_error(result.per_layer_attention_rel_error)


@pytest.mark.parametrize("bits,group,residual,seq_len", [(2, 4, 8, 37), (3, 8, 16, 41), (1, 4, 4, 30)])
def test_eval_is_exact_with_respect_to_token_by_token_decoding(tiny_lm64, text_file, bits, group, residual, seq_len):
    ppl = _check_kivi_matches_decoding(tiny_lm64, text_file, bits, group, residual, seq_len)
    # The quantized cache really took part (a random model's perplexity may move either way). Approximate by
    # design: 1- to 3-bit keys and values move the perplexity by 0.8%-6% here; 1e-3 is 8x below the least.
    windows = token_windows(tiny_lm64.tokenizer, str(text_file), "evaluation", 2, seq_len)
    assert ppl != pytest.approx(_plain_perplexity(tiny_lm64, windows)[0], rel=1e-3)


def test_the_decoding_comparison_catches_a_residual_window_off_by_one(tiny_lm64, text_file, monkeypatch):
    # eval's queries count the cache one token short, so each block is read compressed one query late.
    monkeypatch.setattr(evaluate_module, "flushed_counts", lambda tq, tk, block, device=None, window=0:
                        flushed_length(torch.arange(tk - tq, tk, device=device), block, window))
    with pytest.raises(AssertionError):  # measured 2.7e-2 off: ~500 times the tolerance
        _check_kivi_matches_decoding(tiny_lm64, text_file, 1, 4, 4, 30)


def test_the_decoding_comparison_catches_a_flushed_block_left_uncompressed(tiny_lm64, text_file, monkeypatch):
    def hold_leaving_the_last_block(method, layer, k, v):
        held = hold(method, layer, k, v)
        if held.flushed:
            last = slice(held.flushed - method.block, held.flushed)
            held.k[..., last, :], held.v[..., last, :] = held.k16[..., last, :], held.v16[..., last, :]
        return held

    monkeypatch.setattr(evaluate_module, "hold", hold_leaving_the_last_block)
    with pytest.raises(AssertionError):  # measured 1.4e-2 off: ~250 times the tolerance
        _check_kivi_matches_decoding(tiny_lm64, text_file, 1, 4, 4, 30)


def test_effective_bits_count_metadata_and_the_float16_residual(tiny_lm, text_file):
    # seq_len 40 with R=16: 32 tokens in 2-bit blocks (+32/G bits of fp16 scale and zero), 8 in fp16.
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=1, seq_len=40, method="kivi",
                      bits=2, group_size=8, residual=16)
    expected = (32 * (2 + 32 / 8) + 8 * 16) / 40
    # Exact: integer bit counts over an integer element count, and both sides are exactly 8.0 in binary.
    assert result.effective_bits == expected


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


def test_decode_bits_separate_the_compressed_part_from_the_float16_window():
    from kvcalib.evaluate import decode_bits

    # 5 tokens of 10 elements each, blocks of 2: 4 tokens at 2 bits, the 5th in the float16 window
    out = decode_bits(stored_bits=2 * 4 * 10 + 16 * 10, elements=50, seq_len=5, block=2, shared=0.25)
    assert out["compressed_part_bits_per_element"] == 2.0
    # decode steps t = 1..5 hold 0, 2, 2, 4, 4 tokens compressed: 16, 2, 20/3, 2, 24/5 bits per element
    assert out["decode_averaged_bits_per_element"] == pytest.approx((16 + 2 + 20 / 3 + 2 + 24 / 5) / 5 + 0.25, rel=1e-12)
    assert decode_bits(16 * 30, 30, 3, 4, 0.0) == {"compressed_part_bits_per_element": None,
                                                   "decode_averaged_bits_per_element": 16.0}


def test_decode_bits_under_a_sliding_window_count_the_window_as_float16():
    from kvcalib.evaluate import decode_bits

    # 6 tokens of 10 elements each, window 2, block 1: 4 tokens flushed at 2 bits, the newest 2 float16
    out = decode_bits(stored_bits=2 * 10 * 4 + 16 * 10 * 2, elements=60, seq_len=6, block=1, shared=0.0, window=2)
    assert out["compressed_part_bits_per_element"] == pytest.approx(2.0, rel=1e-12)
    # step t holds max(t - 2, 0) tokens at 2 bits and the rest float16
    want = sum((2 * max(t - 2, 0) + 16 * min(t, 2)) / t for t in range(1, 7)) / 6
    assert out["decode_averaged_bits_per_element"] == pytest.approx(want, rel=1e-12)
