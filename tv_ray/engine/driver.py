"""The verification driver: derive the plan's stages, solve each unique key once, gather the outcome.

    >>> outcome = verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=2))
    >>> outcome.status, outcome.counts()
    (<Status.PROVED: 'proved'>, {'obligations': 4833, 'unique': 1201, 'proved': 4833, 'refuted': 0, 'unknown': 0})

The derivation (claims, stages, keys) and the composition check are
`tv_ray.partition`'s; the driver schedules them — stage generation on the
executor's workers when it has several — solves the unique keys on the
executor, streams verdicts to the checkpoint and builds the `Outcome`.
Phases are timed (`outcome.phases`). A progress bar (tqdm, on stderr) shows
obligations generated / unique / proved / refuted / unknown and the rate when
the run is interactive or asked for.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Iterator

from tqdm import tqdm

from tv_ray.certificate.outcome import Outcome, Status, Verdict
from tv_ray.engine.checkpoint import Checkpoint
from tv_ray.engine.executor import Executor, LocalExecutor, SolveTask
from tv_ray.engine.solve import Budget
from tv_ray.errors import CommunicationError
from tv_ray.partition.compose import composition_problems
from tv_ray.partition.claims import Claims
from tv_ray.partition.derive import Settings, derive_claims, position_deviations
from tv_ray.partition.stages import Partition
from tv_ray.plan import Plan
from tv_ray.reduce import reduce_plan

BATCH = 64
REFINE_ROUNDS = 4


def _name(executor: Executor) -> str:
    return getattr(executor, "name", type(executor).__name__)


def _batches(tasks: list[SolveTask], size: int) -> Iterator[list[SolveTask]]:
    for i in range(0, len(tasks), size):
        yield tasks[i:i + size]


def _solve(part: Partition, budget: Budget, executor: Executor, verdicts: dict[str, Verdict], show: bool,
           checkpoint: Checkpoint | None = None) -> None:
    """Solve the keys not solved yet (each unique key once; those in the checkpoint were), streaming each
    verdict to the checkpoint."""
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
                progress: bool | None = None, seed: int = 0, symmetry: bool = True, templates: bool = True,
                checkpoint: Checkpoint | None = None, shards: bool | None = None) -> Outcome:
    """Run the whole verification of `plan`; never raises on a failed proof (see `Outcome.status`).

    A refuted claim inferred by value held in every concrete run, so it was
    a wrong guess — values can agree at every sampled point by structure,
    like a max that always picks the same column — so it is dropped and the stages around it are
    cut again, up to `REFINE_ROUNDS` times. A refuted claim stated by the
    plan's intermediate lineage is dropped too, unless some program output is
    wrong in the concrete runs: then the plan has a bug, and the first stated
    claim refuted is where it shows. Boundary claims are never dropped.

    With a `checkpoint`, keys it holds verdicts for are not solved again and every new verdict is streamed
    to it (flushed on the way out, whatever ends the run). `shards`: generate the stages one pipeline stage
    per shard (True), whole (False) or by size (None; `tv_ray.partition.generate`); an executor that can
    `map` work (Ray) runs the shards in parallel.
    """
    phases: dict[str, float] = Counter()
    executor = executor or LocalExecutor()
    t = time.perf_counter()
    try:
        derivation = derive_claims(plan, Settings(seed, symmetry, shards, templates))
    except CommunicationError as err:   # missing or misrouted communication: no output is ever computed
        empty = Partition([], {}, [])
        return Outcome(plan, reduce_plan(plan), empty, [], Claims({}), {}, [str(err)], dict(phases), _name(executor),
                       failure=str(err))
    phases["claims"] += time.perf_counter() - t
    show = sys.stderr.isatty() if progress is None else progress
    verdicts: dict[str, Verdict] = dict(checkpoint.verdicts) if checkpoint is not None else {}
    loaded = set(verdicts)
    # shards go to the executor's workers (Ray tasks, or processes) when it has more than one
    generation = {"generate": executor.map, "groups": executor.width()} \
        if hasattr(executor, "map") and executor.width() > 1 else {}
    for _ in range(REFINE_ROUNDS):
        t = time.perf_counter()
        part = derivation.cut(progress=show, **generation)
        phases["partition"] += time.perf_counter() - t
        for key, why in part.unformed.items():     # a stage too large to form: unknown, never solved
            verdicts[key] = Verdict(Status.UNKNOWN, 0, "unformed", reason=why)
        t = time.perf_counter()
        try:
            _solve(part, budget, executor, verdicts, show, checkpoint)
        finally:
            if checkpoint is not None:
                checkpoint.flush()
        phases["solve"] += time.perf_counter() - t
        refuted = {k for k, v in verdicts.items() if v.verdict is Status.REFUTED}
        wrong = [o for o in part.obligations if o.key in refuted and not o.claim.boundary]
        # a microbatch copy's claim is its own rank's (a mirrored rank's claims are its representative's)
        if refuted:         # (expanding the copies costs a pass over them: only when something is wrong)
            wrong += [o for _, o in part.microbatch_copies() if o.key in refuted and not o.claim.boundary]
        if derivation.deviations:       # a bug: what the lineage states stays, to show where it enters
            wrong = [o for o in wrong if not o.claim.given]
        elif refuted:                   # no output wrong: a partial sum a refuted stage reads may hold yet forget
            wrong += _partials_read(part, refuted)      # how it is split (each part zero where it is masked)
        if not wrong:
            break
        derivation.drop((rank, ob.tensor) for ob in wrong for rank in ob.ranks)
    deviations = derivation.deviations
    if not deviations and refuted:     # a fault past the positions the reduced dims keep shows at more of them
        deviations = position_deviations(plan, derivation.reduction.reduced, derivation.settings.seed)
    proved = {o.id for o in part.obligations if verdicts[o.key].proved}
    problems = composition_problems(plan, part, proved)
    # belt and braces: a proof can never stand against an output that is wrong in a concrete run
    problems += [f"program output {d['stage']} differs from {d['logical']} by {d['max_abs_dev']:.3g} in a concrete "
                 f"run" for d in deviations]
    keys = {o.key for o in part.obligations}
    return Outcome(plan, derivation.reduction, part, derivation.runs, derivation.claims,
                   {k: verdicts[k] for k in keys}, problems, dict(phases), _name(executor),
                   sorted(derivation.dropped), deviations, resumed=len(loaded & keys))


def _partials_read(part, refuted: set[str]) -> list:
    """The inferred partial-sum claims that refuted stages read: a group's sum cut as free parts holds whatever
    each member's part is, so a stage that needs what a part is (a vocabulary-parallel rank's gradient, zero at
    the tokens outside its shard) is refuted there though nothing is wrong. Dropped, the stages are cut again."""
    by_id = {o.id: o for o in part.obligations}
    read = {part.representative(src) for o in part.obligations if o.key in refuted for src in o.reads}
    return [by_id[i] for i in read if i in by_id and by_id[i].claim.partial and not by_id[i].claim.boundary
            and not by_id[i].claim.given]


__all__ = ["verify_plan"]
