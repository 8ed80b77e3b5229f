import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvcalib.attention import AttentionOptions, flushed_counts, intercept, mixed_attention
from conftest import tiny_model
from tolerances import EXP_ULPS, UNIT_ROUNDOFF, gamma

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"]


def _roundoff(p, mag, vals, o, d, dtype):
    """Per output element, the first-order bound on |computed - exact| of softmax attention evaluated in
    `dtype` (Higham, ch. 3), from the exact probabilities p (.., tk), score magnitudes
    mag_j = scaling * sum_i |q_i k_ji| >= |s_j| (.., tk), values (.., tk, dv) and output o (.., dv).

    Each weight exp(s_j - max) is off by a relative eps_j: the d-term dot product and the scaling
    (gamma_{d+1} * mag_j), the softcap's three operations (tanh contracts errors; gamma_4 * mag_j), the
    subtraction of the max (u * (mag_j + max mag); the max's own error is a shift shared by all j and
    cancels), exp (EXP_ULPS ulps = 2 EXP_ULPS u: torch's float32 softmax uses a 20-ulp exp) and the division by
    the sum (<= 1 ulp = 2u). Those move o by sum_j p_j eps_j (v_j - o).
    The tk-term normalizing sum scales all p alike and the tk-term output sum (two, plus an add, in
    mixed_attention's held path) adds gamma_{2 tk + 2} * sum_j p_j |v_j|. A weight that underflows (scores
    ~87 apart in float32) is off by up to the subnormal spacing `sub` absolute instead: sub (2 sum |v_j| + tk).
    """
    u, sub = UNIT_ROUNDOFF[dtype], torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    tk = p.shape[-1]
    top = mag.amax(-1, keepdim=True)
    eps = gamma(d + 6, u) * (mag + top) + gamma(2 * EXP_ULPS[dtype] + 2, u)
    return ((p * eps)[..., None] * (vals - o[..., None, :]).abs()).sum(-2) \
        + gamma(2 * tk + 2, u) * (p[..., None] * vals.abs()).sum(-2) + sub * (2 * vals.abs().sum(-2) + tk)


def _reference(q, k, v, opts, k_held=None, v_held=None, flushed=None):
    """Float64, one query at a time, straight from the definition. Returns the output (B, Hq, Tq, dv) and
    the bound on how far an evaluation in float32 may lie from it: `_roundoff` in float32, plus the same in
    float64 for the reference's own round-off."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for i in range(tq):
        pos = tk - tq + i
        keys, vals = k.double().clone(), v.double().clone()
        if k_held is not None:
            n = int(flushed[i])
            keys[:, :, :n] = k_held[:, :, :n].double()
            vals[:, :, :n] = v_held[:, :, :n].double()
        keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)  # query head h reads KV head h // g
        qi = q[:, :, i].double().unsqueeze(2)
        s = (qi * keys).sum(-1) * opts.scaling
        mag = (qi.abs() * keys.abs()).sum(-1) * opts.scaling
        if opts.softcap:
            s = opts.softcap * torch.tanh(s / opts.softcap)
        j = torch.arange(tk)
        visible = j <= pos
        if opts.sliding_window:
            visible &= j > pos - opts.sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, -1)
        o = (p.unsqueeze(-1) * vals).sum(-2)
        out[:, :, i] = o
        mag = mag.masked_fill(~visible, 0.0)
        bound[:, :, i] = _roundoff(p, mag, vals, o, d, torch.float32) + _roundoff(p, mag, vals, o, d, torch.float64)
    return out, bound


def _check_within(got, ref, bound, what="attention"):
    """Every element of `got` lies within `bound` of `ref`."""
    excess = ((got.double() - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"{what} is off by {excess:.3g} times its round-off bound"


def _case(groups, tq, tk, softcap, window, hkv=2, d=16):
    # The same inputs in every run: drawn from the global generator they changed from run to run (its state
    # depends on what ran before), and a failure seen once in a fresh clone could not be reproduced.
    g = torch.Generator().manual_seed(1000 * groups + 10 * tq + tk + (7 if softcap else 0))
    q = torch.randn(2, hkv * groups, tq, d, generator=g)
    k, v = torch.randn(2, hkv, tk, d, generator=g), torch.randn(2, hkv, tk, d, generator=g)
    k_held = k + 0.3 * torch.randn(k.shape, generator=g)
    v_held = v + 0.3 * torch.randn(v.shape, generator=g)
    opts = AttentionOptions(scaling=d**-0.5, softcap=softcap, sliding_window=window)
    return q, k, v, k_held, v_held, opts, flushed_counts(tq, tk, block=8)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("tq,tk", [(37, 37), (1, 45), (5, 50)])
@pytest.mark.parametrize("softcap,window", [(None, None), (3.0, 16)])
def test_mixed_attention_matches_float64_reference(groups, tq, tk, softcap, window):
    # float32 inputs are exact in float64, so the float64 reference differs from mixed_attention's float32
    # evaluation only by round-off: element by element within `_roundoff`'s bound (its derivation there).
    q, k, v, k_held, v_held, opts, flushed = _case(groups, tq, tk, softcap, window)
    _check_within(mixed_attention(q, k, v, opts, k_held, v_held, flushed),
                  *_reference(q, k, v, opts, k_held, v_held, flushed))
    _check_within(mixed_attention(q, k, v, opts), *_reference(q, k, v, opts))
    # only the values held (the keys passed as their own held keys, as plan's sensitivity does): the same bits as
    # with an equal copy of the keys (the scores' second product, which it skips, would select the same scores)
    # and within the reference's bound
    only_values = mixed_attention(q, k, v, opts, k, v_held, flushed)
    assert torch.equal(only_values, mixed_attention(q, k, v, opts, k.clone(), v_held, flushed))
    _check_within(only_values, *_reference(q, k, v, opts, k, v_held, flushed))


@pytest.mark.parametrize("plant", ["sliding window one key wider", "causal mask one key late",
                                   "one key more read as held"])
def test_the_reference_comparison_catches_a_mask_off_by_one_key(plant):
    q, k, v, k_held, v_held, opts, flushed = _case(4, 37, 37, 3.0, 16)
    ref, bound = _reference(q, k, v, opts, k_held, v_held, flushed)
    if plant == "sliding window one key wider":
        got = mixed_attention(q, k, v, AttentionOptions(opts.scaling, opts.softcap, 17), k_held, v_held, flushed)
    elif plant == "causal mask one key late":  # one key appended: every query also sees the key after its own
        pad = lambda x: torch.cat([x, torch.randn_like(x[:, :, :1])], 2)  # noqa: E731
        got = mixed_attention(q, pad(k), pad(v), opts, pad(k_held), pad(v_held), flushed)
    else:
        got = mixed_attention(q, k, v, opts, k_held, v_held, flushed + 1)
    with pytest.raises(AssertionError, match="round-off bound"):
        _check_within(got, ref, bound)


def _compare_with_the_model(arch, attention=mixed_attention):
    model = tiny_model(arch)
    ids = torch.randint(0, 512, (1, 40))
    cache = DynamicCache(config=model.config)
    native_attn = {}  # layer -> the model's own attention output, as o_proj receives it (B, T, Hq * d)
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda module, args, i=i: native_attn.__setitem__(i, args[0])) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        native = model(ids, past_key_values=cache, use_cache=True).logits
    for hook in hooks:
        hook.remove()
    recorded = {}

    def record(layer, q, k, v, opts):
        recorded[layer] = (q, k, v, opts, attention(q, k, v, opts))
        # Hand on the model's own output, so every later layer computes from exactly the native inputs and
        # the two runs differ only in which attention was evaluated (no round-off carried across layers).
        b, hq, t, d = q.shape
        return native_attn[layer].reshape(b, t, hq, d).transpose(1, 2)

    with torch.no_grad(), intercept(model, record):
        ours = model(ids, use_cache=False).logits
    assert model.config._attn_implementation == "eager"  # restored after the block
    # Same operations on the same inputs in both runs: bit-identical, and the handler's layout round-trips.
    assert torch.equal(ours, native)
    assert len(recorded) == model.config.num_hidden_layers
    for layer, (q, k, v, opts, out) in recorded.items():
        assert q.shape[1] == model.config.num_attention_heads
        # Sliding-window layers keep only their last tokens; those must match.
        n = cache.layers[layer].keys.shape[-2]
        assert n >= 23
        assert torch.equal(k[..., -n:, :], cache.layers[layer].keys)
        assert torch.equal(v[..., -n:, :], cache.layers[layer].values)
        # Our attention (mask, GQA, softcap, sliding window) reproduces the model's own: both are float32
        # evaluations of the same attention, each within the round-off bound of it, so within twice that.
        b, hq, t, d = q.shape
        _, bound = _reference(q, k, v, opts)
        _check_within(out, native_attn[layer].reshape(b, t, hq, d).transpose(1, 2), 2 * bound)


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_keys_and_values_equal_what_the_kv_cache_holds(arch):
    _compare_with_the_model(arch)


@pytest.mark.parametrize("arch,plant", [("gemma3_text", {"sliding_window": None}), ("gemma2", {"softcap": None}),
                                        ("llama", {"scaling": 16**-0.5 * 1.001})])
def test_the_model_comparison_catches_a_dropped_window_or_softcap_or_a_scaling_off_by_a_thousandth(arch, plant):
    def planted(q, k, v, opts):
        return mixed_attention(q, k, v, dataclasses.replace(opts, **plant))

    with pytest.raises(AssertionError, match="round-off bound"):
        _compare_with_the_model(arch, planted)
