"""OScaR (Su et al., 2026, "Omni-Scaled Canalized Rotation"): Hadamard rotation, then per-token key
scaling, then KIVI's per-channel key / per-token value quantization. Training-free.

Keys: k' = (k H) / s(k H), with H the normalized Hadamard matrix (`kvcalib.hadamard`) and s one
coefficient per token and KV head, stored in float16; k' is quantized per channel in groups of G
tokens. Reading back: k = (dequant(k') * s) H. Queries take the same rotation, so q·k is unchanged
(H is orthogonal); the evaluation reads keys back in the original space, which gives the same scores.
Values: v H quantized per token in groups of min(G, head_dim) channels. A deployment folds H into
the value and output projections once (`fold_value_rotation`); the evaluation simulates that fold in
the cache (rotate V, quantize, rotate back), which is the same computation because H H = I.

Scaling coefficients s (the paper's ablation), over the rotated key of one token and head:
`l2` ||k||_2 (default), `rsqrt` sqrt(||k||_2) (only half the norm spread, in log scale, is removed),
`max` max_i |k_i|, `mean-abs` mean_i |k_i|, `none` no scaling (the "Hadamard only" ablation);
`rotation=False` is the "scaling only" ablation.

Packed layout: `kvcalib.quant` exactly as KIVI (keys axis="tokens", values axis="channels"), plus

| what      | dtype   | shape             | meaning                                               |
|-----------|---------|-------------------|-------------------------------------------------------|
| `k_scale` | float16 | `(B, Hkv, T, 1)`  | s of each token and KV head; absent with scaling none |

Stored bits per flushed block: KIVI's, plus 16 per token and KV head for `k_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..artifacts import load_artifact
from ..defaults import DEFAULTS
from ..errors import ArtifactError, SettingsError
from ..hadamard import hadamard, rotate
from ..models import AttentionShape, LoadedModel, attention_shape
from ..quant import FLOAT16_MAX, Quantized
from .base import MethodSettings
from ..formats.codebook.layout import CodebookSpec, CodedBlock, affine_part
from .kivi import Kivi, KiviConfig, KiviPacked, affine_block

SCALINGS = ("l2", "rsqrt", "max", "mean-abs", "none")
_FP16_TINY = 2.0**-14  # smallest normal float16: a zero token keeps a finite, storable coefficient


def token_scale(x: torch.Tensor, scaling: str) -> torch.Tensor | None:
    """The float16 coefficient s of every token of x (..., T, d), shape (..., T, 1); None for `none`."""
    x = x.float()
    if scaling == "none":
        return None
    if scaling == "l2":
        s = x.norm(dim=-1, keepdim=True)
    elif scaling == "rsqrt":
        s = x.norm(dim=-1, keepdim=True).sqrt()
    elif scaling == "max":
        s = x.abs().amax(-1, keepdim=True)
    elif scaling == "mean-abs":
        s = x.abs().mean(-1, keepdim=True)
    else:
        raise SettingsError(f"--scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    return s.clamp(_FP16_TINY, FLOAT16_MAX).half()


def encode_keys(k: torch.Tensor, rotation: bool, scaling: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What OScaR quantizes: the rotated keys divided by their per-token coefficients, and those."""
    k = rotate(k.float()) if rotation else k.float()
    s = token_scale(k, scaling)
    return (k if s is None else k / s.float()), s


def decode_keys(k: torch.Tensor, s: torch.Tensor | None, rotation: bool) -> torch.Tensor:
    """Inverse of `encode_keys` (H is its own inverse)."""
    k = k.float() if s is None else k.float() * s.float()
    return rotate(k) if rotation else k


@dataclass(frozen=True)
class OscarConfig(KiviConfig):
    scaling: str = DEFAULTS["scaling"]
    rotation: bool = DEFAULTS["rotation"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scaling not in SCALINGS:
            raise SettingsError(f"--scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")


@dataclass
class OscarPacked:
    kivi: KiviPacked
    k_scale: torch.Tensor | None


class Oscar(Kivi):
    name = "oscar"

    def __init__(self, config: OscarConfig, shape: AttentionShape):
        super().__init__(config, shape)
        self.head_dim = shape.head_dim
        if config.rotation:
            hadamard(shape.head_dim)  # refuses an odd head_dim now, not mid-evaluation

    @property
    def rotated_keys(self) -> bool:
        return self.config.rotation

    @property
    def rotated_values(self) -> bool:
        return self.config.rotation

    def int2_parts(self, packed: OscarPacked) -> tuple[Quantized, Quantized, torch.Tensor | None]:
        norms = None if packed.k_scale is None else packed.k_scale[..., 0]
        return packed.kivi.k, packed.kivi.v, norms

    def codebook_spec(self, layer: int) -> CodebookSpec:
        """KIVI's affine parts, the key scale as the keys' norm, H as both parts' basis."""
        c = self.config
        basis = hadamard(self.head_dim, torch.float32)[None] if c.rotation else None
        return CodebookSpec(affine_part(c.bits, token_group=c.group_size, norm=c.scaling != "none", basis=basis),
                            affine_part(c.bits, channel_group=self.value_group, basis=basis))

    def codebook_parts(self, packed: OscarPacked) -> CodedBlock:
        return affine_block(packed.kivi.k, packed.kivi.v, None if packed.k_scale is None else packed.k_scale[..., 0])

    def compress(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> OscarPacked:
        c = self.config
        k, s = encode_keys(k, c.rotation, c.scaling)
        v = rotate(v.float()) if c.rotation else v
        return OscarPacked(kivi=super().compress(layer, k, v), k_scale=s)

    def decompress(self, layer: int, packed: OscarPacked) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().decompress(layer, packed.kivi)
        return decode_keys(k, packed.k_scale, self.config.rotation), (rotate(v) if self.config.rotation else v)

    def part_bits(self, packed: OscarPacked) -> tuple[int, int]:
        norms = 0 if packed.k_scale is None else 16 * packed.k_scale.numel()
        k, v = super().part_bits(packed.kivi)
        return k + norms, v

    def settings(self) -> dict:
        return super().settings() | {"scaling": self.config.scaling, "rotation": self.config.rotation}


def fold_value_rotation(model: torch.nn.Module) -> None:
    """Fold H into every attention layer's v_proj (rows of each KV head) and o_proj (columns of each
    query head, with the rotation of the KV head it reads), in place: the value cache then holds v H
    and the model's outputs are unchanged. This is what a deployment does once, offline."""
    shape = attention_shape(model.config)
    d, group = shape.head_dim, shape.num_heads // shape.num_kv_heads
    attentions = [m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj")]
    if not attentions:
        raise SettingsError("folding the value rotation needs attention modules with separate v_proj and o_proj")
    with torch.no_grad():
        for attn in attentions:
            v_proj, o_proj = attn.v_proj, attn.o_proj
            h = hadamard(d, torch.float64, v_proj.weight.device)
            rotations = [h] * shape.num_kv_heads  # one per KV head; query head j reads KV head j // group
            w = v_proj.weight.double().reshape(shape.num_kv_heads, d, -1)
            # v_j H = x W_jᵀ H = x (Hᵀ W_j)ᵀ: each KV head's rows become Hᵀ W_j.
            v_proj.weight.copy_(torch.stack([r.T @ w[j] for j, r in enumerate(rotations)]).reshape(v_proj.weight.shape))
            if v_proj.bias is not None:
                b = v_proj.bias.double().reshape(shape.num_kv_heads, d)
                v_proj.bias.copy_(torch.stack([b[j] @ r for j, r in enumerate(rotations)]).reshape(-1))
            # (a_j H) W'_jᵀ = a_j W_jᵀ needs W'_j = W_j H for the columns of query head j.
            wo = o_proj.weight.double().reshape(o_proj.weight.shape[0], shape.num_heads, d)
            folded = [wo[:, j] @ rotations[j // group] for j in range(shape.num_heads)]
            o_proj.weight.copy_(torch.stack(folded, dim=1).reshape(o_proj.weight.shape))


SETTINGS = ("bits", "group_size", "residual", "scaling", "rotation")


def _artifact_settings(path: str, shape: AttentionShape, model: LoadedModel | None) -> dict:
    art = load_artifact(path, method="oscar", model=model.model if model is not None else None)
    fixed = {k: art.settings[k] for k in SETTINGS if k in art.settings}
    if fixed.get("rotation", True) and not torch.equal(art.tensors.get("rotation", torch.empty(0)), hadamard(shape.head_dim)):
        raise ArtifactError(f"artifact {path} holds another rotation than the normalized Hadamard of size {shape.head_dim}")
    return fixed


def build(shape: AttentionShape, settings: MethodSettings, artifacts: str | None, model: LoadedModel | None) -> Oscar:
    """With an artifact, its settings (a deployment reproduces them); options may only repeat them."""
    fixed = _artifact_settings(artifacts, shape, model) if artifacts is not None else None
    return Oscar(OscarConfig(**settings.resolve("oscar", SETTINGS, fixed, artifacts)), shape)
