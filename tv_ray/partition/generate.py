"""Stage generation: the plan run once symbolically (`SymbolicRun`), whole or one pipeline stage per shard.

A run cut at claims needs nothing of another pipeline stage but the values
it sends, and each of those is cut at a claim, so it is that claim's
continuation: the ranks of one pipeline stage (with their mirrored dp
images) can run apart from the others, rebuilding what the other stages send
them from the senders' claims (`SymbolicRun._sent_by`). The shards run in
parallel — a Ray task or worker process per group of shards, each group
building the logical terms and its table of stage templates once (a stage
one shard built, the group's later shards take by renaming) — and are
merged:

- every value that crossed shards was fingerprinted twice, by the shard that
  sent it (what it held) and by the shard that received it (what it
  rebuilt); they must agree, else the run is made whole (`Unshardable`, a
  note) — so a sharded run steps every rank exactly as the whole run would;
- the stages are ordered by their depth in the stage DAG (then shard, then
  execution order in the shard), so "first failing" is first in dataflow;
- mirrored stages point at their representative's stage in the merged order.

A plan is sharded when it has pipeline stages, no collective or partial claim
spans them, and running it whole would step at least `SHARD_MIN` ops; the
certificate records the shard count, so its checker re-derives the same stages.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import cache
from typing import Iterable

import numpy as np
from tqdm import tqdm

from tv_ray.errors import Asymmetric, ClaimsMissing, Unshardable
from tv_ray.ir.ops import COLLECTIVES
from tv_ray.partition.claims import Claim, Claims
from tv_ray.partition.dag import depths
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.microbatches import Shifts
from tv_ray.partition.stages import Obligation, Partition, SymbolicRun
from tv_ray.partition.symmetry import Blocks, Mirrors, Moves, find_mirrors, microbatch_moves
from tv_ray.partition.templates import Templates
from tv_ray.plan import Plan
from tv_ray.processes import Generate, gc_paused
from tv_ray.terms import Term, from_table, to_table

SHARD_MIN = 1_000_000       # ops stepped (every rank's program) from which a plan with pipeline stages is sharded
AXIS = "pp"

@dataclass
class ShardRun:
    """What one pipeline shard's run recorded. Pickled (from a Ray task or worker process), its formulas
    travel as one term table, each shared subterm once."""

    obligations: list[Obligation]
    formulas: dict[str, tuple[list[Term], list[Term]]]
    copy_ranks: np.ndarray          # the instantiation map (`Partition.copy`)
    copy_of: np.ndarray             # index into this shard's `obligations`
    copy_mb: np.ndarray
    copy_fan: np.ndarray
    boundary: dict[str, Claim]
    notes: list[str]
    moved: int
    accumulated: int
    sent: dict[tuple, tuple]
    assumed: dict[tuple, tuple]
    unformed: dict[str, str]
    templated: int
    renamed: int
    layer_renamed: int

    def __getstate__(self) -> dict:
        sides = [(len(lhs), len(rhs)) for lhs, rhs in self.formulas.values()]
        table = to_table(*[t for lhs, rhs in self.formulas.values() for t in (*lhs, *rhs)])
        return {**self.__dict__, "formulas": (list(self.formulas), sides, table)}

    def __setstate__(self, state: dict) -> None:
        keys, sides, table = state["formulas"]
        roots = from_table(table)
        roots = iter(roots if isinstance(roots, tuple) else (roots,))
        state["formulas"] = {key: ([next(roots) for _ in range(left)], [next(roots) for _ in range(right)])
                             for key, (left, right) in zip(keys, sides)}
        self.__dict__.update(state)


def ops_of(plan: Plan, ranks: Iterable[int]) -> int:
    """Op executions of one run of `ranks`' programs."""
    names, ids = plan.rank_programs()
    return sum(len(plan.programs[names[ids[r]]].nodes) for r in ranks)


def pipeline_shards(plan: Plan, claims: Claims) -> list[frozenset[int]] | None:
    """The ranks of each pipeline stage, when no collective or partial claim joins two stages; else None."""
    size = plan.axis_sizes.get(AXIS, 1)
    if size < 2:
        return None
    names, ids = plan.rank_programs()
    for name in {names[i] for i in ids}:
        if any(node.op in COLLECTIVES and AXIS in node.attr["axes"] for node in plan.programs[name].nodes):
            return None
    if AXIS in claims.partial_axes():
        return None
    stage = [plan.coords(r)[AXIS] for r in range(plan.num_ranks)]
    return [frozenset(r for r in range(plan.num_ranks) if stage[r] == s) for s in range(size)]


@dataclass(frozen=True)
class Renamings:
    """The renamings a generation uses: dp mirrors (`virtual`: stood in for, never stepped,
    `tv_ray.partition.standins`), microbatch moves, the blocks of samples the logical graph is built for, and
    stage templates (`tv_ray.partition.templates`); `renamed`: microbatch k's ops taken as microbatch 0's renamed
    without evaluating them (`tv_ray.partition.microbatches`), and with templates layer j's as a neighbouring
    layer's (`tv_ray.partition.layers`; off: each evaluated, the same stages); `shifts`: the
    pairing of microbatch k's ops with microbatch 0's, built once for every shard (None: each run builds it)."""

    mirrors: Mirrors | None = None
    moves: Moves | None = None
    blocks: Blocks | None = None
    templates: bool = True
    virtual: bool = True
    renamed: bool = True
    shifts: Shifts | None = None

    def run(self, plan: Plan, dims: dict[str, int], logical: LogicalTerms, claims, bar=None,
            owned: frozenset[int] | None = None, seen: Templates | None = None) -> SymbolicRun:
        """`seen`: the templates another run saw (with `templates`), taken up by this one."""
        run = SymbolicRun(plan, dims, logical, claims, self.mirrors, self.moves, bar, owned=owned,
                          templates=seen or self.templates, virtual=self.virtual, renamed=self.renamed,
                          shifts=self.shifts)
        run.run()
        return run


def run_shards(plan: Plan, dims: dict[str, int], claims: dict[tuple[int, str], Claim], renamings: Renamings,
               shards: list[frozenset[int]], logical: LogicalTerms | None = None,
               bar: tqdm | None = None) -> list[ShardRun]:
    """Run each shard apart (one logical graph for all of them)."""
    with gc_paused():       # see `partition`
        return _run_shards(plan, dims, claims, renamings, shards, logical, bar)


def _run_shards(plan, dims, claims, renamings: Renamings, shards, logical, bar) -> list[ShardRun]:
    if logical is None:
        logical = LogicalTerms.build(plan.logical, dims, renamings.blocks)
    # one table of templates for the job's shards: a stage one shard built, another takes by renaming (its key's
    # formula travels in the first one's run; `merge` gathers them)
    seen = Templates(logical, dims) if renamings.templates else None
    out = []
    for owned in shards:
        run = renamings.run(plan, dims, logical, claims, bar, owned, seen)
        out.append(ShardRun(run.obligations, run.formulas, *run.resolve_copies(), run.boundary,
                            run.notes + _incomplete(run.pending), run.moved, run.accumulated, run.sent, run.assumed,
                            run.unformed, run.templated, run.renamed, run.layer_renamed))
        # what the run held besides (values, memos, ranks), cycles and all: the collector is paused
        run.__dict__.clear()
    return out


def merge(runs: list[ShardRun], mirrors: Mirrors | None = None, symmetry: list[str] | None = None,
          shifts: Shifts | None = None) -> Partition:
    """One partition from the shards' stages (see the module docstring); `Unshardable` when a value crossing
    shards is not what its receiver rebuilt. `shifts`: the pairing the shards' microbatch copies name."""
    sent = {k: v for run in runs for k, v in run.sent.items()}
    assumed = {k: v for run in runs for k, v in run.assumed.items()}
    unmatched = sorted(sent.keys() ^ assumed.keys())
    if unmatched:
        where = unmatched[0]
        raise Unshardable(f"send #{where[3] + 1} from rank {where[0]} to rank {where[1]} (tag {where[2]}) was "
                          f"{'never received' if where in sent else 'received but never sent'}")
    differing = sorted(w for w in sent if sent[w] != assumed[w])
    if differing:
        where = differing[0]
        raise Unshardable(f"send #{where[3] + 1} from rank {where[0]} to rank {where[1]} (tag {where[2]}) is not "
                          f"the continuation of its claim that the receiving shard rebuilt")
    tagged = [(s, i, ob) for s, run in enumerate(runs) for i, ob in enumerate(run.obligations)]
    depth = depths([ob for _, _, ob in tagged])
    tagged.sort(key=lambda t: (depth[t[2].id], t[0], t[1]))
    where = [np.zeros(len(run.obligations), dtype=np.int32) for run in runs]    # shard, index -> merged index
    obligations = []
    for n, (s, i, ob) in enumerate(tagged):
        where[s][i] = ob.position = n
        obligations.append(ob)
    formulas: dict[str, tuple[list[Term], list[Term]]] = {}
    for run in runs:
        for key, sides in run.formulas.items():
            formulas.setdefault(key, sides)
    copies = (np.concatenate([run.copy_ranks for run in runs]).astype(np.int32),
              np.concatenate([where[s][run.copy_of] for s, run in enumerate(runs)]).astype(np.int32),
              np.concatenate([run.copy_mb for run in runs]).astype(np.int32),
              np.concatenate([run.copy_fan for run in runs]).astype(bool))
    part = _assemble(obligations, {cid: c for run in runs for cid, c in run.boundary.items()},
                     [note for run in runs for note in run.notes], formulas, symmetry or [], copies, mirrors,
                     sum(r.moved for r in runs), sum(r.accumulated for r in runs),
                     {k: why for run in runs for k, why in run.unformed.items()}, shifts)
    part.shards = len(runs)
    part.templated = sum(r.templated for r in runs)
    part.renamed = sum(r.renamed for r in runs)
    part.layer_renamed = sum(r.layer_renamed for r in runs)
    return part


def partition(plan: Plan, dims: dict[str, int], claims: dict[tuple[int, str], Claim],
              symmetry: "bool | Mirrors" = True, progress: bool = False, shards: bool | None = None,
              generate: Generate | None = None, groups: int = 1, templates: bool = True,
              complete: bool = True, virtual: bool = True, renamed: bool = True) -> Partition:
    """Run the plan symbolically with cuts at `claims`; the obligations and the stage DAG.

    With `symmetry` (True, or the plan's `mirrors` already found), the logical graph is built for one block
    of samples and dp ranks are mirrored where `tv_ray.partition.symmetry` shows it sound (their claims
    are their representatives', moved, whatever `claims` holds for them); where it cannot, the note says
    why and every rank runs in full. Mirrored stages are kept compactly (`Partition.copy`); the stage DAG
    holds the recorded ones, whose composition the mirrored ones repeat under renaming.

    `shards`: run one shard per pipeline stage (True), whole (False), or decide by size (None, `SHARD_MIN`);
    the shards go to `generate` in `groups` jobs (default: in this process, one job). With `progress`, a bar
    on stderr counts the ops stepped through (every rank's program), the stages and the unique keys.
    `templates`: a stage whose template was seen takes that stage's key without its terms being built.
    `virtual`: mirrored ranks are stood in for, never stepped (`tv_ray.partition.standins`; where that ends in
    `Asymmetric`, they are stepped — the same stages).
    `renamed`: microbatch k's ops taken as microbatch 0's renamed, not evaluated (`tv_ray.partition.microbatches`),
    and (with `symmetry` and `templates`) layer j's as a neighbouring layer's (`tv_ray.partition.layers`).
    `complete`: `claims` hold every rank's claims (False: the mirrored ranks' are their representatives', and
    where symmetry fails during the run, `ClaimsMissing` asks for theirs)."""
    # Python's cyclic collector would walk every term and array again and again as the heap grows (llama3-8b
    # dp=16,tp=8,pp=4,mb=32: stages 1,191 s with it, 929 s without it in the run; the logical graph 2.5x; 8 % more
    # in the instantiation map and assembly, at 4 layers): generation builds no cycles worth collecting
    with gc_paused():
        return _partition(plan, dims, claims if isinstance(claims, Claims) else Claims(dict(claims)), symmetry, progress, shards, generate, groups, templates, complete,
                          virtual, renamed)


def _partition(plan, dims, claims, symmetry, progress, shards, generate, groups, templates, complete, virtual,
               renamed) -> Partition:
    found, notes = (symmetry, []) if isinstance(symmetry, Mirrors) else find_mirrors(plan, dims, symmetry)
    moves = microbatch_moves(plan, dims, found, bool(symmetry))
    blocks = moves.blocks if moves else found.blocks if found else None
    total = ops_of(plan, range(plan.num_ranks))
    split = pipeline_shards(plan, claims) if shards or (shards is None and total >= SHARD_MIN) else None
    logical = cache(lambda: LogicalTerms.build(plan.logical, dims, blocks))   # built here once, if needed here
    bar = tqdm(total=total, disable=not progress, unit="op", desc="generating", file=sys.stderr, dynamic_ncols=True)
    renamings = Renamings(found, moves, blocks, templates, virtual and found is not None and not found.notes,
                          renamed and bool(symmetry), Shifts(plan, moves.blocks) if moves else None)
    try:
        try:
            return _mirrored(plan, dims, claims, renamings, logical, notes, split, bar, generate, groups)
        except Asymmetric as why:
            notes.append(f"symmetry: {why}; every rank run in full")
            have = {r for r, _ in claims.made}        # a moved claim's rank holds its counterpart's
            if found and (not complete or any(rank not in have for rank in found.rep)):
                raise ClaimsMissing(f"data-parallel symmetry failed during the run ({why}) and the claims of the "
                                    f"mirrored ranks were never built; run with --no-symmetry") from None
            bar.reset()
            return _run(plan, dims, claims, Renamings(None, None, blocks, templates, renamed=renamed), logical, notes,
                        split, bar, generate, groups)
    finally:
        bar.close()


def _mirrored(plan, dims, claims, renamings: Renamings, logical, notes, split, bar, generate, groups) -> Partition:
    """One generation with the mirrors stood in for (`renamings.virtual`) and, where that ends in `Asymmetric`,
    with the mirrors stepped."""
    if renamings.virtual:
        try:
            part = _run(plan, dims, claims, renamings, logical, notes, split, bar, generate, groups)
            part.stood_in = len(renamings.mirrors.rep)
            return part
        except Asymmetric:
            bar.reset()
            renamings = replace(renamings, virtual=False)
    return _run(plan, dims, claims, renamings, logical, notes, split, bar, generate, groups)


def _run(plan, dims, claims, renamings: Renamings, logical, notes, split, bar, generate, groups) -> Partition:
    """One generation with the given renamings: sharded when `split`, and whole if the shards disagree."""
    found = renamings.mirrors
    symmetry = notes + (found.notes if found else [])
    if split is not None:
        try:
            return _sharded(plan, dims, claims, renamings, logical, split, bar, generate, groups, symmetry)
        except Unshardable as why:
            notes.append(f"pipeline shards: {why}; the run was made whole")
            symmetry = notes + (found.notes if found else [])
            bar.reset()
    run = renamings.run(plan, dims, logical(), claims, bar)
    copies = run.resolve_copies()
    run.notes += _incomplete(run.pending)
    part = _assemble(run.obligations, run.boundary, run.notes, run.formulas, symmetry, copies, found, run.moved,
                     run.accumulated, run.unformed, run.shifts)
    part.templated, part.renamed, part.layer_renamed = run.templated, run.renamed, run.layer_renamed
    return part


def _sharded(plan, dims, claims, renamings: Renamings, logical, split, bar, generate, groups, symmetry) -> Partition:
    jobs = [split[g::groups] for g in range(min(groups, len(split)))]
    runs: list[list[ShardRun] | None] = [None] * len(jobs)
    if generate is None:
        for i, job in enumerate(jobs):
            runs[i] = run_shards(plan, dims, claims, renamings, job, logical(), bar)
    else:
        for i, result in generate(run_shards, [(plan, dims, claims, renamings, job) for job in jobs]):
            runs[i] = result
            bar.update(ops_of(plan, set().union(*jobs[i])))
    by_shard = {owned: run for job, done in zip(jobs, runs) for owned, run in zip(job, done)}
    return merge([by_shard[owned] for owned in split], renamings.mirrors, symmetry, renamings.shifts)


def _incomplete(pending: dict) -> list[str]:
    return [f"{cid}: partial claim produced on ranks {sorted(parts)} only" for cid, parts in pending.items()]


def _assemble(obligations, boundary, run_notes, formulas, symmetry, copies, found, moved, accumulated,
              unformed, shifts) -> Partition:
    return Partition(obligations, boundary, run_notes, formulas, symmetry, unformed, *copies, found, shifts, moved,
                     accumulated)


__all__ = ["partition", "pipeline_shards", "run_shards", "merge", "ops_of", "ShardRun", "Renamings",
           "SHARD_MIN"]
