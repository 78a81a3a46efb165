"""Intermediate lineage the plan states: cut points taken as stated, proved like any claim, never assumed."""
from dataclasses import replace

import numpy as np

from tv_ray.engine.driver import verify_plan
from tv_ray.plan_check import check_plan


def test_stated_claims_are_cut_points_of_a_proof(tiny_dp2_plan):
    outcome = verify_plan(tiny_dp2_plan, progress=False)
    assert outcome.status == "proved"
    stated = {key for key, claim in outcome.claims.items() if claim.given}
    mirrored = set(outcome.partition.mirrors.rep)              # they take their representative's claims
    selected = {(int(rank), e.tensor) for e in tiny_dp2_plan.interior
                for rank in np.flatnonzero(tiny_dp2_plan.selects(e)) if rank not in mirrored}
    # every entry on every rank it selects that runs its own program (an output's boundary claim stands)
    assert mirrored and stated <= selected <= set(outcome.claims) and len(stated) > 0.9 * len(selected)
    assert stated <= {(rank, ob.tensor) for ob in outcome.partition.every() for rank in ob.ranks}
    assert not outcome.dropped


def test_a_false_statement_on_a_correct_plan_is_dropped_not_believed(tiny_dp2_plan):
    """An entry naming the wrong logical tensor (same shape, other values) is refuted by its stage; the plan's
    outputs are right in the concrete runs, so it is dropped as a wrong guess and the plan is still proved."""
    plan = tiny_dp2_plan
    shapes = {n.name: n.shape for n in plan.logical.nodes if n.dtype == "float"}
    i, entry, other = next((i, e, o) for i, e in enumerate(plan.interior) if e.tensor.startswith("mm_")
                           and not e.partial for o in shapes
                           if o.startswith("mm_") and o != e.logical and shapes[o] == shapes[e.logical])
    false = replace(plan, interior=plan.interior[:i] + (replace(entry, logical=other),) + plan.interior[i + 1:])
    check_plan(false)
    outcome = verify_plan(false, progress=False)
    assert outcome.status == "proved", outcome.problems[:3]
    dropped = {tensor for _, tensor in outcome.dropped}
    assert entry.tensor in dropped and len(dropped) <= 2     # and maybe the next stage, which read the lie
    assert outcome.deviations == []
