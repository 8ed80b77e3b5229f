"""The fused INT2 decode kernel against the float64 torch reference, on fresh random inputs.

Every check holds the kernel to flash-attention's rule, row by row (a row: one batch entry and query
head): its error against float64 is at most twice the error of torch SDPA computed in the query
dtype over the same dequantized cache, plus 1e-4 (an absolute floor for rows where SDPA happens to
round well). SDPA in fp16/bf16 is what a user who dequantizes gets; the fused kernel may not be
worse than that peer anywhere, not only on average.
"""

import pytest
import torch

from kvcalib.formats.int2.layout import pack, reference_decode
from kvcalib.formats.int2.launch import fused_decode

cupy = pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)

DEV = "cuda"
FLOOR = 1e-4  # flash-attention's absolute term
# With KVLinC's correction terms SDPA is no peer (it cannot add them): the global bound is then a
# few units of output rounding to the query dtype, u = 2^-11 (fp16) or 2^-8 (bf16): 4u.
CORRECTION_TOL = {torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def _layer(b, hkv, d, length, residual, group, vgroup, norms, extra=256, rotated=(False, False)):
    """Flushed keys and values as stored (`rotated`: keys, values in the Hadamard basis, as OScaR stores
    both and KVLinC its values), the residual in the model's basis."""
    torch.manual_seed(length * 7 + residual)
    k = torch.randn(b, hkv, length, d, device=DEV) * (1 + 4 * torch.rand(1, 1, 1, d, device=DEV))
    v = torch.randn(b, hkv, length, d, device=DEV)
    kn = (0.5 + torch.rand(b, hkv, length, device=DEV)) if norms else None
    layer = pack(k, v, torch.randn(b, hkv, residual, d, device=DEV), torch.randn(b, hkv, residual, d, device=DEV),
                 group, vgroup, kn, capacity=length + extra, rotated_keys=rotated[0], rotated_values=rotated[1])
    # Poison the unused capacity: the kernel must never read past `length` / `residual`.
    for buf, filled in ((layer.kcodes, length // 16), (layer.vcodes, length)):
        buf[:, :, filled:] = torch.randint(-2**31, 2**31 - 1, buf[:, :, filled:].shape, device=DEV, dtype=torch.int32)
    for buf, filled in ((layer.kscale, length // group), (layer.vscale, length), (layer.kres, residual), (layer.vres, residual)):
        buf[:, :, filled:] = float("nan")
    return layer


def _row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.double() - ref).norm(dim=-1).flatten() / ref.norm(dim=-1).flatten()


def _sdpa(q, layer, scaling):
    """The peer: SDPA in q's dtype over the dequantized cache (flushed blocks in the model's basis, then
    the residual), what a user who dequantizes gets."""
    k, v = layer.flushed_kv(model_basis=True)
    k = torch.cat([k.to(q.dtype), layer.kres[:, :, : layer.residual].to(q.dtype)], 2)
    v = torch.cat([v.to(q.dtype), layer.vres[:, :, : layer.residual].to(q.dtype)], 2)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scaling, enable_gqa=True)[:, :, 0]


def _check(q, layer, correction=None, loader="auto"):
    scaling = q.shape[-1] ** -0.5
    out = fused_decode(q, layer, scaling, correction, checked=True, loader=loader)
    ref = reference_decode(q, layer, scaling, correction)
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    rows = _row_errors(out, ref)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if correction is None:
        bound = 2 * _row_errors(_sdpa(q, layer, scaling), ref) + FLOOR
        worst = int((rows / bound).argmax())
        assert (rows <= bound).all(), f"row {worst}: {rows[worst]:.2e} > {bound[worst]:.2e} ({int((rows > bound).sum())} rows over)"
    else:
        assert err < CORRECTION_TOL[q.dtype] and rows.max() < 2 * CORRECTION_TOL[q.dtype], (err, rows.max().item())
    return err


def _long_layer(b, hkv, length, group, inputs, norms, d=128, residual=127):
    """Keys, values: unit randn ("diffuse": near-uniform attention, what many heads of a long context
    do), or with 8 outlier channels at 5x and a sink token aligned with the queries ("peaked"). With
    norms the layout is OScaR's: unit keys times norms, keys and values stored in the Hadamard basis."""
    k = torch.randn(b, hkv, length, d, device=DEV)
    v = torch.randn(b, hkv, length, d, device=DEV)
    if inputs == "peaked":
        k[..., :8] *= 5.0
        k[:, :, 0] = 4.0 * torch.randn(b, hkv, d, device=DEV).sign()  # the sink: norm 4 sqrt(d)
    kn = k.norm(dim=-1) if norms else None
    if norms:
        k = k / kn[..., None]
    return pack(k, v, torch.randn(b, hkv, residual, d, device=DEV), torch.randn(b, hkv, residual, d, device=DEV),
                group, min(group, d), kn, rotated_keys=norms, rotated_values=norms)


@pytest.mark.parametrize("b,length,group,gqa,norms", [
    (1, 32768, 128, 4, False), (8, 32768, 128, 4, False), (1, 131072, 128, 4, False), (4, 131072, 32, 8, False),
    (8, 131072, 128, 1, False), (8, 131072, 32, 4, True), (16, 32768, 256, 8, False), (16, 16384, 32, 4, True),
])
@pytest.mark.parametrize("inputs", ["diffuse", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_context_decode_is_as_exact_as_sdpa_in_every_row(b, length, group, gqa, norms, inputs, dtype):
    torch.manual_seed(b * 131 + length + group)
    hkv = 8 if b * length <= 8 * 131072 // 2 else 4  # 32 q / 8 kv heads where memory allows the float64 reference
    layer = _long_layer(b, hkv, length, group, inputs, norms)
    q = torch.randn(b, hkv * gqa, 128, device=DEV)
    if inputs == "peaked":  # every query leans towards its sink: q.k_sink / sqrt(d) ~ 9, about the mass of the rest
        k0, _ = layer.flushed_kv(model_basis=True)
        q = q + 0.05 * k0[:, :, 0].repeat_interleave(gqa, dim=1)
        del k0
    _check(q.to(dtype), layer)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("length,residual", [(0, 77), (128, 0), (896, 104), (4224, 1), (33280, 127)])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loader", ["auto", "cp.async"])  # the bulk-copy loader on sm_90+, and the other
def test_fused_kivi_decode_matches_float64_reference(d, gqa, length, residual, b, dtype, loader):
    hkv = 2
    layer = _layer(b, hkv, d, length, residual, group=32, vgroup=min(32, d), norms=False)
    q = torch.randn(b, hkv * gqa, d, device=DEV).to(dtype)
    _check(q, layer, loader=loader)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("loader", ["auto", "cp.async"])
def test_fused_decode_handles_group_sizes_and_oscar_norms(group, norms, d, loader):
    layer = _layer(2, 2, d, 2048, 50, group=group, vgroup=min(group, d), norms=norms, rotated=(norms, norms))
    q = torch.randn(2, 8, d, device=DEV).half()
    _check(q, layer, loader=loader)


def test_every_residual_length_from_0_to_127():
    for r in range(128):
        layer = _layer(1, 2, 128, 256, r, 32, 32, norms=False, extra=0)
        _check(torch.randn(1, 8, 128, device=DEV).half(), layer)


@pytest.mark.parametrize("rotated_values", [False, True])  # KVLinC stores values rotated; its terms are in the model's basis
def test_kvlinc_correction_terms_enter_numerator_and_denominator(rotated_values):
    layer = _layer(3, 2, 128, 1024, 30, 128, 128, norms=False, rotated=(False, rotated_values))
    q = torch.randn(3, 8, 128, device=DEV).half()
    # Terms as large as the attention's own sum of exp(q.k/sqrt(d)), so they visibly move the output.
    k, _ = layer.flushed_kv(model_basis=True)
    z = torch.logsumexp(torch.einsum("bkgd,bktd->bkgt", q.float().reshape(3, 2, 4, 128), k) * 128**-0.5, -1).exp()
    z = z.reshape(3, 8)
    num = torch.randn(3, 8, 128, device=DEV) * z[..., None]
    den = (0.5 + torch.rand(3, 8, device=DEV)) * z
    err = _check(q, layer, (num, den))
    plain = fused_decode(q, layer, 128**-0.5, checked=True)
    corrected = fused_decode(q, layer, 128**-0.5, (num, den), checked=True)
    assert not torch.allclose(plain, corrected, atol=1e-2), "correction had no effect"
    assert err < CORRECTION_TOL[q.dtype]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("rotated", [(True, True), (False, True), (True, False)], ids=["oscar", "kvlinc", "keys"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("length,residual", [(0, 40), (256, 0), (4224, 77)])
def test_blocks_stored_in_the_hadamard_basis_are_read_in_it(d, gqa, rotated, dtype, length, residual):
    """The query and the output stay in the model's basis; the kernel rotates the query for rotated keys
    and the blocks' partial outputs back from rotated values (`warp_hadamard`), while the residual's
    blocks read the model's basis as it is: every row within the rule against the reference in the model's
    basis. The same codes read as if stored unrotated are a different cache: no row is then anywhere near
    the reference (a kernel that skipped a rotation, or rotated the residual too, fails here)."""
    import dataclasses

    layer = _layer(2, 2, d, length, residual, group=32, vgroup=min(32, d), norms=rotated[0], rotated=rotated)
    q = torch.randn(2, 2 * gqa, d, device=DEV).to(dtype)
    _check(q, layer)
    if length:
        plain = dataclasses.replace(layer, rotated_keys=False, rotated_values=False)
        wrong = _row_errors(fused_decode(q, plain, d**-0.5, checked=True), reference_decode(q, layer, d**-0.5))
        assert wrong.min() > 0.05, wrong.min().item()  # diffuse rows of random values: O(1) apart, not 1e-3


def test_output_is_fully_rewritten_on_fresh_inputs_each_call():
    layer = _layer(1, 2, 128, 512, 10, 32, 32, norms=False)
    q1, q2 = (torch.randn(1, 8, 128, device=DEV).half() for _ in range(2))
    o1 = fused_decode(q1, layer, 128**-0.5, checked=True)
    o2 = fused_decode(q2, layer, 128**-0.5, checked=True)
    assert not torch.equal(o1, o2)
    _check(q2, layer)


@pytest.mark.parametrize("length,group", [(16, 16), (32, 16), (48, 16), (96, 16), (4112, 16), (64, 64), (192, 64),
                                          (4160, 64)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("loader", ["auto", "cp.async"])
def test_flushed_lengths_that_are_not_multiples_of_the_stage(length, group, d, loader):
    layer = _layer(2, 2, d, length, 9, group=group, vgroup=16, norms=False, extra=0)
    _check(torch.randn(2, 8, d, device=DEV).half(), layer, loader=loader)


@pytest.mark.parametrize("group,norms", [(128, False), (32, True)])
def test_rows_with_device_counts_each_split_their_own_length_over_the_launch(group, norms):
    """A static cache's launch is sized for its capacity and reads each row's counts on the device; each
    row spreads its own flushed length over all the launch's splits (a 4k sequence in a 128k cache must
    not sit in the few splits that cover its first 4k of capacity). Rows of very different lengths in one
    launch, what lies past each row's counts poisoned, each row held to the accuracy rule against the
    float64 reference over that row alone. A split that left a row's last tokens unread, or read past
    them, fails the rule or the finiteness check."""
    from kvcalib.formats.int2.layout import PackedLayer
    from kvcalib.formats.int2.launch import partition

    d, hkv, cap = 128, 2, 33280
    flushed, residual = [0, 256, 4224, cap], [3, 0, 127, 64]
    layer = _layer(len(flushed), hkv, d, cap, 128, group=group, vgroup=min(group, d), norms=norms, extra=0,
                   rotated=(norms, norms))
    for i, (n, r) in enumerate(zip(flushed, residual)):  # poison each row past its own counts
        layer.kcodes[i, :, n // 16 :] = -1
        layer.vcodes[i, :, n:] = -1
        for buf, filled in ((layer.kscale, n // group), (layer.vscale, n), (layer.kres, r), (layer.vres, r)):
            buf[i, :, filled:] = float("nan")
    counts = tuple(torch.tensor(c, dtype=torch.int32, device=DEV) for c in (flushed, residual))
    assert partition(layer, 0)[1] > 8  # the launch has many splits: the short rows must use them all
    q = torch.randn(len(flushed), 4 * hkv, d, device=DEV).half()
    out = fused_decode(q, layer, d**-0.5, counts=counts, checked=True)
    assert torch.isfinite(out).all(), "a row read past its counts, or left its output unwritten"
    for i, (n, r) in enumerate(zip(flushed, residual)):
        row = PackedLayer(layer.kcodes[i : i + 1], layer.kscale[i : i + 1], layer.kzero[i : i + 1],
                          layer.vcodes[i : i + 1], layer.vscale[i : i + 1], layer.vzero[i : i + 1],
                          layer.kres[i : i + 1], layer.vres[i : i + 1], n, r, group, min(group, d),
                          None if layer.knorm is None else layer.knorm[i : i + 1], layer.rotated_keys,
                          layer.rotated_values)
        ref = reference_decode(q[i : i + 1], row, d**-0.5)
        err = _row_errors(out[i : i + 1], ref)
        bound = 2 * _row_errors(_sdpa(q[i : i + 1], row, d**-0.5), ref) + FLOOR
        assert (err <= bound).all(), (i, err.max().item(), bound.min().item())


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 48), (1, 8, 4096)])
def test_reorder_kernel_equals_the_torch_tensor_core_order(d, which, shape):
    from kvcalib.quant import pack_bits
    from kvcalib.formats.int2.layout import reorder_packed, to_tensor_core_order

    codes = torch.randint(0, 4, (*shape, d), device=DEV)
    words = pack_bits(codes, 2, -2 if which == "k" else -1)
    got = reorder_packed(words, which)
    torch.cuda.synchronize()
    assert torch.equal(got, to_tensor_core_order(codes, which))


@pytest.mark.parametrize("n16,blocks", [(1, 8), (1000, 3), (3 * 2**20 + 5, 528)])
def test_stream_read_floor_reads_every_word_exactly_once(n16, blocks):
    # benchmarks/decode.py's read floor: the XOR of the blocks' sinks is the XOR of the whole buffer
    # only if each word was read once (a word read twice cancels, one never read is missing).
    import numpy as np

    from kernels_cupy.loader import kernel, launch, torch_stream

    buf = torch.randint(-2**31, 2**31 - 1, (n16, 4), dtype=torch.int32, device=DEV)
    sink = torch.full((blocks,), -1, dtype=torch.int32, device=DEV)
    with torch_stream():
        launch(kernel("stream_read.cu", {}, "stream_read"), (blocks,), (512,),
               (cupy.uint64(buf.data_ptr()), cupy.int64(n16), cupy.uint64(sink.data_ptr())), checked=True)
    assert np.bitwise_xor.reduce(sink.cpu().numpy()) == np.bitwise_xor.reduce(buf.cpu().numpy().ravel())


@pytest.mark.parametrize("length,group", [(128, 128), (384, 128), (4224, 128), (256, 256), (768, 256)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("loader", ["auto", "cp.async"])
def test_four_tile_stages_ending_mid_stage(length, group, d, norms, loader):
    # G >= 128 with one value group per token: stages of 256 tokens, four tiles per warp; these
    # lengths leave the last stage half full (warps without tokens) or a single key group.
    layer = _layer(2, 2, d, length, 9, group=group, vgroup=d, norms=norms, extra=0, rotated=(norms, norms))
    _check(torch.randn(2, 8, d, device=DEV).half(), layer, loader=loader)
