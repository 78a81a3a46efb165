"""Microbatch k's ops taken as microbatch 0's renamed, without evaluating them.

With microbatch symmetry (`tv_ray.partition.symmetry.Moves`) a value of
microbatch k ≥ 1 is `Moved`: microbatch 0's value under σₖ, the renaming of
variables that swaps sample block 0 with block k (and the free parts paired
with it). `SymbolicRun` finds such values by evaluating each op of
microbatch k on them (`_moved`: a memo of microbatch 0's ops by their
arguments) and each stage by comparing its terms with microbatch 0's
(`_moved_stage`): about 90 µs per op, most of a frontier plan's generation,
where nearly every op is a cut.

Here each op of microbatch k is paired, once per program, with the op at the
same place among microbatch 0's (`counterparts`: the same op, attributes,
shape, dtype and arity). At the op, on a rank reading block 0, it is taken as
its counterpart's value renamed when, argument by argument, the value it
reads is σₖ of what the counterpart read: a `Moved` value of that very object
(identity) with the same k, or the very same tensor (same name) whose value
σₖ leaves alone (no sample of block 0 or k, no free part). Then

    op(σₖ a₁, …, σₖ aₙ) = σₖ op(a₁, …, aₙ)

(a renaming of variables commutes with every symbolic rule; the rank, so
its coordinate, is the same), so its value is `Moved(counterpart's, k)`.
At a cut of a whole or sliced claim that is the counterpart's claim moved to
block k (`Moves.split`), the stage's formula is σₖ of the counterpart's
stage's formula — valid exactly when that one is, with its key — so it is
recorded with that key, and the run continues from the claim as
`_continuation` would. Anything else (a partial claim, a mirrored rank's
own values, an argument that is not σₖ of the counterpart's) is stepped as
before: the pairing is a hypothesis that the arguments confirm or refute at
every op, never an assumption that microbatches are alike. The stages and
their order are those of evaluating every op (tests/partition/
test_microbatches.py compares them, keys too, on the grid plans); where
evaluating would build a stage in full — the memo found microbatch 0's cut
by its claim, and another op cut at that claim — it takes its counterpart's
key here, so a plan may have fewer unique keys.

A stage of microbatch k taken as microbatch 0's (here or by `_moved_stage`)
is kept in the instantiation map as (that stage, k) rather than recorded,
where `Shifts` expands it to exactly the stage recorded there; in the
composition its id stands for microbatch 0's (`Partition.representative`).
"""
from __future__ import annotations

from array import array

import numpy as np

from tv_ray.ir import Graph
from tv_ray.partition.ids import StageId
from tv_ray.partition.lazy import Continued, Deferred

SIGNATURE = ("op", "attrs", "shape", "dtype")


class Moved:
    """A value of microbatch k never computed: microbatch 0's `base` renamed (`Moves.rename`), built only when
    it meets a value that is not (`SymbolicRun._real`)."""

    __slots__ = ("base", "k", "shape", "real")

    def __init__(self, base: np.ndarray, k: int):
        self.base, self.k, self.shape, self.real = base, k, base.shape, None


class Accumulated:
    """A sum over microbatches never computed: microbatch 0's `base` plus its renamings to each other
    microbatch in `ks` (gradient accumulation of `Moved` values). Recorded at its cut as microbatch 0's
    contribution alone (`SymbolicRun._accumulated`); built only when it meets anything else. `made`: the
    base's provenance (None: unknown), the template of that stage."""

    __slots__ = ("base", "ks", "shape", "real", "made")

    def __init__(self, base: np.ndarray, ks: frozenset[int], made: tuple | None = None):
        self.base, self.ks, self.shape, self.real, self.made = base, ks, base.shape, None, made


LAZY = (Moved, Accumulated)


class Shifts:
    """How a stage of microbatch 0 reads as microbatch k's: a microbatch copy in the instantiation map
    (`Partition.copy`). Its op and the ops it read are named through the pairing (`counterparts`: the op at
    the same place among microbatch k's), its claim moved to block k; nothing else changes. A stage is kept
    as a copy only where this expansion is exactly the stage its run records (`Renamed._append_moved`), so a
    copy is a record of that stage, never an assumption about it."""

    def __init__(self, plan, blocks):
        names, ids = plan.rank_programs()
        self.program_of = [names[i] for i in ids]             # rank -> its program
        self.blocks = blocks
        self.pairs: dict[str, dict[str, str]] = {}     # program -> op of microbatch k -> its counterpart
        self.named: dict[str, dict[tuple[str, int], str]] = {}   # program -> (counterpart, k) -> op
        self.mb: dict[str, dict[str, int]] = {}        # program -> op of microbatch k -> k
        # program -> op of microbatch k -> (its counterpart, their arguments side by side): what `_renamed` reads
        self.wiring: dict[str, dict[str, tuple]] = {}
        self.images: dict[str, frozenset[str]] = {}    # program -> the counterparts (`_keep`)
        for name in set(self.program_of):
            program = plan.programs[name]
            mb = {node.name: node.get_meta("mb") for node in program.nodes}
            self.pairs[name] = pairs = counterparts(program)
            self.named[name] = {(base, mb[op]): op for op, base in pairs.items()}
            self.mb[name] = {op: mb[op] for op in pairs}
            nodes = {n.name: n for n in program.nodes}
            self.wiring[name] = {op: (base, tuple(zip(nodes[op].args, nodes[base].args))) for op, base in pairs.items()}
            self.images[name] = frozenset(pairs.values())

    def rename_id(self, cid: StageId, k: int) -> StageId:
        """A stage or claim id of microbatch 0 as microbatch k's (an input, or an op no microbatch pairs, is
        the same)."""
        if cid.kind not in ("r", "g"):
            return cid
        name = self.named[self.program_of[cid.ranks[0]]].get((cid.tensor, k))
        return cid if name is None else StageId(cid.kind, cid.ranks, name)

    def first(self, cid: StageId) -> tuple[StageId, int] | None:
        """The id of microbatch 0 and the k that `rename_id` names `cid` from, for an op some microbatch k ≥ 1
        pairs; else None."""
        if cid.kind not in ("r", "g"):
            return None
        program = self.program_of[cid.ranks[0]]
        base = self.pairs[program].get(cid.tensor)
        return None if base is None else (StageId(cid.kind, cid.ranks, base), self.mb[program][cid.tensor])

    def shift(self, ob, k: int):
        """Stage `ob` of microbatch 0 as microbatch k's (its position, microbatch 0's)."""
        cid = self.rename_id(ob.id, k)
        reads = [self.rename_id(r, k) for r in ob.reads]
        return type(ob)(cid, ob.ranks, ob.program, cid.tensor, self.blocks.move(ob.claim, k), ob.key,
                        tuple(reads) if len(reads) < 2 else tuple(sorted(reads)), ob.op, ob.module,
                        ob.phase, ob.realises, k, ob.position, ob.notes)


class CopyIndex:
    """The stages of a generation by id: a recorded one (its index, microbatch 0), or a microbatch copy — recorded
    stage i moved to microbatch k (`shifted`: the (i, k) of each) — whose id is that stage's renamed
    (`Shifts.rename_id`), found from its op back to the counterpart (`Shifts.first`) without naming every copy."""

    def __init__(self, obligations, shifts: Shifts | None, at: np.ndarray, ks: np.ndarray):
        self.obligations, self.shifts = obligations, shifts
        self.recorded = {ob.id: i for i, ob in enumerate(obligations)}
        self.width = int(ks.max(initial=0)) + 1
        # each (stage, microbatch) held, as one bit of (stage · width + microbatch): 1 MB at llama3-405b
        held = np.zeros(len(obligations) * self.width, dtype=bool)
        held[at.astype(np.int64) * self.width + ks] = True
        self.copies = np.packbits(held, bitorder="little").tobytes()

    def find(self, cid: StageId) -> tuple[int, int] | None:
        """(recorded stage, microbatch) of the stage with id `cid`; None if there is none."""
        i = self.recorded.get(cid)
        if i is not None:
            return i, 0
        first = self.shifts.first(cid) if self.shifts is not None else None
        i = self.recorded.get(first[0]) if first is not None else None
        if i is None or not 0 < first[1] < self.width:
            return None
        code = i * self.width + first[1]
        return (i, first[1]) if self.copies[code >> 3] >> (code & 7) & 1 else None


def counterparts(program: Graph) -> dict[str, str]:
    """Each op of a microbatch k ≥ 1 → the op at the same place among microbatch 0's ops, where both are the
    same op (kind, attributes, shape, dtype, arity); a microbatch with another number of ops has none."""
    by_mb: dict[int, list] = {}
    for node in program.nodes:
        mb = node.get_meta("mb")
        if mb is not None:
            by_mb.setdefault(mb, []).append(node)
    first = by_mb.get(0, [])
    pairs = {}
    for k, nodes in by_mb.items():
        if k == 0 or len(nodes) != len(first):
            continue
        for node, base in zip(nodes, first):
            if len(node.args) == len(base.args) and \
                    all(getattr(node, f) == getattr(base, f) for f in SIGNATURE):
                pairs[node.name] = base.name
    return pairs


class Renamed:
    """The renamed ops of a `SymbolicRun` (a mixin: it reads the run's moves, claims, sources, stages and
    stand-ins)."""

    def _pair_microbatches(self, plan, on: bool = True, shifts: Shifts | None = None) -> None:
        """`shifts`: the pairing of this plan's microbatches, if built already (once for every pipeline shard of a
        generation: a 405B plan's 16 programs of ~33k ops took 1.4 s a shard)."""
        self.shifts = shifts if shifts is not None or self.moves is None else Shifts(plan, self.moves.blocks)
        on = on and self.shifts is not None      # off: every op of microbatch k is evaluated
        self._images: dict[str, frozenset[str]] = self.shifts.images if on else {}
        self._pairing: dict[str, dict[str, tuple]] = self.shifts.wiring if on else {}
        self._kept: dict[int, dict] = {}         # rank -> counterpart (or input) -> its value after its op
        self._stage_at: dict[int, dict[str, int]] = {}   # rank -> op of microbatch 0 -> its stage's index
        self.renamed = 0                          # ops taken as their counterparts' renamed
        self.shifted = array("i"), array("i")     # (microbatch 0's stage, k) of each stage kept as a copy

    def _keep(self, state, node, value) -> None:
        """After a counterpart's op on a rank reading block 0: its value, for the ops paired with it."""
        if node.name in self._images.get(state.name, ()) and self._movable(state.rank):
            self._kept.setdefault(state.rank, {})[node.name] = value

    def _keep_input(self, rank: int, name: str, value) -> None:
        if self.moves is not None and self._movable(rank):
            self._kept.setdefault(rank, {})[name] = value

    def _staged(self, rank: int, node) -> None:
        """After recording the stage of an op of microbatch 0 (a whole or sliced claim): where it is."""
        if self.moves is not None and self.obligations[-1].mb == 0:
            self._stage_at.setdefault(rank, {})[node.name] = len(self.obligations) - 1

    def _renamed(self, state, node) -> bool:
        """Take the op as its counterpart's renamed (the module docstring); False: step it."""
        paired = self._pairing.get(state.name, {}).get(node.name)     # none without moves
        if paired is None or not self._movable(state.rank):
            return False
        rank = state.rank
        base, args = paired
        kept = self._kept.get(rank)
        if kept is None or base not in kept or (rank, base) in self.opaque:
            return False
        env, k = state.env, None
        for name, theirs in args:
            value = env[name]
            if isinstance(value, Moved):
                if value.base is not kept.get(theirs) or k not in (None, value.k):
                    return False
                k = value.k
            elif name != theirs or not isinstance(value, (np.ndarray, Continued, Deferred)):
                return False
        if k is None or not all(self._fixed(rank, env[name], k) for name, theirs in args if name == theirs):
            return False
        if rank in self.mirrors_of and not self._renamed_throughout(rank, node):
            return False
        claim = self.claims.get((rank, node.name))       # a movable rank is not mirrored: its own claims
        if claim is not None and node.dtype == "float":
            return self._renamed_cut(state, node, base, claim, k)
        self.sources[rank, node.name] = self._reads(state, node)
        self.renamed += 1
        self._passed(state, node, Moved(kept[base], k))
        return True

    def _renamed_cut(self, state, node, base: str, claim, k: int) -> bool:
        """A cut whose claim is the counterpart's moved to block k: the counterpart's stage, renamed."""
        rank = state.rank
        mine = self.claims.get((rank, base))
        at = self._stage_at.get(rank, {}).get(base)
        if claim.partial or mine is None or at is None or self.moves.blocks.tags.get(mine.logical) is None or \
                not self.moves.first(mine):
            return False
        moved = self.moves.blocks.move(mine, k)         # `claim` must be it: inside block k, as `mine` in block 0
        if place(moved) != place(claim) or self.obligations[at].ranks != (rank,):
            return False
        reads = self._reads(state, node)
        cid = StageId("r", (rank,), node.name)
        self.sources[rank, node.name] = frozenset({cid})
        self._append_moved(at, k, cid, (rank,), state, node, claim, reads)
        self.renamed += 1
        self._copy_mirrors(state)
        first = self._conts.get(rank, {}).get(place(mine))      # what `_continuation` continues from
        self._passed(state, node, Moved(first, k) if first is not None else self._continuation(rank, claim))
        return True

    def _append_moved(self, at: int, k: int, cid, members, state, node, claim, reads) -> None:
        """The stage of microbatch k that is recorded stage `at` (microbatch 0's) renamed: kept as a microbatch copy
        (`Shifts`) where that expansion is exactly the stage, else recorded with that stage's key."""
        self.moved += 1
        first = self.obligations[at]
        if self._expands_to(first, k, cid, members, state, node, claim, reads):
            self.shifted[0].append(at)
            self.shifted[1].append(k)
            self._latest = (at, k)
        else:
            self._append(cid, members, state, node, claim, first.key, reads)

    def _expands_to(self, first, k: int, cid, members, state, node, claim, reads) -> bool:
        """Is `Shifts.shift(first, k)` (its position aside) exactly the stage `_obligation` records here? Field by
        field, without building either: id, ranks, program, claim, reads (the same ones, none twice), what the op is
        (kind, module, phase, what it realises, its microbatch k), no notes — the key is `first`'s either way."""
        shifts = self.shifts
        if first.ranks != members or first.program != state.name or first.notes or \
                self._info_of(node) != (first.op, first.module, first.phase, first.realises, k) or \
                shifts.rename_id(first.id, k) != cid or shifts.blocks.move(first.claim, k) != claim:
            return False
        renamed = [shifts.rename_id(r, k) for r in first.reads]
        return len(renamed) == len(reads) and set(renamed) == reads


def place(claim) -> tuple:
    """Where a claim lies (its tensor, slice and partial axes): what microbatch 0's values are kept by."""
    return claim.logical, claim.offsets, claim.shape, claim.partial


__all__ = ["counterparts", "place", "Renamed", "Shifts", "CopyIndex", "Moved", "Accumulated", "LAZY"]
