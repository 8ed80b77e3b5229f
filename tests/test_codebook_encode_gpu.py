"""kernels_cupy/codebook_encode.cu (`vq.encode_on_gpu`) against TurboQuant's torch encode (kvcalib.methods.turboquant: `unit_rotated`, then
`torch.bucketize` or `nearest_per_coordinate` or `vq.encode`, then `pack_stream`), row by row.

- Norms: bit for bit (both take |x| in float64 and round it once; their sums' orders differ by ~1e-16, which float32
  rounding absorbs but for a number within that of a float32 boundary: none in these draws, and a test that met one
  would name it).
- Scalar codes: bit for bit but where the torch path's y_i lies within 2 float32 ulps of a bound (the kernel's float64
  rotation sums in its own order: y may round to the neighbouring float32), and there only by one code.
- Vector codes: the kernel's pick is the float64 nearest centroid but for near-ties (within float32's rounding of
  the distances, as `vq.encode`'s own test holds it), every code of the stream at its bits.
- Outputs poisoned first (the caching allocator's blocks filled with 0x7f before the kernel's are taken from them):
  every element the kernel owns is written. Every launch checked (`checked=True`: synchronised, errors raised).
"""

import pytest
import torch

from kvcalib import vq
from kvcalib.methods.turboquant import codebook, midpoints, nearest_per_coordinate, rotation, unit_rotated
from kvcalib.quant import pack_stream, stream_bytes, unpack_stream
from kvcalib.vq import encode_on_gpu

cupy = pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)

DEV = "cuda"


def _poison() -> None:
    """Fill the allocator's free blocks with 0x7f bytes: a tensor taken from them next holds garbage, not zeros. Small
    blocks (under 1 MiB: the outputs here are tens of KiB) come from the allocator's small pool, so small ones are
    poisoned."""
    junk = [torch.full((256 << 10,), 0x7F, dtype=torch.uint8, device=DEV) for _ in range(64)]
    del junk


def _pi(d: int) -> torch.Tensor:
    return rotation(d, torch.float64, torch.device(DEV))


def _rows(b, h, t, d, seed, strided):
    """x (b, h, t, d) float32 of float16 values, some rows zero (a zero norm), some large; `strided`: the heads a
    slice of a larger tensor (a plan's group of heads), so that batch and heads stride."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    full = torch.randn(b, h + 2 if strided else h, t, d, generator=g, device=DEV) * 3
    full[:, :, 1] = 0
    full[:, :, 2] *= 1000
    x = full.half().float()
    return x[:, 1 : h + 1] if strided else x


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("calibrated,groups", [(False, 1), (True, 1), (True, "h")])
@pytest.mark.parametrize("b,h,t,strided", [(1, 3, 128, True), (3, 2, 37, False)])
def test_scalar_codes_and_norms_are_the_torch_encodes(d, bits, calibrated, groups, b, h, t, strided):
    x = _rows(b, h, t, d, seed=d * bits + b, strided=strided)
    y, norm = unit_rotated(x)
    if calibrated:
        g = h if groups == "h" else 1
        gen = torch.Generator(device=DEV).manual_seed(bits)
        centroids = torch.randn(g, d, 2**bits, generator=gen, device=DEV).sort(-1).values * 0.1
        bounds = midpoints(centroids)
        want = nearest_per_coordinate(y, centroids, bounds)
        near = (y.unsqueeze(-1) - bounds[:, None]).abs()
    else:
        bounds = midpoints(codebook(d, bits).half().float()).to(DEV)  # TurboQuant's `_tables`
        want = torch.bucketize(y, bounds)
        near = (y.unsqueeze(-1) - bounds).abs()
    _poison()
    words, norms = encode_on_gpu(x, bits, _pi(d), bounds=bounds, checked=True)
    assert words.shape == (b, h, t, -(-d * bits // 32)) and words.dtype == torch.int32
    assert torch.equal(norms, norm.clamp(max=65504).half())
    got = unpack_stream(words, bits, d)
    ulp = torch.finfo(torch.float32).eps * y.abs().clamp_min(torch.finfo(torch.float32).tiny)
    edge = (near <= 2 * ulp.unsqueeze(-1)).any(-1)
    assert ((got == want) | edge).all(), f"{((got != want) & ~edge).sum().item()} codes off a bound differ"
    assert ((got - want).abs() <= 1).all()
    assert torch.equal(words[(got == want).all(-1)], pack_stream(want, bits)[(got == want).all(-1)])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits,n", [(5, 4), (6, 4), (7, 4), (8, 4), (6, 2)])
@pytest.mark.parametrize("groups", [1, "h"])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_vector_codes_are_the_float64_nearest_centroids_but_for_near_ties(d, bits, n, groups, as_bytes):
    b, h, t = 2, 3, 71  # 426 rows: the last block of 4 holds 2
    x = _rows(b, h, t, d, seed=bits * n + d, strided=True)
    y, norm = unit_rotated(x)
    g = h if groups == "h" else 1
    gen = torch.Generator(device=DEV).manual_seed(bits)
    books = (torch.randn(g, 2**bits, n, generator=gen, device=DEV) * 0.2).half()
    _poison()
    out, norms = encode_on_gpu(x, bits, _pi(d), books=books, as_bytes=as_bytes, checked=True)
    assert torch.equal(norms, norm.clamp(max=65504).half())
    c = d // n
    if as_bytes:
        assert out.dtype == torch.uint8 and out.shape == (b, h, t, -(-c * bits // 8))
        got = vq.unpack_codes(out, bits, c)
    else:
        assert out.dtype == torch.int32 and out.shape == (b, h, t, -(-c * bits // 32))
        got = unpack_stream(out, bits, c)
    sub = y.unflatten(-1, (c, n)).double()
    per_head = books.double().repeat_interleave(h // g, dim=0)  # (h, E, n)
    dist = (sub.unsqueeze(-2) - per_head[None, :, None, None]).pow(2).sum(-1)  # (b, h, t, c, E)
    best = dist.min(-1).values
    taken = dist.gather(-1, got.unsqueeze(-1)).squeeze(-1)
    assert (taken - best <= 1e-5 * (1 + best)).all()  # float32 distances: a few ulps of |y|^2 + |c|^2
    torch_codes = vq.encode(y, books)
    same = (got == torch_codes).all(-1)
    assert same.float().mean() > 0.99  # near-ties are rare
    packed = stream_bytes(torch_codes, bits) if as_bytes else pack_stream(torch_codes, bits)
    assert torch.equal(out[same], packed[same])


@pytest.mark.parametrize("groups", [1, 2])
def test_rows_as_given_are_coded_without_a_norm_into_vecinfers_bytes(groups):
    """ROTATE 0 (VecInfer: the rows already in the codec basis), bytes, a book a head or one for all: the codes of the
    rows themselves (the float64 nearest but for near-ties), `vq.pack_codes`' bytes where they agree, no norms."""
    x = _rows(2, 2, 41, 64, seed=9 + groups, strided=True)
    gen = torch.Generator(device=DEV).manual_seed(groups)
    books = torch.randn(groups, 256, 4, generator=gen, device=DEV)
    _poison()
    out, norms = encode_on_gpu(x, 8, books=books, as_bytes=True, checked=True)
    assert norms is None and out.shape == (2, 2, 41, 16) and out.dtype == torch.uint8
    got, want = vq.unpack_codes(out, 8, 16), vq.encode(x, books)
    sub = x.unflatten(-1, (16, 4)).double()
    dist = (sub.unsqueeze(-2) - books.double().repeat_interleave(2 // groups, 0)[None, :, None, None]).pow(2).sum(-1)
    taken = dist.gather(-1, got.unsqueeze(-1)).squeeze(-1)
    best = dist.min(-1).values
    assert (taken - best <= 1e-5 * (1 + best)).all()
    same = (got == want).all(-1)
    assert same.float().mean() > 0.99 and torch.equal(out[same], vq.pack_codes(want, 8)[same])


def test_turboquant_takes_the_kernel_on_cuda_and_codes_as_on_the_cpu():
    """The methods route their codes through the kernel on CUDA (`vq.on_the_encode_kernel`) and the torch ops on the
    CPU; the two agree: TurboQuant's norms bit for bit and its scalar codes but for a coordinate on a bound (none
    here), the vector codes but for near-ties."""
    from kvcalib.methods.turboquant import TurboQuant, TurboQuantConfig
    from kvcalib.models import AttentionShape

    x = _rows(2, 2, 40, 64, seed=11, strided=False)
    assert vq.on_the_encode_kernel(x) and not vq.on_the_encode_kernel(x.cpu())
    method = TurboQuant(TurboQuantConfig(bits=3, residual=40), AttentionShape(1, 4, 2, 64))
    gpu, cpu = method.encode_vectors(x), method.encode_vectors(x.cpu())
    assert torch.equal(gpu.norm.cpu(), cpu.norm)
    assert (unpack_stream(gpu.codes.cpu(), 3, 64) == unpack_stream(cpu.codes, 3, 64)).float().mean() > 0.9999


@pytest.mark.parametrize("t", [0, 1, 37])
def test_rows_as_attention_hands_them_over_code_as_the_same_rows_laid_out(t):
    """Keys come from attention as (B, T, H, D) transposed (the heads stride by D, the tokens by H D), in float16; a
    plan takes a group of heads, and codes a part no group reads over no tokens. Such rows, none, one or many, code
    as the same rows laid out by hand (a stride along a length of one or none is not read; `.contiguous()` kept
    such strides, which the kernel's check refused)."""
    g = torch.Generator(device=DEV).manual_seed(t)
    part = torch.randn(2, max(t, 1), 4, 64, generator=g, device=DEV).half().transpose(1, 2)[:, 1:3, :t]
    laid = part.float().clone(memory_format=torch.contiguous_format)
    bounds = midpoints(codebook(64, 2).half().float()).to(DEV)
    _poison()
    got = encode_on_gpu(part, 2, _pi(64), bounds=bounds, checked=True)
    want = encode_on_gpu(laid, 2, _pi(64), bounds=bounds, checked=True)
    assert got[0].shape == (2, 2, t, 4) and got[1].shape == (2, 2, t, 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
