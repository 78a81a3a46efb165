"""Claims, stages and keys on a real plan: every stage of a correct plan is closed, keys deduplicate slots."""
import numpy as np
import pytest

from tv_ray import api
from tv_ray.engine.driver import claims_for, obligations_of
from tv_ray.partition.keys import formula_key
from tv_ray.partition.stages import partition
from tv_ray.reduce import reduce_plan
from tv_ray.terms import const, var


@pytest.fixture(scope="module")
def plan():
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    return api.parallelize(graph, "dp=2", model="llama3-tiny")


@pytest.fixture(scope="module")
def derived(plan):
    return obligations_of(plan)


def test_boundary_claims_come_from_lineage_and_cover_every_output(plan, derived):
    reduction, runs, claims, part, keys = derived
    outputs = {value for _, value in plan.logical.outputs}
    covered = {o.claim.logical for o in part.obligations if o.claim.boundary}
    assert outputs <= covered
    assert all(c.boundary for cid, c in part.boundary.items())
    # most float tensors a rank computes are matched to a logical slice
    produced = sum(1 for r, t in runs[0].order if runs[0].ranks[r][t].dtype.kind == "f")
    assert len(claims) > 0.9 * produced


def test_dp_slots_share_keys(plan, derived):
    _, _, _, part, keys = derived
    by_tensor = {}
    for ob in part.obligations:
        if len(ob.ranks) == 1:
            by_tensor.setdefault(ob.tensor, {})[ob.ranks[0]] = keys[ob.id]
    same = [t for t, k in by_tensor.items() if len(k) == 2 and k[0] == k[1]]
    assert len(same) > 0.8 * len(by_tensor)
    assert len(set(keys.values())) < 0.5 * len(keys)


def test_keys_rename_variables_but_not_constants():
    a, b, c = var("a[0]"), var("b[3]"), var("zz")
    assert formula_key([a + b], [b + a]) == formula_key([c + a], [a + c])
    assert formula_key([a * const(2)], [a]) != formula_key([a * const(3)], [a])
    assert formula_key([a + b], [a]) != formula_key([a + b], [b])


def test_a_claim_that_does_not_hold_is_an_obligation_that_fails(plan):
    from dataclasses import replace
    from tv_ray.engine.solve import solve
    reduction = reduce_plan(plan)
    runs, claims = claims_for(plan, reduction.reduced)
    # rank 1's copy of a batch-sliced activation, claimed to be rank 0's rows instead of its own
    (rank, tensor), claim = next((k, c) for k, c in claims.items()
                                 if k[0] == 1 and not c.boundary and c.offsets and c.offsets[0] > 0)
    claims[rank, tensor] = replace(claim, offsets=(0,) + claim.offsets[1:])
    part = partition(plan, reduction.reduced, claims)
    ob = next(o for o in part.obligations if o.ranks == (1,) and o.tensor == tensor)
    assert solve(*part.formulas[ob.key]).verdict == "refuted"
