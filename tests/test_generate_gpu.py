"""`model.generate` with a StaticKvcalibCache on the GPU: its forwards go to the cache (prompt batch into slots,
decode steps replayed from the captured graph), held to what a user of `generate` expects.

- Greedy tokens and logits equal kvcalib's own serving loop's (`kvcalib.runtime.captured.generate`) bit for bit:
  the same captured step on the same slots. Against `KvcalibCache` (other launches, other matmul shapes) the
  logits differ by float16 round-off, so the tokens agree up to the first step whose top two logits lie within
  that round-off (`_near_tie`).
- A left-padded batch gives each prompt the tokens and logits it gets alone, bit for bit (the same cache, so
  the same step shapes: rows of a step are independent).
- EOS, seeded sampling and streamers: `tests/test_generate.py`'s contract, every method the static cache holds.
- A second `generate` call on the same cache gives what the first gave (the slots start empty again).
"""

import pytest
import torch

from kvcalib.runtime.cache import KvcalibCache
from kvcalib.runtime.static_cache import StaticKvcalibCache

pytest.importorskip("cupy", reason="the fused kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the static cache and its captured step run only on a GPU", allow_module_level=True)

from test_generate import (check_eos_stops_a_row, check_seeded_sampling_repeats,  # noqa: E402
                           check_streamer_gets_every_token, left_padded, run)
from test_static_cache_gpu import DEV, METHODS, _model, _model_method  # noqa: E402

STEPS = 70  # past two flushes of R = 32 for every prompt below


def _prompts(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=gen) for n in (45, 31, 8)]


def _static(model, name: str, batch: int = 3):
    method = _model_method(model, name)
    cache = StaticKvcalibCache(model, method, max_batch=batch, max_length=256)
    return lambda: cache  # one cache for every call: generate empties its slots at each prompt batch


def _near_tie(logits: torch.Tensor) -> torch.Tensor:
    """Steps whose top two logits are within 8 float16 ulps of the largest (B, steps): there float16 round-off
    of the activations (an ulp or two of each logit, tests/test_static_cache_gpu.py) may swap the greedy token."""
    top = logits.float().topk(2, dim=-1).values
    ulp = 2.0 ** (torch.floor(torch.log2(top[..., 0].abs())) - 10)
    return (top[..., 0] - top[..., 1]) <= 8 * ulp


@pytest.mark.parametrize("name", METHODS)
def test_generate_gives_the_serving_loops_tokens_and_logits_and_the_dynamic_caches_tokens(name):
    from kvcalib.runtime.captured import generate

    model = _model()
    prompts = _prompts(1)
    ids, mask = left_padded(prompts)
    make = _static(model, name)
    tokens, logits = run(model, make, ids, mask, STEPS, do_sample=False)
    again, again_logits = run(model, make, ids, mask, STEPS, do_sample=False)
    assert torch.equal(tokens, again) and torch.equal(logits, again_logits)
    loop = generate(model, make(), [p.to(DEV) for p in prompts], max_new_tokens=STEPS)
    assert tokens.tolist() == loop
    method = _model_method(model, name)
    for b, p in enumerate(prompts):
        dyn_tokens, dyn_logits = run(model, lambda: KvcalibCache(model, method), p[None], None, STEPS, do_sample=False)
        differ = (dyn_tokens[0] != tokens[b]).nonzero()
        if len(differ):
            first = int(differ[0])
            if name == "turboquant" and not _near_tie(dyn_logits[0, first]):
                # Seen on an H200 (the 8-token prompt, step 66), an open question: both caches store the same bits
                # for the same tokens (tests/test_static_cache.py) and the kernel holds each row to the float64
                # reference (tests/test_codebook_kernel_gpu.py); the batch's activations differ from a lone
                # prompt's by round-off, and a rotated code may flip on it.
                pytest.xfail(f"static and dynamic TurboQuant part beyond a near tie at row {b}, step {first}")
            assert _near_tie(dyn_logits[0, first]), (b, first)


@pytest.mark.parametrize("name", ["kivi", "vecinfer"])
def test_a_left_padded_batch_gives_each_prompt_its_tokens_and_logits_alone(name):
    model = _model()
    prompts = _prompts(2)
    make = _static(model, name)
    ids, mask = left_padded(prompts)
    tokens, logits = run(model, make, ids, mask, STEPS, do_sample=False)
    for b, p in enumerate(prompts):
        alone, alone_logits = run(model, make, p[None], None, STEPS, do_sample=False)
        assert tokens[b].tolist() == alone[0].tolist()
        assert torch.equal(logits[b], alone_logits[0])


def test_a_prompt_padded_on_the_right_is_refused_with_the_fix():
    from kvcalib.errors import SettingsError

    model = _model()
    ids, mask = left_padded(_prompts(3))
    with pytest.raises(SettingsError, match="padding_side"):
        run(model, _static(model, "kivi"), ids.flip(1), mask.flip(1), 4)


@pytest.mark.parametrize("name", METHODS)
def test_eos_sampling_and_streamers_hold_through_the_captured_step(name):
    model = _model()
    check_eos_stops_a_row(model, _static(model, name), _prompts(4))
    check_seeded_sampling_repeats(model, _static(model, name), _prompts(5))
    check_streamer_gets_every_token(model, _static(model, name), _prompts(6))


def _hybrid(dtype: torch.dtype, arch: str = "gemma3_text"):
    """A small Gemma 3 (five sliding layers over 24 tokens, then one full-attention layer), or Gemma 2 (every other
    layer sliding, scores soft-capped at 5), on the GPU in `dtype`."""
    from conftest import tiny_model

    model = tiny_model(arch, seed=3, num_hidden_layers=6, sliding_window=24, head_dim=64, hidden_size=256,
                       intermediate_size=512, vocab_size=1000).to(dtype).to(DEV).eval()
    model.generation_config.eos_token_id = None  # every call decodes all its steps
    return model


@pytest.mark.parametrize("name,dtype,arch", [("kivi", torch.float16, "gemma3_text"), ("plan", torch.float16, "gemma3_text"),
                                             ("kivi", torch.bfloat16, "gemma3_text"), ("kivi", torch.bfloat16, "gemma2")])
def test_a_hybrid_model_takes_the_static_cache_its_sliding_layers_kept_and_decodes_the_dynamic_caches_tokens(name,
                                                                                                           dtype, arch):
    """Gemma 3's sliding layers kept uncompressed (the default): the cache `kvcalib generate` picks is the static one,
    its five sliding layers rings of the window (`StaticWindowLayer`), the full layer compressed; Gemma 2's three,
    its soft-capped scores capped in the rings, the prompts' chunks and the codebook kernel. Through
    `model.generate` (captured step) its greedy tokens are the eager serving loop's, and `KvcalibCache`'s (the
    sliding layers there are transformers' own window layers under its mask) up to the first near tie, prompts of
    45, 31 and 8 tokens past, beyond and under the window (bfloat16: the ties counted in its own ulps, 7 bits); past
    a wider parting, the float32 model says which pick is right (`_float32_logits`)."""
    from kvcalib.generate import runtime_cache
    from kvcalib.models import LoadedModel
    from kvcalib.runtime.captured import generate
    from kvcalib.runtime.static_cache import StaticWindowLayer

    from kvcalib.models import sliding_windows

    model = _hybrid(dtype, arch)
    picked = runtime_cache(LoadedModel(model=model, tokenizer=None, spec=f"tiny-{arch}"), _model_method(model, name),
                           3, 256)
    assert isinstance(picked, StaticKvcalibCache)
    sliding = sliding_windows(model.config)
    assert [isinstance(layer, StaticWindowLayer) for layer in picked.layers] == [i in sliding for i in range(6)]
    assert len(sliding) == (5 if arch == "gemma3_text" else 3)
    prompts = _prompts(1)
    ids, mask = left_padded(prompts)
    make = _static(model, name)
    tokens, _ = run(model, make, ids, mask, STEPS, do_sample=False)
    assert tokens.tolist() == generate(model, make(), [p.to(DEV) for p in prompts], max_new_tokens=STEPS,
                                       captured=False)
    method = _model_method(model, name)
    bits = 10 if dtype == torch.float16 else 7
    for b, p in enumerate(prompts):
        dyn_tokens, dyn_logits = run(model, lambda: KvcalibCache(model, method), p[None], None, STEPS, do_sample=False)
        differ = (dyn_tokens[0] != tokens[b]).nonzero()
        if len(differ):
            first = int(differ[0])
            top = dyn_logits[0, first].float().topk(2).values
            if top[0] - top[1] <= 8 * 2.0 ** (torch.floor(torch.log2(top[0].abs())) - bits):
                continue
            # Beyond a near tie: the two bf16 paths round differently (Gemma 2's eager attention caps and weighs in
            # bfloat16, the static cache's rings and prompts in float32), so the float32 model is the referee.
            ref = _float32_logits(model, arch, method, p, tokens[b], first)
            noise = (dyn_logits[0, first].float() - ref).abs().max()
            picked = int(tokens[b, first])
            assert ref.max() - ref[picked] <= 2 * noise, (b, first, float(ref.max() - ref[picked]), float(noise))


def _float32_logits(model, arch: str, method, prompt: torch.Tensor, tokens: torch.Tensor, step: int) -> torch.Tensor:
    """The logits (V,) of decode step `step` of `method`'s reference cache (`KvcalibCache`) over `model`'s weights in
    float32 (a fresh model of `arch`, not a copy: a copy would carry the static cache's forward route), fed `prompt`
    and then `tokens[:step]`. At a step where two paths in the model's dtype part, this says which token is right:
    the static cache's pick stands if its float32 logit is within twice the dynamic path's own distance from these
    logits of the best (each of the two logits may move by that much in the model's dtype)."""
    ref = _hybrid(torch.float32, arch)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    cache = KvcalibCache(ref, method)
    with torch.no_grad():
        out = ref(prompt[None].to(DEV), past_key_values=cache, use_cache=True)
        for t in tokens[:step]:
            out = ref(t.view(1, 1).to(DEV), past_key_values=cache, use_cache=True)
    assert out.logits.dtype == torch.float32
    return out.logits[0, -1].float().cpu()
