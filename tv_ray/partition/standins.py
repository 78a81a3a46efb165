"""Stand-ins: mirrored data-parallel ranks that are never stepped, their part played by their representatives.

A mirrored rank (`tv_ray.partition.symmetry`) runs its representative's
program on its representative's claims moved to its block, so every value
it holds is `Mirrored` — its representative's renamed, or (`same`) its
representative's very value, after a collective both took part in — and
each of its stages is its representative's renamed. Stepping it op by op
(`SymbolicRun` with `virtual=False`) finds nothing else; it only costs: at
dp=8 most of a run's steps are mirrored ones.

So, when every rank off dp 0 is mirrored, the run steps the representatives
alone and keeps, for each of their values, the one fact stepping a mirror
would establish: what the mirrors hold there — its *kind*: renamed (the
default), `SAME`, `CONSTANT` (a value without variables, the
representative's own), or the mirrors' own values by dp block (the free
part of a partial claim across dp blocks that is no contribution sum, as
`SymbolicRun._part` makes it). The mirrors are met only where stepping
would meet them:

- at each op, the kinds of the arguments decide the result's, exactly as
  `SymbolicRun._evaluate` decides a mirrored rank's (mixing kinds is
  `Asymmetric`); an op on values of the mirrors' own (and constants) is
  computed for each mirror, as stepping it would;
- a collective over a group without mirrors (tp, within dp 0) gives each
  member's mirrors the kind of their common arguments; a collective over a
  group across dp blocks gets each mirror's input from its representative
  (`stand_in`), the very `Mirrored` value it would bring, and the group's
  rules (`_as_mirror`) say what each mirror receives (`stood_in`): a value of
  its own ends the stand-ins;
- a cut of a representative's whole or sliced claim is also each mirror's
  cut: a copy of the stage per mirror (`Partition.copy`); a partial claim over
  a group within dp 0 is one copy per mirrored group; a partial claim over a
  group across dp blocks gets each mirror's part from its representative's,
  and each mirror continues from its own part (`SymbolicRun._part`); a
  constant or own value cut at a whole or sliced claim is each mirror's own
  stage, recorded as stepping would record it;
- a send to or a receive from a mirrored rank ends the stand-ins.

Whatever ends them raises `Asymmetric`, and the generation steps every
mirrored rank (`tv_ray.partition.generate`), as before; the stages are the
same either way (tests/partition/test_standins.py compares them), only their
order of recording may differ.
"""
from __future__ import annotations

import numpy as np

from tv_ray.errors import Asymmetric
from tv_ray.ir import Node, Op
from tv_ray.ir.ops import COLLECTIVES
from tv_ray.partition.claims import Claim
from tv_ray.partition.ids import NOTHING, StageId
from tv_ray.partition.lazy import terms_of
from tv_ray.partition.logical import SHAPE_ONLY
from tv_ray.terms import Kind, Term, postorder

SAME, CONSTANT = "same", "constant"     # kinds besides renamed (None) and own values ({dp block: value})


class Mirrored:
    """The value a mirrored rank holds, never computed: its representative's renamed (or, `same`, its
    representative's exactly — the result of a collective both took part in)."""

    __slots__ = ("shape", "same")

    def __init__(self, shape: tuple[int, ...], same: bool = False):
        self.shape, self.same = shape, same


def constant(value: np.ndarray) -> bool:
    """No variable (and no data element) in any element."""
    terms = [t for t in value.reshape(-1) if isinstance(t, Term)]
    if any(not isinstance(t, (Term, int, float, bool, np.integer, np.floating, np.bool_)) for t in value.reshape(-1)):
        return False
    return not any(n.kind is Kind.VAR for n in postorder(*terms)) if terms else True


class StandIns:
    """The stand-in bookkeeping of a `SymbolicRun` (a mixin: it reads the run's plan, mirrors and sources)."""

    def _stand_in_for(self, virtual: bool) -> None:
        """Stand in for the mirrored ranks when `virtual` and every rank off dp 0 is mirrored."""
        mirrors = self.mirrors
        self.mirrors_of: dict[int, tuple[int, ...]] = {}
        self._kinds: dict[tuple[int, str], object] = {}    # (representative, value) -> its mirrors' kind there
        self._stood: dict[int, object] = {}               # representative -> its mirrors' kind of a collective result
        self._part_kinds: dict[StageId, dict[int, object]] = {}
        self._received_kind = None
        if not virtual or mirrors is None or mirrors.notes or not mirrors.rep:
            return
        self.virtual = frozenset(mirrors.rep)
        self.mirrors_of = {rep: mirrors.of(rep) for rep in set(mirrors.rep.values())}
        self.active = [state for state in self.active if state.rank not in self.virtual]

    def _mirror_kind(self, state, node: Node):
        """What the mirrors of `state`'s rank hold as their value of `node`."""
        if node.op in COLLECTIVES:
            return self._stood.pop(state.rank, None)
        if node.op == Op.RECV:
            return self._received_kind
        if not node.args or node.op == Op.SEND:
            return None         # a send's result is a token; what its mirrors send travels with it (`send_extra`)
        kinds = [self._kinds.get((state.rank, a)) for a in node.args]
        if any(isinstance(k, dict) for k in kinds):
            if node.op in SHAPE_ONLY:
                return CONSTANT           # the same shape, so the same constant as the representative's
            if any(k is None or k is SAME for k in kinds):
                raise Asymmetric(f"the mirrors of {self.plan.describe(state.rank)} compute {node.name} from "
                                 f"values of their own and mirrored ones")
            return self._own_op(state, node, kinds)
        mirrored = {k for k in kinds if k is not CONSTANT}
        if len(mirrored) > 1:
            raise Asymmetric(f"the mirrors of {self.plan.describe(state.rank)} mix mirrored values at {node.name}")
        return mirrored.pop() if mirrored else CONSTANT

    def _renamed_throughout(self, rank: int, node: Node) -> bool:
        """Do the mirrors of `rank` hold its values renamed at the op's arguments, constants aside, so its result
        renamed too (what `_mirror_kind` gives when no argument is the same, nor a mirror's own)?"""
        kinds = [self._kinds.get((rank, a)) for a in node.args]
        return all(k is None or k is CONSTANT for k in kinds) and any(k is None for k in kinds)

    def _renamed_throughout_run(self, rank: int, run) -> bool:
        """`_renamed_throughout` at every op of a `Run` (`tv_ray.partition.microbatches`): its mirrors hold the
        run's entries renamed or constant, and each op reading entries alone reads one renamed (the run's own
        values are renamed)."""
        kinds = [self._kinds.get((rank, name)) for name, _ in run.entries]
        return all(kind is None or kind is CONSTANT for kind in kinds) and \
            all(any(kinds[e] is None for e in alone) for alone in run.alone)

    def _own_op(self, state, node: Node, kinds) -> dict:
        """Each mirror computes an op on values of its own (and constants, the representative's), as stepping it
        would: its own result."""
        own = {}
        for m in self.mirrors_of[state.rank]:
            k = self.mirrors.block[m]
            args = [kind[k] if isinstance(kind, dict) else self._real(state.env[a])
                    for a, kind in zip(node.args, kinds)]
            own[k] = self._evaluate(self.ranks[m], node, args)
        return own

    def _kind_after(self, state, node: Node, kind) -> None:
        if kind is not None:
            self._kinds[state.rank, node.name] = kind

    def _forget_kind(self, rank: int, name: str) -> None:
        self._kinds.pop((rank, name), None)

    # -- collectives ------------------------------------------------------------------------------
    def stand_in(self, node: Node, members, rank: int, arrived: dict):
        rep = self.mirrored.get(rank)
        if rep is None or rep not in arrived:
            raise Asymmetric(f"{self.plan.describe(rank)} meets a group without its representative")
        kind = self._kinds.get((rep, self._at(rep).args[0]))
        if isinstance(kind, dict):
            return kind[self.mirrors.block[rank]]
        return arrived[rep] if kind is CONSTANT else Mirrored(arrived[rep].shape, kind is SAME)

    def stood_in(self, node: Node, rank: int, value) -> None:
        rep = self.mirrored[rank]
        if isinstance(value, Mirrored):
            kind = SAME if value.same else None
            if self._stood.setdefault(rep, kind) is not kind:
                raise Asymmetric(f"the mirrors of {self.plan.describe(rep)} get different kinds of {node.name}")
            return
        own = self._stood.setdefault(rep, {})
        if not isinstance(own, dict):
            raise Asymmetric(f"the mirrors of {self.plan.describe(rep)} get different kinds of {node.name}")
        own[self.mirrors.block[rank]] = value

    def _group_kinds(self, members) -> None:
        """A collective over a group without mirrors: each member's mirrors hold the kind of the group's inputs."""
        if not self.mirrors_of or any(m in self.virtual for m in members) or \
                not any(m in self.mirrors_of for m in members):
            return
        brought = (self._kinds.get((m, self._at(m).args[0])) if m in self.mirrors_of else "computed" for m in members)
        kinds = {"own" if isinstance(k, dict) else k for k in brought}     # a dict: each mirror's own value
        if len(kinds) > 1 or not kinds <= {None, SAME}:
            raise Asymmetric(f"the mirrors of group {list(members)} bring mixed values to a collective")
        for m in members:
            self._stood[m] = next(iter(kinds))

    def _at(self, rank: int) -> Node:
        state = self.ranks[rank]
        return state.program.nodes[state.pc]

    def _sources_at(self, rank: int) -> frozenset:
        """The claims read by what `rank` brings to the collective it is at (a mirror: its representative's,
        renamed)."""
        rep = self.mirrored.get(rank) if rank in self.virtual else None
        held = rank if rep is None else rep
        got = self.sources.get((held, self._at(held).args[0]), frozenset())
        if rep is None:
            return got
        k = self.mirrors.block[rank]
        return self.mirrors.rename_ids(got, k)

    # -- cuts --------------------------------------------------------------------------------------
    def _mirrored_cut(self, state, node: Node, claim: Claim, kind) -> None:
        """A representative's cut where its mirrors hold `Mirrored` values: never the very value on a slice with
        samples."""
        if kind is not SAME or not self.mirrors_of.get(state.rank):
            return
        if self.mirrors.blocks.tags.get(claim.logical) is not None:
            raise Asymmetric(f"the mirrors of {self.plan.describe(state.rank)} {node.name}: a collective's result "
                             f"claimed as a slice with samples")

    def _own_cuts(self, state, node: Node, claim: Claim, kind, value, reads, out) -> bool:
        """A representative's whole or sliced cut where its mirrors hold a constant or values of their own: each
        records a stage of its own, as stepping it would, and continues from its claim's value — a constant
        (the representative's continuation `out`) or its own atoms. False for `Mirrored` values."""
        if kind is None or kind is SAME:
            return False
        own = {}
        for m in self.mirrors_of.get(state.rank, ()):
            k = self.mirrors.block[m]
            mine = self._claim(m, node.name)
            self._record(StageId.group((m,), node.name), (m,), self.ranks[m], node, mine,
                         [value if kind is CONSTANT else kind[k]],
                         self.mirrors.rename_ids(reads, k))
            own[k] = self._continuation(m, mine)
        self._kinds[state.rank, node.name] = CONSTANT if constant(terms_of(out)) else own
        return True

    def _copy_mirrors(self, state) -> None:
        """A representative's cut (whole or sliced, or completing a group within dp 0), its stage just recorded or
        kept as a microbatch copy (`_latest`): each of its mirrors' copy of that stage, as one row of the
        instantiation map (a fan: `Partition.copy_fan`)."""
        if state.rank in self.mirrors_of:
            self._fan_copies(state.rank, (state.pc,), (self._latest[0],), self._latest[1])

    def _fan_copies(self, rank: int, positions, ats, k: int) -> None:
        """`_copy_mirrors` of the cuts at `positions` of a rank, their stages recorded stages `ats` (as microbatch k's),
        at once."""
        ranks = self.mirrors_of.get(rank)
        if ranks:
            n = len(positions)
            self.copied[0].extend([rank] * n)
            self.copied[1].extend(positions)
            self.copied_of[0].extend(ats)
            self.copied_of[1].extend([k] * n)
            self.fanned.extend([1] * n)
            self.copied_stages += n * len(ranks)

    def _part_arrived(self, cid: StageId, members, rank: int, kind) -> None:
        if kind is not None and kind is not SAME and not any(m in self.virtual for m in members):
            raise Asymmetric(f"stage {cid}: the mirrors of {self.plan.describe(rank)} hold parts of their own")
        if rank in self.mirrors_of:
            self._part_kinds.setdefault(cid, {})[rank] = kind

    def _complete(self, members, parts: dict) -> bool:
        """Have all the parts of a partial claim arrived (a mirror's with its representative's)?"""
        return len(parts) == len(members) or \
            (bool(self.virtual) and all(m in parts or m in self.virtual for m in members))

    def _stand_in_parts(self, cid: StageId, members, claim: Claim, parts: dict) -> None:
        """A partial claim over a group across dp blocks: each mirror's part from its representative's — what it
        read renamed, except in a contribution sum, whose stage reads block 0's members' reads alone
        (`_record_group`)."""
        kinds = self._part_kinds.pop(cid, {})
        renamed = not self._contributes(members, claim)
        for m in members:
            if m in parts:
                continue
            rep = self.mirrored[m]
            if rep not in parts:
                raise Asymmetric(f"stage {cid}: {self.plan.describe(m)} without its representative")
            k, kind = self.mirrors.block[m], kinds.get(rep)
            held = kind[k] if isinstance(kind, dict) else parts[rep][0] if kind is CONSTANT else \
                Mirrored(claim.shape, kind is SAME)
            parts[m] = (held, self.mirrors.rename_ids(parts[rep][1], k) if renamed else NOTHING, None)

    def _mirrors_continue(self, state, node: Node, members, claim: Claim, cid: StageId) -> None:
        """After a partial claim over a group across dp blocks, each mirror continues from its part: its block's
        contribution (renamed: the default), or a free part of its own."""
        mirrors = [m for m in self.mirrors_of.get(state.rank, ()) if m in members]
        if mirrors and not self._contributes(members, claim):
            self._kinds[state.rank, node.name] = {self.mirrors.block[m]: self._part(m, members, claim, cid)
                                                  for m in mirrors}

    def _copy_groups(self, state, cid: StageId, members) -> None:
        """A partial claim over a group within dp 0 is complete: one copy per mirrored group."""
        kinds = self._part_kinds.pop(cid, None)
        if kinds is None or len(kinds) != len(members):
            return
        if len(set(kinds.values())) > 1:
            raise Asymmetric(f"stage {cid}: mirrored groups with parts of two kinds")
        self._copy_mirrors(state)

    def _stood_in_ops(self, state) -> int:
        """Ops the mirrors of a finished representative never stepped (for the progress bar)."""
        return len(state.program.nodes) * len(self.mirrors_of.get(state.rank, ()))


__all__ = ["StandIns", "Mirrored", "constant", "SAME", "CONSTANT"]
