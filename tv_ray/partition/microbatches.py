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

Where microbatch k's ops run one after the other (a pipeline schedule), the
checks are made per stretch: a `Run` pairs a stretch of them with a stretch
of microbatch 0's wired alike, and `_renamed_run` takes its segments — the
ops taken whatever k is, checked once per rank and counterpart stretch — at
once, after checking what depends on k (the entries, the claims, the reads
of the entries) for the whole segment; the stages are those of taking each
op alone (docs/templates.md).

A stage of microbatch k taken as microbatch 0's (here or by `_moved_stage`)
is kept in the instantiation map as (that stage, k) rather than recorded,
where `Shifts` expands it to exactly the stage recorded there; in the
composition its id stands for microbatch 0's (`Partition.representative`).
"""
from __future__ import annotations

import weakref
from array import array
from typing import NamedTuple

import numpy as np

from tv_ray.errors import TvRayError
from tv_ray.ir import Graph
from tv_ray.ir.ops import COMMUNICATION, P2P
from tv_ray.partition.ids import NOTHING, StageId
from tv_ray.partition.lazy import Continued, Deferred

MIN_RUN = 4     # the fewest ops `Renamed._renamed_run` takes at once; a shorter stretch is taken op by op


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
        # program -> the counterparts and what they read (`_keep`): a value an op reads must be its counterpart's
        # argument renamed, so that argument is kept too — a collective's result, say, which no microbatch pairs
        self.images: dict[str, frozenset[str]] = {}
        for name in set(self.program_of):
            program = plan.programs[name]
            mb = {node.name: node.get_meta("mb") for node in program.nodes}
            self.pairs[name] = pairs = counterparts(program)
            self.named[name] = {(base, mb[op]): op for op, base in pairs.items()}
            self.mb[name] = {op: mb[op] for op in pairs}
            bases = set(pairs.values())
            self.images[name] = frozenset(bases).union(*(program.value(base).args for base in bases))

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


_PAIRED: dict[int, dict[str, str]] = {}      # id of a program -> its `counterparts`, while the program lives


def counterparts(program: Graph) -> dict[str, str]:
    """Each op of a microbatch k ≥ 1 → the op at the same place among microbatch 0's ops, where both are the
    same op (kind, attributes, shape, dtype, arity; a send or recv's message tag aside — each microbatch's messages
    have their own); a microbatch with another number of ops has none. Found once per program (the claims and the
    generation's `Shifts` both ask: 0.5 s for llama3-70b's four); not to be changed."""
    found = _PAIRED.get(id(program))
    if found is None:
        found = _PAIRED[id(program)] = _counterparts(program)
        weakref.finalize(program, _PAIRED.pop, id(program), None)
    return found


def _counterparts(program: Graph) -> dict[str, str]:
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
            if len(node.args) == len(base.args) and node.op is base.op and node.shape == base.shape and \
                    node.dtype == base.dtype and (node.attrs == base.attrs or
                                                  node.op in P2P and _untagged(node) == _untagged(base)):
                pairs[node.name] = base.name
    return pairs


def _untagged(node) -> dict:
    """A send or recv's attributes but its message tag."""
    return {k: v for k, v in node.attr.items() if k != "tag"}


class GroupCut(NamedTuple):
    """A partial cut of a run segment (`Renamed._taken`): its group, its counterpart's value before the cut, and where
    its counterpart's part is kept (`_parts0`: the key, and the entry there — its counterpart's stage id, and part)."""

    members: tuple[int, ...]
    value: object
    key: tuple
    entry: tuple

    @property
    def first(self) -> StageId:
        """The id of its counterpart's stage."""
        return self.entry[0]


class Wired(NamedTuple):
    """What `Renamed._renamed_run` reads of a run segment that is the same for every k (`Renamed._wired`)."""

    claims: tuple           # per float op (`Run.floats`): its counterpart's claim where it is a cut (else None)
    groups: tuple           # per op: the group of its cut (else None)
    steps: tuple            # the cuts in order: (ops, their counterparts' stages) of plain ones between partial
    #                         ones, and (op, `GroupCut`, the segment's cuts and entries it reads) of each partial one
    group_cuts: tuple       # (op, `GroupCut`) of each partial cut
    entry_reads: tuple      # (op, the segment's cuts and entries it reads, its counterpart's stage) of each cut whose
    #                         reads include what entries read
    combos: tuple           # the distinct (cuts, entries) read by the values that outlive the segment
    live: tuple             # (op, its combo) of each value that outlives the segment
    gone: tuple             # the partial cuts whose values the segment reads last: their sources, dropped after it


class Run:
    """A stretch of microbatch k's ops, no communication among them, paired op by op with a stretch of microbatch
    0's wired alike: where an op reads an op of its stretch, its counterpart reads that op's counterpart, and what
    else it reads comes from before the stretch (an entry) as its counterpart's does. `Renamed._renamed_run` takes
    it at once."""

    __slots__ = ("start", "k", "nodes", "bases", "entries", "wiring", "alone", "live", "frees", "gone", "floats",
                 "claims_moved")

    def __init__(self, nodes, at: dict[str, int], pairs: dict[str, str], frees: list[list[str]], start: int,
                 stop: int):
        self.start, self.nodes = start, nodes[start:stop]
        self.k = self.nodes[0].get_meta("mb")
        self.bases = tuple(pairs[node.name] for node in self.nodes)
        entries: dict[tuple[str, str], int] = {}    # (the name read, the counterpart's) -> its index
        wiring = []                 # per op, per argument: j ≥ 0 the stretch's op j, else entry -1 - j
        for node, base in zip(self.nodes, self.bases):
            wiring.append(tuple(at[mine] - start if start <= at.get(mine, -1) < stop else
                                -1 - entries.setdefault((mine, theirs), len(entries))
                                for mine, theirs in zip(node.args, nodes[at[base]].args)))
        self.entries, self.wiring = tuple(entries), tuple(wiring)
        # the entries of each op that reads nothing else: one must be moved (else the op is not renamed)
        self.alone = tuple(tuple(-1 - j for j in w) for w in wiring if max(w) < 0)
        freed = {name for pc in range(start, stop) for name in frees[pc]}
        self.live = tuple(i for i, node in enumerate(self.nodes) if node.name not in freed)
        self.frees = tuple(name for name in freed if at.get(name, -1) < start)
        self.gone = tuple(node.name for node in self.nodes if node.name in freed)     # its own values read last in it
        self.floats = tuple(node.name for node in self.nodes if node.dtype == "float")    # the ops a claim may cut
        self.claims_moved: bool | None = None       # their claims are their counterparts' moved (`_claims_moved`)


def runs(program: Graph, pairs: dict[str, str], frees: list[list[str]], at: dict[str, int]) -> dict[int, Run]:
    """The program's `Run`s of at least `MIN_RUN` ops, by first position (`at`: each op's)."""
    nodes = program.nodes
    found, start = {}, 0
    while start < len(nodes):
        stop = _run_end(nodes, at, pairs, start)
        if stop - start >= MIN_RUN:
            found[start] = Run(nodes, at, pairs, frees, start, stop)
        start = max(stop, start + 1)
    return found


def _run_end(nodes, at: dict[str, int], pairs: dict[str, str], start: int) -> int:
    """Where the run from `start` ends (`start` itself: no run)."""
    def taken(node) -> bool:
        return node.name in pairs and bool(node.args) and node.op not in COMMUNICATION

    if not taken(nodes[start]):
        return start
    k, first = nodes[start].get_meta("mb"), at[pairs[nodes[start].name]]
    stop = start + 1
    while stop < len(nodes) and taken(node := nodes[stop]) and node.get_meta("mb") == k and \
            at[pairs[node.name]] == first + stop - start:
        for mine, theirs in zip(node.args, nodes[at[pairs[node.name]]].args):
            i, j = at.get(mine, -1), at.get(theirs, -1)
            inside, theirs_inside = start <= i < stop, first <= j < first + stop - start
            if inside != theirs_inside or inside and j - first != i - start:
                return stop
        stop += 1
    return stop


class Renamed:
    """The renamed ops of a `SymbolicRun` (a mixin: it reads the run's moves, claims, sources, stages and
    stand-ins)."""

    def _pair_microbatches(self, plan, on: bool = True, shifts: Shifts | None = None) -> None:
        """`shifts`: the pairing of this plan's microbatches, if built already (once for every pipeline shard of a
        generation: a 405B plan's 16 programs of ~33k ops took 1.4 s a shard)."""
        self.shifts = shifts if shifts is not None or self.moves is None else Shifts(plan, self.moves.blocks)
        on = on and self.shifts is not None      # off: every op of microbatch k is evaluated
        self._images: dict[str, frozenset[str]] = self.shifts.images if on else {}
        # program -> op of microbatch k -> (its counterpart, their arguments side by side), or None: what `_renamed`
        # reads, made when first asked (most ops are taken in run segments: never asked)
        self._pairing: dict[str, dict[str, tuple | None]] | None = {} if on else None
        self._kept: dict[int, dict] = {}         # rank -> counterpart (or input) -> its value after its op
        self._stage_at: dict[int, dict[str, int]] = {}   # rank -> op of microbatch 0 -> its stage's index
        self.renamed = 0                          # ops taken as their counterparts' renamed
        # program -> its runs by first position, and its ops' positions (`_program_runs`); None: no runs
        self._runs: dict[str, tuple[dict[int, Run], dict[str, int]]] | None = {} if on else None
        self._run_parts: dict[tuple[str, int, int], Run] = {}     # (program, first, end) -> a run's segment
        self._segment_checks: dict[tuple, list] = {}    # (rank, a run's counterparts) -> its segments' (`_segments`)
        self._segment_at: dict[int, dict[int, tuple]] = {}    # rank -> segments ahead by first position
        self.shifted = array("i"), array("i")     # (microbatch 0's stage, k) of each stage kept as a copy
        # the claims, where they hold microbatch k's ops' claims as their counterparts' moved by this run's blocks
        self._stated = self.claims if on and getattr(self.claims, "blocks", None) == self.moves.blocks else None

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
        paired = self._paired(state.name, node.name)
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

    def _paired(self, program: str, op: str) -> tuple | None:
        """(op's counterpart, their arguments side by side) where a microbatch k pairs op with microbatch 0's (else,
        and without moves, None)."""
        if self._pairing is None:
            return None
        found = self._pairing.setdefault(program, {})
        if op in found:
            return found[op]
        base = self.shifts.pairs[program].get(op)
        nodes = self._nodes[program]
        paired = found[op] = None if base is None else (base, tuple(zip(nodes[op].args, nodes[base].args)))
        return paired

    def _renamed_run(self, state) -> bool:
        """Take the ops from here to the end of their run segment (`_segments`) at once, each as `_renamed` would
        take it alone — every op its counterpart's value renamed, every cut its counterpart's stage kept as a
        microbatch copy, in the same order — where what `_renamed` checks op by op and depends on k holds (the
        entries, the claims, the reads of the entries); else False."""
        if self._runs is None:
            return False
        rank, env = state.rank, state.env
        ahead = self._segment_at.get(rank)
        found = ahead.pop(state.pc, None) if ahead else None     # segments ahead are found on movable ranks only
        if found is None:
            run = (self._runs.get(state.name) or self._program_runs(state))[0].get(state.pc)   # most ops: no run
            if run is None or not self._movable(rank):
                return False
            ahead = self._segment_at.setdefault(rank, {})
            for segment, checked in self._segments(state, run):
                ahead[segment.start] = segment, checked
            found = ahead.pop(state.pc, None)
            if found is None:
                return False
        segment, checked = found
        if rank in self.mirrors_of and not self._renamed_throughout_run(rank, segment):
            return False
        k, kept = segment.k, self._kept[rank]
        moved = [False] * len(segment.entries)
        for e, (name, theirs) in enumerate(segment.entries):
            value = env[name]
            if name != theirs:
                if not isinstance(value, Moved) or value.base is not kept.get(theirs) or value.k != k:
                    return False
                moved[e] = True
            elif not isinstance(value, (np.ndarray, Continued, Deferred)) or not self._fixed(rank, value, k):
                return False
        if not all(any(moved[e] for e in alone) for alone in segment.alone):
            return False
        if not self._claims_moved(state.name, segment):
            claims, moves_to = self.claims.get, self.moves.blocks.moves_to
            for name, claim0 in zip(segment.floats, checked.claims):
                claim = claims((rank, name))
                if claim is None:
                    if claim0 is not None:
                        return False
                elif claim0 is None or not moves_to(claim0, k, claim):
                    return False
        paired = self.moves.pairs.get(k, {})
        for i, at in checked.group_cuts:     # a partial cut's free parts pair with its counterpart's (`_moved_part`)
            cid = StageId.group(at.members, segment.nodes[i].name)
            if paired.get(at.first, cid) != cid or paired.get(cid, at.first) != at.first:
                return False
        shifts = self.shifts
        for i, within, entries, first in checked.entry_reads:
            renamed = [shifts.rename_id(r, k) for r in first.reads]
            reads = self._segment_reads(rank, segment, checked.groups, within, entries)
            if len(renamed) != len(reads) or set(renamed) != reads:
                return False
        self._take_segment(state, segment, checked)
        return True

    def _claims_moved(self, program: str, segment: Run) -> bool:
        """Is every float op's claim in the segment its counterpart's moved by the claims' making (`Claims.moved`:
        on every rank of the program, by the blocks this run moves by), so that no op needs checking?"""
        moved = segment.claims_moved
        if moved is None:
            moved = segment.claims_moved = self._stated is not None and self._stated.all_moved(program, segment.floats)
        return moved

    def _segment_reads(self, rank: int, segment: Run, groups, within, entries) -> frozenset:
        """The claims read by the segment's cuts `within` (each cut by `groups`) and by what its entries `entries`
        read."""
        return frozenset(StageId.group(groups[j], segment.nodes[j].name) for j in within).union(
            *(self.sources.get((rank, segment.entries[e][0]), NOTHING) for e in entries))

    def _take_segment(self, state, segment: Run, checked: Wired) -> None:
        """What `_renamed` (and, at a partial cut, `_cut`) leaves after each op of the segment, at once: its cuts in
        order, then what outlives it."""
        rank, k, env, start, groups = state.rank, segment.k, state.env, segment.start, checked.groups
        reads = [self._segment_reads(rank, segment, groups, *combo) for combo in checked.combos]
        kept = self._kept[rank]
        for step in checked.steps:
            if len(step) == 2:          # plain cuts, each its counterpart's stage kept as a microbatch copy
                positions, ats = step
                self._keep_copies(rank, [start + i for i in positions], ats, k)
                continue
            i, at, within, entries = step
            state.pc = start + i
            self._segment_part(state, segment.nodes[i], at, k, self._segment_reads(rank, segment, groups, within,
                                                                                     entries))
        nodes, bases, sources = segment.nodes, segment.bases, self.sources
        for i, combo in checked.live:
            name = nodes[i].name
            env[name] = Moved(kept[bases[i]], k)
            sources[rank, name] = reads[combo]
        for name in segment.frees:
            del env[name]
            self._dropped(rank, name)
        for name in checked.gone:
            self._dropped(rank, name)
        self.renamed += len(segment.nodes) - len(checked.group_cuts)
        state.pc = start + len(segment.nodes)
        self._stepped_past(state, len(segment.nodes))

    def _segment_part(self, state, node, at: GroupCut, k: int, reads: frozenset) -> None:
        """A partial cut of a run segment, as `_cut` makes it (`_taken` checked what does not depend on k): its part,
        its counterpart's value before the cut renamed, added to its group; the member continues from its
        counterpart's part renamed, the two cuts' free atoms paired (`_moved_part`)."""
        rank = state.rank
        cid = StageId.group(at.members, node.name)
        self.sources[rank, node.name] = frozenset({cid})
        self._add_part(state, node, self.claims[rank, node.name], cid, at.members, (Moved(at.value, k), reads, None),
                       None, False)
        if self._parts0.get(rank, {}).get(at.key) is not at.entry or not self.moves.pair(k, at.first, cid):
            raise TvRayError(f"{self.plan.describe(rank)} {node.name}: a partial cut in a run segment "
                             f"continues from something other than its counterpart's part renamed")

    def _program_runs(self, state) -> tuple[dict[int, Run], dict[str, int]]:
        """The program's runs by first position, and its ops' positions."""
        found = self._runs.get(state.name)
        if found is None:
            at = {node.name: i for i, node in enumerate(state.program.nodes)}
            found = self._runs[state.name] = runs(state.program, self.shifts.pairs[state.name],
                                                  self.frees[state.name], at), at
        return found

    def _segments(self, state, run: Run) -> list[tuple[Run, Wired]]:
        """The run's segments on this rank: its longest stretches of ops `_renamed` takes as renamed whatever k is
        (`_taken`), of at least `MIN_RUN` ops, each a `Run` with what `_renamed_run` reads of it that is the same
        for every k (`_wired`) — found once per rank and counterpart stretch."""
        key = (state.rank, run.bases[0], run.wiring)
        found = self._segment_checks.get(key)
        if found is None:
            taken = [self._taken(state, node, base, run.k) for node, base in zip(run.nodes, run.bases)]
            found = self._segment_checks[key] = []
            a = 0
            for b in range(len(taken) + 1):
                if b == len(taken) or taken[b] is None:
                    if b - a >= MIN_RUN:
                        checked = self._wired(state.rank, self._segment(state, run, a, b), taken[a:b])
                        if checked is not None:
                            found.append((a, b, checked))
                    a = b + 1
        return [(self._segment(state, run, a, b), checked) for a, b, checked in found]

    def _segment(self, state, run: Run, a: int, b: int) -> Run:
        """Ops [a, b) of the run, as a run of their own."""
        if a == 0 and b == len(run.nodes):
            return run
        key = (state.name, run.start + a, run.start + b)
        part = self._run_parts.get(key)
        if part is None:
            part = self._run_parts[key] = Run(state.program.nodes, self._program_runs(state)[1],
                                              self.shifts.pairs[state.name], self.frees[state.name], *key[1:])
        return part

    def _taken(self, state, node, base: str, k: int):
        """What `_renamed` and `_renamed_cut` (with `_expands_to`) check of an op of microbatch k that is the same
        for every k: None where the op is not taken as its counterpart's renamed; else, for a cut, its counterpart's
        claim (which must be moved to k) with its counterpart's stage, kept as a microbatch copy — or for a partial
        cut over a group in dp block 0, a `GroupCut`: stepping it evaluates it as its counterpart's value renamed
        (`_moved`) and continues from its counterpart's part renamed (`_moved_part`) —; (None, None) for an op no
        claim cuts."""
        rank = state.rank
        kept = self._kept.get(rank, {})
        if base not in kept or (rank, base) in self.opaque:
            return None
        claim = self.claims.get((rank, base)) if node.dtype == "float" else None
        if claim is None:
            return None, None
        if self.moves.blocks.tags.get(claim.logical) is None or not self.moves.first(claim):
            return None
        if claim.partial:
            return self._group_cut(state, node, base, claim)
        at = self._stage_at.get(rank, {}).get(base)
        first = self.obligations[at] if at is not None else None
        if first is None or first.ranks != (rank,) or first.id != StageId("r", (rank,), base) or \
                self._conts.get(rank, {}).get(place(claim)) is not kept[base] or first.program != state.name or \
                first.notes or self._info_of(node) != (first.op, first.module, first.phase, first.realises, k):
            return None
        return claim, at

    def _group_cut(self, state, node, base: str, claim):
        """`_taken` of a partial cut: its counterpart's claim and `GroupCut`, or None."""
        rank, kept = state.rank, self._kept[state.rank]
        members = self.members(rank, claim.partial)
        if any(m in self.mirrored for m in members) or self._contributes(members, claim):
            return None
        args = [kept.get(name) for name in self._nodes[state.name][base].args]
        value = self._memoized(rank, node, args) if all(a is not None for a in args) else None
        cut = self._cuts0.get(rank, {}).get(place(claim))
        key = place(claim), members.index(rank)
        part = self._parts0.get(rank, {}).get(key)
        if value is None or cut is None or cut[1] is not value or part is None or part[1] is not kept[base]:
            return None
        return claim, GroupCut(members, value, key, part)

    def _wired(self, rank: int, segment: Run, taken: list) -> Wired | None:
        """What `_renamed_run` reads of a segment (its ops `taken`, `Wired`), or None where a cut reading only the
        segment's own cuts does not read its counterpart's reads renamed (not taken at once)."""
        mine, groups, steps, group_cuts, entry_reads, reads_of = [], [], [], [], [], []
        positions: list[int] = []       # the plain cuts since the last partial one: their ops and stages
        ats: list[int] = []
        for i, (wiring, (claim, at)) in enumerate(zip(segment.wiring, taken)):
            within = frozenset().union(*(reads_of[j][0] for j in wiring if j >= 0))
            entries = frozenset().union(*(reads_of[j][1] for j in wiring if j >= 0), (-1 - j for j in wiring if j < 0))
            mine.append(claim)
            groups.append(None if claim is None else at.members if isinstance(at, GroupCut) else (rank,))
            if claim is None:
                reads_of.append((within, entries))
                continue
            reads_of.append((frozenset({i}), frozenset()))
            if isinstance(at, GroupCut):
                if positions:
                    steps.append((tuple(positions), tuple(ats)))
                    positions, ats = [], []
                steps.append((i, at, within, entries))
                group_cuts.append((i, at))
                continue
            first = self.obligations[at]
            if entries:
                entry_reads.append((i, within, entries, first))
            elif len(first.reads) != len(within) or \
                    set(first.reads) != {StageId.group(groups[j], segment.bases[j]) for j in within}:
                return None
            positions.append(i)
            ats.append(at)
        if positions:
            steps.append((tuple(positions), tuple(ats)))
        combos: dict[tuple, int] = {}
        live = tuple((i, combos.setdefault(reads_of[i], len(combos))) for i in segment.live)
        gone = tuple(segment.nodes[i].name for i, _ in group_cuts if segment.nodes[i].name in segment.gone)
        floats = tuple(claim for node, claim in zip(segment.nodes, mine) if node.dtype == "float")
        return Wired(floats, tuple(groups), tuple(steps), tuple(group_cuts), tuple(entry_reads), tuple(combos),
                     live, gone)

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
            self._keep_copy(at, k)
        else:
            self._append(cid, members, state, node, claim, first.key, reads)

    def _keep_copy(self, at: int, k: int) -> None:
        """The stage just met is recorded stage `at` moved to microbatch k: a row of the instantiation map."""
        self.shifted[0].append(at)
        self.shifted[1].append(k)
        self._latest = (at, k)

    def _keep_copies(self, rank: int, positions: list[int], ats: tuple[int, ...], k: int) -> None:
        """`_keep_copy` and `_copy_mirrors` of the cuts of a run segment at `positions`, recorded stages `ats` each
        moved to microbatch k, at once."""
        self.moved += len(ats)
        self.shifted[0].extend(ats)
        self.shifted[1].extend([k] * len(ats))
        self._latest = (ats[-1], k)
        self._fan_copies(rank, positions, ats, k)

    def _expands_to(self, first, k: int, cid, members, state, node, claim, reads) -> bool:
        """Is `Shifts.shift(first, k)` (its position aside) exactly the stage `_obligation` records here? Field by
        field, without building either: id, ranks, program, claim, reads (the same ones, none twice), what the op is
        (kind, module, phase, what it realises, its microbatch k), no notes — the key is `first`'s either way."""
        shifts = self.shifts
        if first.ranks != members or first.program != state.name or first.notes or \
                self._info_of(node) != (first.op, first.module, first.phase, first.realises, k) or \
                shifts.rename_id(first.id, k) != cid or not shifts.blocks.moves_to(first.claim, k, claim):
            return False
        renamed = [shifts.rename_id(r, k) for r in first.reads]
        return len(renamed) == len(reads) and set(renamed) == reads


def place(claim) -> tuple:
    """Where a claim lies (its tensor, slice, partial axes and scale): what microbatch 0's values are kept by."""
    return claim.logical, claim.offsets, claim.shape, claim.partial, claim.scale


__all__ = ["counterparts", "runs", "place", "Renamed", "Run", "GroupCut", "Shifts", "CopyIndex", "Moved", "Accumulated",
           "LAZY"]
