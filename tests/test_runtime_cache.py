"""`model.generate` with a KvcalibCache against an independent recomputation of the same cache.

Both run the tiny model in float64 (`conftest.float64`, norms included; the cache and the reference
attention follow it: `kvcalib.attention.compute_dtype`), so they agree to float64 round-off. In float32 they would not be
comparable this way: the two paths compute keys in float32 with different matmul shapes, and a key
within one float32 ulp of a float16 rounding boundary is stored as a different float16 value by each,
which moves a logit by up to ~1e-4 relative (measured: 1.3e-4 for fp16); in float64 the chance of
such a flip is about u64 / u16 = 2^-42 per element.
"""

import copy

import pytest
import torch

import kvcalib.runtime.cache as runtime_cache
from kvcalib.attention import flushed_counts, intercept
from kvcalib.methods import MethodSettings, apply_residual_mode, build_method, hold
from kvcalib.models import LoadedModel, attention_shape
from kvcalib.runtime.cache import KvcalibCache
from conftest import float64, tiny_model
from tolerances import U32


def _reference_greedy(model, method, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Each new token from a full forward: prompt queries attend in float16, later queries over the
    cache as held at their position (eval's rule); no incremental state at all."""
    ids = prompt.clone()
    tokens, logits = [], []
    p = prompt.shape[1]

    def attend(layer, q, k, v, opts):
        held = hold(method, layer, k, v)
        flushed = flushed_counts(q.shape[-2], k.shape[-2], method.block, window=method.window)
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


# Planted errors in the runtime cache (the reference keeps the true rule), switched on one at a time
# by the plant tests below or for every test with `pytest --plant NAME` (conftest.py).
def _plant_residual_late(monkeypatch):
    """The residual window off by one token: a block is flushed one token after it fills."""
    monkeypatch.setattr(runtime_cache, "flushed_length", lambda n, block, window=0: max(n - window - 1, 0) // block * block)


def _plant_block_kept(monkeypatch):
    """The second flushed block of every layer (the first past the sink tokens, when those cover it)
    read back in float16 instead of as compressed."""
    real = runtime_cache.keep_sinks

    def keep(method, start, k16, v16, kq, vq):
        kq, vq, bits = real(method, start, k16, v16, kq, vq)
        first = -(-max(method.sink, method.block) // method.block) * method.block
        if start <= first < start + kq.shape[-2]:
            blk = slice(first - start, first + method.block - start)
            kq, vq = kq.clone(), vq.clone()
            kq[..., blk, :], vq[..., blk, :] = k16[..., blk, :].to(kq), v16[..., blk, :].to(vq)
        return kq, vq, bits

    monkeypatch.setattr(runtime_cache, "keep_sinks", keep)


PLANTS = {"residual-late": _plant_residual_late, "block-kept": _plant_block_kept}


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


def _plan(shape, residual: int = 16, granularity: str = "layer"):
    """A plan whose layers' KV heads take schemes of every family: TurboQuant at its own widths with
    per-coordinate codebooks (the oblivious one, stretched per coordinate so that no two coordinates
    share centroids) and with a vector codebook, VecInfer, KIVI and OScaR with key groups of 16 (whole tiles of the codebook kernel); some
    layers one scheme for all heads. Granularity head: each KV head its own codebooks (the layer's, scaled
    by 1 + head / 10)."""
    from kvcalib.methods.plan import Plan, codebook_name, parse_scheme
    from kvcalib.methods.turboquant import codebook

    pool = ["turboquant-1", "oscar-2-g16", "turboquant-3", "vecinfer-d4b5", "kivi-2-g16", "turboquant-4", "turboquant-d4b5",
            "kivi-3-g16"]
    h = shape.num_kv_heads

    def layer(i, shift):
        if i % 3 == 2:  # every head alike
            return [parse_scheme(pool[(i + shift) % len(pool)])] * h
        return [parse_scheme(pool[(i + shift + j) % len(pool)]) for j in range(h)]

    schemes = {"k": [layer(i, 0) for i in range(shape.num_layers)], "v": [layer(i, 3) for i in range(shape.num_layers)]}
    stretch = torch.linspace(0.8, 1.2, shape.head_dim)[None, :, None]
    books = {codebook_name(i, p, s.bits): (codebook(shape.head_dim, s.bits).float()[None, None] * stretch).half().float()
             for p in ("k", "v") for i, heads in enumerate(schemes[p]) for s in heads if s.family == "turboquant" and not s.dim}
    gen = torch.Generator().manual_seed(5)  # vector codebooks (TurboQuant's and VecInfer's) and VecInfer's λ: any values
    books |= {codebook_name(i, p, s.book): (torch.randn(1, 32, 4, generator=gen) * (0.3 if s.family == "turboquant" else 1)).half().float()
              for p in ("k", "v") for i, heads in enumerate(schemes[p]) for s in heads if s.dim}
    books |= {f"layers.{i}.k_smooth": (torch.rand(h, shape.head_dim, generator=gen) + 0.5).half()
              for i, heads in enumerate(schemes["k"]) if any(s.family == "vecinfer" for s in heads)}
    if granularity == "head":
        scale = lambda t: torch.stack([t[0] * (1 + j / 10) for j in range(h)])  # noqa: E731
        books = {n: t if n.endswith("_smooth") else scale(t) for n, t in books.items()}
    return Plan(shape, schemes, residual, 16, books, granularity)


def _turboquant_per_head(shape, residual: int = 16):
    """Calibrated TurboQuant-3 with per-coordinate codebooks of each KV head's own (the oblivious one stretched
    per coordinate and scaled per head)."""
    from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig, codebook

    stretch = torch.linspace(0.8, 1.2, shape.head_dim)[None, :, None]
    book = torch.stack([codebook(shape.head_dim, 3).float()[None] * stretch[0] * (1 + j / 10)
                        for j in range(shape.num_kv_heads)])
    return TurboQuant(TurboQuantConfig(bits=3, residual=residual), shape, [(book, book * 0.9)] * shape.num_layers, "head")


CASES = {
    "fp16": MethodSettings(),
    "vecinfer+sinks": None,
    "kivi": MethodSettings(bits=2, group_size=8, residual=16),
    "kvlinc": MethodSettings(bits=2, group_size=8, residual=16),
    "kvlinc+adapters": None,
    "oscar": MethodSettings(bits=2, group_size=8, residual=16),
    "turboquant": MethodSettings(bits=3, residual=16),
    "plan": None,
    # --residual-mode sliding: the newest 16 tokens always float16, flushes of one key group (8) or one token
    "kivi+sliding": MethodSettings(bits=2, group_size=8, residual=16, residual_mode="sliding"),
    "oscar+sliding": MethodSettings(bits=2, group_size=8, residual=16, residual_mode="sliding"),
    "turboquant+sliding": MethodSettings(bits=3, residual=16, residual_mode="sliding"),
    "kvlinc+adapters+sliding": None,
    "vecinfer+sinks+sliding": None,
    "plan+sliding": None,  # flushes of the plan's step, 16 tokens (its KIVI and OScaR key groups)
}


def _generate_against_reference(name: str) -> None:
    """Greedy decoding of 30 tokens through KvcalibCache equals the reference recomputation."""
    model = float64(tiny_model("llama", seed=1))
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (1, 21))
    shape = attention_shape(model.config)
    method = _method(name, shape)
    cache = KvcalibCache(lm, copy.copy(method))
    with torch.no_grad():
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=30, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, prompt.shape[1]:].tolist()
    ref_tokens, ref_logits = _reference_greedy(model, method, prompt, 30)
    assert generated == ref_tokens
    for got, want in zip(out.logits, ref_logits):
        # generate() returns float32 logits. Both sides are float64 results that agree to float64
        # round-off (~1e-14 relative here), so their float32 roundings are equal or one float32 ulp
        # apart (when the two straddle a rounding midpoint): |got - want| <= 2u32 |want|, plus the
        # rounding of `want` itself to float32 (u32 |want|). A logit near zero has no relative
        # agreement: its float64 paths differ by round-off at the scale of the largest logit, 2^-40.
        torch.testing.assert_close(got[0], want.float(), rtol=3 * U32, atol=2.0**-40 * want.abs().max().item())
    assert cache.get_seq_length() == prompt.shape[1] + 29  # the last token is sampled, never cached


@pytest.mark.parametrize("name", list(CASES))
def test_generate_with_compressed_cache_matches_the_reference_recomputation(name, plant):
    _generate_against_reference(name)


@pytest.mark.parametrize("plant_name", list(PLANTS))
@pytest.mark.parametrize("name", [n for n in CASES if n != "fp16"])  # fp16 compresses nothing to plant into
def test_the_reference_comparison_catches_a_planted_cache_error(name, plant_name, monkeypatch):
    PLANTS[plant_name](monkeypatch)
    with pytest.raises(AssertionError):
        _generate_against_reference(name)


def test_compressed_cache_stores_fewer_bits_than_float16():
    model = tiny_model("llama", seed=2)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    prompt = torch.randint(0, 512, (1, 64))
    bits = {}
    for name in ("fp16", "kivi"):
        given = MethodSettings(bits=2, group_size=16, residual=16) if name == "kivi" else MethodSettings()
        cache = KvcalibCache(lm, name, given)
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


def _method(name: str, shape):
    builders = {"kvlinc+adapters": _kvlinc_with_adapters, "vecinfer+sinks": _vecinfer_with_sinks,
                "plan": _plan}
    if CASES[name] is not None:
        return build_method(name.split("+")[0], shape, CASES[name])
    method = builders[name.removesuffix("+sliding")](shape)
    if name.endswith("+sliding"):
        apply_residual_mode(method, "sliding")
    return method


def _greedy(model, method, ids: torch.Tensor, mask: torch.Tensor | None, steps: int):
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    cache = KvcalibCache(lm, copy.copy(method))
    model.generation_config.eos_token_id = None  # random weights: decode every step, whatever is drawn
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), cache


@pytest.mark.parametrize("name", list(CASES))
def test_a_left_padded_batch_decodes_each_sequence_exactly_as_alone(name):
    # Prompts of 37, 21 and 5 tokens: with R = 16 the padded rows' blocks would straddle padding if the
    # cache flushed by padded position; each row must flush at its own length, attend to no padding
    # and store none (float64 model: see the module docstring; the bound is the one above).
    model = float64(tiny_model("llama", seed=5))
    method = _method(name, attention_shape(model.config))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen) for n in (37, 21, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    tokens, logits, cache = _greedy(model, method, ids, mask, 20)
    bits = 0
    for b, p in enumerate(prompts):
        alone_tokens, alone_logits, alone = _greedy(model, method, p[None], None, 20)
        assert tokens[b].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(logits[b], alone_logits[0], rtol=3 * U32, atol=2.0**-40 * alone_logits.abs().max().item())
        bits += alone.stored_bits()
    assert cache.stored_bits() == bits  # padding is neither stored nor counted


def test_a_padded_batch_attends_to_no_padding_even_where_pad_keys_are_huge():
    # The pad token's embedding scaled up: any attention to padding would swamp the output.
    model = float64(tiny_model("llama", seed=6))
    with torch.no_grad():
        model.get_input_embeddings().weight[0] *= 1e3
    method = _method("kivi", attention_shape(model.config))
    p = torch.randint(1, 512, (9,), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([torch.zeros(1, 23, dtype=torch.long), p[None]], 1)
    mask = torch.cat([torch.zeros(1, 23, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], 1)
    tokens, logits, _ = _greedy(model, method, ids, mask, 8)
    alone_tokens, alone_logits, _ = _greedy(model, method, p[None], None, 8)
    assert tokens.tolist() == alone_tokens.tolist()
    torch.testing.assert_close(logits, alone_logits, rtol=3 * U32, atol=2.0**-40 * alone_logits.abs().max().item())


def test_a_padded_batch_decodes_every_row_in_one_reference_call_per_layer_and_step():
    """The reference path takes a padded batch's decode step in one `Method.decode` per layer (each row's cache
    right-aligned, its padding masked), not one per row; the test above holds its result to each row alone."""
    model = float64(tiny_model("llama", seed=5))
    method = _method("turboquant", attention_shape(model.config))
    calls = []
    decode = method.decode
    method.decode = lambda *a, **k: calls.append(len(a[1])) or decode(*a, **k)
    prompts = [torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(3)) for n in (37, 21, 5)]
    ids = torch.zeros(3, 37, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 37 - len(p):], mask[b, 37 - len(p):] = p, 1
    _greedy(model, method, ids, mask, 6)  # the prompt, then 5 decode steps
    assert calls == [3] * (5 * model.config.num_hidden_layers)


def _cpu_kernels(monkeypatch, launches: list[int]) -> None:
    """The fused kernels' contract on the CPU: `supports` says yes to the methods' layouts (as on CUDA), and a
    launch is computed by the layout's float64 reference (`int2_layout.reference_decode`,
    `vq_layout.reference_decode`), row by row at each row's own counts where it is given them, which is what a
    kernel with counts on the device reads. `launches` gets each launch's batch size."""
    import dataclasses

    import kvcalib.formats.int2.format as int2_format
    import kvcalib.formats.vq.format as vq_format
    from kvcalib.formats.int2 import layout as int2_layout
    from kvcalib.formats.int2.format import Int2Format
    from kvcalib.formats.vq import layout as vq_layout
    from kvcalib.formats.vq.format import VQFormat

    def rows_of(layer, counts):
        if counts is None:
            return [layer]
        flushed, residual = (c.tolist() for c in counts)
        names = [n for _, n in (Int2Format() if isinstance(layer, int2_layout.PackedLayer) else VQFormat()).slots(layer)]
        return [dataclasses.replace(layer, **{n: None if getattr(layer, n) is None else getattr(layer, n)[b : b + 1]
                                              for n in names},
                                    kres=layer.kres[b : b + 1], vres=layer.vres[b : b + 1], length=flushed[b],
                                    residual=residual[b]) for b in range(len(flushed))]

    def int2(q, layer, scaling, correction=None, counts=None):
        launches.append(q.shape[0])
        terms = lambda b: None if correction is None else (correction[0][b : b + 1], correction[1][b : b + 1])  # noqa: E731
        return torch.cat([int2_layout.reference_decode(q[b : b + 1], row, scaling, terms(b))
                          for b, row in enumerate(rows_of(layer, counts))]).to(q.dtype)

    def vq(q, layer, scaling, lengths=None, residuals=None):
        launches.append(q.shape[0])
        counts = None if lengths is None else (lengths, residuals)
        return torch.cat([vq_layout.reference_decode(q[b : b + 1], row, scaling)
                          for b, row in enumerate(rows_of(layer, counts))]).to(q.dtype)

    plain = lambda opts: opts is None or not (opts.softcap or opts.sliding_window)  # noqa: E731
    monkeypatch.setattr(int2_format, "supports", lambda spec, d, device, gqa=1, opts=None: spec is not None and plain(opts))
    monkeypatch.setattr(vq_format, "supports", lambda books, d, device, gqa=1, opts=None: books is not None and plain(opts))
    monkeypatch.setattr(int2_format, "fused_decode", int2)
    monkeypatch.setattr(vq_format, "vq_decode", vq)


def _padded_in_one_launch_as_alone(name: str, monkeypatch) -> None:
    # head_dim 64: the INT2 layout's tensor-core order takes 32 channels or more (the kernels 64 or 128)
    model = float64(tiny_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=2))
    shape = attention_shape(model.config)
    method = {"kivi": lambda: build_method("kivi", shape, MethodSettings(bits=2, group_size=16, residual=16)),
              "oscar": lambda: build_method("oscar", shape, MethodSettings(bits=2, group_size=16, residual=16)),
              "kvlinc+adapters": lambda: _kvlinc_with_adapters(shape, 16, 16),
              "vecinfer": lambda: _vecinfer_with_sinks(shape, sink=0, residual=16)}[name]()
    launches: list[int] = []
    _cpu_kernels(monkeypatch, launches)
    prompts = [torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(3)) for n in (70, 37, 5)]
    ids = torch.zeros(3, 70, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 70 - len(p):], mask[b, 70 - len(p):] = p, 1
    # R = 16: row 2's 5 tokens flush first after 11 steps, when the rows are first stacked (capacity 128 tokens,
    # row 0's); rows 1 and 2 then write their later blocks into the stack, and row 0 outgrows it at 144 tokens
    # (step 74), when its buffers double and the rows are stacked again
    tokens, logits, cache = _greedy(model, method, ids, mask, 80)
    # once every row holds blocks, a decode step is one launch of the 3 rows per layer; before that rows 0 and 1
    # launch alone and row 2 attends through the torch reference
    first = launches.index(3)
    assert launches[:first] == [1] * first and launches[first:] == [3] * (len(launches) - first)
    assert len(launches) - first >= 60 * shape.num_layers
    assert cache.layers[0].side_by_side is not None
    for b, p in enumerate(prompts):
        alone_tokens, alone_logits, _ = _greedy(model, method, p[None], None, 80)
        assert tokens[b].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(logits[b], alone_logits[0], rtol=3 * U32, atol=2.0**-40 * alone_logits.abs().max().item())


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc+adapters", "vecinfer"])
def test_a_padded_batch_on_a_fused_path_decodes_in_one_launch_each_row_as_alone(name, monkeypatch):
    """A padded batch whose rows hold their blocks in a kernel's layout decodes each step in one launch over the
    rows side by side, each row at its own counts (`_RowsSideBySide`), and every row as it decodes alone. The
    stand-in kernels compute each row by the float64 reference whether launched alone or batched, so batched and
    lone rows differ only by the float64 model's round-off on their queries (the module docstring's bound: their
    float32 logits within 3 ulps)."""
    _padded_in_one_launch_as_alone(name, monkeypatch)


@pytest.mark.parametrize("plant", ["residual count one short", "the stack never made again"])
def test_the_one_launch_comparison_catches_a_planted_error(plant, monkeypatch):
    """Each planted fault must fail the comparison: a row's newest token left unread, and a row's blocks read
    from a stack its buffers have outgrown (their new blocks missing)."""
    layout_for = runtime_cache._RowsSideBySide.layout_for

    def planted(self, fmt, parts, residuals, counts):
        if plant == "the stack never made again" and self.layout is not None:
            self.held = [tuple(getattr(o, n) for o, n in fmt.slots(p)) for p in parts]
        layout, (flushed, residual) = layout_for(self, fmt, parts, residuals, counts)
        if plant == "residual count one short":
            residual = (residual - 1).clamp(min=0)
        return layout, (flushed, residual)

    monkeypatch.setattr(runtime_cache._RowsSideBySide, "layout_for", planted)
    # a stale stack is shorter than row 0's count: the reference stops at its end (a kernel would read past it)
    with pytest.raises(AssertionError if plant == "residual count one short" else (AssertionError, RuntimeError)):
        _padded_in_one_launch_as_alone("kivi", monkeypatch)


def test_a_soft_capping_models_layers_pick_the_kernel_that_caps_as_the_log_says():
    """`KvcalibCache` picks each layer's kernel at its first flush (`kernel_format`) with the model's query heads a KV
    head and its cap on the scores, as its decode step calls the kernel and as `where_layers_run` logs it: for Gemma
    2 (cap 5 in the tiny config) KIVI-2 goes to the codebook layout, the one kernel that caps; picked without the
    cap, INT2 would be chosen and refuse every capped step (the torch path, while the log said fused)."""
    import dataclasses

    from kvcalib.runtime.cache import CompressedLayer, kernel_format, model_softcap, where_layers_run

    model = tiny_model("gemma2", head_dim=64)
    cache = KvcalibCache(model, "kivi", MethodSettings(group_size=16))
    compressed = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
    assert compressed and all((layer.gqa, layer.softcap) == (2, 5.0) for layer in compressed)
    cuda, shape = torch.device("cuda"), attention_shape(model.config)
    picked = {kernel_format(cache.method, layer.layer, 64, cuda, layer.gqa, layer.softcap)[0].name for layer in compressed}
    assert picked == {"codebook"} and model_softcap(model.config) == 5.0
    assert kernel_format(cache.method, compressed[0].layer, 64, cuda, 2)[0].name == "INT2"  # the cap ignored
    line = where_layers_run(cache.method, dataclasses.replace(shape), cuda, True, model.config)
    assert f"{len(compressed)} layers on the fused codebook path" in line
