"""`kvcalib lm-eval` (kvcalib/harness.py): lm-eval's generation and loglikelihood requests go through the
cache a decoder holds. On the tiny model in float64 (as tests/test_runtime_cache.py, whose reference and
planted errors these reuse):
- generation (`_model_generate`, what `generate_until` calls) gives the tokens and logits of the
  independent recomputation of the cache, for every method;
- loglikelihood (`_model_call`) gives, at every position, the logits of `KvcalibCache` fed the same
  tokens one at a time;
- an error planted in the runtime cache (a window flushed a token late, a block left uncompressed) fails both."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("lm_eval", reason="kvcalib lm-eval needs lm-evaluation-harness (pip install 'kvcalib[lm-eval]')")

from conftest import float64, tiny_model  # noqa: E402
from test_runtime_cache import CASES, PLANTS, _method, _reference_greedy  # noqa: E402
from tolerances import U32  # noqa: E402

from kvcalib.harness import kvcalib_lm  # noqa: E402
from kvcalib.models import LoadedModel, attention_shape  # noqa: E402
from kvcalib.runtime.cache import KvcalibCache  # noqa: E402


def _lm(tokenizer, name: str):
    model = float64(tiny_model("llama", seed=1))
    lm = LoadedModel(model=model, tokenizer=tokenizer, spec="tiny")
    return lm, _method(name, attention_shape(model.config))


def _generation_matches_the_reference(tokenizer, name: str) -> None:
    """30 greedy tokens through lm-eval's generation call equal the reference recomputation's; logits as in
    tests/test_runtime_cache.py (float32 roundings of float64 results that agree to round-off: 3 u32 relative,
    and 2^-40 of the largest logit for logits near zero)."""
    lm, method = _lm(tokenizer, name)
    harness = kvcalib_lm(lm, copy.copy(method))
    lm.model.generation_config.eos_token_id = None  # random weights: decode every step, whatever is drawn
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (1, 21))
    with torch.no_grad():
        out = harness._model_generate(prompt, max_length=prompt.shape[1] + 30, stop=[], do_sample=False,
                                      attention_mask=torch.ones_like(prompt), output_logits=True,
                                      return_dict_in_generate=True)
    ref_tokens, ref_logits = _reference_greedy(lm.model, method, prompt, 30)
    assert out.sequences[0, prompt.shape[1]:].tolist() == ref_tokens
    for got, want in zip(out.logits, ref_logits):
        torch.testing.assert_close(got[0], want.float(), rtol=3 * U32, atol=2.0**-40 * want.abs().max().item())


def _scores_match_decoding(tokenizer, name: str) -> None:
    """lm-eval's scoring forward (all positions at once) against KvcalibCache fed one token at a time: the same
    float64 computation in another order, within 1e-9 relative (float64 round-off through two layers is
    ~1e-14; a 2-bit cache moves logits by ~1e-2, planted errors by more than 1e-4)."""
    lm, method = _lm(tokenizer, name)
    harness = kvcalib_lm(lm, copy.copy(method))
    ids = torch.randint(0, 512, (1, 45), generator=torch.Generator().manual_seed(2))
    scored = harness._model_call(ids)[0]
    cache = KvcalibCache(lm, copy.copy(method))
    with torch.no_grad():
        decoded = torch.cat([lm.model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0]
                             for t in range(ids.shape[1])])
    torch.testing.assert_close(scored, decoded, rtol=1e-9, atol=1e-9 * decoded.abs().max().item())


COMPRESSED = [n for n in CASES if n != "fp16"]  # fp16 is lm-eval's own path (the model's cache, its dtype)


@pytest.mark.parametrize("name", COMPRESSED)
def test_generation_through_lm_eval_decodes_as_the_cache_a_decoder_holds(tokenizer, name, plant):
    _generation_matches_the_reference(tokenizer, name)


@pytest.mark.parametrize("name", COMPRESSED)
def test_loglikelihoods_through_lm_eval_score_each_position_as_a_decoder_holds_it(tokenizer, name, plant):
    _scores_match_decoding(tokenizer, name)


@pytest.mark.parametrize("plant_name", list(PLANTS))
@pytest.mark.parametrize("name", ["kivi", "oscar", "vecinfer+sinks", "plan"])
def test_a_planted_cache_error_fails_both_comparisons(tokenizer, name, plant_name, monkeypatch):
    PLANTS[plant_name](monkeypatch)
    with pytest.raises(AssertionError):
        _generation_matches_the_reference(tokenizer, name)
    with pytest.raises(AssertionError):
        _scores_match_decoding(tokenizer, name)


def test_fp16_is_lm_evals_own_path(tokenizer):
    """--method fp16 leaves lm-eval's Hugging Face path as it is: the model's own cache and dtype."""
    lm, method = _lm(tokenizer, "fp16")
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = lm.model(ids).logits
    assert torch.equal(kvcalib_lm(lm, method, batch_size=2)._model_call(ids), plain)


@pytest.mark.parametrize("args,says", [
    (["--tasks", "no_such_task"], "has no task no_such_task"),
    (["--tasks", " , "], "names no task"),
    (["--tasks", "ruler_vt", "--limit", "0"], "--limit must be positive"),
    (["--tasks", "ruler_vt", "--batch-size", "0"], "--batch-size must be positive"),
    (["--tasks", "ruler_vt", "--max-lengths", "4k"], "expected comma-separated integers")])
def test_kvcalib_lm_eval_refuses_bad_input_in_one_line_before_loading_a_model(args, says, capsys):
    from kvcalib.cli import main

    with pytest.raises(SystemExit) as done:
        main(["lm-eval", "--model", "no-such-model-dir", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_static_cache_is_kept_for_the_batches_it_holds_and_a_dynamic_one_is_made_per_batch(monkeypatch):
    """`kvcalib lm-eval` on a GPU: one static cache (and its captured step) serves every later batch of no more
    rows and tokens, sized for the next power of two of the first batch's length, up to the model's context;
    a dynamic cache holds one batch's tokens, so each batch gets a new one. An outgrown static cache is closed
    (its captured step's memory freed) before the next is made."""
    from types import SimpleNamespace

    import kvcalib.harness as harness

    made, closed = [], []

    def fake(model, method, max_batch, max_length):
        made.append((max_batch, max_length))
        if method != "static":
            return object()
        cache = SimpleNamespace(max_batch=max_batch, max_length=max_length)
        cache.close = lambda: closed.append((cache.max_batch, cache.max_length, len(made)))
        return cache

    monkeypatch.setattr(harness, "runtime_cache", fake)
    config = SimpleNamespace(max_position_embeddings=8192)
    owner = SimpleNamespace(loaded=SimpleNamespace(config=config), method="static", static=None)
    first = harness.reused_cache(owner, 4, 5000)
    assert made == [(4, 8192)] and owner.static is first
    assert harness.reused_cache(owner, 4, 3000) is first and harness.reused_cache(owner, 2, 8192) is first
    assert not closed
    assert harness.reused_cache(owner, 8, 100) is not first and made[-1] == (8, 128)
    assert closed == [(4, 8192, 1)]  # the first, closed before the second was made
    harness.reused_cache(owner, 8, 9000)  # past the context: sized for the batch as asked
    assert made[-1] == (8, 9000) and closed == [(4, 8192, 1), (8, 128, 2)]
    dynamic = SimpleNamespace(loaded=owner.loaded, method="dynamic", static=None)
    assert harness.reused_cache(dynamic, 1, 10) is not harness.reused_cache(dynamic, 1, 10)
    assert dynamic.static is None
