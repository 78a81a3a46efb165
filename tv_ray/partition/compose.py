"""Composition (soundness rule 3): do the proved stages add up to the end-to-end claim?

    >>> composition_problems(plan, partition, proved={ob.id for ob in partition.obligations if ...})
    []

The stages compose when

- every claim a stage reads is boundary lineage or a proved stage (a mirrored
  rank's claim stands or falls with its representative's, a microbatch copy's
  with microbatch 0's stage it renames);
- the stage DAG, read through those representatives, has no cycle — a proof
  may not rest on itself — and every stage counted as established is reached
  from boundary inputs through proved stages only;
- every logical output (loss, each gradient, each updated parameter and
  state) is the claim of an established output stage;
- each updated parameter and optimizer state leaves the step with the
  lineage it came in with, so the next step starts from a consistent state.

Used by the engine before it calls a run proved and by the checker on the
certificate's stages.
"""
from __future__ import annotations

from tv_ray.errors import StageCycle
from tv_ray.partition.dag import generations, reads_of
from tv_ray.partition.stages import Partition
from tv_ray.plan import Plan
from tv_ray.processes import gc_paused


def established(part: Partition, proved: set[str], reads: dict) -> tuple[set[str], list[str]]:
    """The claims reached from boundary inputs through proved stages only, and the problems (a cycle). `reads` is
    the stage DAG with each read of a copy's claim (a mirrored rank's, a microbatch's kept as microbatch 0's) drawn
    from the recorded stage it renames (`reads_of(part.obligations, part.representative)`)."""
    try:
        depth = generations(reads)
    except StageCycle as cycle:
        return set(part.boundary), [f"the stage DAG has a cycle ({' -> '.join(map(str, cycle.members))}): those "
                                    f"stages' proofs rest on each other"]
    done = set(part.boundary)
    for cid in sorted(depth, key=depth.__getitem__):
        if cid in proved and reads[cid] <= done:
            done.add(cid)
    return done, []


def composition_problems(plan: Plan, part: Partition, proved: set[str]) -> list[str]:
    """What keeps the proved stages (ids in `proved`) from composing into the end-to-end claim; [] when they do."""
    with gc_paused():       # millions of stage ids renamed, nothing cyclic: the collector only costs time
        return _problems(plan, part, proved)


def _problems(plan: Plan, part: Partition, proved: set[str]) -> list[str]:
    problems = list(part.notes)
    boundary = set(part.boundary)
    reads = reads_of(part.obligations, part.representative)
    for cid, srcs in reads.items():
        for src in sorted(srcs - boundary - proved, key=str):
            problems.append(f"stage {cid} reads {src}, which is neither boundary lineage nor proved")
    done, cycles = established(part, proved, reads)
    problems += cycles
    covered = {ob.claim.logical for ob in part.obligations if ob.claim.boundary and ob.id in done}
    for name, value in plan.logical.outputs:
        if value not in covered:
            problems.append(f"logical output {name!r} is not covered by a proved output stage")
    problems += state_lineage_problems(plan)
    return problems


def state_lineage_problems(plan: Plan) -> list[str]:
    """Each updated parameter / optimizer state leaves the step with the lineage it came in with."""
    layouts: dict[str, set] = {}        # logical tensor -> its entries' (where, slice, partial)
    for e in plan.lineage:
        layouts.setdefault(e.logical, set()).add((e.where, e.slice, e.partial, e.scale))
    out = []
    for name, _ in plan.logical.outputs:
        if name.startswith("new/"):
            before, after = layouts.get(name[4:], set()), layouts.get(name, set())
            if before != after:
                out.append(f"{name} leaves the step with lineage {sorted(map(str, after))} but {name[4:]} "
                           f"came in with {sorted(map(str, before))}: the next step would start inconsistent")
    return out


__all__ = ["composition_problems", "state_lineage_problems", "established"]
