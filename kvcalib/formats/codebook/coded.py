"""What a method declares to have its flushed blocks read by the codebook kernel: `CodebookCoded`, a class its own
class takes (TurboQuant's, VecInfer's, KIVI's and OScaR's, a plan's). `format.py` beside it reads a method through
`declared`."""

from __future__ import annotations

from typing import Any

from .layout import CodebookSpec, CodedBlock, HeadGroup


class CodebookCoded:
    """Its blocks in the codebook layout (`layout.py`): a method coding every head alike gives `codebook_spec` and
    `codebook_parts`; one mixing formats per KV head (a plan) gives `codebook_groups` and `codebook_blocks`, which the
    format reads."""

    def codebook_spec(self, layer: int) -> CodebookSpec | None:
        """The flushed blocks as the codebook kernel reads them: each part's codes, books, norms and basis, with
        `codebook_parts` giving a block's code rows; or None."""
        raise NotImplementedError(f"{type(self).__name__} declares no codebook layout")

    def codebook_parts(self, packed: Any) -> CodedBlock:
        """A flushed block's code rows, norms, and an affine part's scales and zeros (`CodedBlock`)."""
        raise NotImplementedError(f"{type(self).__name__} has no codebook parts")

    def codebook_groups(self, layer: int) -> list[HeadGroup] | None:
        """The layer's groups of KV heads, each read by one launch of the codebook kernel, and their specs; None where
        the blocks have no codebook layout. One group of every head unless a method mixes formats per head."""
        spec = self.codebook_spec(layer)
        return None if spec is None else [HeadGroup(None, spec)]

    def codebook_blocks(self, packed: Any) -> list[CodedBlock]:
        """A flushed block per group of `codebook_groups` (its heads in the group's order)."""
        return [self.codebook_parts(packed)]


def declared(method, layer: int) -> list[HeadGroup] | None:
    """`method`'s codebook declaration for `layer` (its groups of heads): None where its class does not take
    `CodebookCoded`."""
    return method.codebook_groups(layer) if isinstance(method, CodebookCoded) else None
