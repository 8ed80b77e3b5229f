"""The fused VecInfer decode kernel (kernels_cupy/vq_decode.cu, issue 18): what it can read, and its launch.

First version, correct before fast (the .cu file says what it does not do yet); not wired into the
runtime caches. The layout it reads and the float64 reference it is tested against are `kvcalib.vq_layout`
(tests/test_vq_kernel_gpu.py). The partials are combined by the INT2 kernel's `merge`.
"""

from __future__ import annotations

import torch

from ..errors import SettingsError
from ..vq_layout import VQLayer
from .int2_kernel import BLOCKS_PER_SM, MAX_GQA, MERGE_WARPS, _sm_count

SHARED_LIMIT = 200 * 1024  # bytes of dynamic shared memory a block may take here (an H100 allows 227 KiB)
NT, NW = 128, 4  # threads and warps per block of `vq_partial`


def shared_bytes(layer: VQLayer, gqa: int) -> int:
    """Dynamic shared memory of one block: both codebooks (float16) and the warps' partials (float32)."""
    books = 2 * (layer.kbook[0].numel() + layer.vbook[0].numel())
    return books + 4 * NW * gqa * (2 + layer.head_dim)


def check(q: torch.Tensor, layer: VQLayer) -> None:
    """Refuse, in one line naming the limit, what the kernel cannot read."""
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    need = shared_bytes(layer, max(1, hq // hkv))
    if need > SHARED_LIMIT:
        raise SettingsError(f"VecInfer codebooks of {tuple(layer.kbook.shape[1:])} (keys) and {tuple(layer.vbook.shape[1:])} "
                            f"(values) need {need // 1024} KiB of shared memory per block; the kernel holds up to "
                            f"{SHARED_LIMIT // 1024} KiB: choose fewer bits per code (e.g. d8b12, not d8b16)")
    if not q.is_cuda or q.dtype != torch.float32 or d % 32 or hq % hkv or hq // hkv > MAX_GQA:
        raise SettingsError("the VecInfer kernel takes float32 queries (B, Hq, D) on CUDA in the codec basis, D a "
                            f"multiple of 32 and at most {MAX_GQA} query heads per KV head")


def vq_decode(q: torch.Tensor, layer: VQLayer, scaling: float, checked: bool = False) -> torch.Tensor:
    """q (B, Hq, D) float32 in the codec basis -> (B, Hq, D) float16."""
    import cupy

    from kernels_cupy.loader import kernel, launch, torch_stream

    check(q, layer)
    b, hq, d = q.shape
    hkv = layer.kres.shape[1]
    gqa = hq // hkv
    nk, nv = layer.kbook.shape[-1], layer.vbook.shape[-1]
    mk, mv = layer.k_bits, layer.v_bits
    defines = {"D": d, "NK": nk, "MK": mk, "RK": layer.kcodes.shape[-1], "NV": nv, "MV": mv,
               "RV": layer.vcodes.shape[-1], "GQ": gqa}
    # One wave of blocks over the flushed tokens (BLOCKS_PER_SM per SM), splits of whole 128-token tiles.
    want = max(1, BLOCKS_PER_SM * _sm_count(q.device.index or 0) // (b * hkv))
    split_len = max(128, -(-(-(-layer.length // want)) // 128) * 128)
    num_splits = -(-layer.length // split_len)
    parts = num_splits + 1  # the last: the residual window
    part_acc = torch.empty(b, hq, parts, d, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(b, hq, parts, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(b, hq, d, device=q.device, dtype=torch.float16)
    tensors = [q.contiguous(), layer.kcodes.contiguous(), layer.vcodes.contiguous(), layer.kbook.contiguous(),
               layer.vbook.contiguous(), layer.ksink.contiguous(), layer.vsink.contiguous(), layer.kres.contiguous(),
               layer.vres.contiguous()]
    qc, kc, vc, kb, vb, ks, vs, kr, vr = tensors
    ptr = lambda t: cupy.uint64(t.data_ptr() if t.numel() else 0)  # noqa: E731
    i32 = cupy.int32
    smem = shared_bytes(layer, gqa)
    partial = kernel("vq_decode.cu", defines, "vq_partial")
    partial.max_dynamic_shared_size_bytes = smem
    with torch_stream(q.device):
        launch(partial, (parts, hkv, b), (NT,),
               (ptr(qc), ptr(kc), ptr(vc), ptr(kb), ptr(vb), i32(kb.shape[0]), i32(vb.shape[0]), ptr(ks), ptr(vs),
                i32(layer.sinks), i32(ks.shape[2]), ptr(kr), ptr(vr), i32(layer.residual), i32(kr.shape[2]),
                i32(layer.length), i32(kc.shape[2]), i32(split_len), i32(num_splits),
                cupy.float32(scaling * 1.4426950408889634), ptr(part_acc), ptr(part_ml)), checked, smem)
        merge_defines = {"D": d, "G": 32, "GV": 32, "GQ": gqa, "HAS_NORM": 0, "BLOCKS_PER_SM": BLOCKS_PER_SM,
                         "CP_ASYNC_LOADER": 0, "QT": "__half", "SPLIT_UNIT": 128}
        warps = b * hq * d // 32
        launch(kernel("quant_decode.cu", merge_defines, "merge"), (-(-warps // MERGE_WARPS),), (32 * MERGE_WARPS,),
               (ptr(part_acc), ptr(part_ml), cupy.uint64(0), cupy.uint64(0), i32(parts), i32(b * hq), ptr(out)),
               checked)
    return out

