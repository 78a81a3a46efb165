"""The verification driver: plan → reduced shapes → claims → obligations with keys → solved once per key → outcome.

    >>> outcome = verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=2))
    >>> outcome.status, outcome.counts()
    ('proved', {'obligations': 4833, 'unique': 1201, 'proved': 4833, 'refuted': 0, 'unknown': 0})

Phases are timed (`outcome.phases`). A progress bar (tqdm, on stderr) shows
obligations generated / unique / proved / refuted / unknown and the rate when
the run is interactive or asked for.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import networkx as nx
import numpy as np
from tqdm import tqdm

from tv_ray.engine.checkpoint import Checkpoint
from tv_ray.engine.executor import Executor, LocalExecutor, SolveTask
from tv_ray.engine.solve import Budget, Verdict
from tv_ray.errors import CommunicationError
from tv_ray.partition.claims import (Claim, ConcreteRun, group_value, infer_claims, input_claims, interior_claims,
                                    output_claims, runs_for)
from tv_ray.partition.generate import ops_of, partition
from tv_ray.partition.stages import Obligation, Partition, claim_id
from tv_ray.partition.symmetry import Mirrors, find_mirrors
from tv_ray.plan import Plan
from tv_ray.reduce import Reduction, reduce_plan
from tv_ray.semantics.table import instantiate_shape
from tv_ray.simulate import max_abs_deviation

BATCH = 64
REFINE_ROUNDS = 4
CONCRETE_LIMIT = 2_000_000    # op executions of one concrete run of every rank
TOL = 1e-8       # a program output further than this from its lineage in a concrete run is wrong


@dataclass
class Outcome:
    """Everything a run found: the basis of a certificate (proved) or a report (refuted / unknown)."""

    plan: Plan
    reduction: Reduction
    partition: Partition
    runs: list[ConcreteRun]
    claims: dict[tuple[int, str], Claim]
    keys: dict[str, str]                       # obligation id -> key
    verdicts: dict[str, Verdict]               # key -> verdict
    problems: list[str] = field(default_factory=list)     # composition failures (never proved then)
    phases: dict[str, float] = field(default_factory=dict)
    executor: str = ""
    dropped: list[tuple[int, str]] = field(default_factory=list)   # claims refuted as wrong guesses
    deviations: list[dict] = field(default_factory=list)   # program outputs wrong in the concrete runs
    failure: str = ""            # the plan's communication cannot complete (a refutation without stages)
    resumed: int = 0             # unique keys whose verdicts came from the checkpoint

    @property
    def status(self) -> str:
        """proved (every obligation proved and the composition holds), refuted, or unknown."""
        if self.failure:
            return "refuted"
        verdicts = [self.verdicts[self.keys[o.id]].verdict for o in self.partition.obligations]
        if "refuted" in verdicts:
            return "refuted"
        if self.problems or any(v != "proved" for v in verdicts) or not verdicts:
            return "unknown"
        return "proved"

    def verdict_of(self, ob: Obligation) -> Verdict:
        return self.verdicts[self.keys[ob.id]]

    def counts(self) -> dict[str, int]:
        c = Counter()
        for key, n in self.partition.key_counts().items():
            c[self.verdicts[key].verdict] += n
        return {"obligations": self.partition.size, "unique": len(self.verdicts),
                "proved": c["proved"], "refuted": c["refuted"], "unknown": c["unknown"]}

    def tiers(self) -> dict[str, int]:
        """Unique keys by how they closed: normalised, random-point, smt:<solver>, unknown."""
        c = Counter((v.method if v.verdict != "unknown" else "unknown") for v in self.verdicts.values())
        return dict(sorted(c.items()))

    def first_refuted(self) -> Obligation | None:
        bad = [o for o in self.partition.obligations if self.verdict_of(o).verdict == "refuted"]
        return min(bad, key=lambda o: o.position) if bad else None


def claims_for(plan: Plan, dims: dict[str, int], seed: int = 0, ranks: np.ndarray | None = None):
    """The concrete runs and every claim (boundary lineage, intermediate lineage, then matched by value).

    A plan larger than `CONCRETE_LIMIT` op executions is not run concretely: its claims are its lineage
    (boundary and intermediate) alone, made only on `ranks` (a mask; mirrored ranks take their
    representative's), nothing is matched by value and no output is checked at a point — which changes only
    where stages are cut, never what a proof needs."""
    if ops_of(plan, range(plan.num_ranks)) > CONCRETE_LIMIT:
        shapes = {s.name: instantiate_shape(s.shape, dims) for s in plan.logical.inputs}
        shapes |= {n.name: instantiate_shape(n.shape, dims) for n in plan.logical.nodes}
        return [], {**input_claims(plan, shapes, ranks), **interior_claims(plan, shapes, ranks),
                    **output_claims(plan, shapes, ranks)}
    runs, input_claims_ = runs_for(plan, dims, seed)
    shapes = {name: value.shape for name, value in runs[0].logical.items()}
    fixed = {**input_claims_, **interior_claims(plan, shapes), **output_claims(plan, shapes)}
    eligible = [name for name, value in runs[0].logical.items() if value.dtype.kind == "f"]
    return runs, infer_claims(plan, runs, fixed, eligible)


def _unmirrored(plan: Plan, found: Mirrors | None) -> np.ndarray | None:
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
        worst = max((max_abs_deviation(p, run.logical[claim.logical][claim.slices()]) for run in runs
                     if (p := group_value(run, members, tensor)) is not None), default=0.0)
        if worst > TOL:
            out.append({"stage": claim_id(members, tensor), "ranks": list(members), "tensor": tensor,
                        "logical": claim.logical, "max_abs_dev": worst})
    return sorted(out, key=lambda d: -d["max_abs_dev"])


def obligations_of(plan: Plan, seed: int = 0, dropped: Iterable[tuple[int, str]] = (), symmetry: bool = True,
                   shards: bool | None = None) -> tuple[Reduction, list[ConcreteRun], dict, Partition, dict[str, str]]:
    """Reduce, claim (without the `dropped` guesses), partition and key: everything before solving (the
    checker re-runs exactly this, with the certificate's `shards`)."""
    reduction = reduce_plan(plan)
    found, notes = find_mirrors(plan, reduction.reduced, symmetry)
    runs, claims = claims_for(plan, reduction.reduced, seed, _unmirrored(plan, found))
    for key in dropped:
        claims.pop(tuple(key), None)
    part = partition(plan, reduction.reduced, claims, found or (symmetry and not notes), shards=shards)
    part.symmetry = notes + part.symmetry
    return reduction, runs, claims, part, {o.id: o.key for o in part.obligations}


def composition_problems(plan: Plan, part: Partition, proved: set[str]) -> list[str]:
    """Soundness rule 3: what keeps the proved stages from composing into the end-to-end claim.

    The recorded stages are checked; a mirrored stage reads its representative's inputs renamed, so its
    composition is the representative's, renamed."""
    problems = list(part.notes)
    boundary = set(part.boundary)
    for ob in part.obligations:
        for src in ob.reads:
            src = part.representative(src)     # a mirrored stage stands or falls with its representative's
            if src not in boundary and src not in proved:
                problems.append(f"stage {ob.id} reads {src}, which is neither boundary lineage nor proved")
    covered = {ob.claim.logical for ob in part.obligations if ob.claim.boundary and ob.id in proved}
    for name, value in plan.logical.outputs:
        if value not in covered:
            problems.append(f"logical output {name!r} is not covered by a proved output stage")
    problems += state_lineage_problems(plan)
    return problems


def state_lineage_problems(plan: Plan) -> list[str]:
    """Each updated parameter / optimizer state leaves the step with the lineage it came in with."""
    def layout(logical: str) -> set:
        return {(e.where, e.slice, e.partial) for e in plan.lineage if e.logical == logical}
    out = []
    for name, _ in plan.logical.outputs:
        if name.startswith("new/"):
            before, after = layout(name[4:]), layout(name)
            if before != after:
                out.append(f"{name} leaves the step with lineage {sorted(map(str, after))} but {name[4:]} "
                           f"came in with {sorted(map(str, before))}: the next step would start inconsistent")
    return out


def _name(executor: Executor) -> str:
    return getattr(executor, "name", type(executor).__name__)


def _batches(tasks: list[SolveTask], size: int) -> Iterator[list[SolveTask]]:
    for i in range(0, len(tasks), size):
        yield tasks[i:i + size]


def _solve(part: Partition, budget: Budget, executor: Executor, verdicts: dict[str, Verdict], show: bool,
           keys: dict[str, str], checkpoint: Checkpoint | None = None) -> None:
    """Solve the keys not solved yet (each unique key once; those in the checkpoint were), streaming each
    verdict to the checkpoint."""
    keys.update((ob.id, ob.key) for ob in part.obligations)
    tasks = {key: SolveTask.make(key, lhs, rhs) for key, (lhs, rhs) in part.formulas.items() if key not in verdicts}
    weight = part.key_counts()
    counts = Counter()
    with tqdm(total=sum(weight[k] for k in tasks), disable=not show, unit="obl", desc="solving",
              file=sys.stderr, dynamic_ncols=True) as bar:
        bar.set_postfix_str(f"generated {part.size} unique {len(tasks)}")
        for key, verdict in executor.run(_batches(list(tasks.values()), BATCH), budget):
            verdicts[key] = verdict
            if checkpoint is not None:
                checkpoint.add(key, verdict)
            counts[verdict.verdict] += weight[key]
            bar.update(weight[key])
            bar.set_postfix_str(f"unique {len(tasks)} proved {counts['proved']} refuted {counts['refuted']} "
                                f"unknown {counts['unknown']}")


def verify_plan(plan: Plan, *, budget: Budget = Budget(), executor: Executor | None = None,
                progress: bool | None = None, seed: int = 0, symmetry: bool = True,
                checkpoint: Checkpoint | None = None, shards: bool | None = None) -> Outcome:
    """Run the whole verification of `plan`; never raises on a failed proof (see `Outcome.status`).

    When some program output is wrong in the concrete runs, the plan has a
    bug and the first refuted stage is where it shows: nothing is re-cut.
    Otherwise a refuted claim (inferred by value, or stated by the plan's
    intermediate lineage) was a wrong guess — values can agree at every
    sampled point by structure, like a max that always picks the same column
    — so it is dropped and the stages around it are cut again, up to
    `REFINE_ROUNDS` times. Boundary claims are never dropped.

    With a `checkpoint`, keys it holds verdicts for are not solved again and every new verdict is streamed
    to it (flushed on the way out, whatever ends the run). `shards`: generate the stages one pipeline stage
    per shard (True), whole (False) or by size (None; `tv_ray.partition.generate`); an executor that can
    `map` work (Ray) runs the shards in parallel.
    """
    phases: dict[str, float] = Counter()
    t = time.perf_counter()
    reduction = reduce_plan(plan)
    phases["reduce"] += time.perf_counter() - t
    t = time.perf_counter()
    executor = executor or LocalExecutor()
    found, notes = find_mirrors(plan, reduction.reduced, symmetry)
    try:
        runs, claims = claims_for(plan, reduction.reduced, seed, _unmirrored(plan, found))
    except CommunicationError as err:   # missing or misrouted communication: no output is ever computed
        empty = Partition([], {}, nx.DiGraph(), [])
        return Outcome(plan, reduction, empty, [], {}, {}, {}, [str(err)], dict(phases), _name(executor),
                       failure=str(err))
    deviations = output_deviations(plan, runs)
    phases["claims"] += time.perf_counter() - t
    show = sys.stderr.isatty() if progress is None else progress
    verdicts: dict[str, Verdict] = dict(checkpoint.verdicts) if checkpoint is not None else {}
    loaded = set(verdicts)
    dropped: list[tuple[int, str]] = []
    # shards go to the executor's workers (Ray tasks, or processes) when it has more than one
    generation = {"generate": executor.map, "groups": executor.width()} \
        if hasattr(executor, "map") and executor.width() > 1 else {}
    for _ in range(REFINE_ROUNDS):
        t = time.perf_counter()
        part = partition(plan, reduction.reduced, claims, found or (symmetry and not notes), progress=show,
                         shards=shards, **generation)
        part.symmetry = notes + part.symmetry
        phases["partition"] += time.perf_counter() - t
        t = time.perf_counter()
        keys: dict[str, str] = {}
        try:
            _solve(part, budget, executor, verdicts, show, keys, checkpoint)
        finally:
            if checkpoint is not None:
                checkpoint.flush()
        phases["solve"] += time.perf_counter() - t
        wrong = [o for o in part.obligations if verdicts[keys[o.id]].verdict == "refuted" and not o.claim.boundary]
        if not wrong or deviations:
            break
        for ob in wrong:
            for rank in ob.ranks:
                if claims.pop((rank, ob.tensor), None) is not None:
                    dropped.append((rank, ob.tensor))
    proved = {o.id for o in part.obligations if verdicts[keys[o.id]].proved}
    problems = composition_problems(plan, part, proved)
    # belt and braces: a proof can never stand against an output that is wrong in a concrete run
    problems += [f"program output {d['stage']} differs from {d['logical']} by {d['max_abs_dev']:.3g} in a concrete "
                 f"run" for d in deviations]
    return Outcome(plan, reduction, part, runs, claims, keys, {k: verdicts[k] for k in set(keys.values())},
                   problems, dict(phases), _name(executor), sorted(dropped), deviations,
                   resumed=len(loaded & set(keys.values())))


__all__ = ["Outcome", "verify_plan", "obligations_of", "claims_for", "composition_problems", "output_deviations",
           "state_lineage_problems"]
