"""Derivation: everything a plan's proof is built from — reduced shapes, claims, stages, obligations and keys.

    >>> derivation = derive(plan, Settings(seed=0))
    >>> derivation.partition.size, len(derivation.partition.formulas)      # obligations, unique keys
    (3770, 209)

One function, `derive`, used alike by the engine (which then solves the
unique keys) and by the independent checker (which re-derives a certificate's
stages from its plan and compares). In order:

1. shape reduction (`tv_ray.reduce`);
2. data-parallel mirrors (`tv_ray.partition.symmetry`), none where a mirrored
   rank's outputs differ from its representative's in the concrete runs
   (`diverging_mirror`);
3. claims: the plan's boundary and stated lineage, plus claims matched by
   value in concrete runs (plans up to `CONCRETE_LIMIT` op executions;
   a larger plan's communication order is run without values instead);
   the program outputs wrong in those runs (`deviations`) are kept;
4. stages cut at the claims (`tv_ray.partition.generate`), keyed.

A claim refuted as a wrong guess is dropped and the stages cut again
(`Derivation.recut`): the claims and concrete runs stay, the stages change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from tv_ray.errors import ClaimsMissing, PlanError
from tv_ray.execute import check_order
from tv_ray.ir import Op
from tv_ray.ir.dims import Expr
from tv_ray.partition.claims import (Claims, ConcreteRun, group_value, infer_claims, input_claims, interior_claims,
                                    output_claims, run_concrete, runs_for, stated_claims)
from tv_ray.partition.generate import ops_of, partition
from tv_ray.partition.ids import StageId
from tv_ray.partition.stages import Partition
from tv_ray.partition.symmetry import Blocks, Mirrors, find_mirrors, microbatch_moves
from tv_ray.plan import Plan
from tv_ray.processes import Generate, in_processes
from tv_ray.reduce import Reduction, reduce_plan
from tv_ray.semantics.table import instantiate_shape
from tv_ray.simulate import max_abs_deviation

CONCRETE_LIMIT = 2_000_000    # op executions of one concrete run of every rank
TOL = 1e-8       # a program output further than this from its lineage in a concrete run is wrong
POSITION_LIMIT = 20_000_000    # elements of the logical step times ranks, for a run at `position_dims`


@dataclass(frozen=True)
class Settings:
    """What a derivation depends on besides the plan (recorded in the certificate, so the checker re-derives
    the same): the concrete runs' seed, data-parallel / microbatch symmetry, stage templates
    (`tv_ray.partition.templates`), and pipeline shards (True,
    False, or None: by the plan's size)."""

    seed: int = 0
    symmetry: bool = True
    shards: bool | None = None
    templates: bool = True


@dataclass
class Derivation:
    """A plan's reduced shapes, concrete runs, claims and stages."""

    plan: Plan
    settings: Settings
    reduction: Reduction
    mirrors: Mirrors | None
    notes: list[str]                           # why ranks were not mirrored
    runs: list[ConcreteRun]
    claims: Claims
    deviations: list[dict]                     # program outputs wrong in the concrete runs, largest first
    partition: Partition | None = None
    dropped: list[tuple[int, str]] = field(default_factory=list)
    complete: bool = True                      # claims on every rank (else on the ranks that are not mirrored)

    def cut(self, progress: bool = False, generate: Generate | None = None, groups: int = 1) -> Partition:
        """The stages cut at the current claims (generated whole, or one pipeline stage per shard by `generate`
        in `groups` jobs)."""
        symmetry = self.settings.symmetry

        def cut() -> Partition:
            return partition(self.plan, self.reduction.reduced, self.claims,
                             self.mirrors or (symmetry and not self.notes), progress=progress,
                             shards=self.settings.shards, generate=generate, groups=groups,
                             templates=self.settings.templates, complete=self.complete)
        try:
            self.partition = cut()
        except ClaimsMissing:         # symmetry failed mid-run: every rank runs in full, on claims of its own
            self.claims = claims_for(self.plan, self.reduction.reduced, self.settings.seed, runs=self.runs)[1]
            for key in self.dropped:
                self.claims.pop(key)
            self.complete = True
            self.partition = cut()
        self.partition.symmetry = self.notes + self.partition.symmetry
        return self.partition

    def drop(self, wrong: Iterable[tuple[int, str]]) -> None:
        """Drop claims refuted as wrong guesses (never boundary ones: the caller passes interior claims)."""
        for key in wrong:
            if self.claims.pop(tuple(key), None) is not None:
                self.dropped.append(tuple(key))


def claims_for(plan: Plan, dims: dict[str, int], seed: int = 0, ranks: np.ndarray | None = None,
               runs: list[ConcreteRun] | None = None, blocks: Blocks | None = None):
    """The concrete runs (`runs` when they were made already) and the claims of `ranks` (a mask; None: every
    rank) — boundary lineage, intermediate lineage, then matched by value: a mirrored rank's claims are its
    representative's, moved, so it needs none of its own. `blocks`: the microbatch symmetry's blocks, by which
    microbatch k's ops are first offered microbatch 0's claims moved (`infer_claims`).

    A plan larger than `CONCRETE_LIMIT` op executions is not run concretely: its claims are its lineage
    (boundary and intermediate) alone, made only on `ranks`, nothing is matched by value and no output is
    checked at a point — which changes only where stages are cut, never what a proof needs. There microbatch
    k's stated claims that are microbatch 0's moved (by `blocks`) are made when asked (`Claims`)."""
    if ops_of(plan, range(plan.num_ranks)) > CONCRETE_LIMIT:
        shapes = {s.name: instantiate_shape(s.shape, dims) for s in plan.logical.inputs}
        shapes |= {n.name: instantiate_shape(n.shape, dims) for n in plan.logical.nodes}
        return [], stated_claims(plan, shapes, ranks, blocks)
    runs = runs or runs_for(plan, dims, seed)[0]
    shapes = {name: value.shape for name, value in runs[0].logical.items()}
    fixed = {**input_claims(plan, shapes, ranks), **interior_claims(plan, shapes, ranks),
             **output_claims(plan, shapes, ranks)}
    eligible = [name for name, value in runs[0].logical.items() if value.dtype.kind == "f"]
    return runs, Claims(infer_claims(plan, runs, fixed, eligible, ranks, blocks))


def derived_claims(plan: Plan, dims: dict[str, int], found: Mirrors | None, symmetry: bool = True, seed: int = 0,
                   runs: list[ConcreteRun] | None = None):
    """`claims_for` as a derivation makes them: on the ranks not mirrored (`found`), microbatch k's ops offered
    microbatch 0's claims moved where the plan has microbatch symmetry."""
    moves = microbatch_moves(plan, dims, found, symmetry)
    return claims_for(plan, dims, seed, unmirrored(plan, found), runs, blocks=moves.blocks if moves else None)


def diverging_mirror(plan: Plan, runs: list[ConcreteRun], found: Mirrors) -> str:
    """Why the mirrors cannot stand: a mirrored rank's program output that differs in a concrete run from its
    representative's where both are claimed as the same logical slice (a replicated parameter, its optimizer
    state) — a data-parallel gradient never reduced leaves each replica its own. Generation with the mirrors
    would step the whole program to find that (twice: stood in for, then stepped) before running every rank
    in full; '' when every such pair agrees."""
    if not runs:
        return ""
    claims = output_claims(plan, {name: value.shape for name, value in runs[0].logical.items()})
    for (rank, tensor), claim in claims.items():
        rep = found.rep.get(rank)
        other = claims.get((rep, tensor))
        if other is None or claim.partial or (claim.logical, claim.offsets, claim.shape, claim.scale) != \
                (other.logical, other.offsets, other.shape, other.scale):
            continue
        for run in runs:
            a, b = run.ranks[rank].get(tensor), run.ranks[rep].get(tensor)
            if a is not None and b is not None and (dev := max_abs_deviation(a, b)) > TOL:
                return (f"{plan.describe(rank)} output {tensor} differs from its representative rank {rep}'s by "
                        f"{dev:.3g} in a concrete run")
    return ""


def unmirrored(plan: Plan, found: Mirrors | None) -> np.ndarray | None:
    """The ranks that run their own program (a mask), or None when none is mirrored."""
    if found is None:
        return None
    mask = np.ones(plan.num_ranks, dtype=bool)
    mask[list(found.rep)] = False
    return mask


def output_deviations(plan: Plan, runs: list[ConcreteRun]) -> list[dict]:
    """Program outputs whose concrete value differs from their output lineage in some run (largest first)."""
    if not runs:
        return []
    shapes = {name: value.shape for name, value in runs[0].logical.items()}
    seen, out = set(), []
    for (rank, tensor), claim in output_claims(plan, shapes).items():
        members = tuple(plan.group(rank, claim.partial)) if claim.partial else (rank,)
        if (members, tensor) in seen:
            continue
        seen.add((members, tensor))
        worst = max((max_abs_deviation(p, claim.value(run.logical[claim.logical])) for run in runs
                     if (p := group_value(run, members, tensor)) is not None), default=0.0)
        if worst > TOL:
            out.append({"stage": str(StageId.group(members, tensor)), "ranks": list(members), "tensor": tensor,
                        "logical": claim.logical, "max_abs_dev": worst})
    return sorted(out, key=lambda d: -d["max_abs_dev"])


def position_dims(plan: Plan, reduced: dict[str, int]) -> dict[str, int] | None:
    """The reduced dims with every dim that bounds an arange (positions, used as numbers in RoPE's angles) at its
    full size, where the plan holds there, is run concretely at all (`CONCRETE_LIMIT`) and its logical step
    stays under `POSITION_LIMIT` elements times ranks; None otherwise, or when no such dim is reduced.

    At the reduced dims an arange keeps only its first positions, so a constant applied to it may differ only
    past them: the symbolic side makes them variables where they are used as numbers
    (`tv_ray.semantics.symbolic`), and a refutation there is confirmed by a run at these dims
    (docs/reduction.md)."""
    from tv_ray.plan_check import check_plan
    if ops_of(plan, range(plan.num_ranks)) > CONCRETE_LIMIT:
        return None
    names = {d for graph in (plan.logical, *plan.programs.values()) for n in graph.nodes
             if n.op is Op.ARANGE for k in ("start", "end", "step")
             for d in Expr.of(n.attr[k]).free_dims}
    dims = {**reduced, **{d: plan.dims[d] for d in names}}
    if dims == reduced:
        return None
    elements = sum(math.prod(instantiate_shape(n.shape, dims)) for n in plan.logical.nodes)
    if elements * plan.num_ranks > POSITION_LIMIT:
        return None
    try:
        check_plan(plan, dims)
    except PlanError:
        return None
    return dims


def position_deviations(plan: Plan, reduced: dict[str, int], seed: int = 0) -> list[dict]:
    """`output_deviations` in one concrete run at `position_dims` (none where there are no such dims)."""
    dims = position_dims(plan, reduced)
    return output_deviations(plan, [run_concrete(plan, dims, seed)[0]]) if dims is not None else []


def derive_claims(plan: Plan, settings: Settings = Settings()) -> Derivation:
    """Steps 1–3: reduced shapes, mirrors, concrete runs, claims and output deviations; no stages yet.
    Raises CommunicationError when the plan's communication cannot complete: in the concrete runs, or, for a
    plan too large to run, in its communication order run without values (`check_order`; the stages are
    generated per pipeline shard, which matches sends with recvs but cannot see whether the schedule
    completes)."""
    reduction = reduce_plan(plan)
    found, notes = find_mirrors(plan, reduction.reduced, settings.symmetry)
    runs = runs_for(plan, reduction.reduced, settings.seed)[0] \
        if found is not None and ops_of(plan, range(plan.num_ranks)) <= CONCRETE_LIMIT else None
    if found is not None and (why := diverging_mirror(plan, runs, found)):
        found, notes = None, [f"symmetry: {why}; every rank run in full"]
    runs, claims = derived_claims(plan, reduction.reduced, found, settings.symmetry, settings.seed, runs)
    if not runs:
        check_order(plan, reduction.reduced)
    return Derivation(plan, settings, reduction, found, notes, runs, claims, output_deviations(plan, runs),
                      complete=found is None)


def derive(plan: Plan, settings: Settings = Settings(), dropped: Iterable[tuple[int, str]] = (),
           workers: int = 1) -> Derivation:
    """The whole derivation of `plan`, without the claims `dropped` as wrong guesses (what a certificate
    records): its `partition` holds every obligation with its key and one formula per key. Pipeline shards run
    in `workers` processes (`in_processes`) when there are more than one."""
    derivation = derive_claims(plan, settings)
    derivation.drop(dropped)
    derivation.cut(**({"generate": in_processes(workers), "groups": workers} if workers > 1 else {}))
    return derivation


__all__ = ["Settings", "Derivation", "derive", "derive_claims", "claims_for", "derived_claims", "diverging_mirror",
           "output_deviations", "position_deviations", "unmirrored", "CONCRETE_LIMIT"]
