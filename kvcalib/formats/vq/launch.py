"""The fused VecInfer decode kernel (`vq_decode.cu`, in this folder): what it can read, and its launch.

The layout it reads and the float64 reference it is tested against are `kvcalib.formats.vq.layout`
(tests/test_vq_kernel_gpu.py). One launch: the last block of each (sequence, KV head) to finish merges its
partials (`_counters`). `lengths` and `residuals` (B,) int32 on the device make a launch that a CUDA graph
can replay while the cache grows: it is then sized by the buffers' capacities, and each sequence's counts
are read on the device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import SettingsError
from ...vq import VQConfig
from ..waves import MAX_GQA, sm_count, splits
from .layout import VQBooks, VQLayer

KERNEL = str(Path(__file__).with_name("vq_decode.cu"))  # this format's kernel, beside its launch

HEAD_DIMS = (64, 128)

SHARED_LIMIT = 200 * 1024  # bytes of dynamic shared memory a block may take here (an H100 allows 227 KiB)
SM_SHARED = 227 * 1024  # shared memory of one SM a kernel's blocks may share (H100)
MIN_STAGES = 2  # a ring of fewer stages cannot overlap copies with compute (more measured no faster)
TILES = 2  # 16-token tiles per warp and stage: the smallest block (`check`'s measure) and the fallbacks
PLAN_TILES = 4  # the plan's (`_plan`)
PLAN_STAGES = 3  # the plan's where they fit (`_plan`)
RT = 16  # float16 rows (sinks, residual) per chunk: one 16-token tile of a block's last warp
REPLICATED_BOOK = 32 * 1024  # a book whose conflict-free copies (128 bytes an entry) fit this is replicated


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def _replicas(book: torch.Tensor) -> int:
    """Copies of a book in shared memory (`centroid` in vq_decode.cu): 128 bytes of copies per entry when
    that fits REPLICATED_BOOK (codes of up to 8 bits), else one."""
    entries, n = book.shape[1], book.shape[2]
    return 128 // (2 * n) if entries * 128 <= REPLICATED_BOOK and n <= 16 else 1


def shared_bytes(layer: VQLayer, gqa: int, stages: int = 2, warps: int = 4, krepl: int = 1, vrepl: int = 1,
                 tiles: int = TILES) -> int:
    """Dynamic shared memory of one block (SHARED_BYTES of vq_decode.cu, the same formula): both codebooks
    (float16, in their copies), then a ring of `stages` stages of code rows (its last stage first holds the
    books to be replicated; then the warps' combine (float32) and the merge's weights reuse it), then q~ and q
    of the block's heads (float32), then a chunk of float16 key and value rows."""
    return _shared_bytes(layer.head_dim, layer.kcodes.shape[-1], layer.vcodes.shape[-1], layer.kbook[0].numel(),
                         layer.vbook[0].numel(), gqa, stages, warps, krepl, vrepl, tiles)


def _shared_bytes(d: int, rk: int, rv: int, kbook: int, vbook: int, gqa: int, stages: int, warps: int, krepl: int,
                  vrepl: int, tiles: int) -> int:
    """`shared_bytes` from the numbers it reads: head_dim, the code rows' bytes, each book's float16 numbers."""
    stage = 16 * warps * tiles
    books = _up16(2 * kbook * krepl) + _up16(2 * vbook * vrepl)
    ring = stages * (_up16(stage * rk) + 16 + _up16(stage * rv) + 16)
    return books + max(ring, 4 * warps * 8 * d) + 8 * gqa * d + 4 * RT * d


def _min_warps(gqa: int, d: int) -> int:
    """The fewest warps a block may have: the merge (`merge_parts`) gives each thread 4 channels of one query
    head, so a block needs gqa * d / 4 threads (4 warps take up to 4 heads of d = 128, 8 take 8)."""
    return 4 if gqa * d // 4 <= 4 * 32 else 8


def _reads_subvectors(d: int, nk: int, nv: int) -> bool:
    """Sub-vectors the kernel gathers: 2, 4 or a multiple of 8 channels, keys' at most d/4 (a lane's share of
    a key), values' at most d/8 (of a value)."""
    return (nk <= d // 4 and nv <= d // 8 and nk % 2 == 0 and nv % 2 == 0 and (nk <= 4 or nk % 8 == 0)
            and (nv <= 4 or nv % 8 == 0))


def plan(layer: VQLayer, gqa: int, tuning: dict[str, int] | None = None) -> dict[str, int]:
    """`_plan` of this layer's shapes, once per shapes (a decode step asks it per layer). `tuning`: launch
    parameters set by hand (WARPS, NSTAGE, TILES, KREPL, VREPL, BLOCKS_PER_SM), a benchmark's A/B of plans."""
    tuning = tuning or {}
    if set(tuning) - TUNABLE:
        raise SettingsError(f"a VecInfer launch plan sets {', '.join(sorted(TUNABLE))}, not {', '.join(sorted(set(tuning) - TUNABLE))}")
    key = (layer.head_dim, layer.kcodes.shape[-1], layer.vcodes.shape[-1], tuple(layer.kbook.shape),
           tuple(layer.vbook.shape), gqa, tuple(sorted(tuning.items())))
    if key not in _PLANS:
        _PLANS[key] = _plan(layer, gqa, tuning)
    return _PLANS[key]


_PLANS: dict[tuple, dict[str, int]] = {}
TUNABLE = {"WARPS", "NSTAGE", "TILES", "KREPL", "VREPL", "BLOCKS_PER_SM"}  # what a hand-set plan may set (`plan`)


def _plan(layer: VQLayer, gqa: int, tuning: dict[str, int]) -> dict[str, int]:
    """The launch's compile-time shape, the fastest of benchmarks/vq_decode_plans.py's (RESULTS.md): one block
    of 8 warps per SM, 4 tiles per warp (the most registers, 148 to 166, and the most independent gathers per
    warp), small books (up to 8-bit codes) in conflict-free copies, a ring of 3 stages where it fits (d4b8: 0.4
    to 2.8 us faster than 2, B = 1 and 8, 32k and 128k; d8b12's books leave room for 2). Against 2 tiles per
    warp in two blocks of 8 warps (d4b8) or one of 16 (d8b12): d4b8 1.3% to 13% faster (B = 1 and 8, 32k and
    128k), d8b12 1.6% and 4.6% at B = 1 and level at B = 8. If a block does not fit SHARED_LIMIT: 2 tiles,
    single copies, then 4 warps where the merge allows it (`_min_warps`; `check` has refused what fits in none)."""
    krepl, vrepl = _replicas(layer.kbook), _replicas(layer.vbook)
    for warps, tiles, kr, vr, stages in [(8, PLAN_TILES, krepl, vrepl, PLAN_STAGES), (8, PLAN_TILES, krepl, vrepl, MIN_STAGES),
                                         (8, TILES, krepl, vrepl, MIN_STAGES), (8, TILES, 1, 1, MIN_STAGES),
                                         (_min_warps(gqa, layer.head_dim), TILES, 1, 1, MIN_STAGES)]:
        p = {"WARPS": warps, "NSTAGE": stages, "KREPL": kr, "VREPL": vr, "TILES": tiles, **tuning}
        smem = shared_bytes(layer, gqa, p["NSTAGE"], p["WARPS"], p["KREPL"], p["VREPL"], p["TILES"])
        if smem <= SHARED_LIMIT:
            break
    p.setdefault("BLOCKS_PER_SM", max(1, min(2, SM_SHARED // (smem + 1024))))
    p["SMEM"] = smem
    return p


def supports(books: VQBooks | None, head_dim: int, device: torch.device, gqa: int = 1, opts=None) -> bool:
    """Whether the runtime may lay a method's flushed blocks out for this kernel: VecInfer codes on CUDA,
    head_dim 64 or 128, sub-vectors the kernel reads (`check`), books that fit a block's shared memory,
    at most 8 query heads per KV head; and, given the call's `kvcalib.attention.AttentionOptions`, plain
    softmax attention (no softcap, no sliding window)."""
    if books is None or device.type != "cuda" or head_dim not in HEAD_DIMS or gqa > MAX_GQA:
        return False
    if opts is not None and (opts.softcap or opts.sliding_window):
        return False
    nk, nv = books.kbook.shape[-1], books.vbook.shape[-1]
    if not _reads_subvectors(head_dim, nk, nv):
        return False
    rk, rv = VQConfig(nk, books.k_bits).row_bytes(head_dim), VQConfig(nv, books.v_bits).row_bytes(head_dim)
    need = _shared_bytes(head_dim, rk, rv, books.kbook[0].numel(), books.vbook[0].numel(), gqa, MIN_STAGES,
                         _min_warps(gqa, head_dim), 1, 1,
                         TILES)  # `check`'s measure: the smallest block
    return need <= SHARED_LIMIT


def check(q: torch.Tensor, layer: VQLayer) -> None:
    """Refuse, in one line naming the limit, what the kernel cannot read."""
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    gqa = max(1, hq // hkv)
    need = shared_bytes(layer, gqa, MIN_STAGES, _min_warps(gqa, d))
    if need > SHARED_LIMIT:
        raise SettingsError(f"VecInfer codebooks of {tuple(layer.kbook.shape[1:])} (keys) and {tuple(layer.vbook.shape[1:])} "
                            f"(values) need {need // 1024} KiB of shared memory per block; the kernel holds up to "
                            f"{SHARED_LIMIT // 1024} KiB: choose fewer bits per code (e.g. d8b12, not d8b16)")
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or d not in (64, 128) or hq % hkv \
            or hq // hkv > MAX_GQA:
        raise SettingsError("the VecInfer kernel takes float16 or bfloat16 queries (B, Hq, D) on CUDA, D 64 or 128, and "
                            f"at most {MAX_GQA} query heads per KV head")
    nk, nv = layer.kbook.shape[-1], layer.vbook.shape[-1]
    rows = lambda n, bits: VQConfig(n, bits).row_bytes(d)  # noqa: E731
    if (layer.kbook.shape[1] != 1 << layer.k_bits or layer.vbook.shape[1] != 1 << layer.v_bits
            or layer.kbook.shape[0] not in (1, hkv) or layer.vbook.shape[0] not in (1, hkv) or d % nk or d % nv
            or (layer.kcodes.shape[2] and layer.kcodes.shape[-1] != rows(nk, layer.k_bits))
            or (layer.vcodes.shape[2] and layer.vcodes.shape[-1] != rows(nv, layer.v_bits))
            or layer.kres.shape[-1] != d or layer.vres.shape[-1] != d
            or (layer.smooth is not None and tuple(layer.smooth.shape) != (hkv, d))):
        raise SettingsError("the VecInfer layout does not match itself: books of 2^bits entries, one or one per KV "
                            "head, sub-vectors dividing D, code rows (if any) of ceil(D / N x bits / 8) bytes, residual and "
                            "smoothing of the query's D (kvcalib/formats/vq/layout.py)")
    if not _reads_subvectors(d, nk, nv):
        raise SettingsError(f"the VecInfer kernel reads sub-vectors of 2, 4 or a multiple of 8 channels, keys' at most "
                            f"d/4 = {d // 4} and values' at most d/8 = {d // 8}; this cache has {nk} (keys), {nv} (values)")


def _unit(codes: torch.Tensor) -> int:
    """Bytes a stage's rows can be copied in: rows of one (batch, KV head) start at multiples of this."""
    stride = codes.shape[2] * codes.shape[3]
    for unit in (16, 4):
        if codes.data_ptr() % unit == 0 and stride % unit == 0:
            return unit
    return 1


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def vq_decode(q: torch.Tensor, layer: VQLayer, scaling: float, checked: bool = False,
              lengths: torch.Tensor | None = None, residuals: torch.Tensor | None = None,
              tuning: dict[str, int] | None = None) -> torch.Tensor:
    """q (B, Hq, D) float16 or bfloat16, in the model's basis -> (B, Hq, D) in q's dtype. With `lengths` and
    `residuals` (B,) int32 on the device, each sequence's flushed and residual counts are read there
    (layer.length and layer.residual are then unused) and the launch is sized by the buffers' capacities.
    Through the custom op `kvcalib::vq_decode`, so that `torch.compile` keeps it whole; the op checks its
    inputs (`check`). `tuning` (a benchmark's A/B of launch plans, `plan`) launches directly instead."""
    if tuning:
        return _launch(q, layer, scaling, checked, lengths, residuals, tuning)
    return _vq_decode(q, layer.kcodes, layer.vcodes, layer.kbook, layer.vbook, layer.smooth, layer.ksink, layer.vsink,
                      layer.kres, layer.vres, lengths, residuals, layer.length, layer.residual, layer.sinks,
                      layer.k_bits, layer.v_bits, layer.hadamard, scaling, checked)


@torch.library.custom_op("kvcalib::vq_decode", mutates_args=())
def _vq_decode(q: torch.Tensor, kcodes: torch.Tensor, vcodes: torch.Tensor, kbook: torch.Tensor, vbook: torch.Tensor,
               smooth: torch.Tensor | None, ksink: torch.Tensor, vsink: torch.Tensor, kres: torch.Tensor,
               vres: torch.Tensor, lengths: torch.Tensor | None, residuals: torch.Tensor | None, length: int,
               residual: int, sinks: int, k_bits: int, v_bits: int, hadamard: bool, scaling: float,
               checked: bool) -> torch.Tensor:
    """`vq_decode` with the VQLayer spelled out as the op's arguments (a custom op takes tensors and scalars
    only)."""
    layer = VQLayer(kcodes, vcodes, kbook, vbook, ksink, vsink, kres, vres, length, residual, sinks, k_bits, v_bits,
                    smooth, hadamard)
    return _launch(q, layer, scaling, checked, lengths, residuals, None)


def _launch(q: torch.Tensor, layer: VQLayer, scaling: float, checked: bool, lengths: torch.Tensor | None,
            residuals: torch.Tensor | None, tuning: dict[str, int] | None) -> torch.Tensor:
    """The checks and the launch, on torch's current stream, with the plan for the layer's shapes (`plan`)."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    check(q, layer)
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    gqa = hq // hkv
    device = lengths is not None
    if (lengths is None) != (residuals is None):
        raise ValueError("counts on the device are both lengths and residuals, or neither")
    if device and any(c is None or c.dtype != torch.int32 or c.shape != (b,) or not c.is_contiguous()
                      or c.device != q.device for c in (lengths, residuals)):
        raise ValueError(f"counts must be two contiguous int32 tensors of shape ({b},) on {q.device}")
    tensors = [_aligned(x) for x in (q, layer.kcodes, layer.vcodes, layer.kbook, layer.vbook, layer.ksink,
                                     layer.vsink, layer.kres, layer.vres)]
    qc, kc, vc, kb, vb, ks, vs, kr, vr = tensors
    smooth = None if layer.smooth is None else layer.smooth.to(device=q.device, dtype=torch.float16).contiguous()
    qt = "__half" if q.dtype == torch.float16 else "__nv_bfloat16"
    p = plan(layer, gqa, tuning)
    smem, per_sm, stage = p["SMEM"], p["BLOCKS_PER_SM"], 16 * p["WARPS"] * p["TILES"]
    if smem > SHARED_LIMIT:  # only a benchmark's `tuning` gets here (`check` refused the rest)
        raise SettingsError(f"this launch plan needs {smem // 1024} KiB of shared memory, over {SHARED_LIMIT // 1024} KiB")
    defines = {"D": d, "NK": kb.shape[-1], "MK": layer.k_bits, "RK": kc.shape[-1], "NV": vb.shape[-1],
               "MV": layer.v_bits, "RV": vc.shape[-1], "GQ": gqa, "QT": qt, "HADAMARD": int(layer.hadamard),
               "KUNIT": _unit(kc), "VUNIT": _unit(vc), **{k: v for k, v in p.items() if k != "SMEM"}}
    capt = kc.shape[2]
    length = capt if device else layer.length
    extra_rows = ks.shape[2] + kr.shape[2] if device else layer.sinks + layer.residual
    # One wave of blocks over the flushed tokens, splits of whole stages; every part also takes an equal share
    # of the float16 rows (blocks of their own for them queued behind the wave, and the blocks that took one
    # chunk of RT rows each finished last). Without flushed tokens, parts of RT rows.
    num_splits, split_len = splits(length, b * hkv, stage, per_sm * sm_count(q.device.index or 0))
    parts = num_splits or max(1, -(-extra_rows // RT))
    rows_per_part = -(-extra_rows // parts)
    part_acc = torch.empty(b, hq, parts, d, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(b, hq, parts, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    counters = _counters(q.device, b * hkv)
    ptr = lambda t: cupy.uint64(t.data_ptr() if t is not None and t.numel() else 0)  # noqa: E731
    i32 = cupy.int32
    with torch_stream(q.device):  # the device's own function: its shared-memory limit is set per device
        partial = kernel(KERNEL, defines, "vq_partial")
        partial.max_dynamic_shared_size_bytes = smem
        launch(partial, (parts, hkv, b), (32 * p["WARPS"],),
               (ptr(qc), ptr(kc), ptr(vc), ptr(kb), ptr(vb), i32(kb.shape[0]), i32(vb.shape[0]), ptr(smooth), ptr(ks),
                ptr(vs), i32(layer.sinks), i32(ks.shape[2]), ptr(kr), ptr(vr),
                i32(layer.residual), i32(kr.shape[2]), i32(layer.length), i32(capt), i32(split_len), i32(num_splits),
                cupy.float32(scaling * 1.4426950408889634), ptr(part_acc), ptr(part_ml), ptr(lengths),
                ptr(residuals), i32(rows_per_part), ptr(counters), ptr(out)), checked, smem)
    return out


COUNTERS_MIN = 4096  # counters allocated at least (B x KV heads): 16 KiB
_COUNTERS: dict[tuple[int, int], list[torch.Tensor]] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The kernel's arrival counters, one per (sequence, KV head): zero before a launch, and the launch leaves
    them zero (the last block of a row wraps its counter). One buffer per (device, stream): launches on one
    stream never overlap, and a CUDA graph keeps the buffer of the stream it was captured on. Limit: two graphs
    captured on one stream and replayed at the same time on two streams would share counters. A buffer too
    small is replaced, never freed (a captured graph may hold it)."""
    key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream)
    held = _COUNTERS.setdefault(key, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, COUNTERS_MIN), device=device, dtype=torch.int32))
    return held[-1]


@_vq_decode.register_fake
def _(q: torch.Tensor, *args) -> torch.Tensor:
    b, hq, d = q.shape
    return q.new_empty(b, hq, d)
