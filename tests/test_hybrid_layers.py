"""Models whose layers slide over a window beside full-attention ones (Gemma 2 and 3): by default every command keeps
the sliding layers as the model computes them (`--sliding-layers float16`, `Method.float16_layers`) and compresses
the others. The runtime cache holds a kept layer as transformers' own window layer and attends over it with the
model's own attention and mask; eval counts its window at 16 bits; plan makes no items of it unless asked
(`--sliding-layers compress`), and a plan made so keeps its rule."""

import json

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import kvcalib.runtime.cache as runtime_cache
from kvcalib.cli import main
from kvcalib.collect import collect
from kvcalib.errors import SettingsError
from kvcalib.evaluate import decode_bits, evaluate
from kvcalib.methods import MethodSettings, build_method
from kvcalib.methods.plan_fit import make_plan
from kvcalib.models import LoadedModel, attention_shape, sliding_windows
from kvcalib.runtime.cache import CompressedLayer, Float16WindowLayer, KvcalibCache
from conftest import tiny_config, tiny_model

# Gemma 3 slides 5 layers of every 6 (the sixth attends in full); Gemma 2 every other one, and soft-caps its scores.
HYBRIDS = {"gemma3_text": dict(num_hidden_layers=6, sliding_window=8), "gemma2": dict(sliding_window=8)}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tokenizer):
    return LoadedModel(model=tiny_model(request.param, **HYBRIDS[request.param]), tokenizer=tokenizer,
                       spec=f"tiny-{request.param}")


def test_the_sliding_layers_and_their_windows_come_from_the_config():
    assert sliding_windows(tiny_config("gemma3_text", **HYBRIDS["gemma3_text"])) == {i: 8 for i in range(5)}
    assert sliding_windows(tiny_config("gemma2", **HYBRIDS["gemma2"])) == {0: 8}
    assert sliding_windows(tiny_config("mistral")) == {0: 24, 1: 24}  # one window for every layer (v0.1)
    assert sliding_windows(tiny_config("mistral", sliding_window=None)) == {}
    assert sliding_windows(tiny_config("llama")) == sliding_windows(tiny_config("qwen3")) == {}


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 40 and 33 real tokens (five windows), the second left-padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids, mask


def _generate(model, cache):
    ids, mask = _prompt()
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)


def test_kept_sliding_layers_decode_as_transformers_own_cache(hybrid, monkeypatch):
    """A cache that never flushes (R past the whole call) holds every layer as transformers' DynamicCache does, the
    sliding ones as its own window layers: greedy tokens of a padded batch equal, every step's logits within 1e-3.
    (The full-attention layers hold float16 keys and values where the model computes in float32: 1.4e-4 to 1.8e-4
    measured; 1e-3 leaves five times that.) Without the masks transformers makes for the layers' windows and the
    batch's padding, the same check fails: it sees what it checks."""
    model = hybrid.model
    want = _generate(model, DynamicCache(config=model.config))
    cache = KvcalibCache(hybrid, "kivi", MethodSettings(bits=2, group_size=8, residual=256))
    kept = sliding_windows(model.config)
    assert [type(layer) for layer in cache.layers] == [Float16WindowLayer if i in kept else CompressedLayer
                                                      for i in range(model.config.num_hidden_layers)]
    got = _generate(model, cache)
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)) < 1e-3
    assert all(layer.keys.shape[-2] == 8 - 1 for i, layer in enumerate(cache.layers) if i in kept)  # its window
    # the planted error: the same attention under a name transformers makes no masks for
    AttentionInterface.register("kvcalib_runtime_unmasked", runtime_cache._attention)
    monkeypatch.setattr(runtime_cache, "IMPLEMENTATION_MASKED", "kvcalib_runtime_unmasked")
    monkeypatch.setattr(runtime_cache, "register_attention", lambda: None)
    unmasked = _generate(model, KvcalibCache(hybrid, "kivi", MethodSettings(bits=2, group_size=8, residual=256)))
    assert max((a - b).abs().max().item() for a, b in zip(unmasked.scores, want.scores)) > 1e-2


def test_a_prompt_within_the_window_attends_causally_in_a_kept_sliding_layer(hybrid):
    """A lone prompt no longer than the window: transformers makes no mask for it (SDPA's `is_causal` does the work),
    and the eager attention a soft-capping model's kept layers run (Gemma 2) adds none, so the layer must mask
    causally itself. Six tokens under a window of 8, greedy steps past the window: the tokens of transformers' own
    DynamicCache, its logits within 1e-3 (the test above's bound; the prompt attended over later tokens too, before
    this was mended, gave Gemma 2 logits 0.88 off on a GPU)."""
    model = hybrid.model
    ids = torch.randint(5, 500, (1, 6), generator=torch.Generator().manual_seed(1))
    run = lambda cache: model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False,  # noqa: E731
                                       output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    want = run(DynamicCache(config=model.config))
    got = run(KvcalibCache(hybrid, "kivi", MethodSettings(bits=2, group_size=8, residual=256)))
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)) < 1e-3


def test_compress_makes_every_layer_a_compressed_one_and_the_two_decode_apart(hybrid):
    compress = KvcalibCache(hybrid, "kivi", MethodSettings(bits=2, group_size=8, residual=8, sliding_layers="compress"))
    assert all(isinstance(layer, CompressedLayer) for layer in compress.layers)
    kept = KvcalibCache(hybrid, "kivi", MethodSettings(bits=2, group_size=8, residual=8))
    a, b = _generate(hybrid.model, compress), _generate(hybrid.model, kept)
    assert max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores)) > 1e-3
    assert 0 < kept.stored_bits() and 0 < compress.stored_bits()


def test_eval_counts_the_kept_windows_at_16_bits_and_their_error_is_none(hybrid):
    """R past the window of 64 tokens: nothing flushes, so every bit is a float16 one: the full-attention layers hold
    all 64 tokens, the sliding ones their window's 8, each at 16 bits; a kept layer attends exactly as the model."""
    model = hybrid.model
    layers, kept = model.config.num_hidden_layers, sliding_windows(model.config)
    result = evaluate(hybrid, method="kivi", bits=2, group_size=8, residual=128, num_samples=1, seq_len=64,
                      device="cpu")
    assert result.bits_breakdown["float16_layers"] == len(kept)
    assert result.effective_bits == pytest.approx(16 * ((layers - len(kept)) * 64 + len(kept) * 8) / (layers * 64))
    errors = result.per_layer_attention_rel_error
    assert all(errors[i] == 0 for i in kept) and all(errors[i] > 0 for i in range(layers) if i not in kept)


def test_decode_bits_counts_a_kept_layer_by_its_window():
    """Two layers, one kept with a window of 4, 10 tokens, blocks of 4, one element per token and layer: the coded
    layer holds 8 tokens at 3 bits and 2 at 16, the kept one 4 at 16."""
    stored = 3 * 8 + 16 * 2 + 16 * 4
    out = decode_bits(stored, elements=20, seq_len=10, block=4, shared=0.0, float16_windows=[4], layers=2)
    assert out["compressed_part_bits_per_element"] == pytest.approx(3.0)
    per_step = [((3 * (t // 4 * 4) + 16 * (t - t // 4 * 4)) + 16 * min(t, 4)) / (2 * t) for t in range(1, 11)]
    assert out["decode_averaged_bits_per_element"] == pytest.approx(sum(per_step) / 10)
    # no kept layer: the count it always was
    plain = decode_bits(3 * 8 + 16 * 2, elements=10, seq_len=10, block=4, shared=0.0)
    assert plain["compressed_part_bits_per_element"] == pytest.approx(3.0)


def test_a_plan_makes_items_of_the_full_attention_layers_alone_and_keeps_its_rule(tmp_path, tokenizer, text_file):
    """Gemma 3's five sliding layers are no items: their sensitivity is never measured and the budget is spent on
    the sixth; the plan records the rule, eval keeps those layers as the model computes them, and a contradicting
    --sliding-layers is refused. Under compress every layer is an item."""
    lm = LoadedModel(model=tiny_model("gemma3_text", **HYBRIDS["gemma3_text"]), tokenizer=tokenizer, spec="g3")
    acts = collect(tmp_path / "acts", model=lm, dataset=str(text_file), num_samples=2, seq_len=32)
    candidates = ("turboquant-2", "turboquant-4", "kivi-2-g8")
    [path] = make_plan(acts, 5.0, tmp_path / "plan", model=lm, candidates=candidates, windows=1, seq_len=32, iters=3,
                       residual=8, sink_tokens=0)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["settings"]["sliding_layers"] == "float16"
    assert manifest["settings"]["float16_layers"] == [0, 1, 2, 3, 4]
    sens = manifest["extra"]["sensitivity_per_kv_head"]
    assert all(torch.tensor(sens[p][i]).abs().sum() == 0 for p in "kv" for i in range(5))
    assert torch.tensor(sens["k"][5]).abs().sum() > 0
    shape = attention_shape(lm.config)
    method = build_method("plan", shape, MethodSettings(), artifacts=str(path), model=lm)
    assert method.float16_layers == {i: 8 for i in range(5)}
    with pytest.raises(SettingsError, match="--sliding-layers compress contradicts"):
        build_method("plan", shape, MethodSettings(sliding_layers="compress"), artifacts=str(path), model=lm)
    [every] = make_plan(acts, 5.0, tmp_path / "every", model=lm, candidates=candidates, windows=1, seq_len=32, iters=3,
                        residual=8, sink_tokens=0, sliding_layers="compress")
    sens = json.loads((every / "manifest.json").read_text())["extra"]["sensitivity_per_kv_head"]
    assert all(torch.tensor(sens["k"][i]).abs().sum() > 0 for i in range(6))


def test_a_model_that_only_slides_has_nothing_to_plan_unless_asked(tmp_path, tokenizer, text_file):
    lm = LoadedModel(model=tiny_model("mistral"), tokenizer=tokenizer, spec="tiny-mistral")  # every layer slides
    acts = collect(tmp_path / "acts", model=lm, dataset=str(text_file), num_samples=2, seq_len=32)
    with pytest.raises(SettingsError, match="nothing to plan"):
        make_plan(acts, 3.0, tmp_path / "plan", model=lm, candidates=("turboquant-2",), windows=1, seq_len=32,
                  iters=3, residual=8)
    assert not (tmp_path / "plan").exists()


def test_a_bad_sliding_layers_value_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--method", "kivi", "--sliding-layers", "sometimes"])
    assert exit_.value.code == 2
    assert "--sliding-layers" in capsys.readouterr().err


def test_diagnose_measures_the_sliding_layers_and_summarises_the_others(tmp_path, tokenizer, text_file):
    """The collection records Gemma 3's sliding layers; diagnose reports every layer, but its summary is the sixth's
    alone (kept layers are never quantized) unless asked to count them."""
    from kvcalib.diagnose import diagnose

    lm = LoadedModel(model=tiny_model("gemma3_text", **HYBRIDS["gemma3_text"]), tokenizer=tokenizer, spec="g3")
    acts = collect(tmp_path / "acts", model=lm, dataset=str(text_file), num_samples=2, seq_len=32)
    manifest = json.loads((acts / "manifest.json").read_text())
    assert manifest["sliding_windows"] == {str(i): 8 for i in range(5)}
    kept = json.loads((diagnose(acts, tmp_path / "d", bits=(2,), group_size=8) / "report.json").read_text())
    every = json.loads((diagnose(acts, tmp_path / "e", bits=(2,), group_size=8, sliding_layers="compress")
                        / "report.json").read_text())
    assert kept["float16_layers"] == [0, 1, 2, 3, 4] and every["float16_layers"] == []
    assert len(kept["layers"]) == len(every["layers"]) == 6
    sixth = kept["layers"][5]["quant"]["k"]["2"]["none"]["rel_err"]
    assert kept["summary"]["key_rel_err_mean"]["none"] == pytest.approx(sixth)
    errors = [layer["quant"]["k"]["2"]["none"]["rel_err"] for layer in every["layers"]]
    assert every["summary"]["key_rel_err_mean"]["none"] == pytest.approx(sum(errors) / 6)


def test_train_adapters_trains_the_layers_a_cache_compresses(tmp_path, tokenizer, text_file):
    """`--layers all` on Gemma 3: the sixth layer alone (its five sliding ones are kept uncompressed); named layers are
    trained as named."""
    from kvcalib.methods.kvlinc_fit import train_adapters

    lm = LoadedModel(model=tiny_model("gemma3_text", **HYBRIDS["gemma3_text"]), tokenizer=tokenizer, spec="g3")
    acts = collect(tmp_path / "acts", model=lm, dataset=str(text_file), num_samples=2, seq_len=48)
    every = train_adapters(acts, tmp_path / "a", rank=4, steps=1, group_size=8, residual=16, tokens=16, device="cpu")
    named = train_adapters(acts, tmp_path / "b", rank=4, steps=1, group_size=8, residual=16, tokens=16, layers="0,5",
                           device="cpu")
    trained = [json.loads((p / "manifest.json").read_text())["settings"]["trained_layers"] for p in (every, named)]
    assert trained == [[5], [0, 5]]


def _ring_decode(model, ids: torch.Tensor, window: int, steps: int) -> list[torch.Tensor]:
    """Greedy logits of `model` (a small Gemma 3) decoding `ids` (1, T) with every layer a `StaticWindowLayer`, as
    the static cache drives them (a prompt with prefill_slot set, then one token a step, kvcalib's attention, no
    masks): its sliding layers' rings of `window` tokens, its full layer's a ring longer than the whole call."""
    from transformers.cache_utils import Cache

    from kvcalib.runtime.cache import IMPLEMENTATION, register_attention
    from kvcalib.runtime.static_cache import StaticWindowLayer

    config, kept = model.config, sliding_windows(model.config)

    class Rings(Cache):
        def __init__(self):
            super().__init__(layers=[StaticWindowLayer(i, 1, window if i in kept else 4096, config.num_key_value_heads,
                                                       config.head_dim, torch.float32, torch.device("cpu"))
                                     for i in range(config.num_hidden_layers)])

        def get_seq_length(self, *args) -> int:
            return 0

        def get_mask_sizes(self, query_length, *args):
            return (query_length if isinstance(query_length, int) else query_length.shape[0]), 0

    register_attention()
    model.set_attn_implementation(IMPLEMENTATION)
    cache, t = Rings(), ids.shape[1]
    pos = torch.arange(t)
    for layer in cache.layers:
        layer.prefill_slot = 0
    with torch.no_grad():
        out = model(ids, position_ids=pos[None], cache_position=pos, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    for layer in cache.layers:
        layer.prefill_slot = None
    logits = [out.logits[0, -1]]
    for s in range(steps - 1):
        p = torch.tensor([[t + s]])
        with torch.no_grad():
            out = model(logits[-1].argmax().view(1, 1), position_ids=p, cache_position=p[0], past_key_values=cache,
                        use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


@pytest.mark.parametrize("arch,implementation", [("gemma3_text", "sdpa"), ("gemma2", "eager")])
def test_the_static_caches_window_rings_decode_a_gemma_as_transformers_own_cache(arch, implementation):
    """The static cache's kept sliding layers (`StaticWindowLayer`: a prompt through the window's mask chunk by
    chunk, then a ring of the last W tokens) inside Gemma 3's and Gemma 2's own forward under kvcalib's attention,
    which builds no masks: 45 prompt tokens (past the window of 24) and 20 greedy steps give transformers'
    DynamicCache's logits (the model's SDPA under its sliding masks; Gemma 2's eager attention, which soft-caps the
    scores at 5, as kvcalib's `capped_attention` does in prompt chunks and ring steps) within 1e-5 (float32, summed
    in another order: 1.4e-6 seen), the same tokens. Planted: rings of 23 tokens part by far more."""
    model = tiny_model(arch, seed=3, num_hidden_layers=6, sliding_window=24, head_dim=64, hidden_size=256,
                       intermediate_size=512, vocab_size=1000).eval()
    ids = torch.randint(1, 1000, (1, 45), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=DynamicCache(config=model.config),
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got = _ring_decode(model, ids, 24, 20)
    assert [int(x.argmax()) for x in got] == ref.sequences[0, 45:].tolist()
    assert max((a - b).abs().max().item() for a, b in zip(got, ref.logits)) <= 1e-5
    planted = _ring_decode(model, ids, 23, 20)
    assert max((a - b).abs().max().item() for a, b in zip(planted, ref.logits)) > 1e-2
