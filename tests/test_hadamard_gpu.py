"""kernels_cupy/hadamard_rows.cu (`hadamard.rotate` on CUDA) against the float64 product, row by row; a row's bits
whatever rows come with it; poisoned outputs, every launch checked."""

import pytest
import torch

from kvcalib.hadamard import block_size, hadamard, on_the_rotation_kernel, rotate

cupy = pytest.importorskip("cupy", reason="the rotation kernel needs cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the rotation kernel runs only on a GPU", allow_module_level=True)

UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff
SMALLEST = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 0.0}  # half a subnormal step (float16's)


def butterflies(x: torch.Tensor) -> torch.Tensor:
    """The kernel's order of operations in torch float32 ops, element for element: the stages of stride 1, 2, ... up
    to half the block, the lower element of a pair taking a + b and the upper a - b, then the scale 1/sqrt(b) rounded
    to float32, then x's dtype (round to nearest). Elementwise float32 adds and multiplies round exactly on a GPU as
    here, so without denormals (flushed by the kernel) the kernel's bits are these."""
    d = x.shape[-1]
    b = block_size(d)
    v = x.float().reshape(-1, d // b, b)
    s = 1
    while s < b:
        pairs = v.reshape(v.shape[0], v.shape[1], b // (2 * s), 2, s)
        lo, hi = pairs[:, :, :, 0], pairs[:, :, :, 1]
        v = torch.stack((lo + hi, lo - hi), 3).reshape(v.shape)
        s *= 2
    scale = torch.tensor(1 / b**0.5, dtype=torch.float32, device=x.device)
    return (v * scale).reshape(x.shape).to(x.dtype)


def _bound(x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each element's worst error, M its row's max|x| (float16 and bfloat16 rows are read exactly), u float32's unit
    roundoff, b the block: after k of the log2(b) butterfly stages a value sums 2^k of the row's, at most 2^k M, and its
    error is at most 2 e_(k-1) (1 + u) + u 2^k M (the operands' errors, then one rounding), about k u 2^k M; log2(b) u
    sqrt(b) M after the scale 1/sqrt(b), which adds its own rounding and the float32 scale's (exact at powers of 4,
    within 0.3 u otherwise): (log2(b) + 2) u sqrt(b) M, e32. Then the output's rounding to x's dtype: e32 (1 + u_t)
    + u_t |exact|, and half a subnormal step where float16 has them."""
    b = block_size(x.shape[-1])
    row_max = x.double().abs().amax(-1, keepdim=True)
    e32 = (b.bit_length() + 1) * UNIT[torch.float32] * b**0.5 * row_max
    return e32 * (1 + UNIT[x.dtype]) + UNIT[x.dtype] * want.abs() + SMALLEST[x.dtype]


def _check(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    poison = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    poisoned = poison.data_ptr()
    del poison  # the op's output, of the same size, takes this block: an element not written stays NaN
    got = torch.ops.kvcalib.hadamard_rows(x, True)  # checked: a fault inside the kernel raises here
    if x.stride(-1) == 1:
        assert got.data_ptr() == poisoned  # the poisoned block it is (no copy came first)
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    assert torch.isfinite(got).all()  # every element written
    want = x.double() @ hadamard(d, torch.float64, "cuda")
    excess = ((got.double() - want).abs() - _bound(x, want)).amax(-1)  # row by row
    assert (excess <= 0).all(), f"a row beyond its bound by {excess.max().item():.3g}"
    assert torch.equal(got, butterflies(x))  # the kernel's own order of operations, bit for bit
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [6, 32, 48, 64, 80, 96, 128, 160, 256])  # 6, 48, 80: lanes past D (blocks below 32)
def test_rows_equal_the_float64_product_within_the_transforms_rounding(d, dtype):
    torch.manual_seed(d)
    x = torch.randn(3, 4, 37, d, device="cuda") * (0.1 + 8 * torch.rand(1, 1, 1, d, device="cuda"))
    x[..., 3] *= 100  # an outlier channel, as keys have
    _check(x.to(dtype))


@pytest.mark.parametrize("shape", [(128,), (7, 64), (2, 3, 64), (2, 3, 1, 128), (2, 2, 3, 5, 64), (2, 3, 2, 4, 5, 32)])
def test_any_count_of_leading_dimensions(shape):
    torch.manual_seed(len(shape))
    x = torch.randn(shape, device="cuda")
    got = _check(x)
    assert torch.equal(got, rotate(x))  # rotate takes the kernel here
    assert on_the_rotation_kernel(x)
    if x.dim() > 4:  # the leading dimensions flattened where they cannot be viewed as one: a copy first
        y = x.transpose(0, 1)
        assert torch.equal(_check(y), got.transpose(0, 1))


def test_strided_rows_as_attention_hands_them_over():
    """Keys and queries come transposed, (B, T, H, D) viewed as (B, H, T, D): the kernel reads them in place, with
    their strides; a last dimension with a stride is laid out anew first."""
    torch.manual_seed(2)
    base = torch.randn(2, 37, 4, 128, device="cuda", dtype=torch.float16)
    x = base.transpose(1, 2)
    assert not x.is_contiguous()
    got = _check(x)
    assert torch.equal(got, _check(x.contiguous()))
    wide = torch.randn(2, 4, 5, 256, device="cuda")[..., ::2]  # stride 2 along D
    assert torch.equal(rotate(wide), rotate(wide.contiguous()))


@pytest.mark.parametrize("tokens", [1, 16, 32, 128])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_slot_rotated_alone_gets_the_bits_it_gets_among_others(tokens, d):
    """A flush rotates one slot's block (the one-slot flush) or every slot's (the masked flush), and the static cache
    holds the same bits either way: a row's bits may not depend on the rows beside it. cuBLAS's product broke this
    (seen on an H200: a slot of 2 heads x 32 tokens alone against 3 slots, and at 128 tokens)."""
    torch.manual_seed(d + tokens)
    x = torch.randn(8, 2, tokens, d, device="cuda") * 3
    every = rotate(x)
    for b in (1, 3, 8):
        assert torch.equal(rotate(x[:b]), every[:b]), b
        assert torch.equal(rotate(x[b - 1:b]), every[b - 1:b]), b
        assert torch.equal(rotate(x[b - 1:b, :1]), every[b - 1:b, :1]), b


def test_rotating_twice_gives_the_rows_back_within_rounding():
    torch.manual_seed(3)
    x = torch.randn(4, 8, 33, 128, device="cuda")
    back = rotate(rotate(x))
    # the first transform's error (`_bound`: 9 u sqrt(b) M at b = 128) grows by at most sqrt(b) through the second,
    # which adds its own on rows of at most sqrt(b) M: 2 x 9 u b M
    assert (back - x).abs().max() <= 2 * 9 * 2**-24 * 128 * x.abs().max()


def test_a_compiled_rotation_gives_the_eager_bits():
    """An opaque op to torch.compile: a compiled flush or step rotates with the kernel, as an eager one."""
    torch.manual_seed(5)
    x = torch.randn(3, 2, 40, 128, device="cuda")
    compiled = torch.compile(lambda t: rotate(t) * 2, fullgraph=True, backend="inductor")
    assert torch.equal(compiled(x), rotate(x) * 2)


def test_empty_rows_and_what_the_kernel_does_not_take():
    for x in (torch.empty(2, 0, 5, 64, device="cuda"), torch.empty(2, 2, 0, 5, 64, device="cuda")):
        assert rotate(x).shape == x.shape
    zeros = torch.zeros(3, 64, device="cuda")
    assert torch.equal(rotate(zeros), zeros)
    grad = torch.randn(3, 64, device="cuda", requires_grad=True)
    assert not on_the_rotation_kernel(grad)  # the product, which carries the gradient
    rotate(grad).sum().backward()
    assert grad.grad is not None
    wide = torch.randn(3, 64, device="cuda", dtype=torch.float64)  # the references: cuBLAS's product, as before
    assert not on_the_rotation_kernel(wide)
    assert torch.allclose(rotate(wide), wide @ hadamard(64, torch.float64, "cuda"), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="hadamard_rows takes"):
        torch.ops.kvcalib.hadamard_rows(torch.randn(3, 81, device="cuda"), True)  # odd: no rotation exists
