"""The fused INT2 decode kernel (`int2_decode.cu`, in this folder): what it can read, and its launch.

`supports` is the one statement of the kernel's input limits: the runtime asks it before it lays a
method's flushed blocks out for the kernel, and `fused_decode` refuses what it refuses. The layout
it reads, and the torch reference it is tested against, are `kvcalib.formats.int2.layout`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..waves import MAX_GQA, sm_count, splits
from .layout import TILE, Int2Spec, PackedLayer

KERNEL = str(Path(__file__).with_name("int2_decode.cu"))  # this format's kernel, beside its launch

RESIDUAL_CHUNK = 16  # RT in int2_decode.cu: residual tokens per block
MERGE_WARPS = 4  # MERGE_WARPS in int2_decode.cu: warps per block of `merge`
BLOCKS_PER_SM = 4  # resident decode blocks per SM: the kernel's register budget and the size of one wave
HEAD_DIMS = (64, 128)


def supports(spec: Int2Spec | None, head_dim: int, device: torch.device, gqa: int = 1, opts=None) -> bool:
    """Whether the kernel reads blocks of this spec: 2-bit KIVI-layout codes on CUDA, head_dim 64 or
    128, power-of-two key groups of >= 16 tokens, value groups of >= 16 channels, flushes in whole
    16-token tiles, no float16 sink tokens, at most 8 query heads per KV head; and, given the call's
    `kvcalib.attention.AttentionOptions`, plain softmax attention (no softcap, no sliding window)."""
    if spec is None or device.type != "cuda" or spec.bits != 2 or spec.sink or head_dim not in HEAD_DIMS:
        return False
    if gqa > MAX_GQA or (opts is not None and (opts.softcap or opts.sliding_window)):
        return False
    g, gv = spec.group_size, spec.value_group_size
    return g >= 16 and g & (g - 1) == 0 and gv >= 16 and spec.block % 16 == 0


def split_unit(group: int) -> int:
    """Tokens a split is a whole number of: 128 (TILE) and whole key groups."""
    return TILE * group // math.gcd(TILE, group)


def partition(layer: PackedLayer, device: int) -> tuple[int, int, int]:
    """How `fused_decode` splits `layer` on GPU `device`: (residual blocks, packed splits, tokens per split)."""
    b, hkv = layer.kcodes.shape[:2]
    residual_blocks = max(1, -(-layer.residual // RESIDUAL_CHUNK))
    sms = sm_count(device)
    # The residual blocks are short: they take wave slots up to an eighth of the wave, and any beyond
    # run as packed blocks finish.
    reserved = min(residual_blocks * b * hkv, BLOCKS_PER_SM * sms // 8)
    return residual_blocks, *splits(layer.length, b * hkv, split_unit(layer.group_size), BLOCKS_PER_SM * sms, reserved)


def fused_decode(q: torch.Tensor, layer: PackedLayer, scaling: float,
                 correction: tuple[torch.Tensor, torch.Tensor] | None = None, checked: bool = False,
                 loader: str = "auto", counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The CuPy kernels; q (B, Hq, D) fp16/bf16 on CUDA -> (B, Hq, D) in q's dtype, both in the model's
    basis whatever basis `layer` stores its blocks in (`PackedLayer.rotated_keys`/`rotated_values`: the
    kernel rotates the query and the blocks' partial outputs itself), `correction` as well.

    `loader`: "auto" streams the packed cache with the bulk-copy engine on sm_90 and later, with
    cp.async before; "cp.async" forces the latter (the tests run both on one GPU).
    `counts`: (flushed, residual) int32 (B,) on the device, each sequence's own counts, read by the
    kernel (a static cache: the launch does not change from step to step and can be captured in a
    CUDA graph); `layer.length` and `layer.residual` are then the capacities the launch is sized for.

    The launch is the custom op `torch.ops.kvcalib.int2_decode`, so `torch.compile` traces a step
    through it (it reads its inputs and writes only its fresh output) without a graph break.
    """
    num, den = (c.float().contiguous() for c in correction) if correction is not None else (None, None)
    flushed, residual = counts if counts is not None else (None, None)
    return torch.ops.kvcalib.int2_decode(
        q, layer.kcodes, layer.kscale, layer.kzero, layer.knorm, layer.vcodes, layer.vscale, layer.vzero,
        layer.kres, layer.vres, num, den, flushed, residual, layer.length, layer.residual, layer.group_size,
        layer.value_group_size, layer.rotated_keys, layer.rotated_values, scaling, loader, checked)


@torch.library.custom_op("kvcalib::int2_decode", mutates_args=())
def _int2_decode(q: torch.Tensor, kcodes: torch.Tensor, kscale: torch.Tensor, kzero: torch.Tensor,
                 knorm: torch.Tensor | None, vcodes: torch.Tensor, vscale: torch.Tensor, vzero: torch.Tensor,
                 kres: torch.Tensor, vres: torch.Tensor, num: torch.Tensor | None, den: torch.Tensor | None,
                 flushed: torch.Tensor | None, residual: torch.Tensor | None, length: int, residual_len: int,
                 group_size: int, value_group_size: int, rotated_keys: bool, rotated_values: bool, scaling: float,
                 loader: str, checked: bool) -> torch.Tensor:
    """`fused_decode` with the PackedLayer spelled out as the op's arguments (a custom op takes tensors
    and scalars only); it checks the inputs and launches on torch's current stream."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    layer = PackedLayer(kcodes, kscale, kzero, vcodes, vscale, vzero, kres, vres, length, residual_len, group_size,
                        value_group_size, knorm, rotated_keys, rotated_values)
    counts = (flushed, residual) if flushed is not None else None

    b, hq, d = q.shape
    hkv = layer.kcodes.shape[1]
    spec = Int2Spec(2, layer.group_size, layer.value_group_size, block=max(16, layer.group_size))
    if q.dtype not in (torch.float16, torch.bfloat16) or not supports(spec, d, q.device, hq // hkv):
        raise ValueError("fused decode needs fp16/bf16 queries on CUDA, head_dim 64 or 128, at most 8 query heads per "
                         "KV head, power-of-two key groups and value groups of >= 16 (`supports`)")
    buffers = (layer.kcodes, layer.kscale, layer.kzero, layer.vcodes, layer.vscale, layer.vzero, layer.kres, layer.vres)
    if not all(b.is_contiguous() for b in buffers) or (layer.knorm is not None and not layer.knorm.is_contiguous()):
        raise ValueError("fused decode reads dense buffers: every PackedLayer tensor must be contiguous")
    if any(t.data_ptr() % 16 for t in buffers) or (layer.knorm is not None and layer.knorm.data_ptr() % 16):
        raise ValueError("fused decode copies 16-byte pieces: every PackedLayer tensor must start 16-byte aligned")
    if loader not in ("auto", "cp.async"):
        raise ValueError(f"loader must be 'auto' or 'cp.async', got {loader!r}")
    if layer.length % spec.block or layer.vcodes.shape[2] % 16:
        raise ValueError("fused decode needs whole key groups of >= 16 tokens and capacity in multiples of 16 tokens")
    defines = {"D": d, "G": layer.group_size, "GV": layer.value_group_size, "GQ": hq // hkv,
               "HAS_NORM": int(layer.knorm is not None), "ROT_K": int(rotated_keys), "ROT_V": int(rotated_values),
               "BLOCKS_PER_SM": BLOCKS_PER_SM,
               "CP_ASYNC_LOADER": int(loader == "cp.async"), "SPLIT_UNIT": split_unit(layer.group_size),
               "QT": "__half" if q.dtype == torch.float16 else "__nv_bfloat16"}
    if counts is not None and any(c.dtype != torch.int32 or c.shape != (b,) or not c.is_contiguous() or c.device != q.device
                                  for c in counts):
        raise ValueError(f"counts must be two contiguous int32 tensors of shape ({b},) on {q.device}")
    residual_blocks, num_splits, split_len = partition(layer, q.device.index or 0)
    parts = num_splits + residual_blocks  # the last partials are the residual window's
    part_acc = torch.empty(b, hq, parts, d, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(b, hq, parts, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    q = q.contiguous()
    scale_log2 = cupy.float32(scaling * 1.4426950408889634)  # softmax in base 2
    i32 = cupy.int32
    # Raw device pointers: cupy.asarray on each tensor would cost more than the kernel at short lengths.
    ptr = lambda t: cupy.uint64(t.data_ptr() if t is not None else 0)  # noqa: E731
    with torch_stream(q.device):
        # Block (part, kv head, batch): the first num_splits stream split_len packed tokens each for the
        # GQ heads of their KV head; the others take 16 tokens of the fp16 residual window.
        launch(kernel(KERNEL, defines, "packed_partial"), (parts, hkv, b), (128,),
               (ptr(q), ptr(layer.kcodes), ptr(layer.kscale), ptr(layer.kzero), ptr(layer.knorm),
                ptr(layer.vcodes), ptr(layer.vscale), ptr(layer.vzero), i32(layer.length),
                i32(layer.kcodes.shape[2]), i32(layer.kscale.shape[2]), i32(layer.vcodes.shape[2]),
                i32(split_len), i32(num_splits), ptr(layer.kres), ptr(layer.vres), i32(layer.residual),
                i32(layer.kres.shape[2]), scale_log2, ptr(part_acc), ptr(part_ml),
                ptr(counts[0] if counts else None), ptr(counts[1] if counts else None)), checked)
        # Warp per (batch, query head, 32 channels), MERGE_WARPS per block: merge partials (+ KVLinC terms), normalise.
        warps = b * hq * d // 32
        launch(kernel(KERNEL, defines, "merge"), (-(-warps // MERGE_WARPS),), (32 * MERGE_WARPS,),
               (ptr(part_acc), ptr(part_ml), ptr(num), ptr(den), i32(parts), i32(b * hq), ptr(out)), checked)
    return out


@_int2_decode.register_fake
def _(q: torch.Tensor, *args) -> torch.Tensor:
    b, hq, d = q.shape
    return q.new_empty(b, hq, d)
