"""The runtime cache on CUDA: fused kernel path against the torch reference path of the same cache."""

import pytest
import torch

from kvcalib.methods import MethodSettings, apply_residual_mode, build_method
from kvcalib.models import LoadedModel, attention_shape
import kvcalib.runtime.cache as cache_module
from kvcalib.runtime.cache import KvcalibCache
import kvcalib.formats.codebook.format as codebook_format
from kvcalib.formats.int2.coded import declared as int2_declared
import kvcalib.formats.int2.format as int2_format
import kvcalib.formats.vq.format as vq_format
from test_runtime_cache import CASES, _greedy, _kvlinc_with_adapters, _method, _plan, _vecinfer_with_sinks

pytest.importorskip("cupy", reason="the fused path needs cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the fused path runs only on a GPU", allow_module_level=True)


# each format's kernel launch, as its format module calls it
KERNELS = [(int2_format, "fused_decode"), (vq_format, "vq_decode"), (codebook_format, "codebook_decode")]


def _model(head_dim: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=8 * head_dim, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).cuda().half().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["kivi", "kvlinc", "kvlinc+adapters", "oscar", "vecinfer+sinks", "turboquant+sinks",
                                  "kivi3+sinks", "plan+sinks"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_steps_match_the_reference_over_the_same_cache(head_dim, name, batch, monkeypatch):
    """Every single-token step of a fused cache (the INT2 kernel, or the VecInfer kernel for vecinfer),
    against the method's torch reference (`Method.decode`) over the very same held cache: flushed blocks,
    float16 sinks and residual, KVLinC states."""
    model = _model(head_dim)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    shape = attention_shape(model.config)
    settings = MethodSettings(bits=2, group_size=16, residual=32)
    if name.endswith("adapters"):
        method = _kvlinc_with_adapters(shape, 16, 32, "cuda")
    elif name.startswith("vecinfer"):
        method = _vecinfer_with_sinks(shape, 3, 32)
        for books in method.layers:
            books.k, books.v, books.smooth = books.k.cuda(), books.v.cuda(), books.smooth.cuda()
    elif name.startswith("turboquant"):
        method = build_method("turboquant", shape, MethodSettings(bits=3, residual=32, sink_tokens=3))
    elif name.startswith("kivi3"):
        method = build_method("kivi", shape, MethodSettings(bits=3, group_size=16, residual=32, sink_tokens=3))
    elif name.startswith("plan"):
        method = _plan(shape, 32, "head")
        method.sink = 3
    else:
        method = build_method(name, shape, settings)
    errors = []
    fused_decode_step = cache_module.decode

    def checked(layer, q, opts):
        out = fused_decode_step(layer, q, opts)
        if layer.layout is not None:
            ref = layer.method.decode(layer.layer, q, *layer.held(torch.float32), opts, layer.state)
            errors.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
        return out

    monkeypatch.setattr(cache_module, "decode", checked)
    launches = []  # the VecInfer kernel's calls: a step that fell back to the reference would compare it with itself
    vq_decode = vq_format.vq_decode
    monkeypatch.setattr(vq_format, "vq_decode", lambda *a, **k: launches.append(1) or vq_decode(*a, **k))
    cache = KvcalibCache(lm, method)
    ids = torch.randint(0, 1000, (batch, 150), device="cuda")
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, ids.shape[1]):
            logits = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            assert torch.isfinite(logits).all()
    kernel = {"vecinfer": "VecInfer", "turboquant": "codebook", "kivi3": "codebook", "plan": "codebook"}
    assert cache.layers[0].format.name == kernel.get(name.split("+")[0], "INT2")
    assert cache.layers[0].layout.length == 128
    assert len(errors) == 2 * 110  # every decode step of both layers ran fused
    assert len(launches) == (2 * 110 if name.startswith("vecinfer") else 0)

    # The kernel rounds q to fp16 for the tensor cores, P to fp16 and its output to fp16, each a
    # relative u16 = 2^-11 = 4.9e-4, amplified by softmax over logits of a few units: 10 u16.
    assert max(errors) < 10 * 2.0**-11, max(errors)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_vecinfer_kernels_layout_holds_what_the_reference_path_holds(batch):
    """A VecInfer layer fed on the kernel's path and one fed the same tokens on the reference path (`use_fused`
    False) hold the same cache: flushed keys back in the model's basis, the float16 sink tokens at their
    offsets, the residual. The two dequantize in different launches (a block at a flush, all blocks at once),
    so float32 products over d terms may round apart: within d x u32 of the row's magnitude (a misplaced sink
    or block moves a whole token, O(1))."""
    from kvcalib.models import AttentionShape
    from kvcalib.runtime.cache import CompressedLayer

    d = 64
    method = _vecinfer_with_sinks(AttentionShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=d), 3, 32)
    books = method.layers[0]
    books.k, books.v, books.smooth = books.k.cuda(), books.v.cuda(), books.smooth.cuda()
    g = torch.Generator(device="cuda").manual_seed(batch)
    k = torch.randn(batch, 2, 150, d, device="cuda", generator=g).half()
    v = torch.randn(batch, 2, 150, d, device="cuda", generator=g).half()
    fused, plain = CompressedLayer(method, 0), CompressedLayer(method, 0, use_fused=False)
    for layer in (fused, plain):
        layer.append(k[:, :, :40], v[:, :, :40])
        for t in range(40, 150):
            layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert fused.format.name == "VecInfer" and fused.layout.length == 128 and fused.layout.sinks == 3
    assert plain.layout is None
    for a, b in zip(fused.held(torch.float32), plain.held(torch.float32)):
        bound = d * 2.0**-24 * b.abs().amax(-1, keepdim=True)
        assert ((a - b).abs() <= bound).all(), (a - b).abs().max()


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc+adapters", "vecinfer", "turboquant+sinks", "plan+sinks"])
def test_a_padded_batch_decodes_in_one_launch_as_close_as_its_rows_launched_alone(name, monkeypatch):
    """One launch over a padded batch's rows side by side (`_fused_rows`) against each row's own launch over the
    same cache: the kernel splits a row's tokens by the launch's batch, so each split's softmax weights, rounded
    to fp16 for the tensor cores relative to that split's own max, round differently. A split's partial is then
    off by at most U16 Σ p|v| (float32 sums add orders less), so the merged outputs of two split layouts differ
    by at most 2 U16 mean|v| <= 2 U16 max|v| over the row's held values, plus both outputs' fp16 roundings,
    2 U16 |alone|. (Measured on an H200: VecInfer 2e-4 at outputs near 0.07, where one fp16 ulp is 6e-5.)"""
    from tolerances import U16

    from kvcalib.attention import AttentionOptions

    model = _model(64)
    shape = attention_shape(model.config)
    settings = MethodSettings(bits=2, group_size=16, residual=32)
    if name == "kvlinc+adapters":
        method = _kvlinc_with_adapters(shape, 16, 32, "cuda")
    elif name == "vecinfer":
        method = _vecinfer_with_sinks(shape, 0, 32)
        for books in method.layers:
            books.k, books.v, books.smooth = books.k.cuda(), books.v.cuda(), books.smooth.cuda()
    elif name == "turboquant+sinks":
        method = build_method("turboquant", shape, MethodSettings(bits=3, residual=32, sink_tokens=1))
    elif name == "plan+sinks":
        method = _plan(shape, 32, "head")
        method.sink = 1
    else:
        method = build_method(name, shape, settings)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    cache = KvcalibCache(lm, method)
    lengths = (3000, 1100, 70)
    width = max(lengths)
    ids = torch.randint(1, 1000, (3, width), device="cuda")
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
    launches = []
    for module, name_ in KERNELS:
        real = getattr(module, name_)
        monkeypatch.setattr(module, name_, lambda *a, _real=real, **k: launches.append(a[0].shape[0]) or _real(*a, **k))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for t in range(40):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(ids[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
        assert launches[-2:] == [3, 3], launches[-4:]  # the last step: one launch a layer
        g = torch.Generator(device="cuda").manual_seed(7)
        for layer in cache.layers:
            q = torch.randn(3, shape.num_heads, 1, 64, device="cuda", generator=g, dtype=torch.float16) * 2
            opts = AttentionOptions(scaling=64**-0.5)
            batched = cache_module._fused_rows(layer, q, opts).double()
            alone = torch.cat([cache_module.decode(row, q[b : b + 1], opts) for b, row in enumerate(layer.rows)]).double()
            vmax = torch.stack([row.held(torch.float32)[1].abs().amax() for row in layer.rows]).double()
            assert torch.isfinite(batched).all()
            bound = 2 * U16 * vmax[:, None, None, None] + 2 * U16 * alone.abs()
            assert ((batched - alone).abs() <= bound).all(), ((batched - alone).abs() / bound).max()


@pytest.mark.parametrize("name", list(CASES))
def test_a_left_padded_batch_decodes_each_sequence_as_alone_on_the_gpu(name, monkeypatch):
    """As the CPU test: each sequence of a padded batch keeps its own row and flushes at its own length. The
    model is float64 (the fused path rounds its queries to fp16 either way). Where every launch took one row,
    batched and lone inputs agree to float64 round-off and their fp16 roundings almost surely coincide: same
    tokens, logits within one float32 ulp. Where rows with blocks in a kernel's layout decoded together in one
    launch (the test above holds that launch to each row's own: float16 roundings of a few attention outputs a
    step), the same tokens and logits within 2^-8 of the largest: those roundings (2^-11 relative, 2^-10 of
    the values' largest), carried through two layers, with room."""
    from conftest import float64, tiny_model
    from tolerances import U32

    model = float64(tiny_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=2)).cuda()
    shape = attention_shape(model.config)
    fused = MethodSettings(bits=2, group_size=16, residual=32)  # the kernel reads groups of >= 16 tokens
    base = name.removesuffix("+sliding")  # a sliding case: its blockwise method, then the sliding rule
    if base in ("kivi", "kvlinc", "oscar"):
        method = build_method(base, shape, fused)
    elif base == "kvlinc+adapters":
        method = _kvlinc_with_adapters(shape, 16, 32, device="cuda")
    else:
        method = _method(base, shape)
    if base == "vecinfer+sinks":
        for books in method.layers:
            books.k, books.v, books.smooth = books.k.cuda(), books.v.cuda(), books.smooth.cuda()
    if name.endswith("+sliding"):
        apply_residual_mode(method, "sliding")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen).cuda() for n in (70, 37, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    batches = []  # each launch's rows
    for module, name_ in KERNELS:
        real = getattr(module, name_)
        monkeypatch.setattr(module, name_, lambda *a, _real=real, **k: batches.append(a[0].shape[0]) or _real(*a, **k))
    tokens, logits, cache = _greedy(model, method, ids, mask, 40)
    together = max(batches, default=1) > 1
    if int2_declared(method) is not None:  # methods the INT2 kernel reads (not fp16, VecInfer, TurboQuant)
        assert any(row.format is not None for row in cache.layers[0].rows), "the fused kernel never ran"
    if base.startswith("vecinfer"):  # the VecInfer kernel's
        assert any(row.format is not None and row.format.name == "VecInfer" for row in cache.layers[0].rows), \
            "the VecInfer kernel never ran"
    for b, p in enumerate(prompts):
        alone_tokens, alone_logits, _ = _greedy(model, method, p[None], None, 40)
        assert tokens[b].tolist() == alone_tokens[0].tolist()
        if together:
            torch.testing.assert_close(logits[b], alone_logits[0], rtol=0, atol=2.0**-8 * alone_logits.abs().max().item())
        else:
            torch.testing.assert_close(logits[b], alone_logits[0], rtol=3 * U32, atol=2.0**-40 * alone_logits.abs().max().item())
