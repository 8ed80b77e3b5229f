"""The codebook kernel layout's float64 reference (`kvcalib.formats.codebook.layout`): what a method declares of
its blocks (`codebook_groups`, `codebook_blocks`) read back through the layout gives the method's own dequantized
cache, and `reference_decode` is attention over it: TurboQuant with oblivious, per-layer and per-head codebooks,
scalar and vector codes; KIVI and OScaR (affine codes) at 2 to 4 bits; VecInfer (smoothed, rotated keys); plans
mixing all of them per KV head; sinks on and off. It never reads past its counts."""

import collections
import re
import shutil
import subprocess

import pytest
import torch

from kvcalib.attention import AttentionOptions, mixed_attention
from kvcalib.formats.codebook.layout import CodedPart, append_block, decode_part, flushed_kv, reference_decode
from kvcalib.methods import MethodSettings, build_method
from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig, TurboQuantVQ
from kvcalib.models import AttentionShape
from kvcalib import vq

# float64 sums of at most a few hundred terms of magnitude ~10: ~1e-13 apart; 1e-9 is far above that and far
# below one wrong code (a centroid apart: ~1e-2 of a vector's norm).
F64 = 1e-9
# The method decodes in float32 (its rotation's product taken in float64, rounded once, times a float16 norm in
# float32): two roundings of u32 = 2^-24 relative to each coordinate, ~1.2e-7; 1e-6 of the vector's norm bounds it.
F32 = 1e-6


def turboquant(kind: str, bits: int = 2, d: int = 32, kv_heads: int = 2, sinks: int = 0, residual: int = 16):
    """A TurboQuant of one layer: oblivious, calibrated per layer or per KV head, or vector codes of 4 coordinates
    and `bits` bits (`vector-layer`, `vector-head`)."""
    shape = AttentionShape(num_layers=1, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=d)
    g = torch.Generator().manual_seed(bits)
    groups = kv_heads if kind.endswith("head") else 1
    if kind == "oblivious":
        method = TurboQuant(TurboQuantConfig(bits=bits, residual=residual), shape)
    elif kind.startswith("vector"):
        books = [tuple(torch.randn(groups, 1 << bits, 4, generator=g).div(d**0.5).half() for _ in range(2))]
        method = TurboQuantVQ(vq.VQConfig(4, bits), residual, shape, books, "head" if groups > 1 else "layer")
    else:
        books = [tuple(torch.randn(groups, d, 1 << bits, generator=g).div(d**0.5).sort(-1).values.half()
                       for _ in range(2))]
        method = TurboQuant(TurboQuantConfig(bits=bits, residual=residual), shape, books,
                            "head" if groups > 1 else "layer")
    method.sink = sinks
    return method


def affine(name: str, bits: int, group: int = 32, d: int = 32, kv_heads: int = 2, sinks: int = 0,
           residual: int = 32):
    """KIVI or OScaR (its default l2 key scaling and rotation) of one layer: `bits`, key groups of `group` tokens."""
    shape = AttentionShape(num_layers=1, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=d)
    method = build_method(name, shape, MethodSettings(bits=bits, group_size=group, residual=residual))
    method.sink = sinks
    return method


def vecinfer(bits: int = 6, d: int = 32, kv_heads: int = 2, sinks: int = 0, residual: int = 32, granularity="layer"):
    """VecInfer d4b`bits` of one layer, random books and smoothing λ (keys smoothed and rotated)."""
    from kvcalib.methods.vecinfer import LayerCodebooks, VecInfer, VecInferConfig

    shape = AttentionShape(num_layers=1, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=d)
    g = torch.Generator().manual_seed(bits)
    groups = kv_heads if granularity == "head" else 1
    books = [LayerCodebooks(k=torch.randn(groups, 1 << bits, 4, generator=g).half(),
                            v=torch.randn(groups, 1 << bits, 4, generator=g).half(),
                            smooth=(torch.rand(kv_heads, d, generator=g) + 0.5).half())]
    return VecInfer(VecInferConfig(f"d4b{bits}", f"d4b{bits}", granularity=granularity, sink_tokens=sinks), books,
                    shape, residual)


# Plans mixing every family per KV head (4 of them): keys and values of different schemes, heads sharing a pair.
PLANS = {"mixed": (["kivi-2-g32", "turboquant-3", "kivi-2-g32", "oscar-4-g32"],
                   ["vecinfer-d4b6", "turboquant-d4b6", "vecinfer-d4b6", "kivi-3-g32"]),
         "vector keys": (["vecinfer-d4b8", "turboquant-2", "vecinfer-d4b8", "oscar-2-g32"],
                         ["oscar-3-g128", "turboquant-4", "vecinfer-d4b7", "turboquant-1"])}


def plan(kind: str = "mixed", d: int = 32, sinks: int = 0, residual: int = 128, granularity: str = "head"):
    """A plan of one layer and 4 KV heads (`PLANS`), random calibrated books (per KV head with granularity head)."""
    from kvcalib.methods.plan import Plan, codebook_name, parse_scheme, smooth_name

    shape = AttentionShape(num_layers=1, num_heads=16, num_kv_heads=4, head_dim=d)
    keys, values = ([parse_scheme(x) for x in names] for names in PLANS[kind])
    groups = 4 if granularity == "head" else 1
    g = torch.Generator().manual_seed(d)
    books = {}
    for part, schemes in (("k", keys), ("v", values)):
        for s in schemes:
            if s.book:
                x = torch.randn(*s.book_shape(groups, d), generator=g) * (d**-0.5 if s.family == "turboquant" else 1)
                books[codebook_name(0, part, s.book)] = (x if s.dim else x.sort(-1).values).half().float()
    if any(s.family == "vecinfer" for s in keys):
        books[smooth_name(0)] = (torch.rand(4, d, generator=g) + 0.5).half()
    method = Plan(shape, {"k": [keys], "v": [values]}, residual, residual, books, granularity)
    method.sink = sinks
    return method


def layout_of(method, k16: torch.Tensor, v16: torch.Tensor):
    """The layout of a cache fed k16, v16 (B, H, T, d): its whole blocks coded in one call (each format codes a
    vector, or a key group of whole blocks, on its own: the same as block by block), the first `sink` tokens also
    kept, the rest in the residual."""
    t, r, s = k16.shape[2], method.block, method.sink
    n = t // r * r
    packed = method.compress(0, k16[:, :, :n].float(), v16[:, :, :n].float())
    sink = slice(0, min(s, n))
    groups = [group.to(k16.device) for group in method.codebook_groups(0)]
    return append_block(None, groups, method.codebook_blocks(packed), k16[:, :, sink], v16[:, :, sink],
                        k16[:, :, n:], v16[:, :, n:])


def any_method(kind: str, bits: int, d: int = 32, sinks: int = 0, residual: int | None = None):
    """TurboQuant (`turboquant` kinds), KIVI or OScaR (`kivi-g32`: key groups of 32), VecInfer, a plan (`plan`)."""
    if kind.startswith(("kivi", "oscar")):
        name, group = kind.split("-g")
        return affine(name, bits, int(group), d, sinks=sinks, residual=residual or 128)
    if kind.startswith("vecinfer"):
        return vecinfer(bits, d, sinks=sinks, residual=residual or 32, granularity=kind.split("-")[1])
    if kind.startswith("plan"):
        return plan(kind.split("-", 1)[1], d, sinks, residual or 128)
    return turboquant(kind, bits, d, sinks=sinks, residual=residual or 16)


KINDS = ["oblivious", "layer", "head", "vector-layer", "vector-head"]
OTHERS = [("kivi-g32", 2), ("kivi-g128", 3), ("kivi-g32", 4), ("oscar-g32", 2), ("oscar-g128", 3), ("oscar-g128", 4),
          ("vecinfer-layer", 6), ("vecinfer-head", 8), ("plan-mixed", 0), ("plan-vector keys", 0)]


@pytest.mark.parametrize("kind,bits", [(k, b) for k in KINDS for b in (1, 3, 4)] + OTHERS)
@pytest.mark.parametrize("sinks", [0, 3])
def test_the_layout_reads_back_the_methods_own_cache(kind, bits, sinks):
    method = any_method(kind, bits, sinks=sinks)
    g = torch.Generator().manual_seed(7)
    h = 4 if kind.startswith("plan") else 2
    n = 3 * method.block
    k16 = (torch.randn(2, h, n + 4, 32, generator=g) * 3).half()
    v16 = torch.randn(2, h, n + 4, 32, generator=g).half()
    layer = layout_of(method, k16, v16)
    assert layer.length == n and layer.residual == 4 and layer.sinks == sinks
    k, v = flushed_kv(layer)
    kd, vd = method.decompress(0, method.compress(0, k16[:, :, :n].float(), v16[:, :, :n].float()))
    kd[:, :, :sinks], vd[:, :, :sinks] = k16[:, :, :sinks].float(), v16[:, :, :sinks].float()
    for got, want in ((k, kd), (v, vd)):
        err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert err.max() <= F32, f"worst token {err.max():.2e}"


@pytest.mark.parametrize("kind", KINDS + ["kivi-g32", "oscar-g32", "vecinfer-head", "plan-mixed"])
@pytest.mark.parametrize("t", [0, 5, 16, 37, 300])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_decode_is_attention_over_the_dequantized_cache(kind, t, softcap):
    """The kernel's float64 reference is attention over the dequantized cache, its scores soft-capped where the
    model caps them (Gemma 2: softcap tanh(s / softcap), `mixed_attention`'s rule; a cap of 2 moves these scores
    of up to about 10 by far more than the tolerance)."""
    method = any_method(kind, 2, sinks=2, residual=32)
    g = torch.Generator().manual_seed(t)
    h = 4 if kind.startswith("plan") else 2
    k16 = (torch.randn(2, h, t + 1, 32, generator=g) * 2).half()
    v16 = torch.randn(2, h, t + 1, 32, generator=g).half()
    layer = layout_of(method, k16, v16)
    q = torch.randn(2, 4 * h, 32, generator=g, dtype=torch.float64)
    k, v = flushed_kv(layer, torch.float64)
    k = torch.cat([k, layer.kres.double()], 2)
    v = torch.cat([v, layer.vres.double()], 2)
    want = mixed_attention(q[:, :, None], k, v, AttentionOptions(scaling=32**-0.5, softcap=softcap))[:, :, 0]
    got = reference_decode(q, layer, 32**-0.5, softcap)
    assert torch.allclose(got, want, rtol=0, atol=F64 * want.abs().max().item())
    if softcap and t > 0:  # the cap is applied: without it the reference is another attention
        assert not torch.allclose(reference_decode(q, layer, 32**-0.5), want, rtol=0, atol=1e-3)


@pytest.mark.parametrize("kind", ["head", "plan-mixed"])
def test_reference_decode_reads_nothing_past_its_counts(kind):
    """Codes, norms, scales and zeros past the length, residual rows past the count: poison moves nothing."""
    method = any_method(kind, 3, sinks=1, residual=32)
    h = 4 if kind.startswith("plan") else 2
    g = torch.Generator().manual_seed(3)
    k16, v16 = torch.randn(1, h, 80, 32, generator=g).half(), torch.randn(1, h, 80, 32, generator=g).half()
    layer = layout_of(method, k16, v16)
    q = torch.randn(1, 4 * h, 32, generator=g)
    want = reference_decode(q, layer, 0.2)
    for rows in layer.groups:
        for name in rows.present():
            buf, unit = getattr(rows, name), rows.unit(name)
            used = buf[:, :, : layer.length // unit]
            bad = -1 if buf.dtype == torch.int32 else float("nan")
            setattr(rows, name, torch.cat([used, torch.full_like(buf[:, :, :1], bad).expand(*buf.shape[:2], 9, *buf.shape[3:])], 2))
    layer.kres = torch.cat([layer.kres, torch.full_like(layer.kres[:, :, :3], float("nan"))], 2)
    layer.vres = torch.cat([layer.vres, torch.full_like(layer.vres[:, :, :3], float("nan"))], 2)
    assert torch.equal(reference_decode(q, layer, 0.2), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_the_kernels_books_read_the_same_centroids_from_the_same_bits(kind, bits):
    """`kernel_book`: scalar codes read four at a time or in pairs (one code of four or twice the bits, its centroid
    theirs) or one by one; every coordinate's centroid from the same code row is the layout's, rounded to fp16
    once."""
    from kvcalib.formats.codebook.launch import kernel_book
    from kvcalib.quant import unpack_stream

    method = turboquant(kind, bits, d=32, kv_heads=2)
    for part in (method.codebook_spec(0).key, method.codebook_spec(0).value):  # noqa: B007
        kb = kernel_book(part)
        g = torch.Generator().manual_seed(bits)
        words = torch.randint(-2**31, 2**31 - 1, (2, 2, 5, part.words(32)), generator=g, dtype=torch.int64).to(torch.int32)
        want = decode_part(words, None, CodedPart(part.bits, part.dim, part.book, False), 32, torch.float32)
        codes = unpack_stream(words, kb.bits, 32 // kb.dim)  # (B, H, T, count) in the kernel's reading
        book = kb.book.float().expand(2, *kb.book.shape[1:]) if kb.book.shape[0] == 1 else kb.book.float()
        pos = torch.arange(codes.shape[-1]) if book.shape[1] > 1 else torch.zeros(codes.shape[-1], dtype=torch.long)
        got = book[torch.arange(2).view(1, 2, 1, 1), pos.view(1, 1, 1, -1), codes].reshape(2, 2, 5, 32)
        shared = part.book.shape[1] == 1
        # fours where a book per position stays at most 8 KiB (1 bit), pairs up to 3 bits a position and 4 of a
        # shared book
        together = 4 if bits == 1 and not shared else 2 if bits <= 3 or shared else 1
        assert kb.dim == (together if part.dim == 1 else part.dim)
        assert torch.equal(got, want.half().float())


def _kernel_book(positions: int, entries: int, dim: int):
    from kvcalib.formats.codebook.launch import KernelBook

    return KernelBook(torch.zeros(1, positions, entries, dim, dtype=torch.float16), entries.bit_length() - 1, dim)


def test_shared_books_are_copied_where_a_block_holds_both_books_in_52_kib():
    """`book_copies`: a book shared by every position, of 4- to 16-byte entries, is held in 128 / entry bytes copies
    (128 bytes an entry); books per position and 2-byte entries never; both books within COPIED_BOOKS_BYTES, else
    the value book's copies first, else the key's, else none; `shared_bytes` counts what the block holds."""
    from kvcalib.formats.codebook.launch import COPIED_BOOKS_BYTES, book_copies, query_bytes, shared_bytes

    levels, vec6, vec8 = _kernel_book(1, 16, 2), _kernel_book(1, 64, 4), _kernel_book(1, 256, 4)
    per_position, halves = _kernel_book(64, 64, 2), _kernel_book(1, 16, 1)
    assert book_copies(levels, vec6) == (32, 16)  # KIVI-2's levels in pairs, VecInfer d4b6
    assert shared_bytes(levels, vec6, 4, 128) == 16 * 128 + 64 * 128
    # keys without a basis: each block holds its 4 query heads' q~ (float32) after the books
    assert query_bytes(False, 4, 128) == 4 * 4 * 128 and query_bytes(True, 4, 128) == 0
    assert shared_bytes(levels, vec6, 4, 128, query=query_bytes(False, 4, 128)) == 16 * 128 + 64 * 128 + 2048
    assert book_copies(per_position, vec8) == (1, 16)  # TurboQuant-3's pairs per position, VecInfer d4b8
    assert book_copies(per_position, halves) == (1, 1)
    wide = _kernel_book(1, 256, 2)  # 4-bit levels in pairs: 32 KiB copied
    assert book_copies(wide, vec8) == (1, 16)  # 64 KiB both: the value's copies
    assert book_copies(wide, per_position) == (32, 1)  # 32 KiB + 16.3 KiB held once
    assert book_copies(wide, _kernel_book(128, 64, 2)) == (1, 1)  # 32 KiB + 32.5 KiB: over 52 KiB
    for key in (levels, wide, per_position, halves, vec8):
        for value in (vec6, vec8, per_position, halves, levels):
            if max(book_copies(key, value)) > 1:
                assert shared_bytes(key, value, 1, 64) <= COPIED_BOOKS_BYTES


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine to compile the kernel for its register count")
@pytest.mark.parametrize("head_dim,gqa,softcap", [(256, 2, None), (256, 1, None), (64, 8, None), (256, 2, 50.0)])
def test_the_partial_blocks_per_sm_leave_no_register_spilled(tmp_path, head_dim, gqa, softcap):
    """`blocks_per_sm` caps each `partial` thread's registers (`__launch_bounds__(128, PARTIAL_BLOCKS)`): compiled
    for sm_90 at the count it picks, KIVI-2's codebook form (affine keys over 128-token groups, affine values, the
    largest register set of the formats) spills nothing to local memory. Where it once picked 4 blocks, head_dim
    256 spilled 848 to 964 bytes a thread and 8 query heads of head_dim 64 388 (the planted error: at 4 blocks these
    cases fail here). Llama's 4 query heads of 128 keep 4 blocks, measured the faster there though KIVI's affine keys
    spill 48 bytes (TurboQuant's codes none). Gemma 2's soft cap (`SOFTCAP_LOG2`, as the launch writes it) compiles
    into the same budget."""
    from kernels_cupy.source import source_of
    from kvcalib.formats.codebook.launch import CH, KERNEL, ROWS, SLICES, WARPS, blocks_per_sm, softcap_define

    words = head_dim * 4 // 32  # pairs of 2-bit levels: 4-bit codes (`kernel_book`)
    defines = {"D": head_dim, "GQ": gqa, "QT": "__nv_bfloat16", "CH": CH, "WARPS": WARPS, "ROWS": ROWS,
               "SLICES": SLICES, "PARTIAL_BLOCKS": blocks_per_sm(gqa, head_dim), "KB": 4, "KDIM": 2, "KPOS": 0,
               "KNORM": 0, "KW": words // 2, "KTG": 128, "VB": 4, "VDIM": 2, "VPOS": 0, "VNORM": 0, "VW": words // 2,
               "VCG": max(64, head_dim // 2), "KLEVELS": 1}  # the launch makes these levels (`made_levels`)
    if softcap:
        defines["SOFTCAP_LOG2"] = softcap_define(softcap)
    src = tmp_path / "partial.cu"
    src.write_text("".join(f"#define {k} {v}\n" for k, v in sorted(defines.items())) + source_of(KERNEL))
    run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--use_fast_math", "-cubin", "-Xptxas", "-v", "-o",
                          str(tmp_path / "partial.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "entry function 'partial'" in line)
    usage = " ".join(lines[at + 1 : at + 3])
    spilled = re.search(r"(\d+) bytes spill stores", usage)
    assert spilled and int(spilled.group(1)) == 0, usage
    assert defines["PARTIAL_BLOCKS"] == 2


def test_every_partial_kernel_takes_the_largest_shared_memory_carveout(monkeypatch):
    """`_configure`: each compiled `partial` asks for the SM's largest shared-memory carveout, so that a layer's groups
    of heads, whose blocks take different shared memory (copied books or not), fit SMs of one configuration and run
    side by side; the dynamic shared memory past 48 KiB is allowed; each once per kernel and size."""
    from types import SimpleNamespace

    from kvcalib.formats.codebook import launch
    from kvcalib.formats.codebook.launch import _configure

    monkeypatch.setattr(launch, "_CONFIGURED", {})  # the process's own kernels are not these
    small, large = SimpleNamespace(), SimpleNamespace()
    _configure(small, 12 * 1024)
    _configure(large, 52 * 1024)
    assert vars(small) == {"preferred_shared_memory_carveout": 100}
    assert vars(large) == {"preferred_shared_memory_carveout": 100, "max_dynamic_shared_size_bytes": 52 * 1024}
    large.preferred_shared_memory_carveout = 0
    _configure(large, 52 * 1024)  # configured once: the attribute is not set again
    assert large.preferred_shared_memory_carveout == 0


def test_copies_stay_within_what_an_sm_holds_for_its_resident_blocks(monkeypatch):
    """`copies_budget`: 52 KiB a block where the SM holds 228 KiB (H100, H200: 4 blocks, 1 KiB each reserved), an
    A100's 164 KiB 40 KiB, an sm_89's 100 KiB 24 KiB, so that copies never take a resident block away."""
    from types import SimpleNamespace

    from kvcalib.formats.codebook.launch import COPIED_BOOKS_BYTES, book_copies, copies_budget, query_bytes

    for per_sm, budget in ((228, 52), (164, 40), (100, 24)):
        copies_budget.cache_clear()
        props = SimpleNamespace(shared_memory_per_multiprocessor=per_sm * 1024)
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: props)
        monkeypatch.setattr("torch.cuda.is_available", lambda: True)
        assert copies_budget(0, 4) == min(COPIED_BOOKS_BYTES, budget * 1024)
    copies_budget.cache_clear()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # no device answers: the H100's and H200's budget
    assert copies_budget(0, 4) == COPIED_BOOKS_BYTES
    copies_budget.cache_clear()
    for per_sm, budget in ((228, 52), (164, 38)):  # q~ in shared memory beside the books: 2 KiB less where it binds
        copies_budget.cache_clear()
        props = SimpleNamespace(shared_memory_per_multiprocessor=per_sm * 1024)
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: props)
        monkeypatch.setattr("torch.cuda.is_available", lambda: True)
        assert copies_budget(0, 4, query_bytes(False, 4, 128)) == budget * 1024
    copies_budget.cache_clear()
    vec8 = _kernel_book(1, 256, 4)  # 32 KiB copied
    assert book_copies(_kernel_book(1, 16, 2), vec8, 24 * 1024) == (32, 1)
    assert book_copies(_kernel_book(1, 16, 2), vec8, 40 * 1024) == (32, 16)


def test_books_whose_centroids_take_more_than_one_load_are_refused():
    """`gather` reads a centroid in one load of at most 16 bytes (8 coordinates): books of 16 coordinates a code
    (VecInfer d16) are not the kernel's, though their codes tile a lane's share at head_dim 128."""
    from kvcalib.formats.codebook.launch import _copies, _reads

    assert _reads(_kernel_book(1, 256, 8), 128)
    assert not _reads(_kernel_book(1, 256, 16), 128)
    assert _copies(_kernel_book(1, 256, 16)) == 1


def test_made_levels_hold_no_key_book_and_books_per_position_of_single_levels_take_lane_rows():
    """`made_levels`: an affine key's pairs of levels are taken from their bits, at every width, no other book;
    `book_layout` then holds no key book, and holds a book per position of single levels in lane rows ((codes a lane's
    share) x entries x 128 bytes) where a block reads at least ROWS_MIN_TOKENS tokens and the rows fit the budget
    beside the other book, the value's first; books per position of pairs or quads keep their layout. Planted: the
    made key's copies counted (32 KiB) leave OScaR-4's keys beside TurboQuant-4's values without rows, as the layout
    without a key group reads below."""
    from kvcalib.formats.codebook.launch import ROWS_MIN_TOKENS, book_layout, made_levels, shared_bytes

    levels2, levels3, levels4 = _kernel_book(1, 16, 2), _kernel_book(1, 64, 2), _kernel_book(1, 256, 2)
    tq4_values = _kernel_book(128, 16, 1)  # TurboQuant-4's values, a book per position: rows of 32 KiB at d 128
    tq2_keys, tq1_values, vec8 = _kernel_book(64, 16, 2), _kernel_book(32, 16, 4), _kernel_book(1, 256, 4)
    long_, short = ROWS_MIN_TOKENS, ROWS_MIN_TOKENS - 1
    assert made_levels(levels2, 128) and made_levels(levels4, 128) and made_levels(levels3, 32)
    assert not made_levels(levels2, 0) and not made_levels(tq2_keys, 128)
    # OScaR-4's keys (made) beside TurboQuant-4's values: no key book, the values in lane rows
    assert book_layout(levels4, tq4_values, 128, split_len=long_, key_group=128) == (1, 1, 0, 1, 1)
    assert shared_bytes(levels4, tq4_values, 4, 128, split_len=long_, key_group=128) == 32 * 1024
    assert book_layout(levels4, tq4_values, 128, split_len=long_) == (32, 1, 0, 0, 0)  # a copied key book: no room
    assert book_layout(levels4, tq4_values, 128, split_len=short, key_group=128) == (1, 1, 0, 0, 1)
    # 3-bit levels, whose book would be copied (32 copies beside VecInfer d4b8's 16): made, not copied
    assert book_layout(levels3, vec8, 128, key_group=32) == (1, 16, 0, 0, 1)
    assert book_layout(levels3, vec8, 128) == (32, 16, 0, 0, 0)
    # TurboQuant-4's keys and values at d 64: both in rows (32 + 16 KiB); at d 128 (64 + 32 KiB) the values only
    tq4_keys64, tq4_values64 = _kernel_book(64, 16, 1), _kernel_book(64, 16, 1)
    assert book_layout(tq4_keys64, tq4_values64, 64, split_len=long_) == (1, 1, 1, 1, 0)
    assert shared_bytes(tq4_keys64, tq4_values64, 4, 64, split_len=long_) == 48 * 1024
    assert book_layout(tq4_values, tq4_values, 128, split_len=long_) == (1, 1, 0, 1, 0)
    # where either rows fit beside the other book but not both, the values' take them (4 gathers a lane to 2 keys')
    assert book_layout(tq4_keys64, tq4_values64, 64, 40 * 1024, split_len=long_) == (1, 1, 0, 1, 0)
    # TurboQuant-2's keys (pairs) and TurboQuant-1's values (quads) per position keep their layout
    assert book_layout(tq2_keys, tq1_values, 128, split_len=long_) == (1, 1, 0, 0, 0)
    assert book_layout(tq2_keys, vec8, 128, split_len=long_) == (1, 16, 0, 0, 0)  # pairs, and VecInfer's copies


@pytest.mark.parametrize("d", [64, 128, 256])
def test_books_per_position_of_single_levels_held_once_give_each_lane_share_banks_of_its_own(d):
    """A book per position held once of at most 8 words a position (TurboQuant-4's single levels: 16 entries of 2
    bytes) is skewed by lane share (`_skew_words`, the kernel's `skew_words`): with its j-th code a gather's lanes read
    position j of every share (a key's head_dim / 4 channels, a value's / 8), and the shares' books of position j
    must lie in banks of their own: a key's four shares one each, a value's first four one each and the eight two
    to a bank (the conflicts a gather meets: benchmarks/codebook_banks.py, 3.85 wavefronts unskewed, 1.00 skewed);
    `shared_bytes` holds the last share's last book. Wider books (pairs, quads) span the banks anyway and take no
    skew. Planted: no skew puts a key's four shares in the same 8 banks from head_dim 128 (positions d / 4 apart, 9
    (d / 4) words: 0 mod 32) and two to a bank at 64 (16 mod 32), which the first assert reads."""
    from kvcalib.formats.codebook.launch import _book_bytes, _skew_words

    book = _kernel_book(d, 16, 1)
    span, stride = 8, 9  # words: a position's 16 entries of 2 bytes, the kernel's KSTRIDE (18 halves)

    def most_a_bank(shares: range, codes: int, skew: int, j: int) -> int:
        banks = collections.Counter()
        for s in shares:
            start = (s * codes + j) * stride + s * skew
            banks.update({w % 32 for w in range(start, start + span)})
        return max(banks.values())

    for key, shares in ((True, 4), (False, 8)):
        codes, skew = d // shares, _skew_words(book, key)
        for j in range(codes):
            assert most_a_bank(range(min(shares, 4)), codes, skew, j) == 1, (key, j)
            assert most_a_bank(range(shares), codes, skew, j) == shares // 4, (key, j)
        last = ((shares - 1) * codes + codes - 1) * stride + (shares - 1) * skew + span
        assert 4 * last <= _book_bytes(book, key=key) < 4 * last + 16 + 4 * stride
    # the kernel's skew_words(held once, span 8, stride 9, CODES) = (8 - 9 CODES) mod 32, CODES = d / 4 keys, d / 8
    # values: the same words here (the bank rule above also holds for other multiples of 8; the kernel's are these)
    assert (_skew_words(book, True), _skew_words(book, False)) == {64: (24, 0), 128: (8, 24), 256: (8, 8)}[d]
    assert _skew_words(_kernel_book(d // 2, 16, 2), True) == 0 and _skew_words(_kernel_book(d // 4, 16, 4), False) == 0
    assert _skew_words(_kernel_book(1, 16, 2), True) == 0  # a book shared by every position
