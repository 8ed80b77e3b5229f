"""The fused VecInfer decode kernel (kernels_cupy/vq_decode.cu, issue 18) against the float64 reference of
the same codes (`kvcalib.vq_layout.reference_decode`), row by row, under the runtime's accuracy rule: each
row's error at most twice that of SDPA in float16 over the dequantized cache, plus 1e-4
(tests/test_int2_kernel_gpu.py). Per-layer and per-head codebooks, key and value configurations that
differ, sinks on and off, residual windows empty to nearly full, flushed lengths from none to 20k tokens;
what lies past the counts is poisoned and must not move the output."""

import pytest
import torch

from kvcalib import vq
from kvcalib.vq_layout import reference_decode

pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CuPy kernels run only on a GPU", allow_module_level=True)

from kvcalib.runtime.vq_kernel import vq_decode  # noqa: E402  (after the skip: it needs cupy)
from test_int2_kernel_gpu import FLOOR, _row_errors  # noqa: E402
from test_vq_layout import _layer, _method, _q_codec  # noqa: E402

DEV = "cuda"


def _sdpa(q: torch.Tensor, layer) -> torch.Tensor:
    """The peer: SDPA in float16 over the same cache dequantized, in the codec basis."""
    k = vq.decode(layer.codes("k"), layer.kbook.float()) if layer.length else layer.kres[:, :, :0].float()
    v = vq.decode(layer.codes("v"), layer.vbook.float()) if layer.length else layer.vres[:, :, :0].float()
    k[:, :, : layer.sinks], v[:, :, : layer.sinks] = layer.ksink.float(), layer.vsink.float()
    k = torch.cat([k, layer.kres[:, :, : layer.residual].float()], 2).half()
    v = torch.cat([v, layer.vres[:, :, : layer.residual].float()], 2).half()
    return torch.nn.functional.scaled_dot_product_attention(q.half()[:, :, None], k, v, scale=layer.head_dim**-0.5,
                                                            enable_gqa=True)[:, :, 0]


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("k_config,v_config", [("d4b8", "d4b8"), ("d8b12", "d4b8"), ("d2b8", "d8b12")])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("t", [5, 130, 1037, 20000])
def test_vq_kernel_matches_the_float64_reference_row_by_row(granularity, k_config, v_config, sinks, t):
    method = _on_device(_method(granularity, k_config, v_config, sinks, d=128))
    g = torch.Generator(device=DEV).manual_seed(t)
    k16 = (torch.randn(2, 2, t, 128, device=DEV, generator=g) * (1 + 3 * torch.rand(1, 1, 1, 128, device=DEV, generator=g))).half()
    v16 = torch.randn(2, 2, t, 128, device=DEV, generator=g).half()
    layer, q, out = _check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))
    # Poison what lies past the counts: codes of capacity not yet filled, residual rows not yet written.
    layer.kcodes = torch.cat([layer.kcodes, torch.full_like(layer.kcodes[:, :, :64], 255)], 2)
    layer.vcodes = torch.cat([layer.vcodes, torch.full_like(layer.vcodes[:, :, :64], 255)], 2)
    layer.kres = torch.cat([layer.kres, torch.full_like(layer.kres[:, :, :8], float("nan"))], 2)
    layer.vres = torch.cat([layer.vres, torch.full_like(layer.vres[:, :, :8], float("nan"))], 2)
    assert torch.equal(vq_decode(q, layer, 128**-0.5, checked=True), out)


def _check_rows(method, k16, v16, q, scale: float = 1.0):
    """Build the layer, run the kernel, hold every row to the rule against the float64 reference; returns
    the layer, the query in the codec basis and the kernel's output."""
    layer = _layer(method, k16, v16)
    qc = _q_codec(method, q * scale).float()
    ref = reference_decode(qc, layer, 128**-0.5)
    out = vq_decode(qc, layer, 128**-0.5, checked=True)
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    err = _row_errors(out, ref)
    bound = 2 * _row_errors(_sdpa(qc, layer), ref) + FLOOR
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), f"row {worst}: {err[worst]:.2e} > {bound[worst]:.2e}"
    return layer, qc, out


def _on_device(method):
    method.layers[0].k, method.layers[0].v = method.layers[0].k.to(DEV), method.layers[0].v.to(DEV)
    method.layers[0].smooth = method.layers[0].smooth.to(DEV)
    method.block = method.residual = 128
    return method


@pytest.mark.parametrize("b,t,granularity,k_config,v_config", [
    (1, 131072, "layer", "d4b8", "d4b8"), (1, 131072, "head", "d8b12", "d8b12"), (8, 32768, "layer", "d8b12", "d4b8"),
    (16, 8192, "head", "d4b8", "d8b12")])
@pytest.mark.parametrize("inputs", ["diffuse", "peaked"])
def test_long_contexts_and_large_batches_are_as_exact_as_sdpa_in_every_row(b, t, granularity, k_config, v_config, inputs):
    """Issue 18's range: L up to 128k, B up to 16. Diffuse: unit queries over unit keys (near-uniform
    attention, the long-context case that sums the most terms); peaked: queries 3x, a sharper softmax."""
    method = _on_device(_method(granularity, k_config, v_config, 0, d=128))
    g = torch.Generator(device=DEV).manual_seed(b * 7 + t)
    k16 = torch.randn(b, 2, t, 128, device=DEV, generator=g).half()
    v16 = torch.randn(b, 2, t, 128, device=DEV, generator=g).half()
    _check_rows(method, k16, v16, torch.randn(b, 8, 128, device=DEV, generator=g), 3.0 if inputs == "peaked" else 1.0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_every_residual_length_from_0_to_127(sinks):
    """Two flushed blocks and a residual window of every length the cache can hold, sinks on and off."""
    method = _on_device(_method("layer", "d4b8", "d8b12", sinks, d=128))
    g = torch.Generator(device=DEV).manual_seed(sinks)
    for r in range(128):
        k16 = torch.randn(2, 2, 256 + r, 128, device=DEV, generator=g).half()
        v16 = torch.randn(2, 2, 256 + r, 128, device=DEV, generator=g).half()
        _check_rows(method, k16, v16, torch.randn(2, 8, 128, device=DEV, generator=g))
