import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvcalib.artifacts import load_artifact, save_artifact
from kvcalib.attention import AttentionOptions, flushed_counts, intercept, mixed_attention
from kvcalib.cli import main
from kvcalib.collect import Activations, collect
from kvcalib.data import token_windows
from kvcalib.errors import KvcalibError, SettingsError
from kvcalib.evaluate import evaluate
from kvcalib.hadamard import rotate
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.methods.kivi import KiviConfig
from kvcalib.methods.kvlinc import ADAPTER_NAMES, Adapter, Kvlinc, States, combine, decode_attention, features
from kvcalib.models import AttentionShape, attention_shape, fingerprint
from kvcalib.train_adapters import head_errors, parse_layers, train_adapters
from conftest import tiny_config

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def _adapter(shape: AttentionShape, rank: int, kind: str = "random", seed: int = 0) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    heads = {"q": shape.num_heads, "k": shape.num_kv_heads}
    make = (lambda h: torch.randn(h, shape.head_dim, rank // 2, generator=gen)) if kind == "random" \
        else (lambda h: torch.zeros(h, shape.head_dim, rank // 2))
    return Adapter(*(make(heads[n[0]]) for n in ADAPTER_NAMES))


def _explicit(q, k, v, held, flushed, adapter, scaling):
    """Float64 quadratic form of the corrected attention, without any max-subtraction, over the cache's
    float16 keys and values (k16, v16) and their quantized form (held.k, held.v)."""
    q, k, kh, vh, v = q.double(), held.k16.double(), held.k.double(), held.v.double(), held.v16

    g = q.shape[1] // k.shape[1]
    kh, vh, k = (x.repeat_interleave(g, 1) for x in (kh, vh, k))

    def phi(x, w1, w2):
        return torch.cat([torch.softmax(torch.einsum("bhtd,hde->bhte", x, w.double()), -1) for w in (w1, w2)], -1)

    fq = phi(q, adapter.q_w1, adapter.q_w2)
    fk = phi(k - kh, adapter.k_w1.repeat_interleave(g, 0), adapter.k_w2.repeat_interleave(g, 0))
    j = torch.arange(k.shape[-2])
    flushed_j = j[None, :] < flushed[:, None]  # query i reads key j quantized iff j < flushed[i]
    w = torch.exp(scaling * torch.where(flushed_j, q @ kh.transpose(-1, -2), q @ k.transpose(-1, -2)))
    w = (w + torch.where(flushed_j, fq @ fk.transpose(-1, -2), 0.0)) * (j[None, :] <= j[:, None])
    return (w * flushed_j) @ vh / w.sum(-1, keepdim=True) + (w * ~flushed_j) @ v.double().repeat_interleave(g, 1) \
        / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("logit_scale", [1.0, 40.0])
@pytest.mark.parametrize("kind", ["random", "zero"])
@pytest.mark.parametrize("bits,group,residual,t", [(2, 4, 8, 37), (1, 8, 16, 50), (3, 4, 4, 13)])
def test_recurrent_states_equal_the_explicit_sum(logit_scale, kind, bits, group, residual, t):
    # logit_scale 40 puts scores far beyond float32's exp range: only the shared shift keeps it finite.
    method = Kvlinc(KiviConfig(bits, group, residual), SHAPE, {0: _adapter(SHAPE, 32, kind)})
    q, k, v = torch.randn(2, 4, t, 16) * logit_scale, torch.randn(2, 2, t, 16), torch.randn(2, 2, t, 16)
    held = hold(method, 0, k, v)
    flushed = flushed_counts(t, t, residual)
    opts = AttentionOptions(scaling=0.25)
    out = method.attend(0, q, k, v, held, flushed, opts)
    ref = _explicit(q, k, v, held, flushed, method.adapters[0], 0.25)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_zero_adapters_give_every_flushed_token_the_constant_weight_4_over_rank():
    a = _adapter(SHAPE, 32, "zero")
    fq = features(torch.randn(1, 4, 5, 16), a.q_w1, a.q_w2)
    fk = features(torch.randn(1, 2, 7, 16), a.k_w1, a.k_w2)
    assert torch.allclose(fq[:, :2] @ fk.transpose(-1, -2), torch.full((1, 2, 5, 7), 4 / 32))


@pytest.mark.parametrize("t", [5, 24, 40])
def test_without_states_the_output_is_plain_quantized_attention(t):
    corrected = Kvlinc(KiviConfig(2, 4, 8), SHAPE, {0: _adapter(SHAPE, 32)})
    plain = Kvlinc(KiviConfig(2, 4, 8), SHAPE)
    q, k, v = torch.randn(1, 4, t, 16), torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)
    held = hold(plain, 0, k, v)
    flushed = flushed_counts(t, t, 8)
    opts = AttentionOptions(scaling=0.25)
    expected = mixed_attention(q, held.k16, held.v16, opts, held.k, held.v, flushed)
    assert torch.equal(plain.attend(0, q, k, v, held, flushed, opts), expected)
    # Zero states (nothing flushed yet, or S = P = 0) leave the attention untouched.
    out, lse = mixed_attention(q, held.k16, held.v16, opts, held.k, held.v, flushed, return_lse=True)
    zero = combine(out, lse, torch.rand(1, 4, t, 32), States.empty(1, 2, 32, 16))
    assert torch.allclose(zero, expected, rtol=1e-6, atol=1e-7)
    if t < 8:
        assert torch.equal(corrected.attend(0, q, k, v, held, flushed, opts), expected)


def test_heads_switched_off_by_the_gate_read_exactly_the_uncorrected_attention():
    adapter = _adapter(SHAPE, 32)
    adapter.heads = torch.tensor([1.0, 0.0, 0.0, 1.0])
    corrected = Kvlinc(KiviConfig(2, 4, 8), SHAPE, {0: adapter})
    plain = Kvlinc(KiviConfig(2, 4, 8), SHAPE)
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    held, flushed, opts = hold(plain, 0, k, v), flushed_counts(40, 40, 8), AttentionOptions(scaling=0.25)
    out, ref = (m.attend(0, q, k, v, held, flushed, opts) for m in (corrected, plain))
    assert torch.allclose(out[:, 1:3], ref[:, 1:3], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(out[:, [0, 3]], ref[:, [0, 3]], rtol=1e-3, atol=1e-4)


def test_values_are_quantized_in_the_hadamard_basis_and_rotated_back():
    method = Kvlinc(KiviConfig(8, 8, 8), SHAPE)
    v = torch.randn(1, 2, 16, 16)
    _, vq = method.decompress(0, method.compress(0, torch.randn(1, 2, 16, 16), v))
    assert ((vq - v).norm() / v.norm()).item() < 0.02
    rotated = method.compress(0, torch.randn(1, 2, 16, 16), v).v
    plain = build_method("kivi", SHAPE, MethodSettings(8, 8, 8)).compress(0, torch.randn(1, 2, 16, 16), rotate(v)).v
    assert torch.equal(rotated.codes, plain.codes)


def test_stored_bits_count_the_float32_states_of_corrected_layers():
    corrected = Kvlinc(KiviConfig(2, 4, 8), SHAPE, {0: _adapter(SHAPE, 32)})
    plain = Kvlinc(KiviConfig(2, 4, 8), SHAPE)
    k, v = torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    extra = hold(corrected, 0, k, v).stored_bits - hold(plain, 0, k, v).stored_bits
    assert extra == 32 * 3 * 2 * 32 * (16 + 1)
    assert corrected.constant_bits() == 16 * (4 + 2) * 2 * 16 * 16


def _save_adapters(path, lm, bits=2, group=4, residual=8, rank=16, layers=None, **overrides):
    shape = attention_shape(lm.config)
    layers = list(range(shape.num_layers)) if layers is None else layers
    tensors = {f"layers.{i}.{n}": getattr(_adapter(shape, rank, seed=i), n).half()
               for i in layers for n in ADAPTER_NAMES}
    tensors |= overrides
    settings = {"bits": bits, "group_size": group, "residual": residual, "rank": rank, "layers": layers,
                "scaling": shape.head_dim**-0.5}
    return save_artifact(path, "kvlinc", settings, fingerprint(lm.model), tensors)


def _decoded_perplexity(lm, windows, method):
    """Token-by-token decoding that keeps S and P as a decoder does: updated once per flushed block."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            blocks: dict[int, tuple[list, list]] = {}
            states: dict[int, States] = {}

            def attend(layer, q, k, v, opts):
                k, v = k.half().float(), v.half().float()  # the cache receives float16
                kq, vq = blocks.setdefault(layer, ([], []))
                n = sum(x.shape[-2] for x in kq)
                if k.shape[-2] - n >= method.block:  # the residual filled: flush one block
                    kb, vb = k[..., n : n + method.block, :], v[..., n : n + method.block, :]
                    kd, vd = method.decompress(layer, method.compress(layer, kb, vb))
                    kq.append(kd)
                    vq.append(vd)
                    adapter = method.adapters[layer]
                    state = states.get(layer) or States.empty(1, k.shape[1], adapter.rank, k.shape[-1])
                    states[layer] = state.flush(adapter, kb - kd, vd)
                    n += method.block
                # The residual in float16, exact otherwise.
                k_held, v_held = torch.cat([*kq, k[..., n:, :]], -2), torch.cat([*vq, v[..., n:, :]], -2)
                return decode_attention(q, k_held, v_held, opts, method.adapters.get(layer), states.get(layer))

            cache = DynamicCache(config=lm.model.config)
            with intercept(lm.model, attend):
                for t in range(len(w) - 1):
                    logits = lm.model(w[None, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                    nll += torch.nn.functional.cross_entropy(logits[None], w[t + 1 : t + 2]).item()
                    count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize("bits,group,residual,seq_len", [(2, 4, 8, 37), (1, 8, 16, 41)])
def test_eval_equals_decoding_with_recurrent_states(tiny_lm, text_file, tmp_path, bits, group, residual, seq_len):
    path = _save_adapters(tmp_path / "a", tiny_lm, bits, group, residual)
    windows = token_windows(tiny_lm.tokenizer, str(text_file), "evaluation", 2, seq_len)
    result = evaluate(tiny_lm, dataset=str(text_file), num_samples=2, seq_len=seq_len, method="kvlinc", artifacts=str(path))
    method = build_method("kvlinc", attention_shape(tiny_lm.config), artifacts=str(path), model=tiny_lm)
    assert result.perplexity == pytest.approx(_decoded_perplexity(tiny_lm, windows, method), rel=1e-5)
    plain = evaluate(tiny_lm, dataset=str(text_file), num_samples=2, seq_len=seq_len, method="kvlinc",
                     bits=bits, group_size=group, residual=residual)
    assert plain.settings["correction"] == "none"
    assert result.perplexity != pytest.approx(plain.perplexity, rel=1e-4)
    assert result.effective_bits > plain.effective_bits


@pytest.fixture(scope="module")
def tiny_acts(tmp_path_factory, tiny_lm, text_file):
    return collect(tmp_path_factory.mktemp("acts") / "acts", tiny_lm, dataset=str(text_file), num_samples=4, seq_len=64)


def _train(acts, out, **kwargs):
    args = dict(rank=16, steps=40, lr=1e-2, group_size=8, residual=16, tokens=48) | kwargs
    return train_adapters(acts, out, **args)


def test_training_lowers_the_attention_loss_on_held_out_tokens(tiny_acts, tmp_path):
    # Same seed, so steps=0 is exactly the initial adapters the 40-step run starts from.
    initial = load_artifact(_train(tiny_acts, tmp_path / "a", steps=0), "kvlinc").extra["heldout_ce_corrected"]
    trained = load_artifact(_train(tiny_acts, tmp_path / "b"), "kvlinc").extra["heldout_ce_corrected"]
    assert len(trained) == 2
    assert all(t < i for t, i in zip(trained, initial))


def test_training_is_deterministic_under_a_seed(tiny_acts, tmp_path):
    a = load_artifact(_train(tiny_acts, tmp_path / "a", steps=5, seed=3, gate=False)).tensors
    b = load_artifact(_train(tiny_acts, tmp_path / "b", steps=5, seed=3, gate=False)).tensors
    c = load_artifact(_train(tiny_acts, tmp_path / "c", steps=5, seed=4, gate=False)).tensors
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_gate_keeps_exactly_the_heads_whose_held_out_output_error_the_adapters_lower(tiny_acts, tmp_path, tiny_lm):
    shape = attention_shape(tiny_lm.config)
    for steps in (0, 40):  # the initial random adapters, and trained ones
        art = load_artifact(_train(tiny_acts, tmp_path / f"s{steps}", steps=steps), "kvlinc")
        before, after = art.extra["heldout_head_error_uncorrected"], art.extra["heldout_head_error_corrected"]
        assert art.settings["trained_layers"] == [0, 1]
        lowered = {i: [a < b for a, b in zip(after[i], before[i])] for i in (0, 1)}
        assert art.settings["layers"] == [i for i in (0, 1) if any(lowered[i])]
        assert sorted({n.split(".")[1] for n in art.tensors}) == [str(i) for i in art.settings["layers"]]
        for i in art.settings["layers"]:
            assert art.layer(i, "heads").tolist() == [float(x) for x in lowered[i]]
        # The stored adapters reproduce the corrected errors the gate compared, head by head.
        acts = Activations(tiny_acts)
        for i in art.settings["layers"]:
            held = {x: acts.layer(i)[x][-1:].float() for x in "qkv"}
            adapter = Adapter(*(art.layer(i, n).float() for n in ADAPTER_NAMES), heads=art.layer(i, "heads").float())
            method = Kvlinc(KiviConfig(2, 8, 16), shape, {i: adapter})
            err = head_errors(method, i, *(held[x] for x in "qkv"), shape.head_dim**-0.5)
            want = [a if on else b for a, b, on in zip(after[i], before[i], lowered[i])]
            assert err.tolist() == pytest.approx(want, rel=1e-4)
    ungated = load_artifact(_train(tiny_acts, tmp_path / "all", steps=0, gate=False), "kvlinc")
    assert ungated.settings["layers"] == [0, 1]
    assert not any(n.endswith(".heads") for n in ungated.tensors)


def test_trained_layers_follow_the_layers_option(tiny_acts, tmp_path, tiny_lm):
    path = _train(tiny_acts, tmp_path / "a", steps=2, layers="1", gate=False)
    method = build_method("kvlinc", attention_shape(tiny_lm.config), artifacts=str(path), model=tiny_lm)
    assert set(method.adapters) == {1}
    assert method.settings()["corrected_layers"] == 1


@pytest.mark.parametrize("spec,expected", [("all", [0, 1, 2, 3]), ("0-2", [0, 1, 2]), ("3,0-1", [0, 1, 3])])
def test_layers_spec_parses_ranges(spec, expected):
    assert parse_layers(spec, 4) == expected


@pytest.mark.parametrize("spec", ["0-4", "x", "", "-1"])
def test_bad_layers_spec_is_refused(spec):
    with pytest.raises(SettingsError):
        parse_layers(spec, 4)


@pytest.mark.parametrize("case", ["another model", "wrong shape", "missing tensor", "other method", "conflicting settings",
                                  "heads not 0 or 1", "heads of another count"])
def test_invalid_artifacts_are_refused(case, tiny_lm, tmp_path):
    shape = attention_shape(tiny_lm.config)
    settings = MethodSettings()
    if case == "wrong shape":
        path = _save_adapters(tmp_path / "a", tiny_lm, **{"layers.0.k_w1": torch.zeros(4, 16, 8).half()})
    elif case.startswith("heads"):
        heads = torch.full((shape.num_heads,), 0.5) if case == "heads not 0 or 1" else torch.ones(shape.num_heads + 1)
        path = _save_adapters(tmp_path / "a", tiny_lm, **{"layers.0.heads": heads.half()})
    elif case == "missing tensor":
        path = _save_adapters(tmp_path / "a", tiny_lm)
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["settings"]["layers"] = [0, 1, 5]
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif case == "other method":
        path = save_artifact(tmp_path / "a", "vecinfer", {}, fingerprint(tiny_lm.model), {"layers.0.x": torch.zeros(1)})
    else:
        path = _save_adapters(tmp_path / "a", tiny_lm)
    model = tiny_lm.model.config if case != "another model" else tiny_config(num_key_value_heads=4)
    if case == "conflicting settings":
        settings = MethodSettings(bits=2, group_size=8, residual=8)
    with pytest.raises(KvcalibError):
        build_method("kvlinc", shape, settings, artifacts=str(path), model=type("M", (), {"model": model})())


@pytest.mark.parametrize("args", [
    ["--activations", "{tmp}/none"],
    ["--activations", "{acts}", "--layers", "7"],
    ["--activations", "{acts}", "--rank", "7"],
    ["--activations", "{acts}", "--group-size", "48"],
])
def test_train_adapters_bad_input_gives_one_line_exit_2_and_no_output(args, tiny_acts, tmp_path, capsys):
    args = [a.format(tmp=tmp_path, acts=tiny_acts) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["train-adapters", *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("kvcalib: error:") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
