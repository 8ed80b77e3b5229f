"""The fused codebook decode kernel (kvcalib/formats/codebook/codebook_decode.cu) against the float64 reference of the
same codes (`kvcalib.formats.codebook.layout.reference_decode`), row by row, under the runtime's accuracy rule: each
row's error at most twice that of SDPA in the query's dtype over the dequantized cache, plus 1e-4
(tests/test_int2_kernel_gpu.py).
TurboQuant oblivious, calibrated per layer and per KV head, 1 to 4 bits, vector codes; KIVI and OScaR (affine codes,
key groups of 32 and 128 tokens) at 2 to 4 bits; VecInfer; plans mixing them per KV head (one launch a group of heads);
head_dim 64, 128 and 256; one to eight query heads per KV head; sinks on and off; residual windows empty to full; flushed
lengths up to 128k; diffuse and peaked attention; float16 and bfloat16 queries; counts read on the device. What lies
past the counts is poisoned and must not move the output."""

import math

import pytest
import torch

from kvcalib.formats.codebook.layout import flushed_kv, reference_decode

pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)

from kvcalib.formats.codebook.launch import codebook_decode  # noqa: E402  (after the skip: it needs cupy)
from test_codebook_layout import any_method, layout_of, turboquant  # noqa: E402
from test_int2_kernel_gpu import FLOOR, _row_errors  # noqa: E402

DEV = "cuda"


def _on_device(method):
    if getattr(method, "books", None) is not None and isinstance(method.books, list):
        method.books = [(k.to(DEV), v.to(DEV)) for k, v in method.books]
    return method



def _sdpa(q: torch.Tensor, layer, scaling: float) -> torch.Tensor:
    """The peer: SDPA in q's dtype over the same cache dequantized (float32, rounded to q's dtype)."""
    k, v = flushed_kv(layer)
    k = torch.cat([k, layer.kres[:, :, : layer.residual].float()], 2).to(q.dtype)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].float()], 2).to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scaling, enable_gqa=True)[:, :, 0]


def _capped_peer(q: torch.Tensor, layer, scaling: float, softcap: float) -> torch.Tensor:
    """The peer of soft-capped attention, which SDPA does not compute: Gemma 2's eager attention in q's dtype over the
    same cache dequantized (products and cap in q's dtype, softmax in float32)."""
    k, v = flushed_kv(layer)
    k = torch.cat([k, layer.kres[:, :, : layer.residual].float()], 2).to(q.dtype)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].float()], 2).to(q.dtype)
    gqa = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
    s = torch.matmul(q[:, :, None], k.transpose(-1, -2)) * scaling
    s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)[:, :, 0]


def _inputs(b, kv_heads, t, d, seed, peaked=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    k16 = (torch.randn(b, kv_heads, t, d, device=DEV, generator=g)
           * (1 + 3 * torch.rand(1, 1, 1, d, device=DEV, generator=g))).half()
    v16 = torch.randn(b, kv_heads, t, d, device=DEV, generator=g).half()
    if peaked:  # one token per sequence the queries find: its key repeated in the query, far above the rest
        k16[:, :, t // 3] *= 4
    return k16, v16, g


def _check(method, k16, v16, q, dtype=torch.float16, softcap=None):
    """Run the kernel on q (model's basis, `dtype`); hold every row to the rule; returns the layer and output.
    `softcap`: scores capped (Gemma 2), against the float64 reference capped alike and the model's eager attention
    as the peer."""
    layer = layout_of(method, k16, v16)
    d = layer.head_dim
    qm = q.to(dtype)
    ref = reference_decode(qm, layer, d**-0.5, softcap)
    out = codebook_decode(qm, layer, d**-0.5, checked=True, softcap=softcap)
    assert out.dtype == dtype and torch.isfinite(out).all(), "unwritten or NaN output"
    err = _row_errors(out, ref)
    peer = _sdpa(qm, layer, d**-0.5) if softcap is None else _capped_peer(qm, layer, d**-0.5, softcap)
    bound = 2 * _row_errors(peer, ref) + FLOOR
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), f"row {worst}: {err[worst]:.2e} > {bound[worst]:.2e}"
    return layer, qm, out


def _launches(monkeypatch) -> list[tuple[str, dict]]:
    """Every kernel the decode takes from the loader from now on, as (name, its defines): what each launch compiled
    with, read where the launch asks for its kernel."""
    import kernels_cupy.loader as loader

    launched, real = [], loader.kernel
    monkeypatch.setattr(loader, "kernel", lambda path, defines, name: launched.append((name, dict(defines)))
                        or real(path, defines, name))
    return launched


def _poison(layer, extra: int = 64):
    """Codes, norms, scales and zeros past the length (and `extra` rows more), residual rows past the count."""
    n = layer.length
    for rows in layer.groups:
        for name in rows.present():
            buf, unit = getattr(rows, name), rows.unit(name)
            if not buf.shape[2]:
                continue
            bad = -1 if buf.dtype == torch.int32 else float("nan")
            buf = torch.cat([buf[:, :, : -(-n // unit)],
                             torch.full_like(buf[:, :, :1], bad).expand(*buf.shape[:2], extra, *buf.shape[3:])], 2)
            setattr(rows, name, buf.contiguous())
    for name in ("kres", "vres"):
        buf = getattr(layer, name)
        setattr(layer, name, torch.cat([buf, torch.full_like(buf[:, :, :1], float("nan")).expand(-1, -1, 8, -1)], 2).contiguous())


# Scalar codes of every width with each kind of codebook; vector codes (d4b6, `turboquant`) with a book per layer or
# per KV head; KIVI and OScaR (affine) with key groups of 32 and 128; VecInfer; the plans of tests/test_codebook_layout.py.
CODES = [(kind, bits) for kind in ("oblivious", "layer", "head") for bits in (1, 2, 3, 4)] + [
    ("vector-layer", 6), ("vector-head", 6), ("kivi-g32", 1), ("kivi-g128", 2), ("kivi-g32", 3), ("kivi-g128", 4),
    ("oscar-g128", 1), ("oscar-g32", 2), ("oscar-g128", 3), ("oscar-g128", 4), ("vecinfer-layer", 6),
    ("vecinfer-head", 8), ("plan-mixed", 0),
    ("plan-vector keys", 0)]


@pytest.mark.parametrize("kind,bits", CODES)
@pytest.mark.parametrize("sinks", [0, 1])
@pytest.mark.parametrize("t", [5, 130, 1037, 20000])
def test_codebook_kernel_matches_the_float64_reference_row_by_row(kind, bits, sinks, t):
    method = _on_device(any_method(kind, bits, d=128, sinks=sinks, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(2, h, t, 128, t)
    layer, q, out = _check(method, k16, v16, torch.randn(2, 4 * h, 128, device=DEV, generator=g))
    _poison(layer)
    assert torch.equal(codebook_decode(q, layer, 128**-0.5, checked=True), out)


@pytest.mark.parametrize("kind,bits", [("oblivious", 3), ("kivi-g128", 4), ("vecinfer-head", 8), ("plan-mixed", 0)])
@pytest.mark.parametrize("t", [130, 300, 1037])
def test_sinks_that_fill_whole_splits_leave_those_splits_empty(kind, bits, t):
    """As many float16 sinks as a flush block (128, which a static cache allows): the first splits (64 tokens at these
    lengths) hold sinks only, read from the float16 rows; their blocks copy no books and must run no tile over them
    (a tile read through uncopied books gave whatever shared memory held: NaN where it held NaN's bits)."""
    method = _on_device(any_method(kind, bits, d=128, sinks=128, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(2, h, t, 128, t)
    layer, q, out = _check(method, k16, v16, torch.randn(2, 4 * h, 128, device=DEV, generator=g))
    assert layer.sinks == 128 and layer.length >= 128
    _poison(layer)
    assert torch.equal(codebook_decode(q, layer, 128**-0.5, checked=True), out)


@pytest.mark.parametrize("b,t", [(1, 131072), (8, 32768)])
@pytest.mark.parametrize("kind,bits", [("oblivious", 3), ("head", 2), ("vector-layer", 6), ("plan-mixed", 0)])
@pytest.mark.parametrize("peaked", [False, True])
def test_long_contexts_and_large_batches_are_as_exact_as_sdpa_in_every_row(b, t, kind, bits, peaked):
    method = _on_device(any_method(kind, bits, d=128, sinks=1, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(b, h, t + 77, 128, b, peaked)
    q = torch.randn(b, 4 * h, 128, device=DEV, generator=g)
    if peaked:  # each query head points at the peaked key: attention concentrates on it
        q = q + 3 * k16[:, :, (t + 77) // 3].float().repeat_interleave(4, 1)
    _check(method, k16, v16, q)


@pytest.mark.parametrize("b,t", [(1, 131072), (8, 32768)])
@pytest.mark.parametrize("kind,bits", [("kivi-g128", 2), ("head", 3)])
@pytest.mark.parametrize("peaked", [False, True])
def test_head_dim_256_at_long_contexts_as_gemma_3_holds_it(b, t, kind, bits, peaked):
    """Gemma 3's full layers: head_dim 256, 2 query heads a KV head, bfloat16 queries, at 2 `partial` blocks an SM
    (`blocks_per_sm`: at 4 the registers spilled), every row as exact as SDPA's on the same cache."""
    method = _on_device(any_method(kind, bits, d=256, sinks=1, residual=128))
    k16, v16, g = _inputs(b, 2, t + 77, 256, b + t, peaked)
    q = torch.randn(b, 4, 256, device=DEV, generator=g)
    if peaked:
        q = q + 3 * k16[:, :, (t + 77) // 3].float().repeat_interleave(2, 1)
    _check(method, k16, v16, q, torch.bfloat16)


@pytest.mark.parametrize("b,t", [(1, 32768), (8, 8192)])
@pytest.mark.parametrize("kind,bits", [("kivi-g128", 2), ("head", 3), ("plan-mixed", 0)])
@pytest.mark.parametrize("softcap,peaked", [(50.0, False), (50.0, True), (2.0, True)])
def test_soft_capped_scores_as_gemma_2_caps_them(b, t, kind, bits, softcap, peaked):
    """Gemma 2 caps its scores at 50 (`attn_logit_softcapping`): the kernel caps each score, packed tokens and float16
    rows alike, as the float64 reference does, every row as exact as the model's own eager attention in bfloat16
    on the same cache (a cap of 2 bends every score of the peaked query). Planted: the kernel without the cap
    (`softcap=None`) misses the capped reference in the peaked rows."""
    method = _on_device(any_method(kind, bits, d=256, sinks=1, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(b, h, t + 77, 256, b + t, peaked)
    q = torch.randn(b, 2 * h, 256, device=DEV, generator=g)
    if peaked:
        q = q + 3 * k16[:, :, (t + 77) // 3].float().repeat_interleave(2, 1)
    layer, qm, out = _check(method, k16, v16, q, torch.bfloat16, softcap)
    if peaked:
        uncapped = codebook_decode(qm, layer, 256**-0.5, checked=True)
        ref = reference_decode(qm, layer, 256**-0.5, softcap)
        assert (_row_errors(uncapped, ref) > 2 * _row_errors(out, ref) + FLOOR).any()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (9, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dims_query_groups_and_bfloat16(d, heads, kv_heads, dtype):
    method = _on_device(turboquant("head", 3, d=d, kv_heads=kv_heads, sinks=1, residual=64))
    k16, v16, g = _inputs(2, kv_heads, 700, d, d + heads)
    _check(method, k16, v16, torch.randn(2, heads, d, device=DEV, generator=g), dtype)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_bit_codes_read_four_at_a_time_at_every_head_dim(d, dtype):
    """1-bit codes with a book per position are read four at a time (`kernel_book`: one 8-byte entry of four
    coordinates' centroids, its book 2 KiB at d=64, 8 KiB at d=256); the other head dims than 128 above."""
    from kvcalib.formats.codebook.launch import kernel_book

    method = _on_device(turboquant("head", 1, d=d, kv_heads=2, sinks=1, residual=64))
    assert kernel_book(method.codebook_spec(0).key).dim == 4 and kernel_book(method.codebook_spec(0).value).dim == 4
    k16, v16, g = _inputs(2, 2, 700, d, d + 1)
    _check(method, k16, v16, torch.randn(2, 8, d, device=DEV, generator=g), dtype)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("t", [700, 20000])
def test_four_bit_books_per_position_skewed_by_lane_share_at_every_head_dim(d, t):
    """4-bit codes with a book per position (single levels, 8 words a position) are held once skewed by lane share
    (launch.py `_skew_words`: a key's four shares' books in banks of their own), the values too where the launch
    does not hold them in lane rows. Head_dim 128 is in the row-by-row test above; here 64 and 256, whose shares lie
    16 and 64 positions apart (a skew of 24 and 8 words a share for keys)."""
    from kvcalib.formats.codebook.launch import _skew_words, kernel_book

    method = _on_device(turboquant("head", 4, d=d, kv_heads=2, sinks=1, residual=64))
    book = kernel_book(method.codebook_spec(0).key)
    assert book.book.shape[1:] == (d, 16, 1) and _skew_words(book, True) == {64: 24, 256: 8}[d]
    k16, v16, g = _inputs(2, 2, t, d, d + t)
    _check(method, k16, v16, torch.randn(2, 8, d, device=DEV, generator=g))


@pytest.mark.parametrize("kind,bits", [("oblivious", 2), ("kivi-g128", 2), ("kivi-g128", 4), ("oscar-g32", 2),
                                       ("vecinfer-head", 8), ("vecinfer-head", 6), ("vector-layer", 6),
                                       ("plan-mixed", 0), ("plan-vector keys", 0)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_copied_books_read_the_centroids_of_the_book_itself(monkeypatch, kind, bits, d):
    """A shared book held in copies (`book_copies`: lane L reads copy L % copies) gives the output of the book held
    once, bit for bit: the same centroids, summed in the same order. The planted error is the book held once, with
    which the copies are compared: a copy of a wrong entry, or a lane reading past its entry's 128 bytes, moves the
    output."""
    from kvcalib.formats.codebook import launch

    method = _on_device(any_method(kind, bits, d=d, sinks=1, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(2, h, 1500, d, d + bits)
    launched = _launches(monkeypatch)
    layer, q, copied = _check(method, k16, v16, torch.randn(2, 2 * h, d, device=DEV, generator=g))
    held = [(x["KREPL"], x["VREPL"]) for name, x in launched if name == "partial"]
    assert any(max(c) > 1 for c in held), f"no book of {kind} is copied: {held}"
    monkeypatch.setattr(launch, "book_copies", lambda *args: (1, 1))  # the books as they are
    assert torch.equal(codebook_decode(q, layer, d**-0.5, checked=True), copied)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("kind", ["plan-mixed", "plan-vector keys"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plans_at_every_head_dim_and_dtype(d, kind, dtype):
    method = _on_device(any_method(kind, 0, d=d, sinks=1, residual=128))
    k16, v16, g = _inputs(2, 4, 900, d, d)
    _check(method, k16, v16, torch.randn(2, 8, d, device=DEV, generator=g), dtype)


@pytest.mark.parametrize("r", [0, 1, 63, 64, 127])
def test_every_residual_length_kind(r):
    method = _on_device(turboquant("layer", 2, d=128, sinks=1, residual=128))
    k16, v16, g = _inputs(1, 2, 256 + r, 128, r)
    _check(method, k16, v16, torch.randn(1, 8, 128, device=DEV, generator=g))


def _rows_of_their_own(method, kv_heads: int, lengths: list[int], seed: int):
    """One layout holding rows of different `lengths` (a static cache's slots), each row's codes, norms, scales and
    zeros past its own flushed tokens poisoned, launched once with the counts on the device: each row is held to the
    rule above against its lone layout's float64 reference. Returns the layout."""
    b, d = len(lengths), 128
    k16, v16, g = _inputs(b, kv_heads, max(lengths), d, seed)
    q = torch.randn(b, 4 * kv_heads, d, device=DEV, generator=g).half()
    full = layout_of(method, k16, v16)  # capacity for the longest
    flushed = torch.tensor([n // 128 * 128 for n in lengths], dtype=torch.int32, device=DEV)
    residual = torch.tensor([n % 128 for n in lengths], dtype=torch.int32, device=DEV)
    cap_r = 128
    full.kres = torch.full((b, kv_heads, cap_r, d), float("nan"), device=DEV, dtype=torch.float16)
    full.vres = torch.full((b, kv_heads, cap_r, d), float("nan"), device=DEV, dtype=torch.float16)
    for i, n in enumerate(lengths):
        f = n // 128 * 128
        full.kres[i, :, : n - f], full.vres[i, :, : n - f] = k16[i, :, f:n], v16[i, :, f:n]
        for rows in full.groups:  # past the row's own length: poison
            for name in rows.present():
                buf, unit = getattr(rows, name), rows.unit(name)
                if buf.shape[2]:
                    buf[i, :, f // unit :] = -1 if buf.dtype == torch.int32 else float("nan")
    full.length = full.groups[0].kcodes.shape[2]
    full.residual = cap_r
    full.ksink = torch.cat([full.ksink, torch.full_like(full.ksink[:, :, :1], float("nan"))], 2)
    full.vsink = torch.cat([full.vsink, torch.full_like(full.vsink[:, :, :1], float("nan"))], 2)
    for i, n in enumerate(lengths):
        full.ksink[i, :, :1] = k16[i, :, :1] if n else float("nan")
        full.vsink[i, :, :1] = v16[i, :, :1] if n else float("nan")
    out = codebook_decode(q, full, d**-0.5, counts=(flushed, residual), checked=True)
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        alone = layout_of(method, k16[i : i + 1, :, :n], v16[i : i + 1, :, :n])
        ref = reference_decode(q[i : i + 1], alone, d**-0.5)
        err = _row_errors(out[i : i + 1], ref)
        bound = 2 * _row_errors(_sdpa(q[i : i + 1], alone, d**-0.5), ref) + FLOOR
        assert (err <= bound).all(), (i, err.max().item(), bound.min().item())
    return full


def test_counts_read_on_the_device_give_each_sequence_its_own_attention():
    """Rows of one layout holding different lengths (a static cache's slots): each row's output equals its lone
    launch's up to the splits' float32 order (both are held to the reference: the rule above, row by row)."""
    method = _on_device(turboquant("head", 2, d=128, sinks=1, residual=128))
    _rows_of_their_own(method, 2, [3 * 128, 0, 9 * 128 + 5, 128 + 127], 11)


def test_a_plans_padded_rows_at_long_contexts_each_get_their_own_attention():
    """A plan's layer at B=8 over a 64k capacity, the rows padded to lengths of their own as a static cache's slots
    (the counts on the device: the kernel spreads the batch's tokens over twice the splits, `balanced_split`): every
    row as exact as SDPA's on its own cache."""
    method = _on_device(any_method("plan-mixed", 0, d=128, sinks=1, residual=128))
    _rows_of_their_own(method, 4, [65536 + 77, 0, 40000 + 5, 12927, 65536 + 76, 129, 300, 65000], 13)


def test_each_group_of_a_plan_writes_only_its_own_query_heads():
    """A plan's layer is one launch a group of heads: each group's launch alone gives its own query heads exactly what
    the whole layer's launches give them."""
    method = _on_device(any_method("plan-mixed", 0, d=64, sinks=1, residual=128))
    k16, v16, g = _inputs(2, 4, 300, 64, 5)
    layer = layout_of(method, k16, v16)
    assert [tuple(r.head_map.tolist()) for r in layer.groups] == [(0, 2), (1,), (3,)]
    q = torch.randn(2, 16, 64, device=DEV, generator=g).half()
    full = codebook_decode(q, layer, 64**-0.5, checked=True)
    groups = layer.groups
    for rows in groups:
        layer.groups = [rows]
        alone = codebook_decode(q, layer, 64**-0.5, checked=True)
        mine = torch.cat([torch.arange(4 * h, 4 * h + 4) for h in rows.head_map.tolist()]).to(DEV)
        assert torch.equal(alone[:, mine], full[:, mine])


def test_only_groups_whose_keys_have_a_basis_launch_the_query_rotation(monkeypatch):
    """`rotate` runs for a group whose keys are coded in a basis of their own (TurboQuant's, OScaR's rotated keys);
    a group without one (KIVI's affine keys) launches `partial` and `merge` only, each block scaling q itself, and
    every row is as exact as SDPA's (the rule above). Planted: KROT 0 for every group fails here (q~ never rotated)."""
    launched = _launches(monkeypatch)
    for kind, bits, rotated in (("kivi-g128", 2, False), ("oscar-g32", 2, True), ("oblivious", 2, True)):
        launched.clear()
        method = _on_device(any_method(kind, bits, d=128, sinks=1, residual=128))
        k16, v16, g = _inputs(2, 2, 1037, 128, bits)
        _check(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))
        names = [(x.get("KROT"), name) for name, x in launched]
        decode = [(krot, name) for krot, name in names if krot is not None]  # the encode's kernels take no KROT
        assert {name for _, name in decode} == ({"rotate", "partial", "merge"} if rotated else {"partial", "merge"})
        assert {krot for krot, _ in decode} == {int(rotated)}, (kind, names)


@pytest.mark.parametrize("kind,bits", [("kivi-g32", 1), ("kivi-g128", 2), ("kivi-g32", 3), ("kivi-g128", 4),
                                       ("oscar-g128", 1), ("oscar-g32", 2), ("oscar-g128", 3), ("oscar-g128", 4),
                                       ("plan-mixed", 0)])
@pytest.mark.parametrize("copied", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_affine_keys_levels_taken_from_their_bits_meet_the_rule_as_the_books_do(monkeypatch, kind, bits, copied, d):
    """Affine keys' pairs of levels taken from their bits (the kernel's KLEVELS 1: a byte permute and an AND a pair,
    each level an fp16 subnormal, its query fragments scaled to match; no key book held) hold every row to the rule
    above, as the same pairs read from the book do (KLEVELS 0), at every level width, pairs that cross bytes and words
    included, the book copied or held once; and the two outputs agree within what the fragments' remainders allow: a
    score moves by at most level 2^(s - 28) a channel, level 2^s < 2^10, so D 2^-18 in all (log2 units), times the
    key's norm where it has one (OScaR's); a weight then by ln 2 times that, the output by twice that of its values'
    largest (as decoded), beside an fp16 output's rounding (2^-10 of it, either way). The book's own fragments round
    their remainders at 2^-25 times the level, within the same bound (level 2^s < 2^10 holds there too). The launch
    takes the levels wherever it can (`made_levels`); here each way is forced.
    Planted: a second level's fragment scaled by its first level's offset (`affine_fragments`: level_shift of c & ~1)
    fails here and in the row-by-row tests."""
    from kvcalib.formats.codebook import launch

    force, launched = [True], _launches(monkeypatch)  # made_levels now
    monkeypatch.setattr(launch, "made_levels", lambda key, group: force[0] and group > 0)
    if not copied:
        monkeypatch.setattr(launch, "book_copies", lambda *args: (1, 1))
    method = _on_device(any_method(kind, bits, d=d, sinks=1, residual=128))
    h = 4 if kind.startswith("plan") else 2
    k16, v16, g = _inputs(2, h, 1037, d, bits + d)
    q = torch.randn(2, 4 * h, d, device=DEV, generator=g)
    layer, _, taken = _check(method, k16, v16, q)
    force[0] = False
    _, _, gathered = _check(method, k16, v16, q)
    made = [x["KLEVELS"] for name, x in launched if name == "partial" and x.get("KTG")]  # each affine group's
    assert made.count(1) and made.count(0) == made.count(1), made  # both ways ran for every affine group
    norm = max([1.0] + [rows.knorm.float().abs().max().item() for rows in layer.groups if rows.knorm is not None])
    values = max(flushed_kv(layer)[1].abs().max().item(), v16.float().abs().max().item())
    bound = 2.0**-10 * gathered.float().abs() + 2 * math.log(2) * d * 2.0**-18 * norm * values
    assert ((taken.float() - gathered.float()).abs() <= bound).all()


@pytest.mark.parametrize("kind,d", [(k, d) for k in ("head", "layer") for d in (64, 128)])  # d 256: rows over budget
def test_lane_rows_read_the_centroids_of_the_book_itself(monkeypatch, kind, d):
    """Books per position of single levels held in lane rows (`book_layout`, forced here for short splits:
    ROWS_MIN_TOKENS 0) give the output of the books held as they are, bit for bit, and meet the float64 reference's
    rule: TurboQuant-4's codes, 2-byte entries in 4-byte slots, a book per head or per layer; at d 64 the keys' rows
    too (32 + 16 KiB). Planted: a slot read for the wrong lane (`book_address`) or a row copied for the wrong position
    (`copy_book_rows`) fails here."""
    from kvcalib.formats.codebook import launch

    launched = _launches(monkeypatch)
    partial_rows = lambda: [(x["KROWS"], x["VROWS"]) for name, x in launched if name == "partial"]  # noqa: E731
    monkeypatch.setattr(launch, "ROWS_MIN_TOKENS", 0)
    method = _on_device(any_method(kind, 4, d=d, sinks=1, residual=128))
    k16, v16, g = _inputs(2, 2, 1500, d, d + 4)
    layer, q, rows = _check(method, k16, v16, torch.randn(2, 4, d, device=DEV, generator=g))
    held = partial_rows()
    assert held and all(v and k == (d == 64) for k, v in held), f"{kind} at d {d}: rows launched {held}"
    launched.clear()
    monkeypatch.setattr(launch, "ROWS_MIN_TOKENS", 1 << 30)
    assert torch.equal(codebook_decode(q, layer, d**-0.5, checked=True), rows)
    held = partial_rows()
    assert held and not any(k or v for k, v in held), held  # the books held as they are
