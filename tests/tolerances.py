"""Where the suite's floating-point tolerances come from: one vocabulary, cited by every comparison.

Unit roundoff u of a format is half the gap between 1 and the next representable number: a correctly
rounded operation returns x(1 + δ) with |δ| <= u. A sum or dot product of n terms, evaluated in any
order, is within γ_n · Σ|terms| of the exact value, γ_n = n·u / (1 − n·u) (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., Lemma 3.1 and eq. 3.5). Two evaluations of the same
expression in different orders therefore differ by at most 2·γ_n · Σ|terms|.

A comparison that is not exact states which of these bounds it uses, with the reduction length n
and the magnitude Σ|terms| it is applied to, and a planted error shows it can fail.
"""

from __future__ import annotations

import math

import torch

U16 = 2.0**-11  # float16: 10 stored mantissa bits
U_BF16 = 2.0**-8  # bfloat16: 7 stored mantissa bits
U32 = 2.0**-24  # float32
U64 = 2.0**-53  # float64

UNIT_ROUNDOFF = {torch.float16: U16, torch.bfloat16: U_BF16, torch.float32: U32, torch.float64: U64}

# ulps of error in the exp of torch.softmax on the CPU: float32 softmax evaluates it with
# Vectorized<float>::exp_u20, "a faster version of exp with ULP=20" (torch 2.13's
# ATen/cpu/vec/vec256/vec256_float.h and vec512/vec512_float.h); measured here, one row's weights moved
# apart by up to 34 u (±17 u), beyond the 2 u of a correctly rounded exp that a test of mixed_attention
# had assumed (it failed once in a fresh clone's run). float64 keeps Sleef's 1-ulp exp. An ulp is at
# most 2 u relative.
EXP_ULPS = {torch.float32: 20, torch.float64: 1}


def gamma(n: int, u: float) -> float:
    """γ_n: the relative bound on a sum of n terms in a format of unit roundoff u (Higham, Lemma 3.1)."""
    if n * u >= 1:
        raise ValueError(f"γ_n is undefined for n·u >= 1 (n={n}, u={u})")
    return n * u / (1 - n * u)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64 (Frobenius norms over the whole tensor)."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


def worst_row_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows (all but the last axis) of ‖got_row − ref_row‖ / ‖ref_row‖, in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def perplexity_tolerance(vocab: int, tokens: int, ppl: float, max_logit: float) -> float:
    """Relative tolerance between eval's perplexity and a float64 reference of it, for a float64 model.

    Upstream of the logits both are float64; their different matmul shapes leave round-off of a few tens of
    u64 (the float32 model shows ~50 u32), which 2^-30 = 2^23 u64 bounds. But evaluate() casts the logits to
    float32 for its cross-entropy. Per token: rounding the logits (2u |logit|), the max subtracted inside the
    exps (2u |logit|, relative on each term), exp and log (<= 1 ulp = 2u each, log S <= ln V), the exp-sum S
    over V positive terms (gamma_V relative), and joining the target logit, the max and log S (two roundings
    of at most 2 |logit| + ln V each). Then eval's float32 sum over the window's N token NLLs adds
    gamma_{N+1} * mean NLL (= ln ppl). The perplexity moves by expm1 of the mean NLL's error.
    """
    u = U32
    nll = (gamma(vocab, u) + 2 * u * (1 + 2 * math.log(vocab)) + 8 * u * max_logit
           + gamma(tokens + 1, u) * math.log(ppl))
    return math.expm1(nll + 2.0**-30)
