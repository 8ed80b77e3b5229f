"""The one-row weight products' kernel (kernels_cupy/gemv.cu, kvcalib.runtime.gemv_kernel) on the GPU, against
a float64 product of the same half-precision inputs, every output element, the output poisoned (NaN) before
the launch so that an element the kernel never writes fails.

Bound (tests/tolerances.py): the kernel sums K products in float32 in some order and rounds once to the output
format, so each element is within γ_K(u32) · Σ|x_i w_i| (+ |bias|) of the exact sum, then within u of that
(u: the output's unit roundoff; float16 2^-11, bfloat16 2^-8). A planted fault (the last row never written)
shows the check fails."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("cupy", reason="the kernel needs cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the kernel runs only on a GPU", allow_module_level=True)

from tolerances import U32, UNIT_ROUNDOFF, gamma  # noqa: E402

from kvcalib.runtime import gemv_kernel  # noqa: E402
from kvcalib.runtime.gemv_kernel import linear  # noqa: E402

DEV = "cuda"


def _launch(x, w, bias=None, rows=None):
    """The kernel launched directly, checked, into an output poisoned with NaN; `rows`: how many of W's rows the
    launch is told of (a planted fault when fewer)."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=DEV, dtype=x.dtype)
    gemv_kernel.launch_gemv(x, w, bias, out, n=rows, checked=True)
    return out


def _within_bound(got, x, w, bias=None) -> bool:
    exact = x.double() @ w.double().T
    mass = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, mass = exact + bias.double(), mass + bias.double().abs()
    k = w.shape[1]
    bound = UNIT_ROUNDOFF[got.dtype] * exact.abs() + (1 + UNIT_ROUNDOFF[got.dtype]) * gamma(k + 1, U32) * mass
    return bool(torch.isfinite(got).all()) and bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 14336), (6144, 4096), (37, 200), (1000, 576), (300, 5128),
                                 (1024, 2560), (2560, 10240)])  # Gemma 3 4B's: one pass of 10 words, four
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_each_element_is_within_the_float32_sum_and_one_rounding_of_the_exact_product(dtype, n, k, rows):
    g = torch.Generator(device=DEV).manual_seed(n + k + rows)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(rows, k, device=DEV, generator=g).to(dtype)
    bias = torch.randn(n, device=DEV, generator=g).to(dtype)
    assert _within_bound(_launch(x, w), x, w)
    biased = _launch(x, w, bias)
    assert _within_bound(biased, x, w, bias)
    assert torch.equal(torch.ops.kvcalib.gemv(x, w, bias, checked=True), biased)  # the op is that launch


def test_a_row_the_kernel_never_writes_fails_the_check():
    """Planted: the launch told of one row fewer leaves the last poisoned."""
    w = torch.randn(96, 256, device=DEV, dtype=torch.float16)
    x = torch.randn(1, 256, device=DEV, dtype=torch.float16)
    assert _within_bound(_launch(x, w, rows=96), x, w)
    assert not _within_bound(_launch(x, w, rows=95), x, w)


def test_linear_keeps_the_inputs_shape_and_a_misaligned_input_goes_to_cublas():
    w = torch.randn(512, 4096, device=DEV, dtype=torch.float16) / 64
    x = torch.randn(1, 1, 4096, device=DEV, dtype=torch.float16)
    y = linear(x, w)
    assert y.shape == (1, 1, 512) and _within_bound(y.view(1, -1), x.view(1, -1), w)
    shifted = torch.randn(4100, device=DEV, dtype=torch.float16)[4:].view(1, 4096)  # starts 8 bytes in
    assert gemv_kernel.applies(shifted, w)  # only the launch sees the address
    assert torch.equal(linear(shifted, w), F.linear(shifted, w))


def test_the_op_compiles_into_a_graph_and_gives_the_eager_launchs_bits():
    w = torch.randn(1024, 4096, device=DEV, dtype=torch.float16) / 64
    x = torch.randn(1, 1, 4096, device=DEV, dtype=torch.float16)
    compiled = torch.compile(lambda t: linear(t, w) * 2, fullgraph=True)
    assert torch.equal(compiled(x), linear(x, w) * 2)


def test_a_one_row_step_runs_every_linear_through_the_kernel_and_a_three_row_step_none():
    """The static cache's step at B = 1 sends each of the model's products (7 a layer and lm_head) through the
    op, at B = 3 none; and the one-row step's logits are cuBLAS's within the bound the compiled step is held to
    against the eager one (tests/test_static_cache_gpu.py: float16 round-off of the activations, 4 float16 ulps
    of the largest logit), since both are float32 sums in another order rounded once to float16. Planted: with
    the switch dropped from the step, the count is 0."""
    from test_static_cache_gpu import SETTINGS, _model

    from kvcalib.runtime.captured import Decoder
    from kvcalib.runtime.static_cache import StaticKvcalibCache
    from tolerances import U16

    model = _model()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    real, calls = torch.ops.kvcalib.gemv, []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    prompt = torch.randint(0, 1000, (1, 40), device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    logits = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.ops.kvcalib, "gemv", spy)
        for rows, batch in ((gemv_kernel.MAX_ROWS, 1), (0, 1), (gemv_kernel.MAX_ROWS, 3)):
            patch.setattr(gemv_kernel, "MAX_ROWS", rows)
            cache = StaticKvcalibCache(model, "kivi", SETTINGS, max_batch=batch, max_length=256, compile="none")
            first = cache.prefill(model, 0, prompt).argmax().view(1)
            calls.clear()
            out = Decoder(model, cache).step(torch.cat([first, first.new_zeros(batch - 1)]))
            logits[rows, batch] = out[0].float()
            assert len(calls) == (linears if rows and batch == 1 else 0), (rows, batch)
    kernel, cublas = logits[gemv_kernel.MAX_ROWS, 1], logits[0, 1]
    assert (kernel - cublas).abs().max() <= 4 * 2 * U16 * cublas.abs().max()
