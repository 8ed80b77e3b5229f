"""The VecInfer kernel layout's float64 reference (`kvcalib.formats.vq.layout`): the lookup-table
computation a fused kernel will do gives, in float64, attention over the very cache it reads, dequantized
and taken back to the keys' own basis, for per-layer and per-head codebooks, key and value
configurations that differ, sink tokens on and off, and every residual length kind (empty, partial); and
it never reads past its counts."""

import pytest
import torch

from kvcalib.attention import AttentionOptions, mixed_attention
from kvcalib.hadamard import rotate
from kvcalib.methods.vecinfer import LayerCodebooks, VecInfer, VecInferConfig, keys_from_codec, queries_to_codec
from kvcalib.models import AttentionShape
from kvcalib import vq
from kvcalib.formats.vq.layout import append_block, reference_decode

# float64 sums of a few hundred terms: the two computations agree to ~1e-14 relative; 1e-10 is far above
# that and far below a single wrong code (a centroid apart: ~1e-1).
F64 = 1e-10


def _method(granularity: str, k_config: str, v_config: str, sinks: int, d: int = 32, heads: int = 8,
            kv_heads: int = 2, smooth: bool = True, hadamard: bool = True) -> VecInfer:
    shape = AttentionShape(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d)
    config = VecInferConfig(k_config, v_config, granularity, smooth=smooth, hadamard=hadamard, sink_tokens=sinks)
    g = torch.Generator().manual_seed(0)
    groups = config.groups(shape)
    books = LayerCodebooks(k=torch.randn(groups, config.k.centroids, config.k.dim, generator=g).half(),
                           v=torch.randn(groups, config.v.centroids, config.v.dim, generator=g).half(),
                           smooth=(0.5 + torch.rand(kv_heads, d, generator=g)).half() if smooth else None)
    return VecInfer(config, [books], shape, residual=16)


def _layer(method: VecInfer, k16: torch.Tensor, v16: torch.Tensor):
    """The layout of a cache that was fed k16, v16 (B, Hkv, T, d): its full blocks coded, the first `sink`
    tokens also kept, the rest in the residual; sinks and residual as they came in (the model's basis)."""
    t, r, s = k16.shape[2], method.block, method.sink
    n = t // r * r
    books, c = method.layers[0], method.config
    layer = None
    for start in range(0, n, r):  # as a decoder flushes: block by block
        blk = slice(start, start + r)
        packed = method.compress(0, k16[:, :, blk], v16[:, :, blk])
        sink = slice(start, min(start + r, max(s, start)))
        layer = append_block(layer, packed.k, packed.v, books.k, books.v, c.k.bits, c.v.bits, k16[:, :, sink],
                             v16[:, :, sink], k16[:, :, n:], v16[:, :, n:], books.smooth, c.hadamard)
    if layer is None:
        empty = torch.zeros(*k16.shape[:2], 0, 1, dtype=torch.uint8, device=k16.device)
        layer = append_block(None, empty, empty, books.k, books.v, c.k.bits, c.v.bits, k16[:, :, :0], v16[:, :, :0],
                             k16[:, :, n:], v16[:, :, n:], books.smooth, c.hadamard)
    return layer


def _expected(method: VecInfer, layer, q: torch.Tensor) -> torch.Tensor:
    """Plain float64 attention of q (B, Hq, d) over the same cache dequantized, coded keys back in the model's
    basis."""
    books, c = method.layers[0], method.config
    d = layer.head_dim
    # vq.decode returns float32: its centroids are float16 numbers, exact there; taken to float64 before the
    # rotation back, so that the comparison holds to float64 round-off
    k = vq.decode(layer.codes("k"), books.k.double()).double() if layer.length else layer.kres[:, :, :0].double()
    v = vq.decode(layer.codes("v"), books.v.double()).double() if layer.length else layer.vres[:, :, :0].double()
    k = keys_from_codec(k, books.smooth.double(), c.hadamard)
    k[:, :, : layer.sinks] = layer.ksink.double()
    v[:, :, : layer.sinks] = layer.vsink.double()
    k = torch.cat([k, layer.kres[:, :, : layer.residual].double()], 2)
    v = torch.cat([v, layer.vres[:, :, : layer.residual].double()], 2)
    out = mixed_attention(q.double()[:, :, None], k, v, AttentionOptions(scaling=d**-0.5))
    return out[:, :, 0]


def test_the_references_float64_query_transform_is_the_methods_float32_one_to_its_rounding():
    """`queries_to_codec` in float64 (the reference's) against float32 (the method's): q̃ · k̃ = q · k holds for
    the layout's reference as for the method's own path."""
    method = _method("layer", "d4b6", "d4b6", 0)
    q = torch.randn(1, 8, 1, 32, generator=torch.Generator().manual_seed(2))
    smooth = method.layers[0].smooth
    want = queries_to_codec(q, smooth, True).double()
    # float32 products and a 32-term float32 matmul: relative error a few units of 2^-24 times sqrt(32)
    assert ((queries_to_codec(q, smooth, True, torch.float64) - want).abs().max() / want.abs().max()) < 1e-6


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("k_config,v_config", [("d4b6", "d4b6"), ("d8b10", "d2b5")])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("t", [9, 16, 41, 64])
def test_the_lookup_table_reference_is_attention_over_the_cache_it_reads(granularity, k_config, v_config, sinks, t):
    method = _method(granularity, k_config, v_config, sinks)
    g = torch.Generator().manual_seed(t)
    k16 = (torch.randn(3, 2, t, 32, generator=g) * (1 + 3 * torch.rand(1, 1, 1, 32, generator=g))).half()
    v16 = torch.randn(3, 2, t, 32, generator=g).half()
    layer = _layer(method, k16, v16)
    assert layer.length == t // 16 * 16 and layer.residual == t % 16 and layer.sinks == min(sinks, layer.length)
    q = torch.randn(3, 8, 32, generator=g)
    got, want = reference_decode(q, layer, 32**-0.5), _expected(method, layer, q)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < F64


def test_the_reference_reads_nothing_past_its_counts_and_each_head_reads_its_own_codebook():
    method = _method("head", "d4b6", "d4b6", 2)
    g = torch.Generator().manual_seed(1)
    k16, v16 = torch.randn(2, 2, 40, 32, generator=g).half(), torch.randn(2, 2, 40, 32, generator=g).half()
    layer = _layer(method, k16, v16)
    q = torch.randn(2, 8, 32, generator=g)
    before = reference_decode(q, layer, 32**-0.5)
    # Poison what lies past the counts: codes of capacity not yet filled (capacity grown past the length
    # first, so that there are such rows), residual rows not yet written.
    assert layer.length == 32
    layer.kcodes = torch.cat([layer.kcodes, torch.full_like(layer.kcodes, 255)], 2)
    layer.vcodes = torch.cat([layer.vcodes, torch.full_like(layer.vcodes, 255)], 2)
    layer.kres = torch.cat([layer.kres, torch.full_like(layer.kres, float("nan"))], 2)
    layer.vres = torch.cat([layer.vres, torch.full_like(layer.vres, float("nan"))], 2)
    assert torch.equal(reference_decode(q, layer, 32**-0.5), before)
    # A planted error: both KV heads reading head 0's codebooks moves the output far beyond F64.
    layer.kbook, layer.vbook = layer.kbook[:1].expand_as(layer.kbook), layer.vbook[:1].expand_as(layer.vbook)
    assert (reference_decode(q, layer, 32**-0.5) - before).abs().max() > 1e-3


def test_the_kernel_refuses_codebooks_beyond_its_shared_memory_with_the_limit_named():
    """d8b16 keys: a 1 MiB codebook (65536 x 8 float16), more than a block's shared memory."""
    from kvcalib.errors import SettingsError
    from kvcalib.formats.vq.launch import MIN_STAGES, SHARED_LIMIT, check, shared_bytes

    method = _method("layer", "d8b16", "d4b8", 0, d=32)
    g = torch.Generator().manual_seed(0)
    layer = _layer(method, torch.randn(1, 2, 20, 32, generator=g).half(), torch.randn(1, 2, 20, 32, generator=g).half())
    need = shared_bytes(layer, 4, MIN_STAGES) // 1024
    assert need >= 1024 + 2  # both codebooks, float16: 1 MiB of keys, 2 KiB of values
    with pytest.raises(SettingsError, match=f"need {need} KiB of shared memory per block; the kernel holds up to {SHARED_LIMIT // 1024} KiB"):
        check(torch.zeros(1, 8, 32), layer)


def test_no_block_has_fewer_threads_than_the_merge_writes_channels():
    """The merge gives each thread 4 channels of one query head (vq_decode.cu `merge_parts`), so 4 warps serve
    at most 4 heads of d = 128. Books of 160 KiB (keys d16b12: 4096 x 16 float16, values d4b12) fit a block of
    4 warps and not one of 8: with 4 query heads per KV head the plan falls back to 4 warps; with 8 it may not
    (4 warps wrote half of the output), and the layer is refused in one line, and not offered to the runtime."""
    from kvcalib.errors import SettingsError
    from kvcalib.formats.vq.launch import SHARED_LIMIT, check, plan, supports
    from kvcalib.formats.vq.layout import VQBooks

    for heads, warps in ((4, 4), (8, None)):
        method = _method("layer", "d16b12", "d4b12", 0, d=128, heads=heads, kv_heads=1, smooth=False)
        g = torch.Generator().manual_seed(0)
        layer = _layer(method, torch.randn(1, 1, 20, 128, generator=g).half(), torch.randn(1, 1, 20, 128, generator=g).half())
        books = VQBooks(layer.kbook, layer.vbook, layer.k_bits, layer.v_bits, None, True)
        offered = supports(books, 128, torch.device("cuda"), gqa=heads)
        p = plan(layer, heads)
        if warps:
            assert p["WARPS"] == warps and p["SMEM"] <= SHARED_LIMIT and offered
            with pytest.raises(SettingsError, match="queries .* on CUDA"):  # past the shared memory: only the CPU query is refused
                check(torch.zeros(1, heads, 128), layer)
        else:
            assert p["WARPS"] == 8 and p["SMEM"] > SHARED_LIMIT and not offered
            with pytest.raises(SettingsError, match="KiB of shared memory per block"):
                check(torch.zeros(1, heads, 128), layer)


@pytest.mark.parametrize("b,h,t,d,n,e,g", [(8, 6, 128, 128, 4, 64, 6), (2, 4, 33, 64, 8, 16, 1), (1, 8, 700, 128, 4, 256, 2)])
def test_encode_takes_every_head_at_once_and_names_the_nearest_centroid_of_its_own_book(monkeypatch, b, h, t, d, n,
                                                                                      e, g):
    """`vq.encode` over all heads in one batched product (`nearest_heads`), chunked (the budget lowered here so that
    the last case takes several chunks) or not: the codes `nearest` gives head by head against the head's own book,
    and each the argmin of the float64 distances but for near-ties (within float32's rounding of them)."""
    monkeypatch.setattr(vq, "_DISTANCE_ENTRIES", 1 << 16)
    gen = torch.Generator().manual_seed(b * h + t)
    x, books = torch.randn(b, h, t, d, generator=gen), torch.randn(g, e, n, generator=gen).half()
    codes = vq.encode(x, books)
    assert codes.shape == (b, h, t, d // n) and codes.is_contiguous()
    sub = x.unflatten(-1, (d // n, n))
    for head in range(h):
        book = books[head // (h // g)]
        assert torch.equal(codes[:, head], vq.nearest(sub[:, head].reshape(-1, n), book).reshape(b, t, d // n))
        dist = (sub[:, head].double().unsqueeze(-2) - book.double()).pow(2).sum(-1)  # (b, t, c, e)
        best = dist.min(-1).values
        taken = dist.gather(-1, codes[:, head].unsqueeze(-1)).squeeze(-1)
        assert (taken - best <= 1e-5 * (1 + best)).all()  # float32 distances: a few ulps of |x|^2 + |c|^2


def test_a_books_float_copy_and_norms_are_made_once_a_book_and_let_go_with_it():
    """`vq.prepared`: the float32 books and their centroids' squared norms `encode` reads, made once for a book
    object (a flush encodes with the same one every time), equal to those made anew, and not kept past the book."""
    gen = torch.Generator().manual_seed(4)
    book = torch.randn(2, 16, 4, generator=gen).half()
    books, norms = vq.prepared(book)
    assert vq.prepared(book)[0] is books and vq.prepared(book)[1] is norms
    assert torch.equal(books, book.float()) and torch.equal(norms, book.float().pow(2).sum(-1).unsqueeze(1))
    other = book.clone()
    assert vq.prepared(other)[0] is not books
    held = len(vq._PREPARED)
    del other
    assert len(vq._PREPARED) == held - 1
    single = torch.randn(1, 8, 4, generator=gen)  # float32: its float copy is itself, which must not keep it held
    vq.prepared(single)
    held = len(vq._PREPARED)
    del single
    assert len(vq._PREPARED) == held - 1
    compiled = torch.compile(lambda b: vq.prepared(b)[1] + 0, fullgraph=True, dynamic=False)
    fresh = torch.randn(1, 8, 4, generator=gen)
    held = len(vq._PREPARED)
    assert torch.equal(compiled(fresh), fresh.pow(2).sum(-1).unsqueeze(1)) and len(vq._PREPARED) == held  # made, not kept


def test_the_encode_kernel_refuses_a_tensor_on_another_device_than_its_rows():
    """The encode kernel (`kvcalib::codebook_encode`) takes raw pointers, so a book, a rotation or an output on another
    device than x's would fault the CUDA context where torch ops raise: the op refuses it first, naming the devices
    (`vq._encode_refusal`; here "meta" stands for another device). The tensors the kernel takes as they are pass.
    Planted: without the device rule each case below passes the check."""
    x = torch.zeros(1, 2, 3, 8)
    out, norms = torch.empty(1, 2, 3, 1, dtype=torch.int32), torch.empty(1, 2, 3, 1, dtype=torch.float16)
    rot, bounds = torch.eye(8, dtype=torch.float64), torch.zeros(3)
    books, book_norms = torch.zeros(2, 4, 2), torch.zeros(2, 1, 4)
    assert vq._encode_refusal(x, out, norms, rot, bounds, None, None) is None
    assert vq._encode_refusal(x, out, norms, None, None, books, book_norms) is None
    for args in ((out, norms, rot.to("meta"), bounds, None, None), (out, norms, rot, bounds.to("meta"), None, None),
                 (out.to("meta"), norms, rot, bounds, None, None),
                 (out, norms, None, None, books.to("meta"), book_norms),
                 (out, norms, None, None, books, book_norms.to("meta"))):
        why = vq._encode_refusal(x, *args)
        assert why is not None and "all on x's device" in why and "meta" in why
