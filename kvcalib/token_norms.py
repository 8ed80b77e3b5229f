"""Token Norm Imbalance (OScaR): per-token norm statistics, the outlier-token rule, and the key
transforms `kvcalib diagnose` compares; shared by the report (`diagnose.py`) and its plots."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# name -> (rotation, scaling) of `kvcalib.methods.oscar.encode_keys`
TRANSFORMS = {"none": (False, "none"), "scaling": (False, "l2"), "rotation": (True, "none"), "oscar": (True, "l2")}
TENSORS = ("q", "k", "v")


@dataclass(frozen=True)
class OutlierRule:
    z: float = 3.5
    ratio: float = 2.0


def norm_stats(norms: torch.Tensor) -> dict:
    """Distribution and imbalance figures of a flat tensor of token norms."""
    n = norms.double().flatten()
    levels = torch.tensor([0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0], dtype=torch.float64, device=n.device)
    qs = torch.quantile(n, levels).tolist()
    lo, med, hi = qs[0], qs[3], qs[6]
    return {
        "min": lo, "p01": qs[1], "p25": qs[2], "median": med, "p75": qs[4], "p99": qs[5], "max": hi,
        "mean": n.mean().item(),
        "max_over_min": hi / lo if lo > 0 else math.inf,
        "max_over_median": hi / med if med > 0 else math.inf,
        "cv": (n.std() / n.mean()).item() if n.mean() > 0 else math.inf,
    }


def find_outliers(norms: torch.Tensor, rule: OutlierRule = OutlierRule()) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (same shape as norms) of low-norm and high-norm outlier tokens."""
    logn = norms.double().clamp_min(1e-30).log()
    med = logn.median()
    mad = (logn - med).abs().median() * 1.4826
    z = (logn - med) / mad.clamp_min(1e-12)
    far = math.log(rule.ratio)
    return (z < -rule.z) & (logn < med - far), (z > rule.z) & (logn > med + far)
