"""The static cache's host-side rules, on any machine (its GPU behaviour: tests/test_static_cache_gpu.py)."""

import dataclasses
import functools

import pytest
import torch

from kvcalib.errors import SettingsError
from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import AttentionShape
from kvcalib.formats.int2.layout import kernel_parts
from kvcalib.methods.kvlinc import Adapter, features
from kvcalib.runtime.cache import check_static
from kvcalib.runtime.slots import flush_writes, masked_write
from kvcalib.runtime.static_cache import StaticLayer
from test_runtime_cache import _vecinfer_with_sinks

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
CUDA = torch.device("cuda")  # `check_static` reads only the device's type: no GPU needed to ask it


def test_masked_write_writes_each_taken_row_at_its_own_offset_and_the_others_only_into_the_slack():
    buf = torch.arange(3 * 2 * 13 * 4).reshape(3, 2, 13, 4)  # 10 positions and a slack of 3
    before = buf.clone()
    new = -torch.arange(3 * 2 * 3 * 4).reshape(3, 2, 3, 4) - 1
    masked_write(buf, new, start=torch.tensor([0, 5, 7], dtype=torch.int32), take=torch.tensor([True, False, True]))
    want = before.clone()
    want[0, :, 0:3] = new[0]
    want[1, :, 10:13] = new[1]
    want[2, :, 7:10] = new[2]
    assert torch.equal(buf, want)


def test_flush_writes_write_what_masked_write_writes_buffer_by_buffer_with_each_index_made_once():
    """A flush's buffers of different units, lengths and head counts (a plan's groups: codes per token, scales per
    group of 4 tokens, one group of 1 head): the same bits as `masked_write` of each at flushed // unit, in fewer
    launches (each index once for the writes sharing it, then one `index_put_` a buffer: 8 launches a buffer before)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in (torch.ops.aten.view, torch.ops.aten.empty):
                self.ops.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    flushed, take = torch.tensor([0, 8, 16], dtype=torch.int32), torch.tensor([True, False, True])
    specs = [(2, 24 + 8, 8, 1, 5), (2, 24 + 8, 8, 1, 3), (2, 6 + 2, 2, 4, 4), (1, 24 + 8, 8, 1, 5)]  # h, N, n, unit, last
    bufs = [torch.randint(-9, 9, (3, h, big, last), generator=g) for h, big, _, _, last in specs]
    news = [torch.randint(100, 200, (3, h, n, last), generator=g) for h, _, n, _, last in specs]
    want = [b.clone() for b in bufs]
    for buf, new, (_, _, _, unit, _) in zip(want, news, specs):
        masked_write(buf, new, torch.div(flushed, unit, rounding_mode="floor"), take)
    flush_writes([(b.clone(), n, spec[3]) for b, n, spec in zip(bufs, news, specs)], flushed, take)  # a warm-up
    with Launches() as launched:
        flush_writes([(b, n, spec[3]) for b, n, spec in zip(bufs, news, specs)], flushed, take)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want))
    # where the rows went: row 0 at its start, row 1 (not taken) into the slack, row 2 at 16 // 4 for the 4-token unit
    assert torch.equal(bufs[0][0, :, :8], news[0][0]) and torch.equal(bufs[0][1, :, 24:], news[0][1])
    assert torch.equal(bufs[2][2, :, 4:6], news[2][2])
    puts = launched.ops.count(torch.ops.aten.index_put_)
    assert puts == len(specs)
    # indices, after a warm-up (the ranges held: `quant.steps`): where the rows go, in tokens, once (every slack
    # block starts at token 24: a scalar and a where), a start per unit (2: a division and a cast each), positions
    # per (unit, length, rows) (2: an add each); buffer by buffer, 9 launches a buffer
    assert len(launched.ops) - puts == 2 + 2 * 2 + 2
    # slack blocks at different tokens: each buffer's rows not taken go to its own (a scalar, where, add each)
    odd = [(torch.zeros(3, 2, 40, 2, dtype=torch.long), torch.ones(3, 2, 8, 2, dtype=torch.long), 1),
           (torch.zeros(3, 2, 8, 2, dtype=torch.long), torch.ones(3, 2, 2, 2, dtype=torch.long), 4)]
    for buf, new, unit in [(b.clone(), n, u) for b, n, u in odd]:
        masked_write(buf, new, torch.div(flushed, unit, rounding_mode="floor"), take)
        flush_writes([(got := torch.zeros_like(buf), new, unit)], flushed, take)
        assert torch.equal(got, buf)
    flush_writes(odd, flushed, take)
    assert odd[0][0][1, :, 32:].eq(1).all() and odd[1][0][1, :, 6:].eq(1).all() and odd[0][0][1, :, :32].eq(0).all()


@pytest.mark.parametrize("name,settings,reason", [
    ("turboquant", MethodSettings(residual_mode="sliding"), "flushes blockwise"),
    ("turboquant", MethodSettings(residual=64, sink_tokens=65), "must lie in the first block of 64"),
    ("kivi", MethodSettings(bits=3, group_size=8), "no fused layout at these settings"),  # tiles of 16
    ("kivi", MethodSettings(group_size=32, residual_mode="sliding"), "flushes blockwise"),
    ("kivi", MethodSettings(group_size=32, sink_tokens=129), "must lie in the first block of 128"),
])
def test_a_static_cache_refuses_what_it_cannot_hold_with_the_reason(name, settings, reason):
    method = build_method(name, SHAPE, settings)
    with pytest.raises(SettingsError, match=reason):
        check_static(method, SHAPE.head_dim, CUDA, 2)


@pytest.mark.parametrize("name", ["kivi", "turboquant"])
def test_a_static_cache_names_the_head_dim_or_query_groups_no_fused_kernel_reads(name):
    """Phi-3's head_dim of 96 and a model of 16 query heads per KV head: the refusal names what is missing, not only
    that no layout fits (a model users bring is refused in one line naming it)."""
    phi = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=96)
    with pytest.raises(SettingsError, match=r"its head_dim 96 is not one a fused kernel reads \(64, 128, 256\)"):
        check_static(build_method(name, phi, MethodSettings()), 96, CUDA, 2)
    wide = AttentionShape(num_layers=1, num_heads=32, num_kv_heads=2, head_dim=64)
    with pytest.raises(SettingsError, match="its 16 query heads per KV head are more than a fused kernel reads"):
        check_static(build_method(name, wide, MethodSettings()), 64, CUDA, 16)
    check_static(build_method(name, SHAPE, MethodSettings(group_size=32) if name == "kivi" else MethodSettings()),
                 SHAPE.head_dim, CUDA, 2)  # the same method at a shape the kernels read: no error


@pytest.mark.parametrize("name,settings,family", [
    ("kivi", MethodSettings(bits=2, group_size=32), "INT2"),
    ("kivi", MethodSettings(bits=3, group_size=32), "codebook"),
    ("kivi", MethodSettings(bits=4, group_size=128), "codebook"),
    ("kivi", MethodSettings(bits=2, group_size=32, sink_tokens=4), "codebook"),  # INT2 holds no sinks
    ("oscar", MethodSettings(bits=3, group_size=128), "codebook"),
    ("kvlinc", MethodSettings(bits=3, group_size=32), None),  # its correction terms are INT2's alone
])
def test_kivi_and_oscar_beyond_two_bits_or_with_sinks_take_the_codebook_kernel(name, settings, family):
    from kvcalib.runtime.cache import kernel_format

    method = build_method(name, SHAPE, settings)
    fmt = kernel_format(method, 0, SHAPE.head_dim, CUDA, 2)[0]
    assert (fmt and fmt.name) == family
    if family:
        check_static(method, SHAPE.head_dim, CUDA, 2)  # no error


def test_a_static_cache_takes_vecinfer_without_sinks_and_books_that_fit_the_kernel():
    check_static(_method("vecinfer"), SHAPE.head_dim, CUDA, 2)  # no error
    with pytest.raises(SettingsError, match="sink tokens are held by the codebook layout only"):
        check_static(_vecinfer_with_sinks(SHAPE, 3, 32), SHAPE.head_dim, CUDA, 2)
    big = _method("vecinfer")
    big.layers[0].k = torch.zeros(1, 2**16, 8, dtype=torch.float16)  # d8b16 keys: a 1 MiB book
    big.config = dataclasses.replace(big.config, k_config="d8b16")
    with pytest.raises(SettingsError, match="no fused layout at these settings"):
        check_static(big, SHAPE.head_dim, CUDA, 2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("sinks", [0, 1, 64])
def test_a_static_cache_takes_turboquant_of_every_width_with_sinks_in_the_first_block(bits, sinks):
    """TurboQuant's codes are read by the codebook kernel (`formats.codebook.launch.supports`); its float16 sinks
    are held beside them."""
    method = build_method("turboquant", SHAPE, MethodSettings(bits=bits, residual=64, sink_tokens=sinks))
    check_static(method, SHAPE.head_dim, CUDA, 2)  # no error
    with pytest.raises(SettingsError, match="its 9 query heads per KV head are more than a fused kernel reads"):
        check_static(method, SHAPE.head_dim, CUDA, 9)  # more query heads per KV head than the kernel holds


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc"])
def test_a_static_cache_takes_the_fused_kernels_methods_and_refuses_a_cpu(name):
    method = build_method(name, SHAPE, MethodSettings(group_size=32))
    check_static(method, SHAPE.head_dim, CUDA, 2)  # no error
    with pytest.raises(SettingsError, match="runs on CUDA only"):
        check_static(method, SHAPE.head_dim, torch.device("cpu"), 2)


U16, U32 = 2.0**-11, 2.0**-24  # unit round-off of float16 and float32


def _method(name: str, seed: int = 0):
    """KIVI, OScaR, or KVLinC with random adapters (rank 8) on layer 0, over channel-wise or OScaR-coded keys
    (`kvlinc-oscar`): G = 16, R = 32; or VecInfer with random codebooks (R = 32)."""
    if name == "vecinfer":  # random d4b6 codebooks and smoothing, R = 32, no sinks
        return _vecinfer_with_sinks(SHAPE, 0, 32)
    keys = "oscar" if name == "kvlinc-oscar" else None
    method = build_method(name.split("-")[0], SHAPE, MethodSettings(bits=2, group_size=16, residual=32, keys=keys))
    if name.startswith("kvlinc"):
        g = torch.Generator().manual_seed(seed)
        w = lambda h: torch.randn(h, SHAPE.head_dim, 4, generator=g) * SHAPE.head_dim**-0.5  # noqa: E731
        method.adapters = {0: Adapter(w(SHAPE.num_heads), w(SHAPE.num_heads), w(SHAPE.num_kv_heads), w(SHAPE.num_kv_heads))}
    return method


def _expected_state(method, k: torch.Tensor, v: torch.Tensor, n: int):
    """KVLinC's S, P after the first n tokens of one sequence (1, H, T, D), block by block as a decoder
    flushes them, and the float64 sums of |terms| each entry of S and P adds (their round-off bound)."""
    adapter, state, mags = method.adapters[0], None, (0.0, 0.0)
    for start in range(0, n, method.block):
        blk = slice(start, start + method.block)
        kd, vd = method.decompress(0, method.compress(0, k[:, :, blk].float(), v[:, :, blk].float()))
        state = method.flush_state(0, state, k[:, :, blk], kd, vd)
        phi = features(k[:, :, blk].float() - kd, adapter.k_w1, adapter.k_w2).double().abs()  # S += φᵀ v, P += Σ φ
        mags = (mags[0] + phi.transpose(-1, -2) @ vd.double().abs(), mags[1] + phi.sum(-2))
    return state, mags


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc", "kvlinc-oscar", "vecinfer"])
def test_each_slot_holds_the_methods_blocks_of_its_own_tokens_and_the_residual_in_the_kernels_basis(name):
    """Three sequences of different lengths, appended a token a step: after every step each slot holds
    bit for bit the method's `compress` of each of its full blocks (codes, scales, zeros, OScaR's key
    norms: what `KvcalibCache` stores) and the float16 tokens not yet flushed, as they came in (the
    kernel reads the residual in the model's basis whatever basis the blocks are stored in); KVLinC's S and P are those of flushing the blocks one by one, within float32 summation round-off
    (tokens summed x u32 x the sum of |terms|)."""
    method = _method(name)
    layer = StaticLayer(method, 0, 3, capacity=160, kv_heads=2, head_dim=64, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    prompts, steps = [3, 31, 70], 40
    seqs = [((1 + 3 * torch.rand(1, 2, 1, 64, generator=g)) * torch.randn(1, 2, t + steps, 64, generator=g)).half()
            for t in prompts]
    vals = [torch.randn(1, 2, t + steps, 64, generator=g).half() for t in prompts]
    for i, t in enumerate(prompts):
        layer.prefill(i, seqs[i][:, :, :t], vals[i][:, :, :t])
    p = layer.layout
    for s in range(steps + 1):
        if s:
            layer.append(torch.cat([x[:, :, t + s - 1 : t + s] for x, t in zip(seqs, prompts)]),
                         torch.cat([x[:, :, t + s - 1 : t + s] for x, t in zip(vals, prompts)]))
        for i, t in enumerate(prompts):
            k, v, held = seqs[i], vals[i], t + s
            n, r = held // 32 * 32, held % 32
            assert (int(layer.flushed[i]), int(layer.residual[i])) == (n, r), (s, i)
            assert torch.equal(p.kres[i, :, :r], k[0, :, n:held]) and torch.equal(p.vres[i, :, :r], v[0, :, n:held])
            if name == "vecinfer":  # VecInfer's code rows, what `KvcalibCache` hands its kernel
                assert layer.format.name == "VecInfer"
            else:
                assert (p.rotated_keys, p.rotated_values) == (method.rotated_keys, method.rotated_values)
            if n and name == "vecinfer":
                want = list(method.vq_parts(method.compress(0, k[:, :, :n].float(), v[:, :, :n].float())))
                for (buf, unit), part in zip(layer._buffers(), want, strict=True):
                    assert torch.equal(buf[i : i + 1, :, : n // unit], part), (s, i, unit)
            elif n:
                packed = method.compress(0, k[:, :, :n].float(), v[:, :, :n].float())
                kq, vq, norms = method.int2_parts(packed)
                want = [*kernel_parts(kq, vq)]
                want = [want[0], kq.scale, kq.zero, want[1], want[2], want[3]] + ([norms] if norms is not None else [])
                assert (p.knorm is not None) == name.endswith("oscar")
                for (buf, unit), part in zip(layer._buffers(), want):
                    assert torch.equal(buf[i : i + 1, :, : n // unit], part), (s, i, unit)
            if name.startswith("kvlinc"):
                if n:
                    state, (ms, mp) = _expected_state(method, k, v, n)
                    for got, want, mag in ((layer.state.s[i], state.s[0], ms[0]), (layer.state.p[i], state.p[0], mp[0])):
                        assert ((got.double() - want.double()).abs() <= n * U32 * mag + 1e-30).all(), (s, i)
                else:
                    assert not layer.state.s[i].any() and not layer.state.p[i].any()
    assert layer.flushed.tolist() == [32, 64, 96]


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc", "kvlinc-oscar", "vecinfer"])
def test_the_append_and_masked_flush_trace_into_one_graph_that_stores_the_eager_bits(name):
    """What `torch.compile(fullgraph=True)` sees of the static cache's step: no host sync, no branch on
    a count (aot_eager: the traced, functionalised graph run by eager ops; the GPU tests run Inductor)."""
    method = _method(name)
    layers = [StaticLayer(method, 0, 3, capacity=128, kv_heads=2, head_dim=64, device=torch.device("cpu"))
              for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate([3, 31, 70]):
        k, v = torch.randn(1, 2, t, 64, generator=g).half(), torch.randn(1, 2, t, 64, generator=g).half()
        for layer in layers:
            layer.prefill(i, k, v)
    compiled = torch.compile(layers[1].append, fullgraph=True, backend="aot_eager")
    k, v = (3 * torch.randn(3, 2, 40, 64, generator=g)).half(), torch.randn(3, 2, 40, 64, generator=g).half()
    for s in range(40):  # every slot flushes once
        layers[0].append(k[:, :, s : s + 1], v[:, :, s : s + 1])
        compiled(k[:, :, s : s + 1], v[:, :, s : s + 1])
        for a, b in zip(layers[0].layout.__dict__.values(), layers[1].layout.__dict__.values()):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, s
        for a, b in zip(layers[0].mutable(), layers[1].mutable()):
            assert torch.equal(a, b), s
    assert layers[0].flushed.tolist() == [32, 64, 96]


@pytest.mark.parametrize("name", ["kivi", "oscar", "kvlinc", "kvlinc-oscar", "vecinfer"])
def test_the_flush_of_one_slot_traces_into_one_graph_that_stores_the_eager_bits(name):
    """`append_one` as `torch.compile(fullgraph=True)` sees it in the whole step's compile: its slot read on the
    device (no host sync, no graph break, KVLinC's state of one slot included), the eager bits (aot_eager, as above)."""
    from kvcalib.runtime.static_cache import flush_step

    method = _method(name)
    layers = [StaticLayer(method, 0, 3, capacity=128, kv_heads=2, head_dim=64, device=torch.device("cpu"))
              for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate([3, 31, 70]):  # windows filling at steps 29, 1 and 26 of 32
        k, v = torch.randn(1, 2, t, 64, generator=g).half(), torch.randn(1, 2, t, 64, generator=g).half()
        for layer in layers:
            layer.prefill(i, k, v)
    compiled = torch.compile(lambda k, v: layers[1].append_one(k, v, layers[1].slot), fullgraph=True,
                             backend="aot_eager")
    k, v = (3 * torch.randn(3, 2, 40, 64, generator=g)).half(), torch.randn(3, 2, 40, 64, generator=g).half()
    counts = [3, 31, 6]
    for s in range(40):
        counts = [c + 1 for c in counts]
        flush, one = flush_step(counts, 32)
        counts = [c % 32 for c in counts]
        x = (k[:, :, s : s + 1], v[:, :, s : s + 1])
        if one is None:
            assert not flush
            for layer in layers:
                layer.append(*x, False)
            continue
        for layer in layers:
            layer.slot.fill_(one)
        layers[0].append_one(*x, layers[0].slot)
        compiled(*x)
        for a, b in zip(layers[0].layout.__dict__.values(), layers[1].layout.__dict__.values()):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, s
        for a, b in zip(layers[0].mutable(), layers[1].mutable()):
            assert torch.equal(a, b), s
    assert layers[0].flushed.tolist() == [32, 64, 96]


def test_compile_modes_are_named_and_a_wrong_one_is_refused_in_one_line():
    from kvcalib.runtime.captured import COMPILE_MODES, compile_mode

    assert [compile_mode(m) for m in COMPILE_MODES] == list(COMPILE_MODES)
    assert (compile_mode(True), compile_mode(False)) == ("step", "none")
    with pytest.raises(SettingsError, match="compile must be one of regions, step, none"):
        compile_mode("fast")


def test_the_compiled_regions_are_the_decoder_layers_without_attention_and_only_inside_the_step():
    """What `compile="regions"` compiles (kvcalib.runtime.captured): every decoder layer, its attention module
    left to run eagerly inside it (its forward under `torch._dynamo.disable`), the final norm, the rotary
    application of the attention's module and the cache's append (`slots.write_token`), switched in while
    the step runs and put back after it, also when the step raises; an attention module's own forward (as
    accelerate's hooks set one) is put back as it was. Nothing is compiled here: torch.compile wraps lazily,
    and these tests check which code runs where (the GPU tests time and compare it)."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcalib.runtime import slots
    from kvcalib.runtime.captured import _Regions

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    hooked = model.model.layers[1].self_attn
    hook = hooked.forward = functools.partial(type(hooked).forward, hooked)  # an instance's own forward
    eager_rope, eager_write = llama.apply_rotary_pos_emb, slots.write_token
    regions = _Regions(model)
    assert sorted(map(id, regions.modules)) == sorted(map(id, [*model.model.layers, model.model.norm]))
    attention = [layer.self_attn for layer in model.model.layers]

    def eager_everywhere():
        return (llama.apply_rotary_pos_emb is eager_rope and slots.write_token is eager_write
                and all(m._compiled_call_impl is None for m in regions.modules)
                and all("forward" not in a.__dict__ for a in attention if a is not hooked) and hooked.forward is hook)

    assert eager_everywhere()
    with regions:
        assert all(m._compiled_call_impl is not None for m in regions.modules)
        assert llama.apply_rotary_pos_emb is not eager_rope and slots.write_token is not eager_write
        assert all("forward" in a.__dict__ and a.forward is not hook for a in attention)
        assert all(getattr(a.forward, "_torchdynamo_disable", False) for a in attention)
        assert hooked.forward._torchdynamo_orig_callable is hook  # the hook still runs, eagerly
    assert eager_everywhere()
    with pytest.raises(RuntimeError, match="inside"):
        with regions:
            raise RuntimeError("inside")
    assert eager_everywhere()


def test_regions_are_put_back_as_they_were_when_entered_twice_when_switching_in_fails_and_over_a_users_compile():
    """Entered again while open (the same regions, or another model's), nothing more is switched and the outermost
    exit puts everything back; a user's own `layer.compile()` survives the step; a failure half-way through
    switching in puts back what was switched and leaves the regions closed. Planted: without the depth count,
    the second entry would record the first's wrappers as the modules' own forwards and leave them behind."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcalib.runtime import captured, slots
    from kvcalib.runtime.captured import _Regions

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model, other = LlamaForCausalLM(config), LlamaForCausalLM(config)
    users = model.model.layers[0]._compiled_call_impl = lambda *a, **k: None  # a user's layer.compile()
    eager_rope, eager_write = llama.apply_rotary_pos_emb, slots.write_token
    regions, again, elsewhere = _Regions(model), _Regions(model), _Regions(other)
    attention = [layer.self_attn for m in (model, other) for layer in m.model.layers]

    def as_before():
        return (llama.apply_rotary_pos_emb is eager_rope and slots.write_token is eager_write
                and all("forward" not in a.__dict__ for a in attention)
                and model.model.layers[0]._compiled_call_impl is users
                and model.model.layers[1]._compiled_call_impl is None and captured._DEPTH[0] == 0)

    with regions:
        with again, elsewhere:
            assert all(getattr(a.forward, "_torchdynamo_orig_callable", None) is not None
                       and "forward" not in getattr(a.forward, "_torchdynamo_orig_callable").__dict__
                       for a in attention[:2])
        assert slots.write_token is not eager_write  # still open: the inner exits put nothing back
    assert as_before()
    # built while another's regions are open, a set still takes the eager functions for the eager ones
    with regions:
        late = _Regions(model)
    assert late.swaps[0][2] is eager_rope and late.swaps[1][2] is eager_write

    calls = []
    real = torch._dynamo.disable

    def failing(fn, *args, **kwargs):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("switching in failed")
        return real(fn, *args, **kwargs)

    torch._dynamo.disable = failing
    try:
        with pytest.raises(RuntimeError, match="switching in failed"):
            with regions:
                pass
    finally:
        torch._dynamo.disable = real
    assert as_before()


def test_the_regions_find_the_innermost_attention_where_the_decoder_layer_names_its_layer_too():
    """Gemma 3's decoder layer carries `layer_idx` and weights, as its attention does: the regions compile the
    decoder layers and leave only the attention modules eager (disabling the layer's own forward would run the
    whole layer eagerly)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvcalib.runtime.captured import _decoder_layers

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Gemma3ForCausalLM(config)
    layers, attention = _decoder_layers(model)
    assert [id(m) for m in layers] == [id(m) for m in model.model.layers]
    assert [id(m) for m in attention] == [id(layer.self_attn) for layer in model.model.layers]


def test_the_regions_compile_the_norms_an_attention_applies_to_its_heads_and_the_rings():
    """Qwen3's and Gemma 3's attention normalise each head's query and key (`q_norm`, `k_norm`) inside the eager
    attention: eager, each is its float32 casts, reduction and products, kernel by kernel, twice a layer (on a
    Gemma-3-4B shape at 32k, the step took 6.2 ms regions-compiled against 4.1 fully compiled before these were
    compiled). The regions compile them as they compile the layers, and swap in the compiled ring write and ring
    attention of kept sliding layers. A Llama attention has no norm: nothing more is compiled there."""
    from kvcalib.runtime import slots
    from kvcalib.runtime.captured import _Regions
    from conftest import tiny_model

    for arch in ("qwen3", "gemma3_text"):
        model = tiny_model(arch)
        regions = _Regions(model)
        norms = [m for layer in model.model.layers for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
        assert sorted(map(id, regions.modules)) == sorted(map(id, [*model.model.layers, model.model.norm, *norms]))
        swapped = {(where, name) for where, name, *_ in regions.swaps}
        assert {(slots, "write_ring"), (slots, "ring_attention"), (slots, "write_token")} <= swapped
        eager = slots.ring_attention
        with regions:
            assert all(m._compiled_call_impl is not None for m in norms) and slots.ring_attention is not eager
        assert all(m._compiled_call_impl is None for m in norms)
    llama = tiny_model("llama")
    assert sorted(map(id, _Regions(llama).modules)) == sorted(map(id, [*llama.model.layers, llama.model.norm]))


@pytest.mark.parametrize("window", [None, 24])
def test_a_prompts_soft_capped_attention_in_chunks_is_causal_attention_capped(window):
    """A prompt in a static layer of a soft-capping model (Gemma 2) attends through `chunked_prefill_attention`:
    chunk by chunk (no T x T matrix), query i over keys j <= i (within the window where one is given), scores capped
    as softcap tanh(s / softcap); against float64 attention over the whole mask, to float32 round-off (1e-5 of
    outputs of order 1). Planted: without the cap the outputs part by more than 1e-2."""
    from kvcalib.runtime.static_cache import chunked_prefill_attention

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 100, 16, generator=g) * s for h, s in ((4, 2.0), (2, 2.0), (2, 1.0)))
    scale, cap = 0.25, 3.0
    got = chunked_prefill_attention(q, k, v, scale, window=window, softcap=cap, chunk=32)
    s = torch.einsum("bjgqd,bjkd->bjgqk", q.double().view(1, 2, 2, 100, 16), k.double()) * scale
    s = cap * torch.tanh(s / cap)
    i, j = torch.arange(100).view(-1, 1), torch.arange(100).view(1, -1)
    seen = (i >= j) & ((i - j < window) if window else True)
    want = torch.einsum("bjgqk,bjkd->bjgqd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1),
                        v.double()).reshape(1, 4, 100, 16)
    assert (got.double() - want).abs().max() <= 1e-5
    plain = chunked_prefill_attention(q, k, v, scale, window=window, chunk=32)
    assert (plain.double() - want).abs().max() > 1e-2


def test_a_window_layer_writes_and_attends_through_the_module_level_ring_functions():
    """`StaticWindowLayer` looks `write_ring` and `ring_attention` up on `kvcalib.runtime.slots` at every call, so
    the regions' compiled forms are the ones that run; the ring attention is SDPA over the tokens each slot holds
    (a slot of 3 tokens in a ring of 8 equals attention over those 3 alone, to float32 round-off)."""
    from kvcalib.attention import AttentionOptions
    from kvcalib.runtime import slots
    from kvcalib.runtime.static_cache import StaticWindowLayer

    layer = StaticWindowLayer(0, 2, window=8, kv_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    calls, eager = [], (slots.write_ring, slots.ring_attention)
    slots.write_ring = lambda *a: (calls.append("write"), eager[0](*a))[1]
    slots.ring_attention = lambda *a: (calls.append("attend"), eager[1](*a))[1]
    torch.manual_seed(0)
    keys, values = torch.randn(3, 2, 2, 1, 16), torch.randn(3, 2, 2, 1, 16)
    try:
        for k, v in zip(keys, values):
            layer.step(k, v)
        q = torch.randn(2, 4, 1, 16)
        out = layer.attend(q, None, None, AttentionOptions(scaling=0.25), prefill=False)
    finally:
        slots.write_ring, slots.ring_attention = eager
    assert calls == ["write"] * 3 + ["attend"] and layer.count.tolist() == [3, 3]
    k3, v3 = keys[:, :, :, 0].permute(1, 2, 0, 3), values[:, :, :, 0].permute(1, 2, 0, 3)  # (B, H, 3, D)
    want = torch.nn.functional.scaled_dot_product_attention(q, k3, v3, scale=0.25, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-6)


def test_a_static_layer_appends_through_the_module_level_write_token():
    """`StaticLayer.append` looks `write_token` up on `kvcalib.runtime.slots` at every call, so the regions' compiled form is
    the one that runs (a name bound at import would keep the eager one)."""
    from kvcalib.runtime import slots

    layer = StaticLayer(_method("kivi"), 0, 2, capacity=64, kv_heads=2, head_dim=64, device=torch.device("cpu"))
    calls, eager = [], slots.write_token
    slots.write_token = lambda *args: (calls.append(len(args)), eager(*args))
    try:
        k = torch.randn(2, 2, 1, 64).half()
        layer.append(k, k, flush=False)
    finally:
        slots.write_token = eager
    assert calls == [5] and layer.residual.tolist() == [1, 1]
    assert torch.equal(layer.layout.kres[:, :, 0], k[:, :, 0])


class _Graph:
    """A stand-in for torch.cuda.CUDAGraph that counts its resets."""

    def __init__(self):
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_closing_the_cache_resets_each_captured_graph_once_and_a_closed_step_is_refused():
    """`close` (and the end of a `with` block) frees the graphs `model.generate` captured, which under tensor
    parallelism must be gone before `destroy_process_group` (a live graph's NCCL collectives make it wait
    forever); the bookkeeping is checked here with stand-in graphs, the release on GPUs in
    tests/test_static_cache_gpu.py and tests/test_multi_gpu.py."""
    from kvcalib.runtime.captured import CapturedDecoder
    from kvcalib.runtime.static_cache import StaticKvcalibCache

    def captured() -> CapturedDecoder:
        decoder = object.__new__(CapturedDecoder)  # no capture without CUDA: the graphs are stand-ins
        decoder.graphs = {True: _Graph(), False: _Graph()}
        decoder.outputs = {True: torch.zeros(1), False: torch.zeros(1)}
        return decoder

    cache = object.__new__(StaticKvcalibCache)
    cache.decoder = decoder = captured()
    graphs = list(decoder.graphs.values())
    cache.close()
    assert cache.decoder is None and [g.resets for g in graphs] == [1, 1] and not decoder.outputs
    with pytest.raises(SettingsError, match="closed"):
        decoder.step(torch.zeros(1, dtype=torch.long))
    cache.close()  # a closed cache closes again without touching anything
    assert [g.resets for g in graphs] == [1, 1]
    with cache as held:
        held.decoder = captured()
        graphs = list(held.decoder.graphs.values())
    assert cache.decoder is None and [g.resets for g in graphs] == [1, 1]


# The flushed buffers of each kernel layout by name, in `StaticLayer._buffers`' order.
LAYOUT_BUFFERS = {"INT2": ("kcodes", "kscale", "kzero", "vcodes", "vscale", "vzero", "knorm"), "VecInfer": ("kcodes", "vcodes")}
# (method, the format holding its kernel layout)
LAYOUTS = {"kivi": ("kivi", "INT2"), "oscar": ("oscar", "INT2"), "kvlinc": ("kvlinc", "INT2"),
           "vecinfer": ("vecinfer", "VecInfer"), "turboquant-2": ("turboquant", "codebook"),
           "turboquant-3+1 sink": ("turboquant", "codebook"), "turboquant-4+3 sinks": ("turboquant", "codebook"),
           "kivi-3": ("kivi", "codebook"), "oscar-4+1 sink": ("oscar", "codebook"), "plan+1 sink": ("plan", "codebook")}


def _append(layer: StaticLayer, k: torch.Tensor, v: torch.Tensor, counts: list[int], r: int) -> bool:
    """A step's append as the cache makes it (`flush_step` on the residual counts after it): the masked flush of every
    slot, of the one slot whose window alone fills, or none. Whether it took one slot."""
    from kvcalib.runtime.static_cache import flush_step

    flush, one = flush_step(counts, r)
    if one is None:
        layer.append(k, v, flush)
    else:
        layer.append_one(k, v, torch.tensor([one]))
    return one is not None


def _layout_method(case: str):
    sinks = int(case.split("+")[1][0]) if "+" in case else 0
    if case.startswith(("turboquant", "kivi-", "oscar-")):
        name, bits = case.split("+")[0].split("-")
        group = {} if name == "turboquant" else {"group_size": 32}
        return build_method(name, SHAPE, MethodSettings(bits=int(bits), residual=32, sink_tokens=sinks, **group))
    if case.startswith("plan"):  # every family per KV head, key groups of 32 (tests/test_codebook_layout.py)
        from test_codebook_layout import plan

        return plan("mixed", d=64, sinks=sinks, residual=32)
    return _method(case)


def _on_any_device(supports):
    """A kernel's `supports` asked as on a GPU: the layouts' host side runs on the CPU (their kernels do not)."""
    return lambda spec, d, device, *a, **k: supports(spec, d, torch.device("cuda"), *a, **k)


def kernels_on_any_device(monkeypatch) -> None:
    """Every format's `supports` asked as on a GPU (`_on_any_device`)."""
    import kvcalib.formats.codebook.format as codebook
    import kvcalib.formats.int2.format as int2
    import kvcalib.formats.vq.format as vq

    for module in (int2, vq, codebook):
        monkeypatch.setattr(module, "supports", _on_any_device(module.supports))


@pytest.mark.parametrize("prompt", [1, 8, 31, 32, 45, 70])
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_static_slot_stores_what_the_dynamic_cache_stores_for_every_kernel_layout(prompt, case, monkeypatch):
    """Every layout a kernel reads (INT2: KIVI, OScaR, KVLinC; VecInfer; the codebook layout: TurboQuant, with float16
    sinks): a slot prefilled with a prompt of any residual phase, then fed one token a step beside two other
    sequences that flush on other steps (its masked flushes writing codes, scales, norms and, at a sequence's first
    flush, its float16 sinks), holds exactly what `KvcalibCache`'s layer holds for the same tokens: counts, flushed
    buffers, sinks, residual. On the CPU: the layouts' host side, which the GPU's kernels read as they are. A planted
    error in the sinks' masked write (the slot's flushed count ignored) fails the sink cases."""
    import kvcalib.runtime.cache as cache_module

    kernels_on_any_device(monkeypatch)
    method, attribute = _layout_method(case), LAYOUTS[case][1]
    h = 4 if case.startswith("plan") else 2
    g = torch.Generator().manual_seed(prompt)
    total = prompt + 75  # two flushes or more past the prompt
    k, v = (torch.randn(1, h, total, 64, generator=g).half() for _ in "kv")
    dynamic = cache_module.CompressedLayer(method, 0, True)
    dynamic.append(k[:, :, :prompt], v[:, :, :prompt])
    static = StaticLayer(method, 0, 3, capacity=256, kv_heads=h, head_dim=64, device=torch.device("cpu"))
    static.prefill(1, k[:, :, :prompt], v[:, :, :prompt])
    for slot, n in ((0, 5), (2, 17)):  # sequences beside it, flushing on other steps
        static.prefill(slot, *(torch.randn(1, h, n, 64, generator=g).half() for _ in "kv"))
    counts = [5, prompt % 32, 17]  # every slot's residual count, as `StaticKvcalibCache.advance` mirrors them
    for t in range(prompt, total):
        dynamic.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        step = torch.randn(3, h, 1, 64, generator=g).half()  # the other slots' tokens
        kk, vv = step.clone(), step.clone()
        kk[1], vv[1] = k[0, :, t : t + 1], v[0, :, t : t + 1]
        counts = [c + 1 for c in counts]
        _append(static, kk, vv, counts, 32)
        counts = [c % 32 for c in counts]
    assert dynamic.format.name == attribute and static.format is dynamic.format
    theirs = dynamic.layout
    n, r = theirs.length, theirs.residual
    assert (int(static.flushed[1]), int(static.residual[1])) == (n, r) and n == total // 32 * 32
    if attribute == "codebook":  # each group's buffers, as `StaticLayer._buffers` lists them
        wants = [(f"{x} of heads {grp.head_map}", getattr(grp, x)) for grp in theirs.groups for x in grp.present()]
    else:
        wants = [(x, getattr(theirs, x)) for x in LAYOUT_BUFFERS[attribute] if getattr(theirs, x) is not None]
    assert len(static._buffers()) == len(wants)
    for (buf, unit), (name, want) in zip(static._buffers(), wants):
        rows = n // unit
        assert torch.equal(buf[1, :, :rows], want[0, :, :rows]), name
    sinks = getattr(theirs, "sinks", 0)
    if sinks:
        mine = static.layout
        assert torch.equal(mine.ksink[1, :, :sinks], theirs.ksink[0]) and torch.equal(mine.vsink[1, :, :sinks], theirs.vsink[0])
    assert torch.equal(static.layout.kres[1, :, :r], theirs.kres[0])
    assert torch.equal(static.layout.vres[1, :, :r], theirs.vres[0])


def test_a_step_flushes_one_slot_where_its_window_alone_fills_and_every_slot_where_several_do():
    """`flush_step`: the residual counts after a step's append (R = 4) say whether it flushes, and which slot alone
    where one window fills in a batch of several; a lone slot's flush is every slot's."""
    from kvcalib.runtime.static_cache import flush_step

    assert flush_step([1, 2, 3], 4) == (False, None)
    assert flush_step([1, 4, 3], 4) == (True, 1)
    assert flush_step([4, 2, 4], 4) == (True, None)
    assert flush_step([4], 4) == (True, None)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_flushing_the_one_slot_whose_window_fills_stores_the_masked_flushs_bits(case, monkeypatch):
    """A batch whose windows fill at different steps, fed the same tokens twice: flushing only the slot whose window
    alone fills (`StaticLayer.append_one`, as `StaticKvcalibCache.advance` picks it) stores what the masked flush of
    every slot stores at every step (codes, scales, norms, sinks, KVLinC's state, counts, windows), bit for bit, but
    the slack block the masked flush writes its other slots into; two slots whose windows fill together take the
    masked flush. A free slot (prompt 0) counts and flushes as the device's counts do. Planted errors (the slot's own
    flushed count ignored for its sinks; the state of slot 0 taken for the slot's; the capacity's clamp left out)
    fail it."""
    kernels_on_any_device(monkeypatch)
    method = _layout_method(case)
    h = 4 if case.startswith("plan") else 2
    g = torch.Generator().manual_seed(3)
    layers = [StaticLayer(method, 0, 5, capacity=64, kv_heads=h, head_dim=64, device=torch.device("cpu"))
              for _ in range(2)]  # two blocks: slots reach the capacity, past which a flush writes into the slack
    prompts = [3, 40, 0, 35, 17]  # residual phases 3, 8, 0 (free), 3, 17 of R = 32
    for slot, n in enumerate(prompts):
        if n:
            k, v = (torch.randn(1, h, n, 64, generator=g).half() for _ in "kv")
            for layer in layers:
                layer.prefill(slot, k, v)
    counts, ones = [n % 32 for n in prompts], 0
    for _ in range(80):  # two flushes or more of each slot
        k, v = (torch.randn(5, h, 1, 64, generator=g).half() for _ in "kv")
        counts = [c + 1 for c in counts]
        layers[0].append(k, v, 32 in counts)
        ones += _append(layers[1], k, v, counts, 32)
        counts = [c % 32 for c in counts]
        masked, one = layers
        for a, b in zip(masked.mutable(), one.mutable()):  # counts, KVLinC's S and P
            assert torch.equal(a, b)
        for (buf, unit), (other, _) in zip(masked._buffers(), one._buffers()):
            stored = buf.shape[2] - masked.layout.residual // unit  # the slack block aside
            assert torch.equal(buf[:, :, :stored], other[:, :, :stored])
        assert torch.equal(masked.layout.kres, one.layout.kres) and torch.equal(masked.layout.vres, one.layout.vres)
        s = getattr(masked.layout, "sinks", 0)  # sink rows, then as many of slack
        if s:
            assert torch.equal(masked.layout.ksink[:, :, :s], one.layout.ksink[:, :, :s])
            assert torch.equal(masked.layout.vsink[:, :, :s], one.layout.vsink[:, :, :s])
    assert masked.flushed.tolist() == [64] * 5  # at the capacity (64 + 32 and more without the clamp)
    assert ones == 7  # windows filling alone at steps 24, 56 (slot 1), 32, 64 (2), 15, 47, 79 (4); together at 29, 61


@pytest.mark.parametrize("model_type,fields,sliding,says", [
    ("gemma2", {}, "float16", None),  # soft-capped scores: the codebook kernel caps them
    ("gemma3_text", {"sliding_window": 512}, "float16", None),  # its sliding layers held as rings, uncompressed
    ("gemma3_text", {"sliding_window": 512}, "compress", "compresses layers that slide"),
    ("mistral", {"sliding_window": 4096}, "float16", "nothing to compress"),  # every layer slides
    ("mistral", {"sliding_window": 4096}, "compress", "compresses layers that slide"),
    ("mistral", {"sliding_window": None}, "float16", None),
    ("qwen3", {"sliding_window": 4096, "use_sliding_window": False}, "float16", None),
    ("llama", {}, "float16", None),
])
def test_a_static_cache_refuses_compressed_sliding_layers_by_the_models_config(model_type, fields, sliding, says):
    """The static cache's kernels attend over every compressed token, and a sliding layer kept uncompressed (the
    default) over its ring of the window's tokens; the options reach an attention call only when it runs, so the
    model's config decides before the cache is made (`attention_refusal`, `model_softcap`)."""
    from transformers import AutoConfig

    from kvcalib.models import attention_shape
    from kvcalib.runtime.cache import attention_refusal

    config = AutoConfig.for_model(model_type, **fields)
    layers = attention_shape(config).num_layers
    method = build_method("kivi", SHAPE, MethodSettings(group_size=32, sliding_layers=sliding))
    if says is None:
        check_static(method, SHAPE.head_dim, CUDA, 2, layers, config=config)  # no error
        assert attention_refusal(config, method.float16_layers) is None
    else:
        with pytest.raises(SettingsError, match=says):
            check_static(method, SHAPE.head_dim, CUDA, 2, layers, config=config)


def test_soft_capped_scores_go_to_the_one_kernel_that_caps_them_or_are_refused(monkeypatch):
    """Gemma 2 caps its scores (`attn_logit_softcapping`): of the fused kernels only the codebook layout's applies the
    cap, so KIVI-2, which the INT2 kernel reads first elsewhere, is held in the codebook layout there, in the static
    cache's layers as in `kernel_format`. Planted: a codebook kernel that did not cap would leave no kernel, and the
    static cache refuses the model, naming the cap."""
    from transformers import AutoConfig

    from kvcalib.formats.codebook import format as codebook_format
    from kvcalib.models import attention_shape
    from kvcalib.runtime.cache import kernel_format, model_softcap

    config = AutoConfig.for_model("gemma2")
    layers = attention_shape(config).num_layers
    method = build_method("kivi", SHAPE, MethodSettings(group_size=32))
    assert model_softcap(config) == 50.0 and model_softcap(AutoConfig.for_model("llama")) is None
    assert kernel_format(method, 0, SHAPE.head_dim, CUDA, 2)[0].name == "INT2"
    assert kernel_format(method, 0, SHAPE.head_dim, CUDA, 2, 50.0)[0].name == "codebook"
    check_static(method, SHAPE.head_dim, CUDA, 2, layers, config=config)
    layer = StaticLayer(method, 0, 2, capacity=128, kv_heads=2, head_dim=64, device=torch.device("cpu"), gqa=2,
                        softcap=50.0)
    assert layer.format.name == "codebook"
    plain = codebook_format.supports
    monkeypatch.setattr(codebook_format, "supports", lambda specs, d, device, gqa=1, opts=None: (
        plain(specs, d, device, gqa, opts) and not (opts and opts.softcap)))
    with pytest.raises(SettingsError, match="soft-caps its attention scores"):
        check_static(method, SHAPE.head_dim, CUDA, 2, layers, config=config)


def test_affine_values_with_a_norm_are_not_read_by_the_codebook_kernel():
    """The kernel's affine values carry no norm beside their scale (a static_assert there): `supports` says so first."""
    from kvcalib.formats.codebook.launch import supports
    from kvcalib.formats.codebook.layout import CodebookSpec, affine_part

    key = affine_part(2, token_group=32)
    assert supports([CodebookSpec(key, affine_part(2, channel_group=64))], 64, CUDA, 2)
    assert not supports([CodebookSpec(key, affine_part(2, channel_group=64, norm=True))], 64, CUDA, 2)


def _window_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: int,
                      scale: float) -> torch.Tensor:
    """float64 attention of one query (Hq, D) over the last `window` of a sequence's keys and values (each (H, D)),
    query heads grouped over the KV heads in order."""
    k = torch.stack(keys[-window:], 1).double()  # (H, n, D)
    v = torch.stack(values[-window:], 1).double()
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    p = torch.softmax((q.double()[:, None] * k).sum(-1) * scale, -1)  # (Hq, n)
    return (p[..., None] * v).sum(1)


@pytest.mark.parametrize("prompts,w,longest", [((5, 12, 30), 8, None), ((1, 8, 9), 8, 64), ((5, 12, 30), 64, 50)])
def test_a_kept_sliding_layer_holds_each_slots_last_window_and_attends_over_it_alone(prompts, w, longest):
    """Three slots with prompts shorter than, as long as and longer than the window (8), then 20 steps: each step's
    output equals float64 attention over the slot's last 8 tokens (1e-5: float32 SDPA over at most 8 keys of unit
    scale against float64). Planted: the reference over 9 tokens, or over all of them, differs by far more. A
    window of 64 in slots of at most 50 tokens: a ring of 50, every token attended."""
    from kvcalib.attention import AttentionOptions
    from kvcalib.runtime.static_cache import StaticWindowLayer

    h, hq, d = 2, 4, 16
    scale = d**-0.5
    layer = StaticWindowLayer(0, len(prompts), w, h, d, torch.float32, torch.device("cpu"), longest=longest)
    assert layer.kwin.shape[2] == min(w, longest or w)
    gen = torch.Generator().manual_seed(3)
    seen = [([], []) for _ in prompts]
    for slot, n in enumerate(prompts):
        k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
        layer.prefill_slot = slot
        layer.update(k, v)
        layer.prefill_slot = None
        seen[slot][0].extend(k[0].unbind(1))
        seen[slot][1].extend(v[0].unbind(1))
    assert layer.count.tolist() == list(prompts)
    opts = AttentionOptions(scaling=scale)
    worst, planted = 0.0, {w + 1: 0.0, "all": 0.0}
    for _ in range(20):
        k, v = torch.randn(len(prompts), h, 1, d, generator=gen), torch.randn(len(prompts), h, 1, d, generator=gen)
        q = torch.randn(len(prompts), hq, 1, d, generator=gen)
        layer.update(k, v)
        out = layer.attend(q, k, v, opts, prefill=False)  # (B, Hq, 1, D)
        for slot in range(len(prompts)):
            seen[slot][0].append(k[slot, :, 0])
            seen[slot][1].append(v[slot, :, 0])
            want = _window_reference(q[slot, :, 0], *seen[slot], w, scale)
            worst = max(worst, (out[slot, :, 0].double() - want).abs().max().item())
            for other in planted:  # what the test's worst would read were the layer to hold these
                wrong = _window_reference(q[slot, :, 0], *seen[slot], len(seen[slot][0]) if other == "all" else other,
                                          scale)
                planted[other] = max(planted[other], (out[slot, :, 0].double() - wrong).abs().max().item())
    assert worst <= 1e-5, worst
    if w < max(prompts) + 20:  # the planted windows hold other tokens only where the window cuts
        assert min(planted.values()) > 1e-2, planted
    assert layer.count.tolist() == [n + 20 for n in prompts]


def test_a_prompt_attends_within_the_window_chunk_by_chunk_as_over_the_whole_mask():
    """`chunked_prefill_attention` with a window, in chunks of 16 queries equals float64 attention under the whole T x T sliding
    mask (query i over keys i - W < j <= i), grouped query heads (1e-5: float32 SDPA against float64); a chunk
    larger than the prompt gives the same."""
    from kvcalib.runtime.static_cache import chunked_prefill_attention

    h, hq, t, d, w = 2, 4, 50, 16, 12
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, hq, t, d, generator=gen), torch.randn(1, h, t, d, generator=gen), torch.randn(1, h, t, d, generator=gen)
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    mask = (i >= j) & (i - j < w)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * d**-0.5
    want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv
    for chunk in (16, 64):
        got = chunked_prefill_attention(q, k, v, d**-0.5, window=w, chunk=chunk)
        assert (got.double() - want).abs().max().item() <= 1e-5, chunk
    wider = torch.softmax(s.masked_fill(~((i >= j) & (i - j < w + 1)), float("-inf")), -1) @ vv  # planted: W + 1
    assert (chunked_prefill_attention(q, k, v, d**-0.5, window=w, chunk=16).double() - wider).abs().max().item() > 1e-2


def _static_layer_fed_past_float16s_range():
    """A KIVI-2 static layer (R = 32) given, in bfloat16, a 40-token prompt and a step whose keys and values reach
    about 1e5, past float16: its residual window, its flushed block's scales and zeros."""
    layer = StaticLayer(_method("kivi"), 0, 1, capacity=96, kv_heads=2, head_dim=64, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    k = (1e5 * torch.randn(1, 2, 41, 64, generator=g)).bfloat16()
    layer.prefill(0, k[:, :, :40], k[:, :, :40])
    layer.append(k[:, :, 40:], k[:, :, 40:], flush=False)
    p = layer.layout
    return torch.cat([p.kres[0, :, :9].flatten(), p.vres[0, :, :9].flatten(), p.kscale[0, :, :2].flatten(),
                      p.kzero[0, :, :2].flatten()]).float()


def test_a_static_layer_holds_keys_and_values_past_float16s_range_at_its_edge(monkeypatch):
    """The static cache's prompt write, flush and step write take a bfloat16 model's keys and values through
    `as_float16`: past float16's range they are held at +-65280 (bfloat16's largest number below 65504), every
    number stored finite. Planted: a plain cast in `static_cache` and `slots`, and the stored rows hold inf."""
    import kvcalib.runtime.slots as slots_module
    import kvcalib.runtime.static_cache as static_module

    held = _static_layer_fed_past_float16s_range()
    assert torch.isfinite(held).all() and float(held.abs().max()) == 65280.0

    plain = lambda x: x.half()  # noqa: E731
    monkeypatch.setattr(static_module, "as_float16", plain)
    monkeypatch.setattr(slots_module, "as_float16", plain)
    assert not torch.isfinite(_static_layer_fed_past_float16s_range()).all()
