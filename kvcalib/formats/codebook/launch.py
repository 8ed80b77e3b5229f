"""The fused codebook decode kernel (`codebook_decode.cu`, in this folder): what it can read, and its launch.

`supports` is the one statement of the kernel's input limits; the layout it reads and the float64 reference it is
tested against are `kvcalib.formats.codebook.layout`. A layer of several groups of heads (a plan's) is one launch a
group, each writing its own query heads of the output; the groups' launches run side by side on streams of their own
(captured into a CUDA graph as parallel branches), each splitting its tokens over its heads' share of one wave, so
that together they fill the GPU as one launch over every head would. (One after another, each would fill the wave
alone only with splits so short that copying the books into shared memory outweighs reading the codes.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...streams import side_by_side
from ..waves import MAX_GQA, sm_count, splits
from .layout import CodebookLayer, CodebookSpec, CodedPart

KERNEL = str(Path(__file__).with_name("codebook_decode.cu"))  # this format's kernel, beside its launch

HEAD_DIMS = (64, 128, 256)
CH = 8  # channels a lane takes of each float16 row (the kernel's CH): D / 8 lanes a row
WARPS = 4  # warps of a `partial` block
ROWS = 64  # float16 rows (sinks, residual) a rows part takes
SLICES = 4  # slices of head_dim threads of a `rotate` and a `merge` block (each slice's loads in flight at once)
SPLIT_UNIT = 16 * WARPS  # packed tokens a split is a whole number of: a tile for each warp
SHARED_LIMIT = 200 * 1024
# Scalar codes with a book per position are read four at a time (one code of four times the bits, its centroid the
# four of theirs: one 8-byte shared-memory load) where that book stays small (`QUAD_BOOK_BYTES`: 1-bit codes, as
# TurboQuant-1's), else in pairs (one load a half2) where the pairs' book stays small: books per position up to 3 bits
# (2^6 half2 a position), a shared book up to 4 bits (2^8 half2). A tuple's code is the bit stream's next codes, the
# first least significant, so the codes' words are read as they are. Measured (benchmarks/codebook_pairs.py, B=8 at
# 32k): fours made TurboQuant-1's values 2-6% faster, but a shared book's 2-bit levels (KIVI's and OScaR's keys) 5-9%
# slower than pairs: every lane reads the one 2 KiB book, and its 8-byte loads meet more bank conflicts.
QUAD_BOOK_BYTES = 8 * 1024
PAIR_BITS = {"per position": 3, "shared": 4}


@dataclass(frozen=True)
class KernelBook:
    """A part's codebook as the kernel reads it: fp16 (G, P, 2^bits, dim), codes of `bits` (k scalar codes read as
    one code of k times the bits, its centroid the k of theirs)."""

    book: torch.Tensor
    bits: int
    dim: int


def codes_read_together(bits: int, positions: int, shared: bool) -> int:
    """How many scalar codes of `bits` the kernel reads as one (`kernel_book`): 4, 2 or 1, for a book of `positions`
    coordinates each with a book of its own, or one book `shared` by them."""
    if not shared and positions % 4 == 0 and positions // 4 * (1 << 4 * bits) * 4 * 2 <= QUAD_BOOK_BYTES:
        return 4
    return 2 if bits <= PAIR_BITS["shared" if shared else "per position"] else 1


def kernel_book(part: CodedPart) -> KernelBook:
    """The part's `KernelBook`, made once per part (kept on it)."""
    held = part.__dict__.get("_kernel_book")
    if held is None:
        book, bits, dim = part.book, part.bits, part.dim
        shared = book.shape[1] == 1
        k = codes_read_together(bits, book.shape[1], shared) if dim == 1 else 1
        if k > 1:
            # code c_0 + 2^bits c_1 + ... of positions k i .. k i + k - 1
            #   -> (book[k i][c_0], .., book[k i + k - 1][c_k-1])
            n = 1 << bits
            e = torch.arange(n**k, device=book.device)
            column = lambda j: book[:, :, :, 0] if shared else book[:, j::k, :, 0]  # noqa: E731
            book = torch.stack([column(j)[:, :, e // n**j % n] for j in range(k)], -1)
            bits, dim = k * bits, k
        held = KernelBook(book.half().contiguous(), bits, dim)
        object.__setattr__(part, "_kernel_book", held)
    return held


def blocks_per_sm(gqa: int, head_dim: int) -> int:
    """Resident `partial` blocks per SM (the kernel's PARTIAL_BLOCKS, its register budget) and so the size of one
    wave, which the splits fill once: 4 up to 4 query heads of head_dim up to 128 (at most 128 registers a thread),
    2 beyond, where a lane holds more of the query and of the accumulators. At 4 blocks head_dim 256 spilled
    740 to 964 bytes a thread (its query fragments and output accumulators alone take 128 registers: Gemma 3's
    full layers decoded at 14x their read floor), 8 query heads of head_dim 64 388 bytes (the float16 rows'
    query and accumulators); at 2, none (tests/test_codebook_layout.py compiles them)."""
    return 4 if head_dim <= 128 and gqa <= 4 and gqa * head_dim <= 512 else 2


def _reads(part: KernelBook, head_dim: int) -> bool:
    """A lane's share of a key (head_dim / 4 channels) and of a value (head_dim / 8) is whole codes of 1, 2, 4 or 8
    coordinates (a centroid one load of at most 16 bytes: `gather`); books tile the head."""
    p, e, dim = part.book.shape[1:]
    return (part.dim in (1, 2, 4, 8) and head_dim // 8 % part.dim == 0 and e == 1 << part.bits and dim == part.dim
            and p in (1, head_dim // dim) and part.bits <= 16)


def _affine_reads(key: CodedPart, value: CodedPart, head_dim: int) -> bool:
    """Affine keys per channel over groups of tokens that whole 16-token tiles fill; affine values per token over
    groups of channels that hold whole lane shares (head_dim / 8 channels) and tile the head; nothing else."""
    return (not key.channel_group and not value.token_group and not (value.channel_group and value.norm)
            and (not key.token_group or key.token_group % 16 == 0)
            and (not value.channel_group or (value.channel_group % (head_dim // 8) == 0
                                             and head_dim % value.channel_group == 0)))


# A book shared by every position, of entries of 4, 8 or 16 bytes, may be held in 128 / entry bytes copies, entry e's
# side by side in the 128 bytes at 128 e, lane L reading copy L % copies (the kernel's XREPL, as `vq_decode.cu` holds
# its books): its gathers then meet no bank conflict, where 32 lanes' random codes otherwise do (Nsight Compute,
# turboquant-2 + vecinfer-d4b6 at B=8: 2.0 wavefronts a key's gather and 4.9 a value's, against 1 and 2). The copies
# cost 128 bytes an entry; a block's books stay within `COPIED_BOOKS_BYTES`, so that PARTIAL_BLOCKS blocks still fit
# an SM (4 x (52 + 1 reserved) KiB of the H100's and H200's 228: TurboQuant-3's keys, 16.3 KiB, beside VecInfer d4b8's
# copies, 32), or less where an SM holds less (`copies_budget`), the value book's copies first (a tile gathers 4
# values a lane to 2 keys).
COPIED_ENTRY_BYTES = 128
COPIED_BOOKS_BYTES = 52 * 1024
RESERVED_BYTES = 1024  # shared memory the hardware keeps for each resident block


def _copies(part: KernelBook) -> int:
    """The copies of each entry a copied book holds: 128 / entry bytes for a shared book of 4- to 16-byte entries, else
    1 (a book per position, or 2-byte entries: two lanes would share a bank)."""
    p, e, dim = part.book.shape[1:]
    return COPIED_ENTRY_BYTES // (2 * dim) if p == 1 and dim in (2, 4, 8) else 1


@functools.lru_cache(maxsize=None)
def copies_budget(device_index: int, blocks: int, query: int = 0) -> int:
    """The shared memory a `partial` block's books may take where they are copied, on this device with `blocks`
    resident blocks an SM, each also holding `query` bytes of q~ (`query_bytes`): `COPIED_BOOKS_BYTES`, or less where
    an SM holds less (an A100's 164 KiB: 40 KiB); the former where no CUDA device answers (`supports` asked of a CUDA
    layout on a machine without one)."""
    if not torch.cuda.is_available():
        return COPIED_BOOKS_BYTES
    props = torch.cuda.get_device_properties(device_index)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    return min(COPIED_BOOKS_BYTES, per_sm // blocks - RESERVED_BYTES - query)


def query_bytes(rotated: bool, gqa: int, head_dim: int) -> int:
    """Shared memory a `partial` block takes for q~ beside its books: none where the keys have a basis (`rotate`
    writes q~), else its query heads' q times the scale in float32 (the kernel's KROT 0)."""
    return 0 if rotated else 4 * gqa * head_dim


def _shares(key: bool) -> int:
    """The lane shares a key's row (4, of head_dim / 4 channels each) or a value's (8, of head_dim / 8) is split into:
    the kernel's D / KCH and D / VCH."""
    return 4 if key else 8


def _skew_words(part: KernelBook, key: bool) -> int:
    """Words each lane share's positions of a book per position held once start after the last share's (the kernel's
    `skew_words`: books of at most 8 words a position, so that a gather's shares read banks of their own)."""
    p, e, dim = part.book.shape[1:]
    span, stride = e * dim // 2, (e * dim + max(2, dim)) // 2
    if p == 1 or span > 8:
        return 0
    codes = p // _shares(key)  # a share's positions
    return (span - stride * codes) % 32


def _book_bytes(part: KernelBook, copies: int = 1, key: bool = True) -> int:
    """A book's bytes in a `partial` block as the kernel holds it: copied, or held once (positions `KSTRIDE` apart,
    each lane share's skewed: `_skew_words`), rounded up to 8 halves as the kernel places what follows."""
    p, e, dim = part.book.shape[1:]
    if copies > 1:
        return e * COPIED_ENTRY_BYTES
    pad = max(2, dim) if p > 1 else 0
    skew = 2 * _skew_words(part, key) * (_shares(key) - 1)
    return 2 * (-(-(p * (e * dim + pad) + skew) // 8) * 8)


def book_copies(key: KernelBook, value: KernelBook, budget: int = COPIED_BOOKS_BYTES) -> tuple[int, int]:
    """(key copies, value copies) of each book entry a `partial` block holds (the kernel's KREPL, VREPL; 1: the book
    as it is): both books copied where both fit `budget` bytes (`copies_budget`), else the value book, else the key
    book, else neither."""
    kc, vc = _copies(key), _copies(value)
    for k, v in ((kc, vc), (1, vc), (kc, 1)):
        if max(k, v) > 1 and _book_bytes(key, k) + _book_bytes(value, v, key=False) <= budget:
            return k, v
    return 1, 1


# A book per position of single levels (2-byte entries) may be held in lane rows (the kernel's XROWS): row (j, e) of
# 128 bytes holds entry e of the position each lane reads with its j-th code, in a 4-byte slot a lane, so that its
# gathers meet no bank conflict (benchmarks/codebook_banks.py: TurboQuant-4's 2-byte gathers 3.4 wavefronts where 1
# would do). The rows cost (codes a lane's share) x entries x 128 bytes (32 KiB for TurboQuant-4's values at head_dim
# 128), copied by every block: only where a block reads at least `ROWS_MIN_TOKENS` tokens (a batch's long splits, not
# B=1's of some 500 tokens at 32k). With counts on the device (a captured step) the split judged is the capacity's.
# Measured over the mapped plans' layers at B=8, 32k (benchmarks/kernel_variants.py): TurboQuant-4's values in rows
# took 16 to 22 µs off each of plan-3's five layers holding them (-2.2% of its attention); books of pairs and quads
# held so gained nothing as values and lost 5 to 6 µs a layer as keys, so they keep their layout.
ROWS_MIN_TOKENS = 2048


def _rows_bytes(part: KernelBook, head_dim: int, key: bool) -> int:
    """The bytes of a book per position of single levels held in lane rows; 0 for any other book (its layout:
    `book_copies`)."""
    p, e, dim = part.book.shape[1:]
    if p == 1 or dim != 1:
        return 0
    return head_dim // _shares(key) * e * COPIED_ENTRY_BYTES


def made_levels(key: KernelBook, key_group: int) -> bool:
    """Whether the kernel takes an affine key's pairs of levels from their bits (its KLEVELS), not reading them from a
    book, which the block then does not hold: keys in groups of `key_group` tokens (KIVI's, OScaR's) read in pairs,
    of any width (a byte permute and an AND a pair, the levels fp16 subnormals: the kernel's `levels`), in place of a
    gather's code mask, address and shared-memory load, copied book or not."""
    return key_group > 0 and key.dim == 2 and key.book.shape[1] == 1


def book_layout(key: KernelBook, value: KernelBook, head_dim: int, budget: int = COPIED_BOOKS_BYTES,
                split_len: int = 0, key_group: int = 0) -> tuple[int, int, int, int, int]:
    """(key copies, value copies, key rows, value rows, levels made) of the books a `partial` block holds (the
    kernel's KREPL, VREPL, KROWS, VROWS, KLEVELS): shared books copied as `book_copies` says, an affine key's book
    not held where its levels are made (`made_levels`, keys in groups of `key_group` tokens); where the block reads
    `split_len` >= ROWS_MIN_TOKENS tokens, a book per position of single levels in lane rows where the rows fit `budget`
    (`copies_budget`: q~'s bytes already left out) beside the other book, the value book's first (a tile gathers 4
    values a lane to 2 keys)."""
    kc, vc = book_copies(key, value, budget)
    levels = int(made_levels(key, key_group))
    kc = 1 if levels else kc
    kbytes, vbytes = 0 if levels else _book_bytes(key, kc), _book_bytes(value, vc, key=False)
    krows = vrows = 0
    if split_len >= ROWS_MIN_TOKENS:
        rows = _rows_bytes(value, head_dim, False)
        if rows and kbytes + rows <= budget:
            vrows, vbytes = 1, rows
        rows = _rows_bytes(key, head_dim, True)
        if rows and rows + vbytes <= budget:
            krows = 1
    return kc, vc, krows, vrows, levels


def shared_bytes(key: KernelBook, value: KernelBook, gqa: int, head_dim: int, budget: int = COPIED_BOOKS_BYTES,
                 query: int = 0, split_len: int = 0, key_group: int = 0) -> int:
    """Dynamic shared memory of a `partial` block: both books (as `book_layout` holds them within `budget` for blocks
    of `split_len` tokens, keys in groups of `key_group`) and `query` bytes of q~ (`query_bytes`), later the warps'
    states."""
    layout = book_layout(key, value, head_dim, budget, split_len, key_group)
    return _block_bytes(key, value, layout, gqa, head_dim, query)


def _block_bytes(key: KernelBook, value: KernelBook, layout: tuple[int, int, int, int, int], gqa: int, head_dim: int,
                 query: int = 0) -> int:
    """`shared_bytes` of books held in this `book_layout`, q~ after them."""
    krepl, vrepl, krows, vrows, levels = layout
    kbytes = 0 if levels else _rows_bytes(key, head_dim, True) if krows else _book_bytes(key, krepl)
    vbytes = _rows_bytes(value, head_dim, False) if vrows else _book_bytes(value, vrepl, key=False)
    return max(kbytes + vbytes + query, 4 * WARPS * gqa * (head_dim + 2))


def supports(specs: list[CodebookSpec] | None, head_dim: int, device: torch.device, gqa: int = 1, opts=None) -> bool:
    """Whether the kernel reads blocks of these specs (a layer's groups of heads): on CUDA, head_dim 64, 128 or 256,
    at most 8 query heads per KV head, codes whose lane shares are whole (scalar codes, vector codes of up to
    head_dim / 8 coordinates), affine groups as `_affine_reads` says, books that fit shared memory; and, given the
    call's `kvcalib.attention.AttentionOptions`, softmax over every token, its scores soft-capped or not (Gemma 2),
    no sliding window."""
    if not specs or device.type != "cuda" or head_dim not in HEAD_DIMS or gqa > MAX_GQA:
        return False
    if opts is not None and opts.sliding_window:
        return False
    for spec in specs:
        key, value = kernel_book(spec.key), kernel_book(spec.value)
        query = query_bytes(spec.key.basis is not None, gqa, head_dim)
        budget = copies_budget(device.index or 0, blocks_per_sm(gqa, head_dim), query)
        if not (_reads(key, head_dim) and _reads(value, head_dim) and _affine_reads(spec.key, spec.value, head_dim)
                and shared_bytes(key, value, gqa, head_dim, budget, query) <= SHARED_LIMIT):
            return False
    return True


LOG2E = 1.4426950408889634  # the kernel's scores are in log2 units


def softcap_define(softcap: float) -> str:
    """The kernel's SOFTCAP_LOG2 for a cap on the scores: the cap in log2 units, as a float literal."""
    if not softcap > 0:
        raise ValueError(f"a soft cap is a positive number, got {softcap}")
    return f"{softcap * LOG2E!r}f"


GROUP_TENSORS = ("kcodes", "knorm", "kscale", "kzero", "vcodes", "vnorm", "vscale", "vzero", "kbook", "vbook", "kbasis",
                 "vbasis", "head_map")  # a group's tensors, in the layer op's list
GROUP_INTS = ("kbits", "kdim", "knormed", "ktokens", "vbits", "vdim", "vnormed", "vchannels")  # and its numbers


def codebook_decode(q: torch.Tensor, layer: CodebookLayer, scaling: float,
                    counts: tuple[torch.Tensor, torch.Tensor] | None = None, checked: bool = False,
                    softcap: float | None = None) -> torch.Tensor:
    """q (B, Hq, D) fp16/bf16 on CUDA, in the model's basis -> (B, Hq, D) in q's dtype: attention over `layer`, one
    launch a group of heads (each writes its own query heads), the groups side by side (module docstring).
    `softcap`: the scores capped as c tanh(s / c) before the softmax (Gemma 2's `attn_logit_softcapping`).

    `counts`: (flushed, residual) int32 (B,) on the device, each sequence's own (a static cache: the launch is the
    same at every step and can be captured); `layer.length` and `layer.residual` are then capacities."""
    out = torch.empty_like(q)
    flushed, residual = counts if counts is not None else (None, None)
    tensors, ints = [], []
    for rows in layer.groups:
        spec = rows.spec
        key, value = kernel_book(spec.key), kernel_book(spec.value)
        tensors += [rows.kcodes, rows.knorm, rows.kscale, rows.kzero, rows.vcodes, rows.vnorm, rows.vscale, rows.vzero,
                    key.book, value.book, spec.key.basis, spec.value.basis, rows.head_map]
        ints += [key.bits, key.dim, int(spec.key.norm), spec.key.token_group, value.bits, value.dim,
                 int(spec.value.norm), spec.value.channel_group]
    torch.ops.kvcalib.codebook_decode(q, out, tensors, ints, layer.ksink, layer.vsink, layer.kres, layer.vres, flushed,
                                      residual, layer.length, layer.residual, layer.sinks, scaling, checked,
                                      float(softcap or 0.0))
    return out


_CONFIGURED: dict[int, tuple] = {}  # id of a `partial` function -> (the function, kept alive, its shared memory)


def _configure(partial, smem: int) -> None:
    """Once per compiled `partial`: the dynamic shared memory it takes, and the SM's largest shared-memory carveout.
    A layer's groups of heads run side by side, and an SM configured for one kernel's carveout holds another's blocks
    only where that carveout fits them: left to the driver, groups whose books differ in size (copied or not) took
    SMs of different configurations and ran in turn, not together (a mapped plan's layer at B=8: 237 us, against
    159 us with every group at the largest carveout and 180 us before the copies; benchmarks/codebook_pairs.py)."""
    held = _CONFIGURED.get(id(partial))
    if held is None or held[0] is not partial or held[1] != smem:
        if smem > 48 * 1024:
            partial.max_dynamic_shared_size_bytes = smem
        partial.preferred_shared_memory_carveout = 100
        _CONFIGURED[id(partial)] = (partial, smem)


@torch.library.custom_op("kvcalib::codebook_decode", mutates_args=("out",))
def _codebook_decode(q: torch.Tensor, out: torch.Tensor, tensors: list[torch.Tensor | None], ints: list[int],
                     ksink: torch.Tensor, vsink: torch.Tensor, kres: torch.Tensor, vres: torch.Tensor,
                     flushed: torch.Tensor | None, residual: torch.Tensor | None, length: int, residual_len: int,
                     sinks: int, scaling: float, checked: bool, softcap: float = 0.0) -> None:
    """`codebook_decode` with the layout spelled out as the op's arguments (a custom op takes tensors, lists of them
    and numbers only: per group `GROUP_TENSORS` and `GROUP_INTS`, in order): one group launched on torch's current
    stream, several each on a side stream of its own, joined back."""
    n, heads = len(GROUP_TENSORS), kres.shape[1]
    groups = [(tensors[i * n : (i + 1) * n], ints[i * len(GROUP_INTS) : (i + 1) * len(GROUP_INTS)])
              for i in range(len(tensors) // n)]
    if len(ints) != len(GROUP_INTS) * len(groups) or not groups:
        raise ValueError("codebook decode takes, per group of heads, its tensors and its numbers")

    def one(group) -> None:
        t, x = group
        _launch_group(q, out, *t[:12], ksink, vsink, kres, vres, t[12], flushed, residual, length, residual_len, sinks,
                      x[0], x[1], bool(x[2]), x[3], x[4], x[5], bool(x[6]), x[7], t[0].shape[1] / heads, scaling,
                      checked, softcap)

    side_by_side(q.device, [lambda g=g: one(g) for g in groups])  # q ready before, out whole after


@_codebook_decode.register_fake
def _(q: torch.Tensor, out: torch.Tensor, *args) -> None:
    return None


def _launch_group(q: torch.Tensor, out: torch.Tensor, kcodes: torch.Tensor, knorm: torch.Tensor | None,
                  kscale: torch.Tensor | None, kzero: torch.Tensor | None, vcodes: torch.Tensor,
                  vnorm: torch.Tensor | None, vscale: torch.Tensor | None, vzero: torch.Tensor | None,
                  kbook: torch.Tensor, vbook: torch.Tensor, kbasis: torch.Tensor | None, vbasis: torch.Tensor | None,
                  ksink: torch.Tensor, vsink: torch.Tensor, kres: torch.Tensor, vres: torch.Tensor,
                  head_map: torch.Tensor | None, flushed: torch.Tensor | None, residual: torch.Tensor | None,
                  length: int, residual_len: int, sinks: int, kbits: int, kdim: int, knormed: bool,
                  ktokens: int, vbits: int, vdim: int, vnormed: bool, vchannels: int, share: float, scaling: float,
                  checked: bool, softcap: float = 0.0) -> None:
    """One group of heads: it checks the inputs and launches on torch's current stream. `share`: the fraction of one
    wave its splits fill (its heads' share of the layer's); `softcap`: 0 for none."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    b, hq, d = q.shape
    hr, h = kres.shape[1], kcodes.shape[1]  # the layer's KV heads (rows), the group's (codes)
    if (head_map is None and h != hr) or (head_map is not None and head_map.shape != (h,)) or hq % hr:
        raise ValueError(f"the query's {hq} heads are not a whole number per KV head ({hr}), or the group's {h} "
                         "heads are not named by its head map")
    gqa = hq // hr
    key, value = KernelBook(kbook, kbits, kdim), KernelBook(vbook, vbits, vdim)
    query = query_bytes(kbasis is not None, gqa, d)
    budget = copies_budget(q.device.index or 0, blocks_per_sm(gqa, d), query)
    if (q.dtype not in (torch.float16, torch.bfloat16) or out.dtype != q.dtype or not q.is_cuda or d not in HEAD_DIMS
            or gqa > MAX_GQA or not (_reads(key, d) and _reads(value, d))
            or (ktokens and (ktokens % 16 or kscale is None or kzero is None))
            or (vchannels and (vchannels % (d // 8) or d % vchannels or vscale is None or vzero is None))
            # the books as copied, without lane rows or made levels (the launch takes those below within the budget)
            or _block_bytes(key, value, book_layout(key, value, d, budget), gqa, d, query) > SHARED_LIMIT):
        raise ValueError("codebook decode needs fp16/bf16 queries on CUDA, head_dim 64, 128 or 256, at most 8 query "
                         "heads per KV head, and codes the kernel reads (`supports`)")
    tensors = [q, kcodes, vcodes, kbook, vbook, ksink, vsink, kres, vres] + [
        t for t in (knorm, vnorm, kbasis, vbasis, head_map, kscale, kzero, vscale, vzero) if t is not None]
    if not all(t.is_contiguous() and t.device == q.device for t in tensors):
        raise ValueError("codebook decode reads dense buffers on the query's device")
    capt = kcodes.shape[2]  # the kernel's row stride of every per-token buffer
    per_token = [t for t in (vcodes, knorm, vnorm, vscale, vzero) if t is not None]
    if any(t.shape[2] != capt for t in per_token) or (ktokens and min(kscale.shape[2], kzero.shape[2]) * ktokens < capt):
        raise ValueError("the group's buffers must hold its codes' capacity of tokens (key scales: of key groups)")
    if capt * max(kcodes.shape[-1], vcodes.shape[-1], d) >= 1 << 32:  # `share_words`: a row's index in 32 bits
        raise ValueError(f"codebook decode indexes a head's rows in 32 bits: {capt} tokens are too many")
    if any(t.dtype != torch.float16 for t in (knorm, vnorm, kscale, kzero, vscale, vzero) if t is not None):
        raise ValueError("norms, scales and zeros are float16")
    if kbook.dtype != torch.float16 or vbook.dtype != torch.float16 or any(
            t is not None and t.dtype != torch.float32 for t in (kbasis, vbasis)):
        raise ValueError("the kernel's books are float16 (`kernel_book`), the bases float32")
    device = flushed is not None
    if (flushed is None) != (residual is None) or (device and any(
            c.dtype != torch.int32 or c.shape != (b,) or not c.is_contiguous() or c.device != q.device
            for c in (flushed, residual))):
        raise ValueError(f"counts must be two contiguous int32 tensors of shape ({b},) on {q.device}")
    length = capt if device else length
    rows = ksink.shape[2] + kres.shape[2] if device else min(sinks, length) + residual_len
    row_parts = -(-rows // ROWS)
    wave = max(1, round(share * blocks_per_sm(gqa, d) * sm_count(q.device.index or 0)))
    num_splits, split_len = splits(length, b * h, SPLIT_UNIT, wave, min(row_parts * b * h, wave // 8))
    # With counts on the device the kernel spreads the batch's tokens over the wave (`balanced_split`): a batch's
    # grid holds twice the splits a row of the capacity takes, so that a padded batch's long rows take more of them.
    spread = 2 if device and b > 1 else 1
    num_splits *= spread
    parts = max(1, num_splits + row_parts)
    # lane rows where this launch's splits are long (the check above held the books without them: within budget too)
    layout = book_layout(key, value, d, budget, split_len, ktokens)
    smem = _block_bytes(key, value, layout, gqa, d, query)
    krepl, vrepl, krows, vrows, levels = layout
    defines = {"D": d, "GQ": gqa, "QT": "__half" if q.dtype == torch.float16 else "__nv_bfloat16", "CH": CH,
               "WARPS": WARPS, "ROWS": ROWS, "SLICES": SLICES, "PARTIAL_BLOCKS": blocks_per_sm(gqa, d), "KB": kbits,
               "KDIM": kdim,
               "KPOS": int(kbook.shape[1] > 1), "KNORM": int(knormed), "KW": kcodes.shape[-1], "KTG": ktokens,
               "VB": vbits, "VDIM": vdim, "VPOS": int(vbook.shape[1] > 1), "VNORM": int(vnormed),
               "VW": vcodes.shape[-1], "VCG": vchannels, "SPREAD": spread, "KREPL": krepl, "VREPL": vrepl,
               "KROT": int(kbasis is not None), "KROWS": krows, "VROWS": vrows, "KLEVELS": levels}
    if softcap:  # only where asked: every other launch keeps its compiled kernel
        defines["SOFTCAP_LOG2"] = softcap_define(softcap)
    qrot = torch.empty(b, h * gqa, d, device=q.device, dtype=torch.float32) if kbasis is not None else None
    part_acc = torch.empty(b, h * gqa, parts, d, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(b, h * gqa, parts, 2, device=q.device, dtype=torch.float32)
    scale_log2 = cupy.float32(scaling * LOG2E)  # softmax in base 2
    i32 = cupy.int32
    ptr = lambda t: cupy.uint64(t.data_ptr() if t is not None and t.numel() else 0)  # noqa: E731
    heads = lambda t: i32(0 if t is None else t.shape[0])  # noqa: E731
    with torch_stream(q.device):
        if kbasis is not None:  # block (query head, batch row): q~ = scale log2(e) q B_K^T; else `partial` scales q
            launch(kernel(KERNEL, defines, "rotate"), (h * gqa, b), (d * SLICES,),
                   (ptr(q), ptr(kbasis), heads(kbasis), ptr(head_map), i32(hq), scale_log2, ptr(qrot)), checked)
        # Block (part, KV head, batch row): split_len packed tokens (parts < num_splits) or ROWS float16 rows.
        partial = kernel(KERNEL, defines, "partial")
        _configure(partial, smem)
        launch(partial, (parts, h, b), (32 * WARPS,),
               (ptr(qrot), ptr(q), i32(hq), ptr(head_map), i32(hr), ptr(kcodes), ptr(knorm), ptr(kscale),
                ptr(kzero), i32(0 if kscale is None else kscale.shape[2]), ptr(vcodes), ptr(vnorm), ptr(vscale),
                ptr(vzero), i32(capt), ptr(kbook), heads(kbook), ptr(vbook), heads(vbook), ptr(ksink), ptr(vsink), i32(sinks),
                i32(ksink.shape[2]), ptr(kres), ptr(vres), i32(residual_len), i32(kres.shape[2]), i32(length),
                i32(split_len), i32(num_splits), scale_log2, ptr(flushed), ptr(residual), ptr(part_acc),
                ptr(part_ml)), checked, smem)
        # Block (query head, batch row): the parts merged, the coded values taken back by B_V, written to out.
        launch(kernel(KERNEL, defines, "merge"), (h * gqa, b), (d * SLICES,),
               (ptr(part_acc), ptr(part_ml), i32(parts), i32(num_splits), ptr(vbasis), heads(vbasis),
                ptr(head_map), i32(hq), ptr(out)), checked)
