"""The static cache on the GPU: what it stores, what it attends to, and its captured step.

- Stored: fed the same float16 tokens, each slot holds bit for bit what `KvcalibCache` holds for that
  sequence alone (packed codes, scales, zeros, residual), after every step, so the masked flush inside
  the step happens at the right token, at every residual length, in every slot of a batch whose
  sequences have different lengths.
- Attended: each row's output against the float64 reference over its own counts, held to the fused
  kernel's rule (tests/test_int2_kernel_gpu.py: at most twice SDPA's error + 1e-4).
- A slot freed and refilled gives the new sequence exactly the outputs it gets in a fresh cache
  (rows are independent: same capacity, same launch, same data; bitwise).
- Captured: the graph-replayed step gives the eager step's logits bit for bit (the same kernels on the
  same inputs), on a small model, through a serving loop with slots refilled. (Against `KvcalibCache`
  driven by `model.generate` the logits differ by float16 round-off: other matmul shapes, launches
  split by capacity rather than length; the layer tests above pin the stored cache and the kernel.)
- Compiled (`torch.compile`, Inductor): a layer's append, masked flush and fused attention give the
  eager ones' buffers and outputs bit for bit; the whole model's compiled and captured step gives the
  eager step's logits within float16 round-off of its activations (module docstring of
  kvcalib.runtime.captured), and its greedy tokens wherever the eager logits' top two are further apart.
"""

import dataclasses

import pytest
import torch

from kvcalib.formats.int2.layout import PackedLayer, reference_decode
from kvcalib.methods import MethodSettings, build_method
from kvcalib.methods.kvlinc import Adapter
from kvcalib.models import AttentionShape
from kvcalib.runtime.cache import CompressedLayer
from kvcalib.formats.int2.launch import fused_decode
from kvcalib.runtime.static_cache import StaticKvcalibCache, StaticLayer

pytest.importorskip("cupy", reason="the fused kernel needs cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the static cache runs only on a GPU", allow_module_level=True)

from test_int2_kernel_gpu import CORRECTION_TOL, FLOOR, _row_errors, _sdpa  # noqa: E402  (after the skip: it needs cupy)
from test_runtime_cache import _vecinfer_with_sinks  # noqa: E402

DEV = "cuda"


def _row_view(layer: StaticLayer, b: int) -> PackedLayer:
    """Row b of a static layer as a plain PackedLayer with host counts (what the reference reads)."""
    p = layer.layout
    one = lambda t: t[b : b + 1].contiguous()  # noqa: E731
    return PackedLayer(one(p.kcodes), one(p.kscale), one(p.kzero), one(p.vcodes), one(p.vscale), one(p.vzero),
                       one(p.kres), one(p.vres), int(layer.flushed[b]), int(layer.residual[b]), p.group_size,
                       p.value_group_size, one(p.knorm) if p.knorm is not None else None, p.rotated_keys,
                       p.rotated_values)


def _tokens(b, h, t, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = 1 + 4 * torch.rand(1, h, 1, d, device=DEV, generator=g)
    return (torch.randn(b, h, t, d, device=DEV, generator=g) * scale).half(), torch.randn(b, h, t, d, device=DEV, generator=g).half()


@pytest.mark.parametrize("group,residual,d", [(16, 32, 64), (32, 64, 128), (128, 128, 128)])
def test_each_slot_stores_what_the_dynamic_cache_stores_and_attends_within_the_kernel_bound(group, residual, d):
    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=d)
    method = build_method("kivi", shape, MethodSettings(bits=2, group_size=group, residual=residual))
    prompts = [1, residual - 1, residual, 2 * residual + 5]  # flushes at the first step, at once, later
    b, h, steps = len(prompts), 2, 2 * residual + 3
    static = StaticLayer(method, 0, b, capacity=4 * residual, kv_heads=h, head_dim=d, device=torch.device(DEV))
    dynamic = [CompressedLayer(method, 0) for _ in range(b)]
    for i, t in enumerate(prompts):
        k, v = _tokens(1, h, t, d, seed=i)
        static.prefill(i, k, v)
        dynamic[i].append(k, v)
    k_new, v_new = _tokens(b, h, steps, d, seed=99)
    q = torch.randn(b, steps, 8, d, device=DEV).half()
    worst = 0.0
    for s in range(steps):
        static.append(k_new[:, :, s : s + 1], v_new[:, :, s : s + 1])
        out = fused_decode(q[:, s], static.layout, d**-0.5, counts=(static.flushed, static.residual), checked=True)
        assert torch.isfinite(out).all()
        for i in range(b):
            dyn = dynamic[i]
            dyn.append(k_new[i : i + 1, :, s : s + 1], v_new[i : i + 1, :, s : s + 1])
            n, r = int(static.flushed[i]), int(static.residual[i])
            assert (n, r) == (dyn.length - dyn.k_res.shape[2], dyn.k_res.shape[2]), (s, i)
            row = _row_view(static, i)
            assert torch.equal(row.kres[:, :, :r], dyn.k_res) and torch.equal(row.vres[:, :, :r], dyn.v_res)
            if n:
                f = dyn.layout
                for got, want, unit in ((row.kcodes, f.kcodes, 16), (row.kscale, f.kscale, group),
                                        (row.kzero, f.kzero, group), (row.vcodes, f.vcodes, 1),
                                        (row.vscale, f.vscale, 1), (row.vzero, f.vzero, 1)):
                    assert torch.equal(got[:, :, : n // unit], want[:, :, : n // unit]), (s, i)
            ref = reference_decode(q[i : i + 1, s], row, d**-0.5)
            err = _row_errors(out[i : i + 1], ref)
            bound = 2 * _row_errors(_sdpa(q[i : i + 1, s], row, d**-0.5), ref) + FLOOR
            assert (err <= bound).all(), (s, i, err.max().item(), bound.min().item())
            worst = max(worst, (err / bound).max().item())
    assert worst > 0  # the comparison ran on real outputs


def test_a_refilled_slot_gives_the_new_sequence_exactly_what_a_fresh_cache_gives():
    d, h, group, residual = 128, 2, 32, 64
    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=h, head_dim=d)
    method = build_method("kivi", shape, MethodSettings(bits=2, group_size=group, residual=residual))
    make = lambda: StaticLayer(method, 0, 3, capacity=8 * residual, kv_heads=h, head_dim=d,  # noqa: E731
                               device=torch.device(DEV))
    used, fresh = make(), make()
    for i, t in enumerate([40, 150, 7]):  # slot 1 first holds another, longer sequence
        used.prefill(i, *_tokens(1, h, t, d, seed=10 + i))
    k_old, v_old = _tokens(3, h, 70, d, seed=20)
    for s in range(70):
        used.append(k_old[:, :, s : s + 1], v_old[:, :, s : s + 1])
    k_p, v_p = _tokens(1, h, 90, d, seed=30)
    used.prefill(1, k_p, v_p)  # the slot refilled: nothing of the old sequence may remain in view
    fresh.prefill(1, k_p, v_p)
    k_new, v_new = _tokens(3, h, 140, d, seed=40)
    q = torch.randn(3, 140, 8, d, device=DEV).half()
    for s in range(140):
        for layer in (used, fresh):
            layer.append(k_new[:, :, s : s + 1], v_new[:, :, s : s + 1])
        a = fused_decode(q[:, s], used.layout, d**-0.5, counts=(used.flushed, used.residual))
        b = fused_decode(q[:, s], fresh.layout, d**-0.5, counts=(fresh.flushed, fresh.residual))
        assert torch.equal(a[1], b[1]), s


@pytest.mark.parametrize("name,d", [("oscar", 64), ("oscar", 128), ("kvlinc", 128), ("kvlinc-oscar", 128)])
def test_a_rotated_or_corrected_layer_attends_as_the_kernel_reads_its_basis_and_state(name, d):
    """OScaR (keys and values in the Hadamard basis, per-token key norms) and KVLinC (values rotated, S and
    P): each row's output of the static layer's `attend` against the float64 reference over that row's
    buffers (its norms, rotated blocks, residual and counts), all in the model's basis, with the
    correction terms in float64 from the row's S and P. Without correction the
    fused kernel's bound (twice SDPA's error + 1e-4); with it the bound of tests/test_int2_kernel_gpu.py
    (a few units of float16 output rounding). What the buffers and states hold is pinned on the CPU
    (tests/test_static_cache.py) and against `KvcalibCache` here, at every step."""
    from kvcalib.attention import AttentionOptions

    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=d)
    settings = MethodSettings(bits=2, group_size=32, residual=64)
    method = _method(name, shape, settings)
    prompts = [1, 63, 64, 133]
    b, h, steps = len(prompts), 2, 131
    static = StaticLayer(method, 0, b, capacity=512, kv_heads=h, head_dim=d, device=torch.device(DEV))
    dynamic = [CompressedLayer(method, 0) for _ in range(b)]
    for i, t in enumerate(prompts):
        k, v = _tokens(1, h, t, d, seed=200 + i)
        static.prefill(i, k, v)
        dynamic[i].append(k, v)
    k_new, v_new = _tokens(b, h, steps, d, seed=299)
    g = torch.Generator(device=DEV).manual_seed(300)  # seeded: the rows checked do not depend on earlier tests
    q = torch.randn(b, 8, steps, d, device=DEV, generator=g).half()  # the kernel tests' regime
    opts = AttentionOptions(scaling=d**-0.5)
    worst, corrected = 0.0, 0
    for s in range(steps):
        static.append(k_new[:, :, s : s + 1], v_new[:, :, s : s + 1])
        q1 = q[:, :, s : s + 1]
        out = static.attend(q1, None, None, opts, prefill=False)[:, :, 0]
        assert torch.isfinite(out).all()
        qk = q1[:, :, 0]
        for i in range(b):
            dyn = dynamic[i]
            dyn.append(k_new[i : i + 1, :, s : s + 1], v_new[i : i + 1, :, s : s + 1])
            row = _row_view(static, i)
            n = row.length
            assert (n, row.residual) == (dyn.length - dyn.k_res.shape[2], dyn.k_res.shape[2]), (s, i)
            if n:  # the packed blocks and norms are KvcalibCache's, bit for bit
                f = dyn.layout
                norms = name.endswith("oscar")
                wants = [f.kcodes, f.kscale, f.kzero, f.vcodes, f.vscale, f.vzero] + ([f.knorm] if norms else [])
                assert (row.knorm is not None) == norms == (f.knorm is not None)
                for (buf, unit), want in zip(static._buffers(), wants):
                    assert torch.equal(buf[i : i + 1, :, : n // unit], want[:, :, : n // unit]), (s, i, unit)
            terms = None
            if static.state is not None and n:
                adapter = method.adapters[0]
                fq = adapter.query_features(q1[i : i + 1].double())  # (1, Hq, 1, D)
                st = static.state
                num = (fq.reshape(1, h, 4, 1, -1) @ st.s[i : i + 1].double().unsqueeze(2)).reshape(1, 8, -1)
                den = (fq.reshape(1, h, 4, 1, -1) @ st.p[i : i + 1].double()[:, :, None, :, None]).reshape(1, 8)
                terms = (num, den)
                corrected += 1
            ref = reference_decode(qk[i : i + 1], row, d**-0.5, terms)
            err = _row_errors(out[i : i + 1], ref)
            if terms is None:
                bound = 2 * _row_errors(_sdpa(qk[i : i + 1], row, d**-0.5), ref) + FLOOR
            else:
                bound = torch.full_like(err, 2 * CORRECTION_TOL[torch.float16])
            assert (err <= bound).all(), (s, i, err.max().item(), bound.min().item())
            worst = max(worst, (err / bound).max().item())
    assert worst > 0 and (corrected > 0) == name.startswith("kvlinc")


def _vecinfer_on_device(shape: AttentionShape, residual: int = 32):
    """VecInfer with random d4b6 codebooks and smoothing on the GPU, no sinks (`check_static`)."""
    method = _vecinfer_with_sinks(shape, 0, residual)
    for books in method.layers:
        books.k, books.v, books.smooth = books.k.to(DEV), books.v.to(DEV), books.smooth.to(DEV)
    return method


@pytest.mark.parametrize("d", [64, 128])
def test_a_vecinfer_layer_attends_each_slot_over_its_own_counts_within_the_kernel_bound(d):
    """Slots of different lengths (a flush at the first step, at once, later), a token a step: each row of
    the VecInfer kernel's output, counts read on the device, against the float64 reference over that slot's
    own codes and residual, held to the kernel's rule (tests/test_vq_kernel_gpu.py)."""
    from kvcalib.formats.vq.launch import vq_decode
    from kvcalib.formats.vq.layout import VQLayer, reference_decode as vq_reference
    from test_vq_kernel_gpu import _sdpa as vq_sdpa

    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=d)
    method = _vecinfer_on_device(shape)
    prompts, steps = [1, 31, 32, 69], 67
    b, h = len(prompts), 2
    static = StaticLayer(method, 0, b, capacity=160, kv_heads=h, head_dim=d, device=torch.device(DEV))
    for i, t in enumerate(prompts):
        static.prefill(i, *_tokens(1, h, t, d, seed=i))
    k_new, v_new = _tokens(b, h, steps, d, seed=99)
    q = torch.randn(b, steps, 8, d, device=DEV).half()
    worst = 0.0
    for s in range(steps):
        static.append(k_new[:, :, s : s + 1], v_new[:, :, s : s + 1])
        out = vq_decode(q[:, s], static.layout, d**-0.5, checked=True, lengths=static.flushed, residuals=static.residual)
        for i in range(b):
            n, r = int(static.flushed[i]), int(static.residual[i])
            p = static.layout
            row = VQLayer(p.kcodes[i : i + 1, :, :n], p.vcodes[i : i + 1, :, :n], p.kbook, p.vbook, p.ksink[i : i + 1],
                          p.vsink[i : i + 1], p.kres[i : i + 1, :, :r], p.vres[i : i + 1, :, :r], n, r, 0, p.k_bits,
                          p.v_bits, p.smooth, p.hadamard)
            ref = vq_reference(q[i : i + 1, s], row, d**-0.5)
            err = _row_errors(out[i : i + 1], ref)
            bound = 2 * _row_errors(vq_sdpa(q[i : i + 1, s], row), ref) + FLOOR
            assert (err <= bound).all(), (s, i, err.max().item(), bound.min().item())
            worst = max(worst, (err / bound).max().item())
    assert worst > 0 and static.flushed.tolist() == [64, 96, 96, 128]


def _model(layers: int = 2, head_dim: int = 64):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=8 * head_dim, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).to(DEV).half().eval()
    with torch.no_grad():  # sharper attention than the init's, so the cache's errors matter
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.generation_config.eos_token_id = None
    return model


SETTINGS = MethodSettings(bits=2, group_size=16, residual=32)
METHODS = ["kivi", "oscar", "kvlinc", "kvlinc-oscar", "vecinfer", "turboquant", "kivi3", "plan"]  # every method the
# static cache holds (`check_static`); kvlinc-oscar: KVLinC over OScaR-coded keys (`--keys oscar`); vecinfer: random
# codebooks; turboquant: 3 bits with one float16 sink token (the codebook layout); kivi3: KIVI at 3 bits with one sink
# (the codebook layout's affine codes); plan: every family mixed per KV head (tests/test_runtime_cache.py), one sink


def _method(name: str, shape: AttentionShape, settings: MethodSettings = SETTINGS, rank: int = 16):
    """The method, KVLinC with random adapters of `rank` on every layer (its correction then moves the
    output: the states and terms are exercised, not zeros)."""
    if name == "vecinfer":
        return _vecinfer_on_device(shape, settings.residual)
    if name == "turboquant":
        return build_method(name, shape, MethodSettings(bits=3, residual=settings.residual, sink_tokens=1))
    if name == "kivi3":
        return build_method("kivi", shape, dataclasses.replace(settings, bits=3, sink_tokens=1))
    if name == "plan":
        from test_runtime_cache import _plan

        method = _plan(shape, settings.residual, "head")
        method.sink = 1
        return method
    if name == "kvlinc-oscar":
        name, settings = "kvlinc", dataclasses.replace(settings, keys="oscar")
    method = build_method(name, shape, settings)
    if name == "kvlinc":
        g = torch.Generator().manual_seed(5)
        w = lambda h: (torch.randn(h, shape.head_dim, rank // 2, generator=g) * 4 * shape.head_dim**-0.5).to(DEV)  # noqa: E731
        method.adapters = {i: Adapter(w(shape.num_heads), w(shape.num_heads), w(shape.num_kv_heads), w(shape.num_kv_heads))
                           for i in range(shape.num_layers)}
    return method


def _model_method(model, name: str):
    from kvcalib.models import attention_shape

    return _method(name, attention_shape(model.config))


@pytest.mark.parametrize("name", METHODS)
def test_captured_steps_equal_eager_steps_bit_for_bit_through_a_serving_loop(name):
    from kvcalib.runtime.captured import CapturedDecoder

    model = _model()
    torch.manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), device=DEV) for n in (5, 31, 32, 70)]
    logits = {}
    for captured in (False, True):
        cache = StaticKvcalibCache(model, _model_method(model, name), max_batch=3, max_length=512)
        decoder = CapturedDecoder(model, cache)
        rows = []
        nxt = torch.stack([cache.prefill(model, i, p[None]).argmax() for i, p in enumerate(prompts[:3])])
        for s in range(100):  # every residual length of R = 32, three flushes and more per slot
            if s == 40:  # slot 1 leaves; the fourth prompt joins in its place
                cache.release(1)
                nxt[1] = cache.prefill(model, 1, prompts[3][None]).argmax()
            out = decoder.step(nxt, captured=captured).clone()
            rows.append(out)
            nxt = out.argmax(-1)
        logits[captured] = torch.stack(rows)
    assert torch.isfinite(logits[True]).all()
    assert torch.equal(logits[True], logits[False])


def test_the_serving_loop_gives_the_same_tokens_captured_and_eager():
    from kvcalib.runtime.captured import generate

    model = _model()
    torch.manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), device=DEV) for n in (9, 40, 64, 17, 33)]
    served = {}
    for captured in (False, True):
        cache = StaticKvcalibCache(model, "kivi", SETTINGS, max_batch=2, max_length=256)
        served[captured] = generate(model, cache, prompts, max_new_tokens=60, captured=captured)
    assert [len(t) for t in served[True]] == [60] * len(prompts)
    assert served[True] == served[False]


def test_a_closed_cache_frees_its_captured_step_and_the_next_generate_captures_it_again():
    """`close` resets the graphs `model.generate` captured (a closed step refuses to replay), and the next call
    captures anew and decodes the same tokens; a `with` block closes the cache at its end."""
    from kvcalib.errors import SettingsError
    from kvcalib.runtime.captured import CapturedDecoder

    model = _model()
    prompt = torch.randint(0, 1000, (1, 45), generator=torch.Generator().manual_seed(6)).to(DEV)
    cache = StaticKvcalibCache(model, "kivi", SETTINGS, max_batch=1, max_length=256, compile="none")
    with torch.no_grad():
        first = model.generate(prompt, past_key_values=cache, max_new_tokens=40, do_sample=False)
    decoder = cache.decoder
    assert isinstance(decoder, CapturedDecoder)
    cache.close()
    assert cache.decoder is None and not decoder.graphs
    with pytest.raises(SettingsError, match="closed"):
        decoder.step(first[:, -1])
    with cache, torch.no_grad():
        again = model.generate(prompt, past_key_values=cache, max_new_tokens=40, do_sample=False)
        assert isinstance(cache.decoder, CapturedDecoder) and cache.decoder is not decoder
    assert cache.decoder is None
    assert torch.equal(first, again)


@pytest.mark.parametrize("name", METHODS)
def test_a_compiled_append_and_attention_store_and_return_the_eager_bits_through_a_refilled_slot(name):
    from kvcalib.attention import AttentionOptions
    from kvcalib.runtime.captured import compile_options

    d, h, group, residual = 128, 2, 32, 64
    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=h, head_dim=d)
    method = _method(name, shape, MethodSettings(bits=2, group_size=group, residual=residual))
    layers = [StaticLayer(method, 0, 3, capacity=8 * residual, kv_heads=h, head_dim=d, device=torch.device(DEV))
              for _ in range(2)]
    for layer in layers:
        for i, t in enumerate([1, residual - 1, 2 * residual + 5]):
            layer.prefill(i, *_tokens(1, h, t, d, seed=50 + i))
    opts = AttentionOptions(scaling=d**-0.5)

    def step(layer, k, v, q):
        layer.append(k, v)
        return layer.attend(q, None, None, opts, prefill=False)

    compiled = torch.compile(step, fullgraph=True, dynamic=False, options=compile_options())
    k_new, v_new = _tokens(3, h, 2 * residual + 3, d, seed=60)
    q = torch.randn(3, 8, 2 * residual + 3, d, device=DEV).half()
    for s in range(2 * residual + 3):  # every residual length, two flushes per slot and more
        if s == residual // 2:  # slot 1 leaves; another sequence joins in its place
            for layer in layers:
                layer.prefill(1, *_tokens(1, h, residual + 3, d, seed=70))
        args = (k_new[:, :, s : s + 1], v_new[:, :, s : s + 1], q[:, :, s : s + 1])
        eager, comp = step(layers[0], *args), compiled(layers[1], *args)
        for (buf, _), (other, _) in zip(layers[0]._buffers(), layers[1]._buffers()):
            assert torch.equal(buf, other), s
        for a, b in zip([layers[0].layout.kres, layers[0].layout.vres, layers[0].flushed, layers[0].residual],
                        [layers[1].layout.kres, layers[1].layout.vres, layers[1].flushed, layers[1].residual]):
            assert torch.equal(a, b), s
        if layers[0].state is None:
            assert torch.equal(eager, comp), s
            continue
        # KVLinC: S and P are float32 sums over the flushed tokens, which Inductor orders its own way: each
        # entry within 2 T u32 of the sum of its |terms| (P's terms are φ >= 0; S's are φ |v|, each at most
        # max|v| times P's), T tokens flushed; then the output moves by at most an ulp of float16, 2^-10 of a row.
        e, c = layers[0].state, layers[1].state
        t = layers[0].flushed.view(-1, 1, 1).double()
        bound_p = 2 * t * 2.0**-24 * e.p.double()
        assert ((e.p.double() - c.p.double()).abs() <= bound_p).all(), s
        vmax = 2 * v_new.abs().max().double()  # values as held: within a quantization step of the float16 ones
        assert ((e.s.double() - c.s.double()).abs() <= (bound_p * vmax)[..., None]).all(), s
        rows = (eager.double() - comp.double()).norm(dim=-1) / eager.double().norm(dim=-1)
        assert (rows <= 2.0**-10).all(), (s, rows.max().item())


@pytest.mark.parametrize("name", METHODS)
def test_a_compiled_one_slot_flush_stores_the_eager_bits(name):
    """`append_one` compiled by Inductor (as `compile="step"` compiles the whole step), its slot read on the device,
    stores what the eager one stores, bit for bit (the same rounding as the masked flush's compiled form, above),
    through windows filling one slot at a time and appends between them."""
    from kvcalib.runtime.captured import compile_options
    from kvcalib.runtime.static_cache import flush_step

    d, h, group, residual = 128, 2, 32, 64
    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=h, head_dim=d)
    method = _method(name, shape, MethodSettings(bits=2, group_size=group, residual=residual))
    layers = [StaticLayer(method, 0, 3, capacity=8 * residual, kv_heads=h, head_dim=d, device=torch.device(DEV))
              for _ in range(2)]
    prompts = [1, residual - 1, 2 * residual + 5]
    for layer in layers:
        for i, t in enumerate(prompts):
            layer.prefill(i, *_tokens(1, h, t, d, seed=50 + i))
    compiled = torch.compile(lambda k, v: layers[1].append_one(k, v, layers[1].slot), fullgraph=True, dynamic=False,
                             options=compile_options())
    k_new, v_new = _tokens(3, h, 2 * residual + 3, d, seed=60)
    counts, ones = [t % residual for t in prompts], 0
    for s in range(2 * residual + 3):  # every slot's window fills twice, alone
        counts = [c + 1 for c in counts]
        flush, one = flush_step(counts, residual)
        counts = [c % residual for c in counts]
        args = (k_new[:, :, s : s + 1], v_new[:, :, s : s + 1])
        if one is None:
            for layer in layers:
                layer.append(*args, flush)
        else:
            ones += 1
            layers[0].slot.fill_(one)
            layers[1].slot.fill_(one)
            layers[0].append_one(*args, layers[0].slot)
            compiled(*args)
        for (buf, _), (other, _) in zip(layers[0]._buffers(), layers[1]._buffers()):
            assert torch.equal(buf, other), s
        assert torch.equal(layers[0].flushed, layers[1].flushed) and torch.equal(layers[0].residual, layers[1].residual)
        assert torch.equal(layers[0].layout.kres, layers[1].layout.kres)
        if layers[0].state is not None:  # KVLinC's float32 sums, in Inductor's order: the bound of the test above
            e, c = layers[0].state, layers[1].state
            bound_p = 2 * layers[0].flushed.view(-1, 1, 1).double() * 2.0**-24 * e.p.double()
            assert ((e.p.double() - c.p.double()).abs() <= bound_p).all(), s
            vmax = 2 * v_new.abs().max().double()
            assert ((e.s.double() - c.s.double()).abs() <= (bound_p * vmax)[..., None]).all(), s
    assert ones == 7  # slot 0 at steps 63 and 127, slot 1 at 1, 65 and 129, slot 2 at 59 and 123


def test_the_compiled_step_writes_the_cache_in_place_allocating_less_than_a_buffer_beyond_the_eager_step():
    """The eager step writes every buffer in place; a compiled write that Inductor turned into a copy
    (as it does a `scatter_` into a graph input) would allocate a whole packed buffer, each of them here
    (>= 4 MiB at 128k tokens) larger than all the eager step's temporaries together (about 1 MiB, the
    attention's partials most of it). Inductor's own temporaries differ from eager's by a few KiB."""
    from kvcalib.runtime.captured import compile_options

    d, h, group, residual = 128, 2, 32, 64
    shape = AttentionShape(num_layers=1, num_heads=8, num_kv_heads=h, head_dim=d)
    method = build_method("kivi", shape, MethodSettings(bits=2, group_size=group, residual=residual))
    layer = StaticLayer(method, 0, 2, capacity=131072, kv_heads=h, head_dim=d, device=torch.device(DEV))
    for i, t in enumerate([residual - 2, 3 * residual - 1]):  # slot 1 flushes at the first step, slot 0 at the second
        layer.prefill(i, *_tokens(1, h, t, d, seed=80 + i))

    def step(k, v, q):
        layer.append(k, v)
        return fused_decode(q, layer.layout, d**-0.5, counts=(layer.flushed, layer.residual))

    compiled = torch.compile(step, fullgraph=True, dynamic=False, options=compile_options())
    k_new, v_new = _tokens(2, h, 4, d, seed=90)
    q = torch.randn(2, 4, 8, d, device=DEV).half()
    extra = {}
    for s, (name, run) in enumerate([("eager", step), ("compiled", compiled)]):
        run(k_new[:, :, 2 * s : 2 * s + 1], v_new[:, :, 2 * s : 2 * s + 1], q[:, 2 * s])  # compiles
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(k_new[:, :, 2 * s + 1 : 2 * s + 2], v_new[:, :, 2 * s + 1 : 2 * s + 2], q[:, 2 * s + 1])
        torch.cuda.synchronize()
        extra[name] = torch.cuda.max_memory_allocated() - before
    p = layer.layout
    smallest = min(b.nbytes for b in (p.kcodes, p.kscale, p.kzero, p.vcodes, p.vscale, p.vzero))
    assert smallest > extra["eager"], extra
    assert extra["compiled"] - extra["eager"] < smallest, extra


@pytest.mark.parametrize("mode", ["step", "regions"])
@pytest.mark.parametrize("name", ["kivi", "oscar"])
def test_compiled_captured_steps_match_eager_steps_through_flushes_and_a_refilled_slot(name, mode):
    """KIVI and OScaR. KVLinC's compiled step is held to the eager one at the layer (above): its correction
    reads the quantization residual k - k̂, which jumps where a code changes, so the float16 round-off
    between Inductor's and eager's activations, where it moves a code, moves that token's φ(kᵉ) by O(1):
    measured on this model with random adapters: layer 1's float16 keys differ by an ulp, a few dozen of its codes
    differ, and the logits by 0.12 (of up to 1.97) after 50 steps where a flush took such codes, not a few ulps.
    `regions` (the cache's default) compiles each decoder layer around its attention (two graphs: before and
    after it), the final norm, the rotary application and the cache's append: five graphs, whatever the number
    of layers."""
    from torch._dynamo.utils import counters

    from kvcalib.runtime.captured import CapturedDecoder, Decoder

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    torch.manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), device=DEV) for n in (5, 31, 70, 32)]
    logits, fed = {}, []
    for compiled in (False, True):
        cache = StaticKvcalibCache(model, _model_method(model, name), max_batch=3, max_length=512)
        decoder = CapturedDecoder(model, cache, compile=mode) if compiled else Decoder(model, cache, compile="none")
        rows = []
        nxt = torch.stack([cache.prefill(model, i, p[None]).argmax() for i, p in enumerate(prompts[:3])])
        for s in range(50):  # every slot flushes at least once (R = 32)
            if s == 20:  # slot 1 leaves; the fourth prompt joins in its place
                cache.release(1)
                nxt[1] = cache.prefill(model, 1, prompts[3][None]).argmax()
            if compiled:  # fed the eager run's tokens: the two runs see the same inputs at every step
                nxt = fed[s]
            else:
                fed.append(nxt.clone())
            out = decoder.step(nxt).float()
            rows.append(out.clone())
            nxt = out.argmax(-1)
        logits[compiled] = torch.stack(rows)
    eager, comp = logits[False], logits[True]
    assert torch.isfinite(comp).all()
    diff = (comp - eager).abs().amax(-1)  # (steps, B)
    print(f"compiled vs eager logits: max |diff| {diff.max().item():.4g} (|logits| up to {eager.abs().max().item():.3g}), "
          f"mean {diff.mean().item():.3g}, steps with equal logits {int((diff == 0).all(-1).sum())}/50")
    # A few float16 ulps of the largest logit (seen on an H100: 1.5 ulps, 0.0015 at |logits| <= 1.92).
    assert diff.max() <= 4 * 2**-10 * eager.abs().max()
    top2 = eager.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert torch.equal(comp.argmax(-1)[clear], eager.argmax(-1)[clear])
    if mode == "regions":  # the five graphs serve every layer (a per-layer compile shows here)
        assert counters["stats"]["unique_graphs"] == 5, dict(counters["stats"])


@pytest.mark.parametrize("name", METHODS)
def test_steps_that_skip_the_flush_hold_what_flushing_every_step_holds(name):
    """The host's copy of the residual counts picks the steps that flush (`StaticKvcalibCache.advance`), and
    those where one slot's window alone fills, which flush that slot only; the others append only. Against a cache
    made to run the masked flush of every slot at every step (the flush rule
    itself, which writes nothing where no window is full but into the slack block), eager and captured
    steps give the same logits bit for bit and hold the same counts and stored blocks (the slack block
    aside), through prompts of several residual phases (two of one phase, 5 and 37 tokens: their windows fill at
    one step, which flushes both), a released slot and a refilled one."""
    from kvcalib.runtime.captured import CapturedDecoder, Decoder

    class EveryStep(Decoder):
        def _take(self, tokens):
            super()._take(tokens)
            for layer in self.cache.layers:
                layer.flush, layer.one = True, False

    model = _model()
    torch.manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), device=DEV) for n in (5, 31, 37, 70)]
    runs = {}
    for run in ("every step", "eager", "captured"):
        cache = StaticKvcalibCache(model, _model_method(model, name), max_batch=3, max_length=512)
        decoder = {"every step": EveryStep, "eager": Decoder, "captured": CapturedDecoder}[run](model, cache)
        nxt = torch.stack([cache.prefill(model, i, p[None]).argmax() for i, p in enumerate(prompts[:3])])
        rows, flushes, ones = [], 0, 0
        for s in range(90):  # every residual length of R = 32, two flushes and more per slot
            if s == 30:
                cache.release(1)
            if s == 45:  # slot 1, free for 15 steps (its counts ran on), takes the fourth prompt
                nxt[1] = cache.prefill(model, 1, prompts[3][None]).argmax()
            out = decoder.step(nxt).clone()
            flushes += cache.layers[0].flush
            ones += cache.layers[0].flush and cache.layers[0].one
            rows.append(out)
            nxt = out.argmax(-1)
        runs[run] = (torch.stack(rows), cache, flushes, ones)
    ref, ref_cache, every, _ = runs["every step"]
    assert every == 90
    for run in ("eager", "captured"):
        logits, cache, flushes, ones = runs[run]
        assert 0 < ones < flushes < 90, (ones, flushes)  # steps without a flush, flushing one slot, and more, were taken
        assert torch.equal(logits, ref), run
        for a, b in zip(cache.layers, ref_cache.layers):
            for x, y in zip(a.mutable(), b.mutable()):  # counts, KVLinC's S and P
                assert torch.equal(x, y), run
            for (buf, unit), (ref_buf, _) in zip(a._buffers(), b._buffers()):
                stored = buf.shape[2] - a.layout.residual // unit  # the slack block aside
                assert torch.equal(buf[:, :, :stored], ref_buf[:, :, :stored]), run
            assert torch.equal(a.layout.kres, b.layout.kres)
            assert torch.equal(a.layout.vres, b.layout.vres)
