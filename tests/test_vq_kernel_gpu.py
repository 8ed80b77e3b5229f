"""The fused VecInfer decode kernel (kvcalib/formats/vq/vq_decode.cu) against the float64 reference of
the same codes (`kvcalib.formats.vq.layout.reference_decode`), row by row, under the runtime's accuracy rule: each
row's error at most twice that of SDPA in float16 over the dequantized cache, plus 1e-4
(tests/test_int2_kernel_gpu.py). Per-layer and per-head codebooks, key and value configurations that
differ, sinks on and off, residual windows empty to nearly full, flushed lengths from none to 20k tokens;
what lies past the counts is poisoned and must not move the output."""

import pytest
import torch

from kvcalib import vq
from kvcalib.methods.vecinfer import keys_from_codec
from kvcalib.formats.vq.layout import reference_decode

pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)

from kvcalib.formats.vq.launch import vq_decode  # noqa: E402  (after the skip: it needs cupy)
from test_int2_kernel_gpu import FLOOR, _row_errors  # noqa: E402
from test_vq_layout import _layer, _method  # noqa: E402

DEV = "cuda"


def _sdpa(q: torch.Tensor, layer) -> torch.Tensor:
    """The peer: SDPA in q's dtype (float16 or bfloat16) over the same cache dequantized, coded keys taken back
    to the model's basis (in float32, then rounded to that dtype, as a dequantize-then-attend path holds them)."""
    k = vq.decode(layer.codes("k"), layer.kbook.float()) if layer.length else layer.kres[:, :, :0].float()
    v = vq.decode(layer.codes("v"), layer.vbook.float()) if layer.length else layer.vres[:, :, :0].float()
    k = keys_from_codec(k, layer.smooth, layer.hadamard)
    k[:, :, : layer.sinks], v[:, :, : layer.sinks] = layer.ksink.float(), layer.vsink.float()
    k = torch.cat([k, layer.kres[:, :, : layer.residual].float()], 2).to(q.dtype)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].float()], 2).to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=layer.head_dim**-0.5,
                                                            enable_gqa=True)[:, :, 0]


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("k_config,v_config", [("d4b8", "d4b8"), ("d8b12", "d4b8"), ("d2b8", "d8b12")])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("t", [5, 130, 1037, 20000])
def test_vq_kernel_matches_the_float64_reference_row_by_row(granularity, k_config, v_config, sinks, t):
    method = _on_device(_method(granularity, k_config, v_config, sinks, d=128))
    g = torch.Generator(device=DEV).manual_seed(t)
    k16 = (torch.randn(2, 2, t, 128, device=DEV, generator=g) * (1 + 3 * torch.rand(1, 1, 1, 128, device=DEV, generator=g))).half()
    v16 = torch.randn(2, 2, t, 128, device=DEV, generator=g).half()
    layer, q, out = _check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))
    # Poison what lies past the counts: codes of capacity not yet filled (the rows between the length and the
    # capacity, and 64 more), residual rows not yet written.
    layer.kcodes[:, :, layer.length :], layer.vcodes[:, :, layer.length :] = 255, 255
    layer.kcodes = torch.cat([layer.kcodes, torch.full_like(layer.kcodes[:, :, :64], 255)], 2)
    layer.vcodes = torch.cat([layer.vcodes, torch.full_like(layer.vcodes[:, :, :64], 255)], 2)
    layer.kres = torch.cat([layer.kres, torch.full_like(layer.kres[:, :, :8], float("nan"))], 2)
    layer.vres = torch.cat([layer.vres, torch.full_like(layer.vres[:, :, :8], float("nan"))], 2)
    assert torch.equal(vq_decode(q, layer, 128**-0.5, checked=True), out)


def _check_rows(method, k16, v16, q, scale: float = 1.0, d: int = 128, dtype=torch.float16, pad: int = 0):
    """Build the layer, run the kernel on q (model's basis, `dtype`), hold every row to the rule against the
    float64 reference of the same query; returns the layer, the query and the kernel's output. `pad`: rows of
    poisoned codes added to the capacity (an odd capacity makes the rows' stride unaligned)."""
    layer = _layer(method, k16, v16)
    if pad:
        layer.kcodes = torch.cat([layer.kcodes, torch.full_like(layer.kcodes[:, :, :pad], 255)], 2)
        layer.vcodes = torch.cat([layer.vcodes, torch.full_like(layer.vcodes[:, :, :pad], 255)], 2)
    qm = (q * scale).to(dtype)
    ref = reference_decode(qm, layer, d**-0.5)
    out = vq_decode(qm, layer, d**-0.5, checked=True)
    assert out.dtype == dtype and torch.isfinite(out).all(), "unwritten or NaN output"
    err = _row_errors(out, ref)
    bound = 2 * _row_errors(_sdpa(qm, layer), ref) + FLOOR
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), f"row {worst}: {err[worst]:.2e} > {bound[worst]:.2e}"
    return layer, qm, out


def _on_device(method):
    method.layers[0].k, method.layers[0].v = method.layers[0].k.to(DEV), method.layers[0].v.to(DEV)
    if method.layers[0].smooth is not None:
        method.layers[0].smooth = method.layers[0].smooth.to(DEV)
    method.block = method.residual = 128
    return method


@pytest.mark.parametrize("b,t,granularity,k_config,v_config", [
    (1, 131072, "layer", "d4b8", "d4b8"), (1, 131072, "head", "d8b12", "d8b12"), (8, 32768, "layer", "d8b12", "d4b8"),
    (16, 8192, "head", "d4b8", "d8b12")])
@pytest.mark.parametrize("inputs", ["diffuse", "peaked"])
def test_long_contexts_and_large_batches_are_as_exact_as_sdpa_in_every_row(b, t, granularity, k_config, v_config, inputs):
    """The range a serving cache meets: L up to 128k, B up to 16. Diffuse: unit queries over unit keys (near-uniform
    attention, the long-context case that sums the most terms); peaked: queries 3x, a sharper softmax."""
    method = _on_device(_method(granularity, k_config, v_config, 0, d=128))
    g = torch.Generator(device=DEV).manual_seed(b * 7 + t)
    k16 = torch.randn(b, 2, t, 128, device=DEV, generator=g).half()
    v16 = torch.randn(b, 2, t, 128, device=DEV, generator=g).half()
    _check_rows(method, k16, v16, torch.randn(b, 8, 128, device=DEV, generator=g), 3.0 if inputs == "peaked" else 1.0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_every_residual_length_from_0_to_127(sinks):
    """Two flushed blocks and a residual window of every length the cache can hold, sinks on and off."""
    method = _on_device(_method("layer", "d4b8", "d8b12", sinks, d=128))
    g = torch.Generator(device=DEV).manual_seed(sinks)
    for r in range(128):
        k16 = torch.randn(2, 2, 256 + r, 128, device=DEV, generator=g).half()
        v16 = torch.randn(2, 2, 256 + r, 128, device=DEV, generator=g).half()
        _check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))


@pytest.mark.parametrize("d,heads,kv_heads,k_config,v_config,dtype", [
    (64, 8, 1, "d4b8", "d8b12", torch.bfloat16), (64, 4, 4, "d8b12", "d4b8", torch.float16),
    (128, 16, 2, "d8b12", "d8b12", torch.float16), (128, 6, 2, "d2b8", "d4b8", torch.bfloat16),
    (128, 10, 2, "d4b8", "d8b12", torch.float16), (64, 4, 2, "d8b9", "d2b7", torch.float16),
    (64, 9, 3, "d4b8", "d4b8", torch.float16), (64, 5, 1, "d4b8", "d8b12", torch.bfloat16)])
@pytest.mark.parametrize("inputs", ["diffuse", "peaked"])
def test_head_dims_query_groups_odd_code_widths_and_bfloat16(d, heads, kv_heads, k_config, v_config, dtype, inputs):
    """head_dim 64 and 128; 1 to 8 query heads per KV head (the remainders of q~ in idle columns up to 4,
    in an mma of their own above: GQA 1, 3, 4, 5, 8; and the embedded model's 9 query heads over 3 KV heads of
    64 channels, where RULER through the static cache answered nothing on an H100: at d = 64, GQ 3 and 5 split the
    merge's threads into 5 and 3 slices, which do not divide its 16 parts, and the last parts' partials were read
    from past a slice's registers); d8b9 keys and d2b7 values: 9- and 7-bit codes across
    byte and word boundaries; a capacity of one odd row more, so that rows of 9 and 28 bytes are copied a byte
    and 4 bytes at a time (24-byte rows 4 bytes at a time); bfloat16 queries and output, held to SDPA in
    bfloat16."""
    method = _on_device(_method("head", k_config, v_config, 2, d=d, heads=heads, kv_heads=kv_heads))
    g = torch.Generator(device=DEV).manual_seed(d + heads)
    k16 = torch.randn(3, kv_heads, 3000, d, device=DEV, generator=g).half()
    v16 = torch.randn(3, kv_heads, 3000, d, device=DEV, generator=g).half()
    layer, _, _ = _check_rows(method, k16, v16, torch.randn(3, heads, d, device=DEV, generator=g),
                              3.0 if inputs == "peaked" else 1.0, d=d, dtype=dtype, pad=1)
    assert layer.kcodes.shape[2] % 2 == 1


@pytest.mark.parametrize("smooth,hadamard", [(False, False), (False, True), (True, False)])
def test_without_smoothing_or_rotation(smooth, hadamard):
    """The keys' transform off in part or whole (`fit-codebook --no-smooth`, `--no-hadamard`): the kernel then
    multiplies by no lambda (a null pointer) and rotates nothing (HADAMARD=0)."""
    method = _on_device(_method("layer", "d4b8", "d8b12", 1, d=128, smooth=smooth, hadamard=hadamard))
    g = torch.Generator(device=DEV).manual_seed(7)
    k16 = torch.randn(2, 2, 2000, 128, device=DEV, generator=g).half()
    v16 = torch.randn(2, 2, 2000, 128, device=DEV, generator=g).half()
    layer, _, _ = _check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g), 3.0)
    assert (layer.smooth is None) == (not smooth) and layer.hadamard == hadamard


@pytest.mark.parametrize("capacity", [4096, 4101])
def test_counts_read_on_the_device_give_each_sequence_its_own_attention(capacity):
    """A captured step's launch: sized by the capacities, each sequence's flushed and residual counts read from
    device memory; rows of odd capacity (4101 x 24 bytes) are copied 4 bytes at a time. Every sequence must get
    the attention of its own prefix, as the float64 reference over that prefix alone gives it, and nothing
    past its counts (poisoned) may move it."""
    from kvcalib.formats.vq.layout import VQLayer

    method = _on_device(_method("layer", "d8b12", "d4b8", 3, d=128))
    g = torch.Generator(device=DEV).manual_seed(capacity)
    b = 4
    k16 = torch.randn(b, 2, 4096 + 100, 128, device=DEV, generator=g).half()
    v16 = torch.randn(b, 2, 4096 + 100, 128, device=DEV, generator=g).half()
    full = _layer(method, k16, v16)
    pad = lambda x, n, fill: torch.cat([x, torch.full_like(x[:, :, :1], fill).expand(-1, -1, n, -1)], 2)  # noqa: E731
    full.kcodes = pad(full.kcodes[:, :, :4096], capacity - 4096, 255)
    full.vcodes = pad(full.vcodes[:, :, :4096], capacity - 4096, 255)
    lengths, residuals = [4096, 128, 0, 2944], [100, 0, 7, 127]
    for i, (t, r) in enumerate(zip(lengths, residuals)):  # poison each sequence past its counts
        full.kcodes[i, :, t:] = 255
        full.vcodes[i, :, t:] = 255
    full.kres = torch.cat([full.kres, full.kres[:, :, :28]], 2)
    full.vres = torch.cat([full.vres, full.vres[:, :, :28]], 2)
    for i, r in enumerate(residuals):
        full.kres[i, :, r:], full.vres[i, :, r:] = float("nan"), float("nan")
    q = torch.randn(b, 8, 128, device=DEV, generator=g).half()
    out = vq_decode(q, full, 128**-0.5, checked=True, lengths=torch.tensor(lengths, device=DEV, dtype=torch.int32),
                    residuals=torch.tensor(residuals, device=DEV, dtype=torch.int32))
    for i, (t, r) in enumerate(zip(lengths, residuals)):
        one = VQLayer(full.kcodes[i : i + 1, :, :t], full.vcodes[i : i + 1, :, :t], full.kbook, full.vbook,
                      full.ksink[i : i + 1, :, : min(3, t)], full.vsink[i : i + 1, :, : min(3, t)],
                      full.kres[i : i + 1, :, :r], full.vres[i : i + 1, :, :r], t, r, min(3, t), full.k_bits,
                      full.v_bits, full.smooth, full.hadamard)
        ref = reference_decode(q[i : i + 1], one, 128**-0.5)
        err = _row_errors(out[i : i + 1], ref)
        bound = 2 * _row_errors(_sdpa(q[i : i + 1], one), ref) + FLOOR
        assert (err <= bound).all(), f"sequence {i} (T={t}, r={r}): {err.max():.2e} > {bound.min():.2e}"


def test_one_launch_merges_on_counters_it_leaves_at_zero_and_streams_keep_their_own():
    """The last block of each (sequence, KV head) to finish merges the partials, counted on `_counters`:
    after launches of every partition (float16 rows only; splits fewer than the rows' chunks; more) the
    counters are back at zero, and launches on two streams at once each give their own sequence's bytes.
    Planted error: a counter left at 1 by a launch would be seen (it stays nonzero after the next)."""
    from kvcalib.formats.vq import launch as vq_kernel

    method = _on_device(_method("layer", "d4b8", "d8b12", 2, d=128))
    g = torch.Generator(device=DEV).manual_seed(11)
    runs = []
    for t in (5, 300, 20000):
        k16 = torch.randn(2, 2, t, 128, device=DEV, generator=g).half()
        v16 = torch.randn(2, 2, t, 128, device=DEV, generator=g).half()
        runs.append(_check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))[:3])
        counters = vq_kernel._counters(torch.device(DEV), 4)  # the current stream's
        assert not counters.any(), f"T={t}: counters left at {counters[:4].tolist()}"
    counters[1] = 1
    vq_decode(runs[2][1], runs[2][0], 128**-0.5, checked=True)
    assert counters[1] != 0, "a counter left wrong must stay visible"
    counters[1] = 0
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(20):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                layer, q, _ = runs[1 + i]
                outs[i].append(vq_decode(q, layer, 128**-0.5))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, runs[1 + i][2]) for o in outs[i]), f"stream {i}: a launch disagrees with its serial run"
        with torch.cuda.stream(streams[i]):
            assert not vq_kernel._counters(torch.device(DEV), 4).any()
