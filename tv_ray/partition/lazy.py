"""Values of a symbolic run not built until something reads them (`terms_of`).

A stage's cut value is needed only for its formula, and a formula only for a
stage whose template was not built before (`tv_ray.partition.templates`);
what the run continues from after a cut is read by the next ops, which often
are cut again at once. So three kinds of value are held as what they would be
built from, and built the first time anything asks for their terms:

- `Deferred`: an op's value — a claimed op whose stage is a template built
  before, a group member's part, an op no claim cuts
  (`SymbolicRun._deferred`);
- `Contribution`: what a dp group member continues from after a contribution
  sum across the dp blocks, its block's contribution;
- `Free`: what a group member continues from after a partial claim, its free
  part;
- `FreeSum`: a sum all-reduce of such parts over a subgroup of the claim's
  group (a dp all-reduce of a gradient partial over dp × tp).

Building one later gives the terms building it at once would have given (the
same op on the same values), so a lazy value changes no stage, key or read —
but one: a group whose members' `FreeSum`s hold every part of their claim
once is its slice identically, and that stage is the slice against itself
rather than the parts' sum collected back to it (a key, not a verdict, changes).
Microbatch renamings (`Moved`, `Accumulated`) are lazy too, but of another
kind: `tv_ray.partition.microbatches`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tv_ray.errors import TvRayError
from tv_ray.ir import Node
from tv_ray.partition.ids import StageId
from tv_ray.semantics.symbolic import eval_symbolic, reduce_members

if TYPE_CHECKING:       # (claims pair microbatches, whose renaming reads a lazy value)
    from tv_ray.partition.claims import Claim
    from tv_ray.partition.logical import LogicalTerms
    from tv_ray.partition.stages import SymbolicRun


class Continued:
    """What the run continues from after a whole or sliced claim (`SymbolicRun._continuation`): the slice's
    logical atoms (`LogicalTerms.value_at`), built when read — where the next op is deferred too (its template
    was built), never."""

    __slots__ = ("logical", "claim", "shape", "real")

    def __init__(self, logical: "LogicalTerms", claim: "Claim"):
        self.logical, self.claim, self.shape, self.real = logical, claim, claim.shape, None

    def terms(self) -> np.ndarray:
        if self.real is None:
            self.real = self.logical.claimed(self.claim)
            self.logical = None
        return self.real


class Deferred:
    """An op's value not computed (`SymbolicRun._deferred`): a claimed op's whose stage is a template built before
    (the run continues from the claim, so only a renaming that meets other values, `Moved` or `Accumulated`, or a
    mirror's own stage may still ask for it), a group member's part (its group's stage asks unless its template
    was built), or an op no claim cuts (the op that reads it asks unless it is deferred too)."""

    __slots__ = ("node", "args", "dims", "ctx", "shape", "real", "depth")

    def __init__(self, node: Node, args: list, dims: dict[str, int], ctx, shape: tuple[int, ...]):
        self.node, self.args, self.dims, self.ctx, self.shape, self.real = node, args, dims, ctx, shape, None
        # the longest chain of values not built it ends (building it recurses that deep)
        self.depth = 1 + max((a.depth for a in args if isinstance(a, Deferred)), default=0)

    def terms(self) -> np.ndarray:
        if self.real is None:
            try:
                self.real = eval_symbolic(self.node, [terms_of(a) for a in self.args], self.dims, self.ctx)
            except TvRayError as err:        # an instance of its template was evaluated: the same op, renamed values
                raise TvRayError(f"{self.node.name}: an op of its template was evaluated, this instance fails: "
                                 f"{err}") from err
            self.args = None
        return self.real


class Contribution:
    """What a dp group member continues from after a contribution sum across the dp blocks: its block's
    contribution to the slice (`LogicalTerms.contribution_of`). The group's all-reduce takes it for what it is
    (`SymbolicRun._summed_contributions`: the slice's atoms), so it is built only if anything else reads it."""

    __slots__ = ("logical", "claim", "width", "shape", "real")

    def __init__(self, logical: "LogicalTerms", claim: "Claim", width: int):
        self.logical, self.claim, self.width, self.shape, self.real = logical, claim, width, claim.shape, None

    def terms(self) -> np.ndarray:
        if self.real is None:
            self.real = self.logical.contribution_of(self.claim.logical, self.claim.slices(), self.width)
        return self.real


class Free:
    """A group member's part of a partial claim (`SymbolicRun._part`), not built: fresh atoms, or for the group's
    last member the slice minus the others' parts. The group's sum all-reduce takes the parts for what they are
    (`SymbolicRun._summed_parts`: the slice's atoms), so it is built only if anything else reads it."""

    __slots__ = ("run", "cid", "claim", "position", "size", "shape", "real", "__weakref__")

    def __init__(self, run: "SymbolicRun", cid: StageId, claim: "Claim", position: int, size: int):
        self.run, self.cid, self.claim, self.position, self.size = run, cid, claim, position, size
        self.shape, self.real = claim.shape, None

    def terms(self) -> np.ndarray:
        if self.real is None:
            self.real = self.run._free_terms(self.cid, self.claim, self.position, self.size)
            self.run = None
        return self.real


class FreeSum:
    """A sum all-reduce's result where each member brought its own free part (`Free`) of one partial claim and the
    group is part of the claim's group (`SymbolicRun._summed_subgroup`): the parts at `positions` summed, built when
    read. Where the members of a later group each hold such a sum and together every part once, their sum is the
    claim's slice identically (`SymbolicRun._sums_every_part`): nothing is built."""

    __slots__ = ("run", "cid", "claim", "positions", "size", "shape", "real")

    def __init__(self, run: "SymbolicRun", cid: StageId, claim: "Claim", positions: tuple[int, ...], size: int):
        self.run, self.cid, self.claim, self.positions, self.size = run, cid, claim, positions, size
        self.shape, self.real = claim.shape, None

    def terms(self) -> np.ndarray:
        if self.real is None:
            self.real = reduce_members([self.run._free_terms(self.cid, self.claim, p, self.size)
                                        for p in self.positions], "sum")
            self.run = None
        return self.real


LATER = (Continued, Deferred, Contribution, Free, FreeSum)
# a value of the rank's own terms, built or not: no mirrored rank's, no renaming of microbatch 0's, no contribution
COMPUTED = (np.ndarray, Continued, Deferred, Free, FreeSum)


def terms_of(value):
    """A value's terms where it is built when asked (`LATER`); any other value as it is."""
    return value.terms() if isinstance(value, LATER) else value


__all__ = ["Continued", "Deferred", "Contribution", "Free", "FreeSum", "LATER", "COMPUTED", "terms_of"]
