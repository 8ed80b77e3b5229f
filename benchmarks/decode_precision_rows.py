"""Where the fused INT2 decode kernel's error comes from, row by row, in one regime of the GPU tests.

    python benchmarks/decode_precision_rows.py [--b 4] [--length 131072] [--group 32] [--gqa 8]
        [--inputs peaked] [--norms] [--dtype float16] [--rows 8]

Builds exactly the inputs of tests/test_int2_kernel_gpu.py::test_long_context_decode_is_as_exact_as_sdpa_in_every_row
(same seeds, same generator), runs the kernel and torch SDPA, and
beside them float64 emulations that each add one of the kernel's fp16 roundings to the exact
computation (every sum exact, no tensor-core truncation):
  keys z+s:     the keys' zero point term from fp16(z + s): what the kernel did before it summed z q and s q apart
                (a what-if: the kernel model below has exact key scores);
  p16:          probabilities rounded to fp16 (relative to the split's max, as the kernel does);
  p~ = p16 s:   the value scale folded into p16 and rounded again (value scheme 3);
  out16:        the output rounded to the query dtype;
  p~, vals z+1.5s: p~ and value scheme 3's zero point term from fp16(z + 1.5 s);
  kernel model: p16, p~, vals z+1.5s, out16;
  SDPA model:   fp16 dequantized keys and values, p16, out16.
Prints, for the rows nearest the bound (fused ≤ 2 × SDPA + 1e-4), every column's row error
‖o − o_ref‖/‖o_ref‖, and the median and worst fused / SDPA ratio. Diagnostics only: records nothing.
With `--norms` the layout is OScaR's (the test's): blocks stored in the Hadamard basis, query, residual and
output in the model's. The emulations then run in the stored basis, the query and residual rotated into it
and the output back, exactly (float64), and SDPA's model rounds keys and values in the model's basis,
where a user who dequantizes holds them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvcalib.hadamard import rotate
from kvcalib.formats.int2.layout import _block_untranspose, from_tensor_core_order, reference_decode
from kvcalib.formats.int2.launch import fused_decode, partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_int2_kernel_gpu import _long_layer, _row_errors, _sdpa  # noqa: E402  (the tests' own inputs and peer)


def half(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return x.to(dtype).double()


def emulate(q: torch.Tensor, layer, scaling: float, split_len: int) -> dict[str, torch.Tensor]:
    """Each emulation's output (B, Hq, D) float64, one batch entry at a time."""
    t, gk, gv = layer.length, layer.group_size, layer.value_group_size
    b, hq, d = q.shape
    hkv = layer.kcodes.shape[1]
    rot_k = rotate if layer.rotated_keys else (lambda x: x)  # model's basis <-> stored (H = H^-1), float64
    rot_v = rotate if layer.rotated_values else (lambda x: x)
    outs: dict[str, list[torch.Tensor]] = {}
    for i in range(b):
        kc = from_tensor_core_order(layer.kcodes[i : i + 1, :, : t // 16], "k")[0].double()  # (H, T, D)
        ks = layer.kscale[i, :, : t // gk].double().repeat_interleave(gk, 1)
        kz = layer.kzero[i, :, : t // gk].double().repeat_interleave(gk, 1)
        vc = from_tensor_core_order(layer.vcodes[i : i + 1, :, :t].reshape(1, hkv, t // 16, d), "v")[0].double()
        vs = _block_untranspose(layer.vscale[i : i + 1, :, :t])[0].double().repeat_interleave(gv, -1)
        vz = _block_untranspose(layer.vzero[i : i + 1, :, :t])[0].double().repeat_interleave(gv, -1)
        kn = layer.knorm[i, :, :t].double()[..., None] if layer.knorm is not None else 1.0
        kr, vr = rot_k(layer.kres[i, :, : layer.residual].double()), rot_v(layer.vres[i, :, : layer.residual].double())
        qd = rot_k(q[i].double()).reshape(hkv, hq // hkv, d)
        keys = {
            "exact": (kc * ks + kz) * kn,
            "keys z+s": ((kc - 1) * ks + half(kz + ks)) * kn,
            "sdpa": rot_k(half(rot_k((kc * ks + kz) * kn), q.dtype)),
        }
        scores = {n: torch.einsum("hgd,htd->hgt", qd, k) * scaling for n, k in keys.items()}
        rscore = torch.einsum("hgd,htd->hgt", qd, kr) * scaling
        del keys

        res = {}
        for name, score, value, odt in [
            ("float64", scores["exact"], "exact", None),
            ("keys z+s", scores["keys z+s"], "exact", None),
            ("p16", scores["exact"], "p16", None),
            ("p~ = p16 s", scores["exact"], "p~", None),
            ("p~, vals z+1.5s", scores["exact"], "kernel", None),
            ("out16", scores["exact"], "exact", q.dtype),
            ("kernel model", scores["exact"], "kernel", q.dtype),
            ("SDPA model", scores["sdpa"], "sdpa", q.dtype),
        ]:
            res[name] = merged(score, rscore, value, odt, split_len, t, vc, vs, vz, vr, rot_v)
        for n, o in res.items():
            outs.setdefault(n, []).append(o.reshape(hq, d))
        del kc, ks, kz, vc, vs, vz, scores
        torch.cuda.empty_cache()
    return {n: torch.stack(o) for n, o in outs.items()}


def merged(score, rscore, value, out_dtype, split_len, t, vc, vs, vz, vr, rot_v) -> torch.Tensor:
    """Per split: p relative to the split's max, the numerator by the value side `value`, then the
    splits and the residual window merged exactly, taken into the model's basis (`rot_v`) and the output
    rounded to `out_dtype`."""
    nums, dens, maxes = [], [], []
    for s in range(0, t, split_len):
        sc = score[..., s : s + split_len]
        m = sc.amax(-1)
        p = torch.exp(sc - m[..., None])
        x, sc_v, z = vc[:, s : s + split_len], vs[:, s : s + split_len], vz[:, s : s + split_len]
        if value == "exact":
            num = torch.einsum("hgt,htd->hgd", p, x * sc_v + z)
        else:
            p16 = half(p, out_dtype if value == "sdpa" else torch.float16)  # SDPA's P in its dtype
            if value == "p16":
                num = torch.einsum("hgt,htd->hgd", p16, x * sc_v + z)
            elif value == "sdpa":
                num = torch.einsum("hgt,htd->hgd", p16, rot_v(half(rot_v(x * sc_v + z), out_dtype)))
            else:  # p~ = fp16(p16 s) times the centred codes, plus the zero point term
                zc = z + 1.5 * sc_v if value == "p~" else half(z + 1.5 * sc_v)
                num = torch.einsum("hgtd,htd->hgd", half(p16[..., None] * sc_v[:, None]), x - 1.5) \
                    + torch.einsum("hgt,htd->hgd", p16, zc)
        nums.append(num)
        dens.append(p.sum(-1))
        maxes.append(m)
    m = rscore.amax(-1)
    p = torch.exp(rscore - m[..., None])
    nums.append(torch.einsum("hgt,htd->hgd", p, vr))
    dens.append(p.sum(-1))
    maxes.append(m)
    mx = torch.stack(maxes).amax(0)
    num = sum(n * torch.exp(a - mx)[..., None] for n, a in zip(nums, maxes))
    den = sum(dn * torch.exp(a - mx) for dn, a in zip(dens, maxes))
    o = rot_v(num / den[..., None])
    return half(o, out_dtype) if out_dtype is not None else o


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--b", type=int, default=4)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--gqa", type=int, default=8)
    parser.add_argument("--inputs", default="peaked", choices=["diffuse", "peaked"])
    parser.add_argument("--norms", action="store_true")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--rows", type=int, default=8, help="rows shown, nearest the bound first")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    b, length, group, gqa = args.b, args.length, args.group, args.gqa
    torch.manual_seed(b * 131 + length + group)  # as the test does, draw for draw
    hkv = 8 if b * length <= 8 * 131072 // 2 else 4
    layer = _long_layer(b, hkv, length, group, args.inputs, args.norms)
    q = torch.randn(b, hkv * gqa, 128, device="cuda")
    if args.inputs == "peaked":
        k0, _ = layer.flushed_kv(model_basis=True)  # as the test leans them
        q = q + 0.05 * k0[:, :, 0].repeat_interleave(gqa, dim=1)
        del k0
    q = q.to(dtype)
    scaling = 128**-0.5
    ref = reference_decode(q, layer, scaling)
    fused = _row_errors(fused_decode(q, layer, scaling, checked=True), ref)
    sdpa = _row_errors(_sdpa(q, layer, scaling), ref)
    _, _, split_len = partition(layer, 0)  # the kernel's own splits
    models = {n: _row_errors(o, ref) for n, o in emulate(q, layer, scaling, split_len).items()}
    bound = 2 * sdpa + 1e-4
    order = (fused / bound).argsort(descending=True)[: args.rows]
    names = ["fused", "SDPA", "bound"] + [n for n in models if n != "float64"]
    print(f"B={b} L={length} G={group} GQA={gqa} {args.inputs}{' norms' if args.norms else ''} {args.dtype}"
          f"; split {split_len} tokens; {fused.numel()} rows, "
          f"{int((fused > bound).sum())} over the bound")
    print("| row | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    cols = {"fused": fused, "SDPA": sdpa, "bound": bound, **models}
    for r in order.tolist():
        print(f"| {r} | " + " | ".join(f"{cols[n][r]:.2e}" for n in names) + " |")
    ratio = fused / sdpa
    print(f"fused / SDPA per row: median {ratio.median():.2f}, worst {ratio.max():.2f}; "
          f"fused / bound worst {(fused / bound).max():.3f}; kernel model / SDPA model median "
          f"{(models['kernel model'] / models['SDPA model']).median():.2f}")


if __name__ == "__main__":
    main()
