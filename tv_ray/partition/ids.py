"""Stage ids: which claim a stage proves or reads, as a small typed value (kind, ranks, tensor).

    >>> StageId.group((0, 4), "mm_15"), StageId.input(3, "tokens")
    (StageId('g0,4/mm_15'), StageId('in:r3/tokens'))

The free parts of a partial claim's split are typed too (`Part`).

Kinds: ``in`` a rank's program input (boundary lineage), ``r`` one rank's
tensor, ``g`` a group's partial sum, ``opaque`` an op without a symbolic
rule. The text form (``str``) is what certificates, reports and variable
names carry; the value is what the code compares, renames and reads — never
the text parsed back.
"""
from __future__ import annotations

from typing import NamedTuple

NOTHING: frozenset = frozenset()     # what an op reads when its arguments read no claim
PREFIX = {"in": "in:r", "r": "r", "g": "g", "opaque": "opaque:r"}


_MADE = tuple.__new__


class StageId(NamedTuple):
    kind: str                   # in | r | g | opaque
    ranks: tuple[int, ...]
    tensor: str

    @staticmethod
    def input(rank: int, tensor: str) -> "StageId":
        """A rank's program input, claimed by boundary lineage."""
        return StageId("in", (rank,), tensor)

    @staticmethod
    def group(members: tuple[int, ...], tensor: str) -> "StageId":
        """The claim on `tensor` held by one rank, or summed over a group of several (made as a tuple is: a
        generation makes millions)."""
        return _MADE(StageId, ("r" if len(members) == 1 else "g", tuple(members), tensor))

    @staticmethod
    def opaque(rank: int, tensor: str) -> "StageId":
        """The value of an op without a symbolic rule (unconstrained)."""
        return StageId("opaque", (rank,), tensor)

    def with_ranks(self, ranks: tuple[int, ...]) -> "StageId":
        """The same claim on other ranks (made as a tuple is: renaming a mirror's reads makes millions)."""
        return _MADE(StageId, (self.kind, ranks, self.tensor))

    def __str__(self) -> str:
        return f"{PREFIX[self.kind]}{','.join(map(str, self.ranks))}/{self.tensor}"

    def __repr__(self) -> str:
        return f"StageId({str(self)!r})"


class Part(NamedTuple):
    """The free part `p` of the split of a partial claim `cid` over its group: the base of that part's atoms
    (text ``<cid>#<p>``), so renaming a slot renames `cid`'s ranks, never text."""

    cid: StageId
    p: int

    def __str__(self) -> str:
        return f"{self.cid}#{self.p}"


__all__ = ["StageId", "Part"]
