"""Every command on the architectures users bring beside Llama: Qwen3 (QK norms), Mistral, Phi-3 (fused projections),
Gemma 2 (soft-capping, every other layer sliding) and Gemma 3 (five of six layers sliding), each as a small
same-architecture model on the CPU.

- The whole pipeline from the command line: `collect` -> `fit-codebook` -> `plan` -> `eval` -> `generate`, then
  `model.generate` through `KvcalibCache` of each artifact and of KIVI.
- The token-by-token logits of the cache a decoder holds against `eval`'s one-forward scoring of the same cache (the
  torch reference), in float64, as tests/test_held_cache_agreement.py holds the embedded model: within 2^-30 of the
  largest logit (its `LOGITS_REL`, from the same round-off argument: both paths float64, differing in the order of
  their sums; a block flushed one token late moves a logit by 0.1 of the largest there)."""

import json

import pytest
import torch

import kvcalib.evaluate as evaluate_module
from kvcalib.cli import main
from kvcalib.evaluate import evaluate
from kvcalib.methods import MethodSettings
from kvcalib.models import LoadedModel, load_model, sliding_windows
from kvcalib.runtime.cache import KvcalibCache
from conftest import float64, tiny_model

LOGITS_REL = 2.0**-30  # tests/test_held_cache_agreement.py
# Gemma 2 soft-caps its scores, so its kept sliding layers attend through its own eager attention, which takes the
# softmax in float32 whatever the model's dtype: weights rounded to 2^-24 carry into the logits at 1.3e-7 of the
# largest (measured, 2^-22.9); 2^-20 leaves 8x, still 10^5 below a block flushed one token late.
FLOAT32_SOFTMAX_REL = 2.0**-20

# Windows of 8 tokens, so that they slide within the texts below; Gemma 3 with six layers (five slide).
ARCHS = {"qwen3": {}, "mistral": {"sliding_window": None}, "phi3": {}, "gemma2": {"sliding_window": 8},
         "gemma3_text": {"num_hidden_layers": 6, "sliding_window": 8}}


# The methods a cache holds without an artifact (the pipeline test below decodes the fitted ones, VecInfer and the
# plan, through `model.generate`): R = 16, so that 65 tokens flush four blocks.
METHODS = {"kivi": {"bits": 2, "group_size": 8, "residual": 16}, "oscar": {"bits": 2, "group_size": 8, "residual": 16},
           "turboquant": {"bits": 3, "residual": 16}}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_decoder_holds_the_cache_eval_scores_on_each_architecture(arch, method, tokenizer, monkeypatch):
    """KIVI-2 G=8, OScaR-2 G=8 and TurboQuant-3, R=16, over 65 tokens (four flushes): logits of one token at a time
    through `KvcalibCache` equal eval's one forward, sliding layers kept as the model computes them on both sides."""
    lm = LoadedModel(model=float64(tiny_model(arch, **ARCHS[arch])), tokenizer=tokenizer, spec=f"tiny-{arch}")
    options = METHODS[method]
    window = torch.randint(5, 500, (65,), generator=torch.Generator().manual_seed(0))
    logits = []
    hook = lm.model.register_forward_hook(lambda module, args, out: logits.append(out.logits[0].detach()))
    monkeypatch.setattr(evaluate_module, "token_windows", lambda *args, **kwargs: window[None])
    try:
        evaluate(lm, num_samples=1, seq_len=65, method=method, **options)
    finally:
        hook.remove()
    scored = logits[0][:-1]

    def decode(cache) -> torch.Tensor:
        """A prompt of 15 tokens (nothing flushes yet), then one token at a time."""
        with torch.no_grad():
            rows = [lm.model(window[None, :15], past_key_values=cache, use_cache=True).logits[0]]
            for t in range(15, 64):
                rows.append(lm.model(window[None, t : t + 1], past_key_values=cache, use_cache=True).logits[0])
        return torch.cat(rows)

    cache = KvcalibCache(lm, method, MethodSettings(**options))
    assert set(cache.method.float16_layers) == set(sliding_windows(lm.config))
    decoded = decode(cache)
    atol = (FLOAT32_SOFTMAX_REL if arch == "gemma2" else LOGITS_REL) * scored.abs().max().item()
    torch.testing.assert_close(decoded, scored, rtol=0, atol=atol)
    assert any(layer.length - layer.k_res.shape[-2] >= 48 for layer in cache.layers if hasattr(layer, "k_res"))
    if sliding_windows(lm.config):  # the planted error: a decoder that compresses the layers eval keeps
        other = decode(KvcalibCache(lm, method, MethodSettings(**options, sliding_layers="compress")))
        assert (other - scored).abs().max().item() > 1000 * atol


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request, tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param, **ARCHS[request.param]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _run(args: list[str], capsys) -> str:
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code in (0, None), out.err[-2000:]
    return out.out


def test_every_command_runs_on_each_architecture(model_dir, tmp_path, text_file, capsys):
    model = ["--model", str(model_dir), "--device", "cpu"]
    acts, books, plan = tmp_path / "acts", tmp_path / "books", tmp_path / "plan"
    _run(["collect", *model, "--dataset", str(text_file), "--num-samples", "4", "--seq-len", "64", "--out", str(acts)],
         capsys)
    _run(["fit-codebook", "--activations", str(acts), "--k-config", "d4b4", "--v-config", "d4b4", "--iters", "3",
          "--out", str(books)], capsys)
    _run(["plan", "--activations", str(acts), *model, "--budget", "5",
          "--candidates", "turboquant-2,turboquant-4,kivi-2-g8",
          "--windows", "1", "--seq-len", "160", "--iters", "3", "--out", str(plan)], capsys)  # R = 128 flushes once
    sliding = sliding_windows(load_model(str(model_dir), device="cpu").config)
    manifest = json.loads((plan / "manifest.json").read_text())
    assert manifest["settings"]["float16_layers"] == sorted(sliding)
    result = tmp_path / "eval.json"
    _run(["eval", *model, "--dataset", str(text_file), "--num-samples", "1", "--seq-len", "160", "--method", "plan",
          "--artifacts", str(plan), "--json", str(result)], capsys)
    scored = json.loads(result.read_text())
    assert torch.isfinite(torch.tensor(scored["perplexity"])) and 0 < scored["effective_bits"] < 16
    assert scored["bits_breakdown"]["float16_layers"] == len(sliding)
    text = _run(["generate", *model, "--method", "plan", "--artifacts", str(plan), "--prompt", "The module",
                 "--max-new-tokens", "6"], capsys)
    assert text.strip()
    lm = load_model(str(model_dir), device="cpu")
    ids = lm.tokenizer(text_file.read_text()[:4000], return_tensors="pt").input_ids[:, :140]  # past R = 128
    for method, artifacts, settings in (("kivi", None, MethodSettings(bits=2, group_size=8, residual=8)),
                                        ("vecinfer", str(books), MethodSettings(residual=8)),
                                        ("plan", str(plan), MethodSettings())):
        cache = KvcalibCache(lm, method, settings, artifacts=artifacts)
        out = lm.model.generate(ids, past_key_values=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + 24
        flushed = [layer.length - layer.k_res.shape[-2] for layer in cache.layers if hasattr(layer, "k_res")]
        assert min(flushed) > 0  # every compressed layer holds codes
